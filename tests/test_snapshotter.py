"""Snapshotter: isolation, the host-memory budget, failures that surface, the output format, the pipeline."""

from __future__ import annotations

import concurrent.futures
import errno
import json
import threading
import time

import pytest
import torch

from safepoint.core.format import MANIFEST_NAME, MARKER_NAME, TMP_PREFIX
from safepoint.core.hashing import hash_path
from safepoint.core.states import CheckpointState
from safepoint.local.snapshot import LocalSnapshot
from safepoint.snapshotter import (
    MemInfo,
    MemoryFloorError,
    SnapshotError,
    Snapshotter,
    UnsupportedState,
    load,
)
from safepoint.snapshotter.writer import Writer
from safepoint.validation.validate import validate_snapshot

MiB = 1024 * 1024
SHARD = "rank-00000-of-00001.safetensors"


def nested_state(seed: int = 0, big: int = 3 * MiB) -> dict:
    """Model + optimizer shaped state: mixed dtypes, a strided view, a 0-d tensor, tied weights, plain values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(big // 4 // 512, 512, generator=g)  # `big` bytes of float32
    state = {
        "model": {
            "embed.weight": w,
            "head.weight": w,  # tied: one tensor, stored once
            "proj.weight": torch.randn(300, 200, generator=g).t(),  # non-contiguous
            "norm.bias": torch.randn(77, generator=g).to(torch.bfloat16),
            "mask": torch.rand(33, generator=g) > 0.5,
            "ids": torch.randint(-100, 100, (13,), generator=g, dtype=torch.int8),
            "empty": torch.empty(0, 4),
        },
        "optim": {
            "state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(1000, generator=g).double()},
                      1: {"step": torch.tensor(7.0), "exp_avg": torch.randn(5, 3, generator=g).half()}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": [0, 1],
                              "foreach": None, "inf": float("inf")}],
        },
        "step": 7, "run": "demo", "dtype": torch.bfloat16, "shape": torch.Size([2, 3]), "blob": b"\x00\xff",
        "nested": [({"a": 1}, [2.5, None]), True],
        "__metadata__": torch.ones(2),  # a name safetensors reserves
    }
    return state


def assert_same(a, b) -> None:
    """Deep equality, tensors bit-exact (dtype, shape, bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b and type(a) is type(b)


def clone_state(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_state(v) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(clone_state(v) for v in obj)
    return obj


def tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


def snapshotter(tmp_path, **kw) -> Snapshotter:
    kw.setdefault("budget_bytes", 64 * MiB)
    kw.setdefault("memory_floor", 0.0)
    return Snapshotter(tmp_path / "nvme", "run-a", **kw)


# ------------------------------------------------------------------------------------- format

def test_round_trip_is_committed_standard_and_exact(tmp_path):
    state = nested_state()
    with snapshotter(tmp_path) as snap:
        h = snap.save(7, state, parent=("run-0", 3), meta={"tags": ["nightly"]})
        manifest = h.wait()
    folder = tmp_path / "nvme" / "run-a" / "7"
    assert h.committed and (folder / MARKER_NAME).is_file()
    assert sorted(p.name for p in folder.iterdir()) == sorted([SHARD, MANIFEST_NAME, MARKER_NAME])
    # The manifest is the one `safepoint commit` writes: same digest a fresh hash finds.
    assert manifest.world_size == 1 and manifest.parent == ("run-0", 3) and manifest.meta["tags"] == ["nightly"]
    assert (manifest.file(SHARD).size, manifest.file(SHARD).blake3) == hash_path(folder / SHARD)
    assert LocalSnapshot.open(folder).verify().outcome is CheckpointState.VERIFIED
    # Safepoint's validator and a plain safetensors loader read it.
    report = validate_snapshot(folder)
    assert report.ok, report.summary()
    from safetensors.torch import load_file

    flat = load_file(folder / SHARD)
    assert torch.equal(flat["model.embed.weight"], state["model"]["embed.weight"])
    assert "model.head.weight" not in flat  # the tied tensor is stored once
    # load() rebuilds the nesting, types and sharing, without pickle.
    back = load(folder)
    assert_same(state, back)
    assert back["model"]["head.weight"] is back["model"]["embed.weight"]
    assert isinstance(back["optim"]["state"], dict) and set(back["optim"]["state"]) == {0, 1}


def test_header_records_the_structure_as_json(tmp_path):
    with snapshotter(tmp_path) as snap:
        snap.save(1, {"a": [torch.ones(2), 3]}).wait()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "nvme" / "run-a" / "1" / SHARD), framework="pt") as f:
        md = f.metadata()
    assert md["format"] == "safepoint.local.snapshot" and md["world_size"] == "1" and md["step"] == "1"
    assert json.loads(md["structure"]) == {"dict": [["a", {"list": [{"tensor": "a.0"}, {"value": 3}]}]]}


