"""The sandbox (safepoint.validation.sandbox): work past a limit ends with that limit named, never hangs the caller;
results come back as plain data; settings come from `[validation]`."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from safepoint.core.errors import UsageError
from safepoint.validation.sandbox import SandboxLimits, note, run_limited
from safepoint.validation.settings import ValidationSettings
from safepoint.validation.validate import validate_snapshot

FAST = SandboxLimits(memory_bytes=64 << 20, cpu_seconds=3, cpu_seconds_per_gib=0, wall_seconds=60,
                     wall_seconds_per_gib=0)   # a generous wall clock: the test machine is busy


def add(a: int, b: int) -> dict:
    return {"sum": a + b, "nested": [1.5, None, "x"]}


def allocate(n: int) -> int:
    note("allocating")
    return len(bytearray(n))


def spin() -> None:
    note("spinning")
    while True:
        pass


def sleep() -> None:
    note("sleeping")
    time.sleep(60)


def crash() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def fail() -> None:
    raise RuntimeError("boom")


@pytest.mark.parametrize("method", ["auto", "forkserver", "fork"])
def test_value_comes_back_as_plain_data(method):
    out = run_limited(add, (2, 3), replace(FAST, start_method=method))
    assert out.ok and out.value == {"sum": 5, "nested": [1.5, None, "x"]}
    assert out.usage["peak_rss_bytes"] > 0


@pytest.mark.parametrize("method", ["fork", "forkserver"])   # forkserver: the CLI's (after prestart)
def test_memory_limit(method):
    out = run_limited(allocate, (1 << 30,), replace(FAST, start_method=method))
    assert out.limit == "validation exceeded 64 MiB of memory" and out.last_note == "allocating"


def map_file(path: str) -> int:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        return sum(m[i] for i in range(0, len(m), 64 << 20)) + len(m)   # a few pages: kernel time counts as CPU


def test_address_space_for_mapped_files_comes_on_top(tmp_path):
    """Mapping a file costs address space, not memory: the allowance grows by the files' size, anonymous
    memory (watched in the parent) does not."""
    path = tmp_path / "big"
    with open(path, "wb") as f:
        f.truncate(256 << 20)
    assert not run_limited(map_file, (str(path),), FAST).ok
    assert run_limited(map_file, (str(path),), FAST, mapped_bytes=256 << 20).value == 256 << 20
    assert run_limited(allocate, (96 << 20,), FAST, mapped_bytes=256 << 20).limit == \
        "validation exceeded 64 MiB of memory"


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_cpu_limit(method):
    t0 = time.monotonic()
    out = run_limited(spin, (), replace(FAST, cpu_seconds=2, wall_seconds=120, start_method=method))
    assert out.limit == "validation exceeded 2 s of CPU time" and out.last_note == "spinning"
    assert time.monotonic() - t0 < 120


def test_wall_clock():
    t0 = time.monotonic()
    out = run_limited(sleep, (), replace(FAST, wall_seconds=5))
    assert out.limit == "validation exceeded its wall clock of 5 s" and out.last_note == "sleeping"
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_crash_and_exception_are_errors_not_values(method):
    limits = replace(FAST, start_method=method)
    out = run_limited(crash, (), limits)
    assert not out.ok and out.limit is None and "SIGSEGV" in out.error
    out = run_limited(fail, (), limits)
    assert out.error == "RuntimeError: boom"


def test_limits_scale_with_the_input():
    lim = SandboxLimits(cpu_seconds=10, cpu_seconds_per_gib=3, wall_seconds=20, wall_seconds_per_gib=7)
    assert (lim.cpu_limit(0), lim.cpu_limit(1 << 30), lim.cpu_limit(5 << 30)) == (10, 13, 25)
    assert (lim.wall_limit(0), lim.wall_limit((1 << 30) + 1)) == (20, 28)   # rounded up


@pytest.mark.parametrize("doc, error", [
    ({"sandbox": "yes"}, "sandbox must be true or false"),
    ({"sandbox_memory_bytes": 0}, "positive integer"),
    ({"sandbox_cpu_seconds": -1}, "positive integer"),
    ({"sandbox_start_method": "thread"}, "one of auto, forkserver"),
])
def test_bad_settings(doc, error):
    with pytest.raises(UsageError, match=error):
        ValidationSettings.from_mapping(doc)


def test_settings():
    s = ValidationSettings.from_mapping({"sandbox": False, "sandbox_memory_bytes": 1 << 30, "sandbox_wall_seconds": 9})
    assert (s.sandbox.enabled, s.sandbox.memory_bytes, s.sandbox.wall_seconds) == (False, 1 << 30, 9)
    assert ValidationSettings().sandbox.enabled


def test_validation_past_its_limit_is_invalid_with_the_reason(tmp_path):
    """The legacy torch.save format cannot be mapped: loading it takes memory the limit does not give.

    The file is written by another process: the child is forked from this one, and a 48 MiB block this
    process had just freed would be address space the child may reuse without mapping more."""
    subprocess.run([sys.executable, "-c", "import sys, torch; torch.save({'w': torch.zeros(48 << 20, "
                    "dtype=torch.uint8)}, sys.argv[1], _use_new_zipfile_serialization=False)",
                    str(tmp_path / "model.pt")], check=True)
    settings = ValidationSettings.from_mapping({"sandbox_memory_bytes": 4 << 20})
    report = validate_snapshot(tmp_path, ["model.pt"], settings=settings)
    assert report.outcome == "invalid"
    [f] = report.findings
    assert f.file == "model.pt" and f.problem.value in ("limit", "unloadable")
    assert "memory" in f.message or "allocate" in f.message
    assert validate_snapshot(tmp_path, ["model.pt"]).outcome == "verified"   # the defaults give it room


# ------------------------------------------------------------------------------------------ the CLI's path

def test_work_named_by_its_path_runs_in_the_child():
    out = run_limited("tests.test_sandbox:add", (2, 3), FAST)
    assert out.ok and out.value == {"sum": 5, "nested": [1.5, None, "x"]}


def test_prestart_is_a_no_op_where_torch_is_loaded():
    """Here (pytest imported torch) forking from the caller is the cheaper path: nothing is started."""
    import torch  # noqa: F401

    from safepoint.validation.sandbox import prestart, start_method

    assert prestart(SandboxLimits()) is False
    assert start_method(SandboxLimits()) == "fork"


def test_a_process_without_torch_validates_through_the_prestarted_fork_server(tmp_path):
    """The CLI's path: prestart() before anything imports torch. The readers (and torch) load in the fork
    server, the caller never imports torch, and the verdicts are the same: a NaN is still caught."""
    import json
    import textwrap

    import torch

    folders = []
    for name, value in (("good", 1.0), ("bad", float("nan"))):
        folder = tmp_path / name
        folder.mkdir()
        torch.save({"model": {"w": torch.full((4, 4), value)}, "step": 3}, folder / "model.pt")
        folders.append(str(folder))
    code = textwrap.dedent("""
        import json, sys
        from safepoint.validation.sandbox import SandboxLimits, prestart, start_method
        from safepoint.validation.validate import validate_snapshot
        started = prestart(SandboxLimits())
        reports = [validate_snapshot(p) for p in sys.argv[1:]]
        print(json.dumps({"started": started, "method": start_method(SandboxLimits()),
                          "torch_here": "torch" in sys.modules, "outcomes": [r.outcome for r in reports],
                          "stats": [[s.name for s in r.stats] for r in reports],
                          "problems": [[f.problem.value for f in r.findings] for r in reports]}))
    """)
    r = subprocess.run([sys.executable, "-c", code, *folders], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == {
        "started": True, "method": "forkserver", "torch_here": False, "outcomes": ["verified", "invalid"],
        "stats": [["model.w"], ["model.w"]], "problems": [[], ["nan"]]}
