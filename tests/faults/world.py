"""What the fault tests share: the fork server client, small checkpoints, and the invariant checks.

The invariants are Safepoint's promises, checked against the real bytes after every fault:

1. no marker exists without complete files (every COMMITTED, local or replica, verifies);
2. no catalog row points at a missing object (every verified replica re-hashes clean);
3. nothing verified is lost (a checkpoint once verified is still verified with a good copy, or
   retention pruned it on purpose), counted in bytes;
4. the newest verified checkpoint is never pruned;
5. nothing is duplicated (one row per (run, step), one replica row per URL, one folder per step);
6. no orphans are left once the grace period has passed (no temporary files, no partial replicas).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from safepoint.catalog.store import Catalog
from safepoint.core.errors import FormatError
from safepoint.core.format import MARKER_NAME, TMP_PREFIX
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.local.snapshot import LocalSnapshot

REPO = Path(__file__).resolve().parents[2]


# -- checkpoints -------------------------------------------------------------------------------

def make_template(folder: Path, *, big_bytes: int = 768 * 1024, seed: int = 0) -> Path:
    """A small real checkpoint: torch.save of a trained model + optimizer, and safetensors files."""
    from safetensors.torch import save_file

    from tests.helpers_ckpt import make_torch_save_ckpt

    folder.mkdir(parents=True, exist_ok=True)
    make_torch_save_ckpt(folder, seed=seed)
    g = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(big_bytes // 4, generator=g)}, str(folder / "big.safetensors"))
    (folder / "shards").mkdir(exist_ok=True)
    for i in range(3):
        save_file({f"s{i}": torch.randn(4096, generator=g)}, str(folder / "shards" / f"part-{i}.safetensors"))
    return folder


def copy_template(template: Path, folder: Path) -> Path:
    """The template's files, with model.pt trained anew for this folder: each step holds its own
    state, as training writes them (the same state under a later step is a duplicate finding)."""
    from tests.helpers_ckpt import make_torch_save_ckpt

    shutil.copytree(template, folder)
    make_torch_save_ckpt(folder)
    return folder


def flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


# -- the fork server -----------------------------------------------------------------------------

@dataclass
class Ran:
    pid: int
    exit: int
    killed: bool          # by our SIGKILL (or its own, at kill_at)
    result: dict[str, Any] | None
    phases: list[str]
    seconds: float


class ForkServer:
    """Client of tests/faults/driver.py (see there)."""

    def __init__(self, catalog_url: str | None, workdir: Path, env: dict[str, str] | None = None):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "driver.log"
        self._n = 0
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.driver", *([catalog_url] if catalog_url else [])], cwd=REPO,
            env=full_env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, start_new_session=True,
        )
        ready = self._read(timeout=120)
        assert ready.get("ready"), f"driver did not start: {self.log_tail()}"

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            raise TimeoutError(f"driver silent for {timeout}s; log: {self.log_tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"driver exited; log: {self.log_tail()}")
        return json.loads(line)

    def start(self, op: str, args: dict[str, Any], *, kill_at: int | None = None, after: bool = False,
              trace: bool = False) -> dict[str, Any]:
        """Start `op` in a fresh child and return at once (with its pid); `finish` waits for it."""
        self._n += 1
        phase_file = self.workdir / f"phase-{self._n}"
        result_file = self.workdir / f"result-{self._n}.json"
        cmd = {"op": op, "args": args, "kill_at": kill_at, "after": after, "trace": trace,
               "phase_file": str(phase_file), "result": str(result_file)}
        assert self.proc.stdin is not None
        t0 = time.perf_counter()
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        pid = self._read(timeout=30)["pid"]
        return {"op": op, "pid": pid, "t0": t0, "phase_file": phase_file, "result_file": result_file}

    def run(self, op: str, args: dict[str, Any], *, kill_after_s: float | None = None, kill_at: int | None = None,
            after: bool = False, trace: bool = False, timeout: float = 120) -> Ran:
        """Run `op` in a fresh child; SIGKILL it after `kill_after_s`, or at its event `kill_at`."""
        h = self.start(op, args, kill_at=kill_at, after=after, trace=trace)
        if kill_after_s is not None:
            time.sleep(kill_after_s)
            try:
                os.kill(h["pid"], 9)
            except ProcessLookupError:
                pass
        return self.finish(h, timeout=timeout)

    def finish(self, h: dict[str, Any], timeout: float = 120) -> Ran:
        op, pid, t0, phase_file, result_file = h["op"], h["pid"], h["t0"], h["phase_file"], h["result_file"]
        done = self._read(timeout=timeout)
        assert done["pid"] == pid
        seconds = time.perf_counter() - t0
        phases = phase_file.read_text().split() if phase_file.exists() else []
        result = json.loads(result_file.read_text()) if result_file.exists() else None
        if done["exit"] not in (0, -9):
            raise AssertionError(f"{op} exited {done['exit']}; log: {self.log_tail()}")
        return Ran(pid, done["exit"], done["exit"] == -9, result, phases, seconds)

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)
                self.proc.wait(timeout=10)
        self._log.close()


# -- invariants ----------------------------------------------------------------------------------

@dataclass
class World:
    """The ledger the invariants are checked against: every checkpoint ever seen verified."""

    ever_verified: dict[tuple[str, int], int] = field(default_factory=dict)   # -> total bytes
    newest_verified: dict[str, int] = field(default_factory=dict)             # run -> step

    def observe(self, catalog: Catalog) -> None:
        for c in catalog.list_checkpoints():
            if c.state is CS.VERIFIED:
                self.ever_verified[(c.run, c.step)] = c.total_bytes
                self.newest_verified[c.run] = max(self.newest_verified.get(c.run, -1), c.step)


@dataclass
class Findings:
    violations: list[str] = field(default_factory=list)
    bytes_lost: int = 0
    markers_checked: int = 0
    replicas_checked: int = 0
    orphans: list[str] = field(default_factory=list)


def _committed_folders(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob(MARKER_NAME)) if root.exists() else []


def _verifies(folder: Path) -> str | None:
    """None if the folder is a committed snapshot whose every file verifies, else why not."""
    try:
        report = LocalSnapshot.open(folder).verify()
    except FormatError as e:
        return str(e)
    return None if report.outcome is CS.VERIFIED else report.summary()


def check(catalog: Catalog, world: World, *, dest_roots: list[Path], local_roots: list[Path],
          orphans_allowed: bool = False) -> Findings:
    """Check every invariant against the real bytes; returns what was violated (nothing, we hope)."""
    f = Findings()
    good: dict[str, str | None] = {}

    def verifies(folder: Path) -> str | None:
        key = str(folder)
        if key not in good:
            good[key] = _verifies(folder)
        return good[key]

    # 1. No marker without complete files, anywhere.
    for root in dest_roots + local_roots:
        for folder in _committed_folders(root):
            f.markers_checked += 1
            why = verifies(folder)
            if why:
                f.violations.append(f"marker without complete files: {folder}: {why}")
    views = catalog.list_checkpoints()
    # 5. No duplicates.
    keys = Counter((c.run, c.step) for c in views)
    f.violations += [f"duplicate checkpoint rows {k}" for k, n in keys.items() if n > 1]
    for c in views:
        urls = Counter(r.url for r in c.replicas)
        f.violations += [f"{c.run}/{c.step}: duplicate replica rows for {u}" for u, n in urls.items() if n > 1]
    # 2. Every verified replica row points at bytes that verify.
    good_copy: dict[tuple[str, int], bool] = {}
    for c in views:
        ok = False
        for r in c.replicas:
            if r.state is not RS.VERIFIED:
                continue
            f.replicas_checked += 1
            assert r.url.startswith("file://"), r.url
            why = verifies(Path(r.url[len("file://"):]))
            if why:
                f.violations.append(f"catalog row points at a missing or bad object: {r.url}: {why}")
            else:
                ok = True
        good_copy[(c.run, c.step)] = ok
        if c.state is CS.VERIFIED and not ok:
            f.violations.append(f"{c.run}/{c.step} is verified without a verified replica that verifies")
    # 3. Nothing verified is lost; 4. the newest verified is never pruned.
    by_key = {(c.run, c.step): c for c in views}
    for key, size in world.ever_verified.items():
        c = by_key.get(key)
        if c is not None and c.state is CS.PRUNED:
            continue
        if c is None or c.state is not CS.VERIFIED or not good_copy.get(key):
            f.violations.append(f"verified checkpoint lost: {key} is {c.state if c else 'gone'}")
            f.bytes_lost += size
    for run, step in world.newest_verified.items():
        c = by_key.get((run, step))
        if c is None or c.state is CS.PRUNED:
            f.violations.append(f"the newest verified checkpoint {run}/{step} was pruned or lost")
    # 6. Orphans: temporary files, and replica folders without a marker.
    for root in dest_roots + local_roots:
        if root.exists():
            f.orphans += [str(p) for p in root.rglob(f"{TMP_PREFIX}*")]
    for root in dest_roots:
        for run_dir in (d for d in root.iterdir() if d.is_dir()) if root.exists() else ():
            for step_dir in (d for d in run_dir.iterdir() if d.is_dir()):
                if not (step_dir / MARKER_NAME).exists():
                    f.orphans.append(f"partial replica {step_dir}")
    if f.orphans and not orphans_allowed:
        f.violations += [f"orphan left after the grace period: {o}" for o in f.orphans]
    return f
