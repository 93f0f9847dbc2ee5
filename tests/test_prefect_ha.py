"""Prefect scaled out as its self-hosting guide says, with the fleet's warm lane on it (issue 35).

Two `prefect server start --no-services` on one PostgreSQL database, Redis (prefect-redis) for
messaging, ordering, leases and the docket, the background services in a process of their own,
a balancer in front; two nodes, each `safepoint serve --watch ROOT` (tests/fleet.py). One fleet for
the module; each test holds its checkpoint's ingest lease from "another host" so that the ingest
is certainly in flight when the fault strikes, then lets it go:

- one API server SIGKILLed during a run: the run still completes, nothing lost, nothing twice;
- a node's warm executor SIGKILLed mid-ingest: restarted, the ingest completes, one catalog row,
  no replica or verdict recorded twice;
- Redis restarted (empty: no persistence) during a run: the run completes and Prefect goes on
  storing events.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from safepoint import commit
from tests.fleet import Fleet, require, require_postgres

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

NODES = ["n0", "n1"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    require_postgres()
    require(shutil.which("redis-server") is not None, "redis-server not installed (Debian package redis-server)",
            "SAFEPOINT_REQUIRE_REDIS")
    f = Fleet(tmp_path_factory.mktemp("ha"), NODES, lane="warm", api_servers=2)
    try:
        f.start()
        yield f
    finally:
        f.close()


def write_part(root: Path, run: str, step: int, node: str, ranks: list[int], world: int) -> dict[str, str]:
    folder = root / run / f"step-{step}"
    folder.mkdir(parents=True)
    for r in ranks:
        torch.save({"model": {f"w{r}": torch.full((32, 32), float(r + step))}, "step": step}, folder / f"rank{r}.pt")
    commit(folder, run, step, world_size=world, ranks=ranks, node=node)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("rank*.pt")}


class Held:
    """The checkpoint's ingest leases held by another host: every part's ingest waits in `replicate+verify`."""

    def __init__(self, fleet: Fleet, run: str, step: int, parts: list[str]):
        from safepoint.core.naming import ingest_lease

        self.cat = fleet.catalog()
        self.names = [ingest_lease(run, step, fleet.durable, p) for p in parts]
        for n in self.names:
            assert self.cat.acquire_lease(n, "elsewhere:1:test", 600)

    def release(self) -> None:
        for n in self.names:
            assert self.cat.release_lease(n, "elsewhere:1:test")


def runs_of(fleet: Fleet, run: str) -> list:
    return [r for r in fleet.ingest_runs() if f"/{run}/" in str((r.parameters or {}).get("snapshot", ""))]


def assert_once(fleet: Fleet, run: str, step: int, files: dict[str, str], parts: int) -> None:
    """One catalog row, verified; one verified replica holding every file; `verified` recorded once;
    one `ingest.done` per part, none skipped."""
    cat = fleet.catalog()
    assert len(cat.list_checkpoints(run)) == 1
    row = cat.get(run, step)
    assert row.state.value == "verified"
    (replica,) = cat.replicas(row.id)
    assert replica.state.value == "verified"
    stored = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
              for p in (fleet.durable_dir / run / str(step)).rglob("rank*.pt")}
    assert stored == files
    verdicts = [e for e in cat.events(row.id, kind="state") if e["detail"].get("to") == "verified"]
    assert len(verdicts) == 1, verdicts
    done = [e["detail"] for e in cat.events(row.id, kind="ingest.done")]
    assert sorted(d["skipped"] for d in done) == [False] * parts, done


def in_flight(fleet: Fleet, run: str, n: int) -> list:
    return fleet.wait_for(f"{n} ingest runs of {run} running", lambda: (
        lambda rs: rs if len(rs) >= n else None)([r for r in runs_of(fleet, run) if r.state_type.value == "RUNNING"]),
        120)


def completed(fleet: Fleet, run: str, n: int) -> list:
    return fleet.wait_for(f"{n} ingest runs of {run} completed", lambda: (
        lambda rs: rs if len(rs) >= n else None)([r for r in runs_of(fleet, run) if r.state_type.value == "COMPLETED"]),
        120)


def test_an_api_server_killed_during_a_run(fleet):
    held = Held(fleet, "apikill", 1, ["0", "1"])
    files = {**write_part(fleet.root("n0"), "apikill", 1, "n0", [0], 2),
             **write_part(fleet.root("n1"), "apikill", 1, "n1", [1], 2)}
    in_flight(fleet, "apikill", 2)
    fleet.kill_api(0)
    held.release()
    fleet.wait_for("apikill/1 verified", lambda: fleet.state("apikill", 1) == "verified", 120)
    assert_once(fleet, "apikill", 1, files, parts=2)
    runs = completed(fleet, "apikill", 2)
    assert len(runs_of(fleet, "apikill")) == 2, [(r.name, r.state_type) for r in runs_of(fleet, "apikill")]
    assert {r.name for r in runs} == {"ingest-apikill-1"}


def test_a_warm_executor_killed_mid_ingest_completes_on_restart(fleet):
    held = Held(fleet, "exkill", 1, ["all"])
    folder = fleet.root("n0") / "exkill" / "step-1"
    folder.mkdir(parents=True)
    torch.save({"model": {"w": torch.ones(16, 16)}}, folder / "rank0.pt")
    commit(folder, "exkill", 1)
    files = {"rank0.pt": hashlib.sha256((folder / "rank0.pt").read_bytes()).hexdigest()}
    (first,) = in_flight(fleet, "exkill", 1)
    fleet.wait_for("exkill/1 registered", lambda: fleet.state("exkill", 1) == "replicating", 60)
    fleet.kill_executor("n0")
    held.release()
    fleet.start_executor("n0")  # the node's executor comes back: its watcher offers the folder again
    fleet.wait_for("exkill/1 verified", lambda: fleet.state("exkill", 1) == "verified", 120)
    assert_once(fleet, "exkill", 1, files, parts=1)
    (again,) = completed(fleet, "exkill", 1)
    assert again.id != first.id
    # The restarted executor marked the killed run Crashed before running the ingest again.
    runs = runs_of(fleet, "exkill")
    assert sorted(r.state_type.value for r in runs) == ["COMPLETED", "CRASHED"], [(r.name, r.state_type) for r in runs]
    assert [r.id for r in runs if r.state_type.value == "CRASHED"] == [first.id]


def test_a_redis_restart_during_a_run_is_survived(fleet):
    held = Held(fleet, "redis", 1, ["0", "1"])
    files = {**write_part(fleet.root("n0"), "redis", 1, "n0", [0], 2),
             **write_part(fleet.root("n1"), "redis", 1, "n1", [1], 2)}
    in_flight(fleet, "redis", 2)
    fleet.redis.stop()
    fleet.redis.start()  # empty: streams, consumer groups and leases are gone
    held.release()
    fleet.wait_for("redis/1 verified", lambda: fleet.state("redis", 1) == "verified", 120)
    assert_once(fleet, "redis", 1, files, parts=2)
    runs = completed(fleet, "redis", 2)
    # Events still flow: the runs' Completed events (emitted after the restart) reach the event store.
    for r in runs:
        fleet.wait_for(f"{r.name}'s Completed event stored", lambda r=r: fleet.events(
            "prefect.flow-run.Completed", f"prefect.flow-run.{r.id}"), 60, poll_s=1)
