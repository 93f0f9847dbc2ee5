"""Real concurrent processes against PostgreSQL: no race may leave an impossible state.

"Impossible" is checked the same way everywhere: every checkpoint's recorded state history is a
chain of allowed transitions (each event's `from` is the previous `to`), its last state is the
row's state, a pruned checkpoint has only deleted replicas and no files left, and a checkpoint
that is not pruned has a committed replica whose bytes verify.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from safepoint.catalog import open_catalog
from safepoint.core.format import MARKER_NAME
from safepoint.core.states import CheckpointState as C
from safepoint.core.states import ReplicaState as R
from safepoint.core.transitions import allowed as can_transition
from safepoint.destinations import open_destination
from safepoint.ops.verify import verify_replica
from tests.helpers_catalog import durable, local_folder, seed

pytestmark = pytest.mark.postgres


# -- workers (module level: spawned processes import them) ---------------------------------------

def _ingest(url: str, folder: str, dest: str, delay: float, barrier, out) -> None:
    from safepoint.core.errors import SafepointError
    from safepoint.ops import ingest as pipeline

    cat = open_catalog(url)
    cat.runs()  # connected and migrated before the start line
    barrier.wait(timeout=120)
    time.sleep(delay)
    try:
        out.put(("ingest", str(pipeline.ingest(folder, [dest], cat).state)))
    except SafepointError as e:  # pruned while registering, or its folder already deleted
        out.put(("ingest", f"refused: {e}"))


def _prune(url: str, run: str, keep: int, delay: float, barrier, out) -> None:
    from safepoint.ops.prune import prune
    from safepoint.rules.retention import KeepLastN

    cat = open_catalog(url)
    cat.runs()
    barrier.wait(timeout=120)
    time.sleep(delay)
    res = prune(cat, [run], KeepLastN(keep), now=datetime.now(timezone.utc))
    out.put(("prune", sorted(s for _r, s in res.pruned), res.errors))


def _scrub(url: str, replica_url: str, rounds: int, barrier, out) -> None:
    from safepoint.ops.verify import verify

    cat = open_catalog(url)
    cat.runs()
    barrier.wait(timeout=120)
    outcomes = [str(verify(cat, replica_url).report.outcome) for _ in range(rounds)]
    out.put(("scrub", outcomes))


def _race(*jobs: tuple) -> list:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(jobs))
    q = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, barrier, q)) for fn, *args in jobs]
    for p in procs:
        p.start()
    results: list = []
    deadline = time.monotonic() + 240
    try:
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                results.append(q.get(timeout=0.5))
            except queue.Empty:
                if all(p.exitcode is not None for p in procs) and q.empty():
                    break  # someone died without answering: fail below with its exit code
    finally:
        for p in procs:
            p.join(60)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    assert len(results) == len(procs)
    return results


# -- what may never happen -----------------------------------------------------------------------

def assert_possible(cat, run: str, root: Path) -> None:
    for c in cat.list_checkpoints(run):
        cur = None
        for e in cat.events(c.id):
            if e["kind"] in ("commit", "recommit"):
                cur = C.COMMITTED
            elif e["kind"] == "state":
                frm, to = C(e["detail"]["from"]), C(e["detail"]["to"])
                assert frm is cur, (c.step, e)
                assert can_transition(frm, to), (c.step, e)
                cur = to
        assert cur is c.state, (c.step, cur, c.state)
        replica = root / "durable0" / run / str(c.step)
        if c.state is C.PRUNED:
            assert {r.state for r in c.replicas} <= {R.DELETED}, (c.step, c.replicas)
            assert not (replica / MARKER_NAME).exists()
            assert not [p for p in replica.rglob("*") if p.is_file()] if replica.exists() else True
            assert not local_folder(root, run, c.step).exists()
        else:
            assert c.state is C.VERIFIED, (c.step, c.state)
            assert [r.state for r in c.replicas] == [R.VERIFIED]
            dest = open_destination(durable(root))
            assert str(verify_replica(dest, run, c.step).outcome) == "verified"


# -- the races -------------------------------------------------------------------------------

def test_two_ingests_of_one_checkpoint(postgres_catalog_url, tmp_path):
    cat = open_catalog(postgres_catalog_url)
    row = seed(cat, tmp_path, "twin", 1, state=C.COMMITTED, replicas=(), loadable=True)
    folder = str(local_folder(tmp_path, "twin", 1))
    results = _race((_ingest, postgres_catalog_url, folder, durable(tmp_path), 0.0),
                    (_ingest, postgres_catalog_url, folder, durable(tmp_path), 0.0))
    # The plain pipeline takes no lease (the flow does): the loser may report the state it saw the
    # winner in. What matters is the catalog: verified once both are done, by a legal history.
    assert "verified" in {r[1] for r in results}, results
    assert {r[1] for r in results} <= {"verified", "validating", "replicated", "replicating"}, results
    assert cat.get_by_id(row.id).state is C.VERIFIED
    assert_possible(cat, "twin", tmp_path)


@pytest.mark.parametrize("ingest_delay,prune_delay", [(0.0, 0.0), (0.0, 0.4), (0.4, 0.0)])
def test_ingest_racing_prune(postgres_catalog_url, tmp_path, ingest_delay, prune_delay):
    """Re-ingesting (re-verifying) the oldest checkpoint while retention wants to delete it: either
    the prune wins (ingest refused, every copy deleted) or the ingest does (kept, still verified)."""
    cat = open_catalog(postgres_catalog_url)
    for s in (1, 2, 3, 4):
        seed(cat, tmp_path, "race", s, loadable=True)
    results = dict(r[:2] for r in _race(
        (_ingest, postgres_catalog_url, str(local_folder(tmp_path, "race", 1)), durable(tmp_path), ingest_delay),
        (_prune, postgres_catalog_url, "race", 1, prune_delay)))
    one = cat.get("race", 1)
    print(f"ingest delay {ingest_delay}, prune delay {prune_delay}: {results}, step 1 {one.state}")
    if one.state is C.PRUNED:
        if results["ingest"] == "verified":
            # The ingest finished first and retention took the checkpoint after it: a sequential history,
            # never a pruned checkpoint brought back to verified.
            states = [e["detail"]["to"] for e in cat.events(one.id) if e["kind"] == "state"]
            assert states[-2:] == ["verified", "pruned"], states
        else:
            assert results["ingest"].startswith("refused") or results["ingest"] == "pruned", results
        assert 1 in results["prune"]
    else:
        assert results["ingest"] == "verified" and 1 not in results["prune"], results
    assert 2 in results["prune"] and cat.get("race", 2).state is C.PRUNED  # 1 pending never shields 2
    assert_possible(cat, "race", tmp_path)
    # Whatever happened, a later prune converges on the same end state.
    _race((_prune, postgres_catalog_url, "race", 1, 0.0))
    assert {c.step: c.state for c in cat.list_checkpoints("race")} == {1: C.PRUNED, 2: C.PRUNED, 3: C.VERIFIED,
                                                                        4: C.VERIFIED}
    assert_possible(cat, "race", tmp_path)


def test_scrub_racing_prune(postgres_catalog_url, tmp_path):
    cat = open_catalog(postgres_catalog_url)
    for s in (1, 2, 3):
        seed(cat, tmp_path, "sc", s, size=256 * 1024)
    results = dict(r[:2] for r in _race((_scrub, postgres_catalog_url, f"{durable(tmp_path)}/sc/1", 6),
                                        (_prune, postgres_catalog_url, "sc", 1, 0.05)))
    assert results["prune"] == [1]
    # The scrub may have read good bytes, or found them going: neither may revive the replica.
    assert set(results["scrub"]) <= {"verified", "incomplete", "corrupt"}
    assert_possible(cat, "sc", tmp_path)
    one = cat.get("sc", 1)
    late = [e for e in cat.events(one.id) if e["kind"] == "replica"
            and e["id"] > max(x["id"] for x in cat.events(one.id) if x["kind"] == "state")]
    assert [e["detail"]["state"] for e in late] == ["deleted"]


def test_three_prunes_at_once(postgres_catalog_url, tmp_path):
    cat = open_catalog(postgres_catalog_url)
    for s in range(1, 7):
        seed(cat, tmp_path, "p3", s)
    results = _race(*[(_prune, postgres_catalog_url, "p3", 2, 0.0)] * 3)
    marked = [s for r in results for s in r[1]]
    assert sorted(marked) == [1, 2, 3, 4]          # each deletion marked by exactly one of them
    assert all(not r[2] for r in results)          # and none of them failed on the others' deletions
    for c in cat.list_checkpoints("p3"):
        n = sum(1 for e in cat.events(c.id) if e["kind"] == "state" and e["detail"]["to"] == "pruned")
        assert n == (1 if c.step <= 4 else 0)
    assert_possible(cat, "p3", tmp_path)
