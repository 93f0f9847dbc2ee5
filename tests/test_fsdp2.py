"""FSDP2 (`fully_shard`) through DCP, on two gloo ranks on the CPU: the sharded model and AdamW state
saved by `sp_dcp.save` and sealed; torch's own `dcp.async_save` into a step folder, sealed by
`sp_dcp.seal_when_saved` once it finished (and `sp_dcp.async_save`, which wraps both); each ingested
verified, restored, then loaded back into world size 2 and resharded into world size 1, every tensor
equal to what the ranks held when they saved.

The ranks are this file run as a script (`--worker SCENARIO TMP`), one process per rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 120
RUN = "fsdp"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp: Path, scenario: str, *args: str, world: int = 2) -> list[dict]:
    """`world` ranks of `scenario`; each one's last JSON line (and its exit code, stderr)."""
    port = _free_port()
    procs = []
    for r in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
               "WORLD_SIZE": str(world), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", scenario, str(tmp), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            out.append({"rc": p.returncode, **(json.loads(lines[-1]) if lines else {}), "stderr": stderr[-3000:]})
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [r["rc"] for r in out] == [0] * world, [r["stderr"] for r in out]
    return out


# ------------------------------------------------------------------------------- what every rank runs

def build(seed: int = 0):
    """The model (two Linear layers) and AdamW; the same on every rank and in world size 1."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model


def sharded(seed: int = 0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build(seed)
    mesh = init_device_mesh("cpu", (2,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, steps: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def full_state(model, opt) -> dict:
    """Every tensor whole (gathered from the shards), on the CPU: what a load must give back."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    m, o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": m, "optim": o}


def sharded_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, o = get_state_dict(model, opt)
    return {"model": m, "optim": o}


