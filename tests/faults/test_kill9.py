"""kill -9 at a random point of commit, replicate, validate or prune; restart; reconcile; check.

Each iteration writes a new checkpoint (step i) and runs the lifecycle a training node runs for
it (commit, ingest, retention with keep-last 2) in a child process that is SIGKILLed at a random
point: either at a random traced I/O event (fsync, rename, link, unlink, rmdir, catalog
transaction begin and commit) or after a random delay. Then it restarts: the same command again
(it must finish), reconcile with the grace period (it must remove nothing young), reconcile once
the grace period has passed (it removes the orphans), and every invariant is checked against the
real bytes (tests/faults/world.py): nothing verified lost, no catalog row pointing at a missing
object, no marker without complete files, no duplicates, no orphans.

Iterations: $SAFEPOINT_FAULT_ITERATIONS (default 100 on SQLite, a quarter of that on PostgreSQL).
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from pathlib import Path

import pytest

from safepoint.catalog.store import open_catalog
from safepoint.core.states import CheckpointState as CS
from safepoint.ops.reconcile import reconcile
from tests.faults.conftest import figures
from tests.faults.world import World, check, copy_template

RUN = "kill9"
KEEP_LAST = 2
GRACE = 3600.0


def iterations(backend: str) -> int:
    n = int(os.environ.get("SAFEPOINT_FAULT_ITERATIONS", "100"))
    return n if backend == "sqlite" else max(10, n // 4)


def kill_loop(catalog_url: str, backend: str, tmp_path: Path, template: Path, fork_server, seed: int) -> dict:
    rng = random.Random(seed)
    server = fork_server(catalog_url)
    catalog = open_catalog(catalog_url)
    nvme, durable = tmp_path / "nvme", tmp_path / "durable"
    nvme.mkdir()
    dest = durable.as_uri()
    world = World()
    n = iterations(backend)
    kills: Counter[str] = Counter()
    modes: Counter[str] = Counter()
    removed = 0
    events = seconds = None
    t0 = time.perf_counter()

    def args(step: int) -> dict:
        return {"folder": str(nvme / f"step-{step}"), "run": RUN, "step": step, "dest": dest,
                "catalog_url": catalog_url, "keep_last": KEEP_LAST}

    for i in range(n + 1):
        step = i * 10
        copy_template(template, nvme / f"step-{step}")
        if i == 0:
            # Calibration: a whole lifecycle, traced, not killed: how many events, how long.
            ran = server.run("lifecycle", args(step), trace=True)
            events, seconds = ran.result["events"], ran.seconds
            assert ran.result["state"] == "verified", ran.result
        elif i % 2:
            modes["event"] += 1
            ran = server.run("lifecycle", args(step), kill_at=rng.randint(1, int(events * 1.1)),
                             after=rng.random() < 0.5)
        else:
            modes["time"] += 1
            ran = server.run("lifecycle", args(step), kill_after_s=rng.uniform(0, seconds * 1.1))
        if i:
            kills[(ran.phases[-1] if ran.phases else "start") if ran.killed else "finished first"] += 1

        # Restart: the same command again must finish.
        again = server.run("lifecycle", args(step))
        assert again.exit == 0 and again.result["state"] == "verified", (i, again.result, server.log_tail())
        world.observe(catalog)

        # Within the grace period the reconciler changes nothing (an upload could be in flight).
        young = reconcile(catalog, [dest], grace_s=GRACE)
        done = [s for s in young.steps if s.done]
        assert not done and not young.errors, (i, [s.to_dict() for s in done], young.errors)
        # Once it has passed, it removes what the kill orphaned.
        old = reconcile(catalog, [dest], grace_s=GRACE, now=time.time() + GRACE + 1)
        assert not old.errors, old.errors
        bad = [s.to_dict() for s in old.steps if s.done and s.action not in ("remove_tmp", "remove_partial")]
        assert not bad, (i, bad)
        removed += sum(1 for s in old.steps if s.done)

        found = check(catalog, world, dest_roots=[durable], local_roots=[nvme])
        assert not found.violations, (i, kills, found.violations)
        assert catalog.get(RUN, step).state is CS.VERIFIED

    took = time.perf_counter() - t0
    stats = {"backend": backend, "iterations": n, "killed": n - kills["finished first"], **modes,
             **{f"killed_in_{k}": v for k, v in sorted(kills.items()) if k != "finished first"},
             "finished_before_kill": kills["finished first"], "orphans_removed_after_grace": removed,
             "verified_checkpoints_seen": len(world.ever_verified), "bytes_lost": found.bytes_lost,
             "events_per_lifecycle": events, "seconds": round(took, 1)}
    figures(f"kill -9 loop ({backend})", **stats)
    return stats


@pytest.mark.slow
def test_kill9_loop_sqlite(sqlite_catalog_url, tmp_path, template, fork_server):
    stats = kill_loop(sqlite_catalog_url, "sqlite", tmp_path, template, fork_server, seed=8)
    assert stats["iterations"] >= 100 or "SAFEPOINT_FAULT_ITERATIONS" in os.environ
    assert stats["bytes_lost"] == 0
    # The random kills must really have hit every stage, else the loop proves little.
    for phase in ("commit", "replicate", "validate", "prune"):
        assert stats.get(f"killed_in_{phase}", 0) > 0, stats


@pytest.mark.slow
@pytest.mark.postgres
def test_kill9_loop_postgres(postgres_catalog_url, tmp_path, template, fork_server):
    stats = kill_loop(postgres_catalog_url, "postgres", tmp_path, template, fork_server, seed=80)
    assert stats["bytes_lost"] == 0 and stats["killed"] > 0