def test_unsupported_values_are_refused_before_anything_is_written(tmp_path):
    with snapshotter(tmp_path) as snap:
        with pytest.raises(UnsupportedState, match=r"model\.fn"):
            snap.save(1, {"model": {"fn": lambda x: x}})
        with pytest.raises(UnsupportedState, match="cycle"):
            loop: list = []
            loop.append(loop)
            snap.save(1, {"x": loop})
        with pytest.raises(SnapshotError, match="meta must be plain JSON"):
            snap.save(1, {"w": torch.ones(1)}, meta={"when": object()})
    assert not (tmp_path / "nvme" / "run-a" / "1").exists()


def test_a_committed_step_is_never_overwritten(tmp_path):
    with snapshotter(tmp_path) as snap:
        snap.save(3, {"w": torch.ones(4)}).wait()
        with pytest.raises(SnapshotError, match="already committed"):
            snap.save(3, {"w": torch.zeros(4)})
    assert torch.equal(load(tmp_path / "nvme" / "run-a" / "3")["w"], torch.ones(4))


def test_a_step_in_flight_is_not_saved_twice(tmp_path, monkeypatch):
    gate = threading.Event()
    real = Writer._write_chunk

    def held(self, fd, data, offset):
        gate.wait(30)
        return real(self, fd, data, offset)

    monkeypatch.setattr(Writer, "_write_chunk", held)
    with snapshotter(tmp_path) as snap:
        h = snap.save(4, {"w": torch.ones(3)})
        with pytest.raises(SnapshotError, match="already being saved"):
            snap.save(4, {"w": torch.zeros(3)})
        gate.set()
        h.wait()
    assert torch.equal(load(tmp_path / "nvme" / "run-a" / "4")["w"], torch.ones(3))


# ---------------------------------------------------------------------------------- isolation

@pytest.mark.parametrize("budget", [64 * MiB, 2 * MiB], ids=["budget>=state", "budget<state"])
def test_mutation_right_after_save_returns_does_not_reach_the_checkpoint(tmp_path, budget):
    state = nested_state(big=6 * MiB)  # larger than a 2 MiB pool: staged with backpressure, split across buffers
    expected = clone_state(state)
    with snapshotter(tmp_path, budget_bytes=budget, buffer_bytes=min(budget, 1 * MiB)) as snap:
        h = snap.save(5, state)
        for t in tensors(state):  # the next optimizer step, at once
            if t.is_floating_point():
                t.add_(1.0).mul_(-3.0)
            elif t.dtype == torch.bool:
                t.logical_not_()
            else:
                t.add_(1)
        h.wait()
        assert h.stats.deferred == (budget >= 6 * MiB)
    back = load(tmp_path / "nvme" / "run-a" / "5")
    assert_same(expected, back)
    with pytest.raises(AssertionError):
        assert_same(state, back)  # the mutation was real


def test_a_budget_of_exactly_the_state_size_holds_the_whole_state(tmp_path):
    state = {"w": torch.randn(MiB // 4 + 12345), "b": torch.randn(7, dtype=torch.float64),
             "m": torch.randint(0, 9, (333,), dtype=torch.uint8), "s": torch.tensor(1.0)}
    size = sum(t.numel() * t.element_size() for t in state.values())
    size += -size % 16  # the pool is made of pieces of 16 bytes or more
    expected = clone_state(state)
    with snapshotter(tmp_path, budget_bytes=size, buffer_bytes=256 * 1024) as snap:
        h = snap.save(1, state)
        for t in state.values():
            t.zero_()
        h.wait()
        assert h.stats.deferred  # it all fit: the writer started only once staging was done ...
        assert size - 16 < snap.pool.high_water_in_use <= snap.pool.high_water_allocated <= size  # ... all at once
    assert_same(expected, load(tmp_path / "nvme" / "run-a" / "1"))


def test_repeated_saves_reuse_the_pool(tmp_path):
    state = {"w": torch.randn(512, 512)}
    expected = []
    with snapshotter(tmp_path, budget_bytes=4 * MiB, buffer_bytes=1 * MiB) as snap:
        for step in range(4):
            state["w"].add_(1)
            expected.append(state["w"].clone())
            snap.save(step, state)
        snap.wait()
        assert snap.pool.high_water_allocated == 4 * MiB
    for step in range(4):
        assert torch.equal(load(tmp_path / "nvme" / "run-a" / str(step))["w"], expected[step])


# ------------------------------------------------------------------------------------- budget

def _rss_mib() -> tuple[int, int]:
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                vals[k] = int(v.split()[0]) // 1024
    return vals["VmRSS"], vals["VmHWM"]


class PeakRss:
    """Peak RSS over a block: the kernel's high-water mark (reset through clear_refs) and 1 ms sampling."""

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm = True
        except OSError:
            self.hwm = False
        self.base = _rss_mib()[0]
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_mib()[0])
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        if self.hwm:
            self.peak = max(self.peak, _rss_mib()[1])