def worker(scenario: str, tmp: Path, *args: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from safepoint.integrations import dcp as sp_dcp
    from safepoint.local.snapshot import is_committed

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict = {"rank": rank}
    if scenario == "save":
        root = tmp / "node" / "ckpt"
        model, opt = sharded()
        out["dtensor"] = type(next(model.parameters())).__name__
        train(model, opt, 2, rank)
        sp_dcp.save(sharded_state(model, opt), root, run=RUN, step=2)
        full = full_state(model, opt)
        if rank == 0:
            torch.save(full, tmp / "ref-2.pt")
        train(model, opt, 2, rank)
        folder = root / "step-4"                     # torch's own async save, sealed once it finished
        saving = dcp.async_save(sharded_state(model, opt), checkpoint_id=str(folder))
        sealed = sp_dcp.seal_when_saved(saving, folder, run=RUN, step=4)
        out["async"] = os.fspath(sealed.result(timeout=TIMEOUT) or "")
        out["async_committed"] = is_committed(folder)
        train(model, opt, 2, rank)
        wrapped = sp_dcp.async_save(sharded_state(model, opt), root, run=RUN, step=6)
        out["wrapped"] = os.fspath(wrapped.result(timeout=TIMEOUT) or "")
        full = full_state(model, opt)
        if rank == 0:
            torch.save(full, tmp / "ref-6.pt")
    elif scenario == "load":
        model, opt = sharded(seed=7)                 # other weights: everything must come from the checkpoint
        train(model, opt, 1, rank)                   # and optimizer state to overwrite
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = sharded_state(model, opt)
        sp_dcp.load(state, args[0])
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        full = full_state(model, opt)
        if rank == 0:
            torch.save(full, tmp / "got-ws2.pt")
    dist.barrier()
    dist.destroy_process_group()
    return out


# ------------------------------------------------------------------------------- the tests

def same(a, b, path: str = "") -> list[str]:
    """Where two nested state dicts differ (tensors bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
        return [] if ok else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in same(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same(x, y, f"{path}.{i}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("fsdp2")
    return tmp, run_ranks(tmp, "save")


@pytest.fixture(scope="module")
def restored(saved):
    """Steps 2, 4 and 6 ingested (verified) into a catalog of their own; step 2, the `sp_dcp.save` one,
    restored into resume/ by `safepoint.restore`."""
    import safepoint
    from safepoint.catalog import db, open_catalog
    from safepoint.core import resumed
    from safepoint.core.config import Config
    from safepoint.core.states import CheckpointState as CS
    from safepoint.ops.ingest import ingest

    tmp, _ = saved
    url = f"sqlite:///{tmp / 'catalog.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SAFEPOINT_CATALOG_URL", url)
        mp.chdir(tmp)
        catalog = open_catalog(url)
        for step in (2, 4, 6):
            outcome = ingest(tmp / "node" / "ckpt" / f"step-{step}", [(tmp / "durable").as_uri()], catalog, Config())
            assert outcome.state is CS.VERIFIED, outcome.message
        resumed.forget()
        try:
            r = safepoint.restore(RUN, "resume/", step=2)
        finally:
            resumed.forget()
            db.dispose(url)
    assert r.step == 2 and (r.path / ".metadata").is_file()
    return tmp, r.path


def test_fsdp2_saves_and_async_saves_are_sealed_and_verified(saved) -> None:
    from safepoint.local.snapshot import LocalSnapshot
    from safepoint.validation.validate import validate_snapshot

    tmp, ranks = saved
    root = tmp / "node" / "ckpt"
    assert ranks[0]["dtensor"] == "DTensor"                     # the parameters really are sharded
    assert ranks[0]["async"] == os.fspath(root / "step-4") and ranks[1]["async"] == ""   # rank 0 sealed
    assert ranks[0]["async_committed"] and ranks[0]["wrapped"] == os.fspath(root / "step-6")
    for step in (2, 4, 6):
        m = LocalSnapshot.open(root / f"step-{step}").manifest
        assert (m.run, m.step) == (RUN, step)
        assert {f.path for f in m.files} == {".metadata", "__0_0.distcp", "__1_0.distcp"}  # both ranks' shards
    m = LocalSnapshot.open(root / "step-4").manifest           # the async one (all three are ingested below)
    report = validate_snapshot(root / "step-4", [f.path for f in m.files], step=4)
    assert report.outcome == "verified", report.summary()
    names = {s.name for s in report.stats}
    assert {"model.0.weight", "model.2.bias", "optim.state.0.weight.exp_avg_sq"} <= names, sorted(names)
    assert next(s for s in report.stats if s.name == "model.0.weight").shape == (16, 8)  # the whole tensor


def test_restored_fsdp2_checkpoint_loads_back_into_world_size_2(restored) -> None:
    tmp, folder = restored
    run_ranks(tmp, "load", os.fspath(folder))
    assert same(torch.load(tmp / "got-ws2.pt"), torch.load(tmp / "ref-2.pt")) == []


def test_restored_fsdp2_checkpoint_reshards_into_world_size_1(restored) -> None:
    """One process, no process group: DCP reads both ranks' shards into whole tensors."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from safepoint.integrations import dcp as sp_dcp

    _tmp, folder = restored
    model = build(seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m, o = get_state_dict(model, opt)
    state = {"model": m, "optim": o}
    sp_dcp.load(state, folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    m, o = get_state_dict(model, opt)
    want = torch.load(_tmp / "ref-2.pt")
    assert same({"model": m, "optim": o}, want) == []
    assert not any(type(t).__name__ == "DTensor" for t in m.values())


def test_an_async_save_that_failed_or_left_no_metadata_is_not_sealed(tmp_path: Path) -> None:
    from concurrent.futures import Future

    from safepoint.integrations import dcp as sp_dcp
    from safepoint.local.snapshot import is_committed

    folder = tmp_path / "step-3"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"x" * 64)          # data, but DCP never wrote .metadata
    failed, unfinished = Future(), Future()
    sealed_failed = sp_dcp.seal_when_saved(failed, folder, run="r", step=3)
    sealed_unfinished = sp_dcp.seal_when_saved(unfinished, folder, run="r", step=3)
    assert not sealed_failed.done()                              # nothing happens before the save ends
    failed.set_exception(OSError("disk full"))
    unfinished.set_result(None)
    with pytest.raises(OSError, match="disk full"):
        sealed_failed.result(timeout=5)
    with pytest.raises(FileNotFoundError, match="without .metadata"):
        sealed_unfinished.result(timeout=5)
    assert not is_committed(folder)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    print(json.dumps(worker(sys.argv[2], Path(sys.argv[3]), *sys.argv[4:])), flush=True)
