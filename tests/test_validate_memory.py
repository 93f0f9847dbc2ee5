"""Bounded memory: validating a file does not grow RSS with its size (pages are released as read).

Each measurement runs in a fresh subprocess and reports the growth of its peak RSS (VmHWM of its
own address space: ru_maxrss would also count the forked image of this big test process from
before exec) over its RSS just before validating. A control that reads the same memory-mapped file without
releasing pages shows the growth the measurement would see if validation kept what it read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

MiB = 1 << 20

CHILD = r"""
import json, sys
import torch
from safepoint.validation.validate import validate_snapshot

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

folder, mode = sys.argv[1], sys.argv[2]
before = status("VmRSS")
if mode == "validate":
    report = validate_snapshot(folder)
    ok, n = report.ok, len(report.stats)
else:  # control: read every tensor of the mmap'd file and keep the pages
    sd = torch.load(folder + "/model.pt", mmap=True, weights_only=True)
    n = sum(1 for t in sd.values() if float(t.sum()) == float(t.sum()))
    ok = True
peak = status("VmHWM")
print(json.dumps({"ok": ok, "tensors": n, "growth": peak - before}))
"""


def _measure(folder: Path, mode: str) -> dict:
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder), mode], cwd=root, capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def big_folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """~256 MiB as torch.save (64 tensors of 4 MiB) and as safetensors."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(64)}
    pt = tmp_path_factory.mktemp("mem-pt")
    torch.save(tensors, pt / "model.pt")
    st = tmp_path_factory.mktemp("mem-st")
    save_file(tensors, str(st / "model.safetensors"))
    return pt, st


def test_torch_save_validation_memory_does_not_grow_with_file(big_folders: tuple[Path, Path]) -> None:
    pt, _ = big_folders
    control = _measure(pt, "control")
    assert control["growth"] > 200 * MiB, control  # the measurement sees pages that are kept
    res = _measure(pt, "validate")
    assert res["ok"] and res["tensors"] == 64
    assert res["growth"] < 64 * MiB, f"validation grew RSS by {res['growth'] / MiB:.0f} MiB on a 256 MiB file"


def test_safetensors_validation_memory_does_not_grow_with_file(big_folders: tuple[Path, Path]) -> None:
    _, st = big_folders
    res = _measure(st, "validate")
    assert res["ok"] and res["tensors"] == 64
    assert res["growth"] < 64 * MiB, f"validation grew RSS by {res['growth'] / MiB:.0f} MiB on a 256 MiB file"