@pytest.mark.parametrize("preallocate", [True, False])
def test_staging_never_exceeds_the_budget_with_state_four_times_larger(tmp_path, preallocate):
    budget = 16 * MiB
    g = torch.Generator().manual_seed(1)
    state = {  # 64 MiB: a tensor larger than the whole budget, one larger than a buffer, strided rows, small ones
        "huge": torch.randn(5 * MiB, generator=g),                          # 20 MiB
        "wide": torch.randn(6 * MiB // 1024, 1024, generator=g),            # 24 MiB
        "strided": torch.randn(4096, 1024, generator=g)[:, ::2],             # 8 MiB, not contiguous
        "rows": [torch.randn(2 * MiB // 4, generator=g) for _ in range(6)],  # 12 MiB
    }
    size = sum(t.numel() * t.element_size() for t in tensors(state))
    assert size >= 4 * budget
    expected = clone_state(state)
    with snapshotter(tmp_path, budget_bytes=16 * MiB, buffer_bytes=2 * MiB, preallocate=preallocate) as warm:
        warm.save(0, {"w": torch.ones(8)}).wait()  # imports and thread start-up out of the measurement
    with PeakRss() as rss:
        snap = snapshotter(tmp_path, budget_bytes=budget, buffer_bytes=2 * MiB, preallocate=preallocate)
        h = snap.save(1, state)
        h.wait()
        snap.close()
    growth = rss.peak - rss.base
    assert snap.pool.high_water_in_use <= budget and snap.pool.high_water_allocated <= budget
    assert not h.stats.deferred  # the writer drained while staging went on ...
    assert snap.pool.acquired >= size // (2 * MiB) > len(snap.pool.sizes)  # ... and buffers came back for reuse
    assert growth <= budget // MiB + 12, f"RSS grew {growth} MiB for a {budget // MiB} MiB budget"
    assert_same(expected, load(tmp_path / "nvme" / "run-a" / "1"))


def test_memory_floor_refuses_an_up_front_pool(tmp_path):
    low = MemInfo(total=1000 * MiB, available=300 * MiB)  # a 64 MiB pool would leave 236 MiB < 25%
    with pytest.raises(MemoryFloorError, match="floor"):
        Snapshotter(tmp_path, "r", budget_bytes=64 * MiB, memory_floor=0.25, meminfo=lambda: low)


def test_memory_floor_delays_a_pool_grown_on_demand_and_reports_it(tmp_path, caplog, monkeypatch):
    total = 1000 * MiB
    snap_box: list[Snapshotter] = []
    real = Writer._write_chunk

    def after_a_refusal(self, fd, data, offset):  # the writer returns no buffer before the floor has said no
        deadline = time.monotonic() + 30
        while snap_box and snap_box[0].guard.refusals == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        return real(self, fd, data, offset)

    monkeypatch.setattr(Writer, "_write_chunk", after_a_refusal)

    def meminfo() -> MemInfo:  # room for 2 buffers above the floor, whatever the pool holds
        held = snap_box[0].pool.allocated_bytes if snap_box else 0
        return MemInfo(total, 250 * MiB + 2 * MiB - held)

    snap = Snapshotter(tmp_path, "r", budget_bytes=8 * MiB, buffer_bytes=1 * MiB, preallocate=False,
                       memory_floor=0.25, meminfo=meminfo)
    snap_box.append(snap)
    state = {"w": torch.randn(2 * MiB)}  # 8 MiB
    with caplog.at_level("WARNING", logger="safepoint.snapshotter"):
        h = snap.save(1, state)
        h.wait()
    snap.close()
    assert snap.pool.high_water_allocated == 2 * MiB  # the floor stopped the growth ...
    assert snap.guard.refusals > 0 and "memory floor delayed staging" in caplog.text  # ... and said so
    assert torch.equal(load(tmp_path / "r" / "1")["w"], state["w"])


def test_memory_floor_without_any_memory_fails_instead_of_hanging(tmp_path):
    low = MemInfo(total=1000 * MiB, available=100 * MiB)
    snap = Snapshotter(tmp_path, "r", budget_bytes=8 * MiB, preallocate=False, memory_floor=0.25,
                       floor_timeout_s=0.3, meminfo=lambda: low)
    with pytest.raises(MemoryFloorError):
        snap.save(1, {"w": torch.ones(1000)})
    assert not (tmp_path / "r" / "1" / MARKER_NAME).exists()
    snap.close()


# ----------------------------------------------------------------------------------- failures

def _nothing_committed(folder) -> None:
    assert not (folder / MARKER_NAME).exists() and not (folder / MANIFEST_NAME).exists()
    assert not list(folder.glob(f"{TMP_PREFIX}*"))  # the temporary shard was removed
    assert not (folder / SHARD).exists()


def test_a_write_failure_commits_nothing_and_surfaces_on_wait(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = Writer._write_chunk

    def disk_full(self, fd, data, offset):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, fd, data, offset)

    monkeypatch.setattr(Writer, "_write_chunk", disk_full)
    state = {"w": torch.randn(4 * MiB)}  # 16 MiB in 1 MiB buffers: the failure hits mid-file
    with snapshotter(tmp_path, budget_bytes=4 * MiB, buffer_bytes=1 * MiB) as snap:
        h = snap.save(1, state)
        with pytest.raises(SnapshotError) as info:
            h.wait()
        assert "No space left" in str(info.value) or isinstance(info.value.__cause__, OSError)
        _nothing_committed(tmp_path / "nvme" / "run-a" / "1")
        monkeypatch.setattr(Writer, "_write_chunk", real)
        snap.save(2, state).wait()  # the writer goes on: the next save commits
    assert torch.equal(load(tmp_path / "nvme" / "run-a" / "2")["w"], state["w"])


def test_an_unwaited_failure_surfaces_on_the_next_save(tmp_path, monkeypatch):
    def fail(self, fd, data, offset):
        raise OSError(errno.EIO, "Input/output error")

    snap = snapshotter(tmp_path)
    monkeypatch.setattr(Writer, "_write_chunk", fail)
    h = snap.save(1, {"w": torch.ones(10)})
    deadline = time.monotonic() + 30
    while not h.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    monkeypatch.undo()
    with pytest.raises(SnapshotError, match="Input/output error"):
        snap.save(2, {"w": torch.ones(10)})
    snap.save(3, {"w": torch.ones(10)}).wait()  # reported once, then saving goes on
    snap.close()
    _nothing_committed(tmp_path / "nvme" / "run-a" / "1")
    assert (tmp_path / "nvme" / "run-a" / "3" / MARKER_NAME).exists()


def test_a_crashed_writer_thread_fails_every_save_and_never_hangs(tmp_path, monkeypatch):
    real = Writer._dispatch
    seen = {"chunks": 0}

    def crash(self, msg):
        if msg[0] == "chunk":
            seen["chunks"] += 1
            if seen["chunks"] == 2:
                raise RuntimeError("injected writer crash")
        return real(self, msg)

    monkeypatch.setattr(Writer, "_dispatch", crash)
    snap = snapshotter(tmp_path, budget_bytes=2 * MiB, buffer_bytes=1 * MiB)  # staging needs buffers back
    state = {"w": torch.randn(2 * MiB)}  # 8 MiB

    def first_save():
        try:
            snap.save(1, state).wait()
        except SnapshotError as e:
            return e
        return None

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        err = ex.submit(first_save).result(timeout=60)
    assert isinstance(err, SnapshotError) and "writer thread died" in str(err)
    with pytest.raises(SnapshotError, match="writer thread died"):
        snap.save(2, state)
    _nothing_committed(tmp_path / "nvme" / "run-a" / "1")
    assert not (tmp_path / "nvme" / "run-a" / "2" / MARKER_NAME).exists()
    snap.close(timeout=10)  # returns: both failures were already reported


# ----------------------------------------------------------------------------------- pipeline

def test_snapshot_ingests_through_the_pipeline(tmp_path, sqlite_catalog):
    from safepoint.ops.ingest import ingest

    with snapshotter(tmp_path) as snap:
        h = snap.save(11, nested_state())
        h.wait()
    durable = "file://" + str(tmp_path / "durable")
    outcome = ingest(h.folder, [durable], sqlite_catalog)
    assert outcome.state is CheckpointState.VERIFIED, outcome.message
    row = sqlite_catalog.get("run-a", 11)
    assert row.world_size == 1 and row.file_count == 1
