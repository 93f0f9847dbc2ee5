"""Two real ranks (gloo on CPU, separate processes): one commit when both wrote; a dead rank hangs nobody.

Each rank is a subprocess running this file as a script (`--worker`), so the test can kill or lose
a rank and still bound every wait with a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from safepoint.core.format import MANIFEST_NAME, MARKER_NAME

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
TIMEOUT = 120

pytestmark = pytest.mark.slow  # a process group of ranks per test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_state(rank: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return {"model": {"shard": torch.randn(64, 32, generator=g), "rank": torch.full((3,), rank)},
            "optim": {"step": 5, "lr": 0.1 * (rank + 1)}}


def run_ranks(tmp_path: Path, scenario: str, world: int = 2, **env_extra: str) -> list[dict]:
    """Start `world` workers for `scenario`; return each one's JSON result (or its exit code)."""
    port = _free_port()
    procs = []
    for r in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
               "WORLD_SIZE": str(world), "PYTHONPATH": str(REPO), **env_extra}
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--worker", scenario, str(tmp_path)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            out.append({"rc": p.returncode, **(json.loads(lines[-1]) if lines else {}), "stderr": stderr[-2000:]})
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_two_ranks_commit_once_with_world_size_2(tmp_path):
    import torch

    from safepoint.local.snapshot import LocalSnapshot
    from safepoint.snapshotter import load
    from safepoint.validation.validate import validate_snapshot

    results = run_ranks(tmp_path, "both")
    assert [r["rc"] for r in results] == [0, 0], [r["stderr"] for r in results]
    assert [r["outcome"] for r in results] == ["committed", "committed"]
    folder = tmp_path / "nvme" / "run-mr" / "10"
    m = LocalSnapshot.open(folder).manifest
    assert m.world_size == 2 and m.held_ranks == (0, 1)
    assert [f.path for f in m.files] == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    assert not [p for p in folder.iterdir() if p.name.startswith(".safepoint-tmp-")]  # done files removed
    assert results[1]["manifest_blake3_of_file"] == m.file("rank-00001-of-00002.safetensors").blake3
    for r in (0, 1):
        back = load(folder, rank=r)
        want = rank_state(r)
        assert torch.equal(back["model"]["shard"], want["model"]["shard"]) and back["optim"] == want["optim"]
        assert torch.equal(back["dt"], torch.arange(8.0).reshape(4, 2)[2 * r: 2 * r + 2])  # the local shard
    assert validate_snapshot(folder).ok
    # The same two ranks also wrote a DCP checkpoint through SafepointWriter: committed by the coordinator.
    dm = LocalSnapshot.open(tmp_path / "nvme" / "run-mr-dcp" / "10").manifest
    assert dm.world_size == 2 and {f.path for f in dm.files} >= {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert validate_snapshot(tmp_path / "nvme" / "run-mr-dcp" / "10").ok


def test_a_rank_that_dies_before_writing_times_out_the_commit(tmp_path):
    results = run_ranks(tmp_path, "rank1-dies", SP_COMMIT_TIMEOUT="3")
    assert results[1]["rc"] == 17  # the dead rank
    assert results[0]["rc"] == 0, results[0]["stderr"]
    assert results[0]["outcome"] == "CommitTimeout" and "rank(s) 1 of 2" in results[0]["error"]
    folder = tmp_path / "nvme" / "run-mr" / "10"
    assert not (folder / MARKER_NAME).exists() and not (folder / MANIFEST_NAME).exists()
    assert (folder / "rank-00000-of-00002.safetensors").exists()  # rank 0's shard, never committed


def test_a_dead_committer_times_out_the_other_ranks(tmp_path):
    results = run_ranks(tmp_path, "rank0-dies", SP_COMMIT_TIMEOUT="3")
    assert results[0]["rc"] == 17
    assert results[1]["rc"] == 0, results[1]["stderr"]
    assert results[1]["outcome"] == "CommitTimeout"
    assert not (tmp_path / "nvme" / "run-mr" / "10" / MARKER_NAME).exists()


# ------------------------------------------------------------------------------- the worker

def worker(scenario: str, tmp: str) -> int:
    import torch.distributed as dist

    from safepoint.snapshotter import CommitTimeout, Snapshotter

    dist.init_process_group("gloo", init_method="env://")
    # Every rank has finished joining before one dies: gloo connects its peers after the store's
    # rendezvous, and a rank gone in the middle of that reset its peer's init ("Connection reset by
    # peer" in CI) instead of leaving it to time out at the commit, which is what these tests check.
    dist.barrier()
    rank = dist.get_rank()
    result: dict = {"rank": rank}
    try:
        if scenario == f"rank{rank}-dies":
            os._exit(17)  # dies after joining the group, before writing anything
        snap = Snapshotter(Path(tmp) / "nvme", "run-mr", budget_bytes=1 << 20, memory_floor=0.0,
                           commit_timeout_s=float(os.environ.get("SP_COMMIT_TIMEOUT", "60")))
        assert (snap.rank, snap.world_size) == (rank, 2)
        state = rank_state(rank)
        if scenario == "both":  # a DTensor too: each rank saves its local shard
            import torch
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            mesh = init_device_mesh("cpu", (2,))
            state["dt"] = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        try:
            manifest = snap.save(10, state).wait()
            result["outcome"] = "committed"
            result["manifest_blake3_of_file"] = manifest.file(snap.shard_name).blake3 if manifest else None
        except CommitTimeout as e:
            result.update(outcome="CommitTimeout", error=str(e))
        finally:
            snap.close()
        if scenario == "both":
            import torch.distributed.checkpoint as dcp

            from safepoint.snapshotter.dcp_writer import SafepointWriter

            dcp.save(rank_state(rank)["model"], storage_writer=SafepointWriter(
                Path(tmp) / "nvme" / "run-mr-dcp" / "10", run="run-mr-dcp"))
    finally:
        print(json.dumps(result), flush=True)
    if scenario == "both":
        # Both ranks are alive: leave together. A rank that tears gloo down while its peer is still
        # in a collective can abort in C++ ("terminate called without an active exception"), which
        # CI saw once on rank 0 (the TCPStore host) after all the work had succeeded.
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    sys.exit(worker(sys.argv[2], sys.argv[3]))
elif __name__ == "__main__":
    pytest.main([__file__, "-q"])
