"""The fleet on Prefect's own workers (tests/fleet.py): three simulated nodes, each a process worker
on its own work queue, a `safepoint watch --emit` on its own root and its own SAFEPOINT_HOME; the
Prefect server's database and the catalog are fresh PostgreSQL databases, dropped at the end.

Done-when of issue 23 (part one):
- a node's worker killed with SIGKILL during an ingest (its flow-run process with it) leaves a run
  that Prefect marks Crashed (the heartbeat automation of automations/crash-zombie-runs.yaml); the
  node's watcher runs the ingest again once the node's worker is back, and the checkpoint reaches
  `verified` with nothing lost or duplicated;
- restore on any node from the shared catalog: node n0 is lost entirely (its root deleted) and its
  checkpoint is restored on n2, by the CLI in a separate process, into a fresh folder.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from safepoint import commit
from tests.fleet import REPO, Fleet, require_postgres
from tests.prefect_server import stop_group

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

NODES = ["n0", "n1", "n2"]
HEARTBEAT_S = 30      # Prefect's minimum flow-run heartbeat period
ZOMBIE_WITHIN_S = 40  # no heartbeat this long after the last one: Crashed


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    require_postgres()  # CI (.ci/run): a failure, never a skip
    f = Fleet(tmp_path_factory.mktemp("fleet"), NODES, zombie_within_s=ZOMBIE_WITHIN_S, heartbeat_s=HEARTBEAT_S)
    try:
        f.start()
        print(f"\nfleet up: server {f.timings['server']:.1f}s, pool+deploy+automation {f.timings['deploy']:.1f}s")
        yield f
    finally:
        f.close()


def write_snapshot(root: Path, run: str, step: int) -> dict[str, str]:
    """A committed two-file snapshot; returns {file name: sha256} of what was written."""
    folder = root / run / f"step-{step}"
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(step)
    torch.save({"model": {"w": torch.randn(64, 64, generator=g)},
                "optimizer": {"state": {0: {"exp_avg": torch.randn(64, 64, generator=g)}}}, "step": step},
               folder / "model.pt")
    (folder / "extra.bin").write_bytes(bytes(range(256)) * 64)
    commit(folder, run, step)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.suffix != ".json"
            and p.name != "COMMITTED"}


def runs_of(fleet: Fleet, snapshot_prefix: str) -> list:
    return [r for r in fleet.ingest_runs() if str((r.parameters or {}).get("snapshot", "")).startswith(snapshot_prefix)]


def test_restore_on_another_node_after_losing_n0(fleet):
    files = write_snapshot(fleet.root("n0"), "lost", 1)
    fleet.wait_for("lost/1 verified", lambda: fleet.state("lost", 1) == "verified", 120)
    (run,) = runs_of(fleet, str(fleet.root("n0")))
    assert run.work_queue_name == "n0"  # ingested by n0's own worker, through its own deployment

    # Node n0 is gone: its worker, its watcher, its disks (root and SAFEPOINT_HOME).
    fleet.kill_worker("n0")
    stop_group(fleet.watchers.pop("n0"), grace_s=0)
    shutil.rmtree(fleet.base / "nodes" / "n0")

    into = fleet.base / "nodes" / "n2" / "restored-lost"  # a fresh folder, outside n2's watched root
    p = subprocess.run([sys.executable, "-m", "safepoint.cli", "restore", "--run", "lost", "--step", "1",
                        "--into", str(into)], env=fleet.env("n2"), cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    got = {q.name: hashlib.sha256(q.read_bytes()).hexdigest() for q in into.iterdir() if q.suffix != ".json"
           and q.name != "COMMITTED"}
    assert got == files
    assert (into / "COMMITTED").is_file()


def test_worker_killed_mid_ingest_crashes_the_run_and_the_ingest_still_verifies(fleet):
    from safepoint.core.naming import ingest_lease

    cat = fleet.catalog()
    # Another host holds this checkpoint's ingest lease, so n1's ingest is certainly in flight (its
    # flow run registered the checkpoint and waits for the lease) when the node dies.
    lease, other = ingest_lease("kill", 1, fleet.durable), "elsewhere:1:test"
    assert cat.acquire_lease(lease, other, 600)
    files = write_snapshot(fleet.root("n1"), "kill", 1)
    prefix = str(fleet.root("n1") / "kill")

    def running() -> list:
        return [r for r in runs_of(fleet, prefix) if r.state_type.value == "RUNNING"]

    (first,) = fleet.wait_for("n1's ingest running", running, 120)
    fleet.wait_for("the checkpoint registered", lambda: fleet.state("kill", 1) is not None, 60)
    # The run's first heartbeat goes out as it starts: the automation counts from it.
    fleet.wait_for("the run's first heartbeat",
                   lambda: fleet.events("prefect.flow-run.heartbeat", f"prefect.flow-run.{first.id}"), 60)
    killed = fleet.kill_worker("n1")
    assert len(killed) >= 2, killed  # the worker and the flow-run process it started
    assert cat.release_lease(lease, other)

    def state_of_first() -> str:
        (r,) = [r for r in fleet.ingest_runs() if r.id == first.id]
        return r.state_type.value

    t0 = time.monotonic()
    fleet.wait_for("the dead run marked Crashed", lambda: state_of_first() == "CRASHED", ZOMBIE_WITHIN_S + 60, poll_s=1)
    print(f"\nkilled -> Crashed: {time.monotonic() - t0:.1f}s (heartbeat {HEARTBEAT_S}s, within {ZOMBIE_WITHIN_S}s)")
    assert fleet.state("kill", 1) != "verified"

    fleet.start_worker("n1")  # the node comes back; its watcher re-runs the crashed ingest
    fleet.wait_for("kill/1 verified", lambda: fleet.state("kill", 1) == "verified", 120)

    # Nothing lost: every file is in the replica, byte for byte, and nothing else is.
    row = cat.get("kill", 1)
    (replica,) = cat.replicas(row.id)
    assert replica.state.value == "verified"
    stored = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
              for p in (fleet.durable_dir / "kill" / "1").iterdir() if p.is_file()}
    assert {k: v for k, v in stored.items() if k in files} == files
    assert set(stored) - set(files) <= {"MANIFEST.json", "COMMITTED"}, sorted(stored)
    assert row.file_count == len(files)
    # Nothing duplicated: one crashed run, one completed run, one ingest recorded (not skipped).
    # (`verified` is recorded a moment before the run finishes: artifacts, final state.)
    fleet.wait_for("the re-run completed", lambda: all(r.state_type.value in ("COMPLETED", "CRASHED", "FAILED")
                                                       for r in runs_of(fleet, prefix)), 60)
    runs = runs_of(fleet, prefix)
    assert sorted(r.state_type.value for r in runs) == ["COMPLETED", "CRASHED"], [(r.name, r.state_type) for r in runs]
    (crashed,) = [r for r in runs if r.state_type.value == "CRASHED"]
    assert "heartbeat" in (crashed.state.message or "")
    done = [e["detail"] for e in cat.events(row.id, kind="ingest.done")]
    assert [d["skipped"] for d in done] == [False], done
    assert len(cat.list_checkpoints("kill")) == 1
