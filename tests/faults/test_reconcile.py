"""A crash between upload and catalog commit, and the reconciler that repairs it.

Injection: the ingest child is SIGKILLed the moment the replica is committed at the destination
and the catalog is about to record it verified (tests/faults/driver.py, crash_before_catalog).
Expected: the catalog says pending/replicating; `safepoint reconcile` re-hashes the committed
replica, records it verified, and (once the grace period has passed) finishes the stuck ingest;
a catalog that lost the checkpoint entirely gets the row back from the replica's manifest.
"""

from __future__ import annotations

import json
import time

import pytest

from safepoint.catalog.store import open_catalog
from safepoint.cli.main import main
from safepoint.core.format import MARKER_NAME, TMP_PREFIX
from safepoint.core.naming import ingest_lease
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.local.commit import commit
from safepoint.ops import ingest as pipeline
from safepoint.ops import steps
from safepoint.ops.reconcile import reconcile
from safepoint.ops.resume import find_resume_point
from safepoint.rules.reconcile import Action, Found, Known, Remote, Settle, decide, plan_checkpoint
from tests.faults.conftest import figures
from tests.faults.world import World, check, copy_template

G = 3600.0


def sp(*args) -> int:
    return main([str(a) for a in args])


# -- the pure rules, as a table ----------------------------------------------------------------

@pytest.mark.parametrize("remote, known, action", [
    (Remote(Found.COMMITTED, "a", complete=True), Known(None), Action.ADOPT),
    (Remote(Found.COMMITTED, "a", complete=True), Known(CS.REPLICATING, "a", RS.PENDING, 5), Action.CONFIRM),
    (Remote(Found.COMMITTED, "a", complete=True), Known(CS.VERIFIED, "a", RS.VERIFIED, 5), Action.NONE),
    (Remote(Found.COMMITTED, "a", complete=False), Known(CS.VERIFIED, "a", RS.VERIFIED), Action.MARK_MISSING),
    (Remote(Found.COMMITTED, "a", complete=False, size_mismatch=True), Known(CS.VERIFIED, "a", RS.VERIFIED),
     Action.MARK_CORRUPT),
    (Remote(Found.COMMITTED, "b", complete=True), Known(CS.VERIFIED, "a", RS.VERIFIED), Action.MARK_CORRUPT),
    (Remote(Found.COMMITTED, "b", complete=True), Known(CS.COMMITTED, "a", None), Action.CONFLICT),
    (Remote(Found.BROKEN), Known(None), Action.UNREADABLE),
    (Remote(Found.BROKEN), Known(CS.VERIFIED, "a", RS.VERIFIED), Action.MARK_CORRUPT),
    (Remote(Found.PARTIAL, age_s=10), Known(None), Action.KEEP_PARTIAL),
    (Remote(Found.PARTIAL, age_s=G), Known(None), Action.REMOVE_PARTIAL),
    (Remote(Found.PARTIAL, age_s=G), Known(CS.REPLICATING, "a", RS.PENDING, 1), Action.KEEP_PARTIAL),
    (Remote(Found.PARTIAL, age_s=G), Known(CS.VERIFIED, "a", RS.VERIFIED, G), Action.MARK_MISSING),
    (Remote(Found.PARTS, age_s=10 * G), Known(CS.REPLICATING, None, RS.PENDING, 10 * G), Action.NONE),
    (Remote(Found.ABSENT), Known(CS.VERIFIED, "a", RS.VERIFIED), Action.MARK_MISSING),
    (Remote(Found.ABSENT), Known(CS.REPLICATING, "a", RS.PENDING, G), Action.ABANDON_REPLICA),
    (Remote(Found.ABSENT), Known(CS.REPLICATING, "a", RS.PENDING, 1), Action.NONE),
    (Remote(Found.COMMITTED, "a", complete=True), Known(CS.PRUNED, "a", RS.VERIFIED), Action.FINISH_PRUNE),
    (Remote(Found.PARTIAL, age_s=1), Known(CS.PRUNED, "a", RS.VERIFIED), Action.FINISH_PRUNE),
    (Remote(Found.PARTIAL, age_s=1), Known(CS.PRUNED, "a", RS.DELETED), Action.KEEP_PARTIAL),
    (Remote(Found.ABSENT), Known(CS.PRUNED, "a", RS.DELETED), Action.NONE),
])
def test_decide(remote, known, action):
    assert decide(remote, known, G) is action


@pytest.mark.parametrize("state, age, verified, world, settle", [
    (CS.REPLICATING, 10, 1, 1, Settle.NONE),
    (CS.REPLICATING, G, 1, 1, Settle.FINISH),
    (CS.VALIDATING, G, 0, 1, Settle.ABANDON),
    (CS.REPLICATING, G, 0, 4, Settle.NONE),       # multi-node: safepoint.assemble's timeouts own it
    (CS.CORRUPT, 0, 1, 1, Settle.FINISH),
    (CS.COMMITTED, 0, 1, 1, Settle.FINISH),
    (CS.VERIFIED, 0, 0, 1, Settle.NO_COPY),
    (CS.VERIFIED, 0, 1, 1, Settle.NONE),
    (CS.INVALID, G, 1, 1, Settle.NONE),
])
def test_plan_checkpoint(state, age, verified, world, settle):
    assert plan_checkpoint(state, age, verified, G, world) is settle


def test_an_ingest_holds_the_lease_reconcile_tries(tmp_path, sqlite_catalog):
    """Reconcile must see a live upload's lease as taken, or it would remove a partial replica in flight."""
    from safepoint.core.config import Config
    from safepoint.local.snapshot import LocalSnapshot
    from safepoint.ops.leases import ingest_leases
    from tests.faults.world import make_template

    folder = make_template(tmp_path / "c")
    commit(folder, "r", 7)
    url = (tmp_path / "d").as_uri()
    with ingest_leases(sqlite_catalog, LocalSnapshot.open(folder).manifest, url, Config()):
        assert not sqlite_catalog.acquire_lease(ingest_lease("r", 7, url), "reconciler", 60)
    assert sqlite_catalog.acquire_lease(ingest_lease("r", 7, url), "reconciler", 60)


# -- the crash, and the repair ---------------------------------------------------------------

@pytest.fixture
def crashed(tmp_path, template, shared_fork_server, catalog_url):
    """A checkpoint whose ingest died between committing the replica and recording it."""
    server = shared_fork_server
    open_catalog(catalog_url)  # migrated here, so the child only checks
    folder = copy_template(template, tmp_path / "nvme" / "step-5")
    commit(folder, "crash", 5)
    dest = (tmp_path / "durable").as_uri()
    ran = server.run("crash_before_catalog", {"folder": str(folder), "dest": dest, "catalog_url": catalog_url})
    assert ran.killed and ran.phases[-1] == "crash"
    assert (tmp_path / "durable" / "crash" / "5" / MARKER_NAME).is_file()
    catalog = open_catalog(catalog_url)
    row = catalog.get("crash", 5)
    assert row.state is CS.REPLICATING
    assert [r.state for r in catalog.replicas(row.id)] == [RS.PENDING]
    return catalog, folder, dest, tmp_path


def test_crash_between_upload_and_catalog_is_repaired(crashed):
    catalog, folder, dest, tmp = crashed
    t0 = time.perf_counter()
    # Within the grace period: the replica is re-hashed and confirmed; the ingest may still be live.
    first = reconcile(catalog, [dest], grace_s=G)
    row = catalog.get("crash", 5)
    assert first.count("confirm") == 1 and first.count("replica_verified") == 1
    assert [r.state for r in catalog.replicas(row.id)] == [RS.VERIFIED]
    assert row.state is CS.REPLICATING
    # Once it has passed, the stuck ingest is finished: validated from a verified copy.
    second = reconcile(catalog, [dest], grace_s=G, now=time.time() + G + 1)
    assert second.count("finish") == 1 and second.count("checkpoint_verified") == 1, second.to_dict()
    assert catalog.get("crash", 5).state is CS.VERIFIED
    assert find_resume_point(catalog, "crash").chosen.step == 5
    world = World()
    world.observe(catalog)
    found = check(catalog, world, dest_roots=[tmp / "durable"], local_roots=[tmp / "nvme"])
    assert not found.violations
    figures("crash between upload and catalog commit", outcome="replica confirmed, checkpoint verified",
            bytes_lost=found.bytes_lost, seconds=round(time.perf_counter() - t0, 2))


def test_catalog_that_lost_the_checkpoint_adopts_it_from_the_replica(crashed, tmp_path, capsys):
    _catalog, _folder, dest, tmp = crashed
    fresh = f"sqlite:///{tmp_path / 'rebuilt.db'}"
    capsys.readouterr()
    assert sp("--catalog", fresh, "reconcile", "--to", dest, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["actions"].get("adopt") == 1 and doc["actions"].get("checkpoint_verified") == 1, doc
    cat = open_catalog(fresh)
    row = cat.get("crash", 5)
    assert row.state is CS.VERIFIED and row.local_path is None and row.file_count == 5
    assert find_resume_point(cat, "crash").urls == [f"{dest}/crash/5"]


def test_flow_starts_with_a_scoped_reconcile(crashed, prefect_api):
    """The ingest flow's first task reconciles its snapshot; the re-ingest then finishes cleanly."""
    from safepoint.flows.ingest import ingest

    catalog, folder, dest, _tmp = crashed
    out = ingest(snapshot=str(folder), to=[dest], catalog_url=catalog.url)
    assert out["state"] == "verified"
    kinds = [e["kind"] for e in catalog.events(catalog.get("crash", 5).id)]
    assert "reconcile.adopt" not in kinds
    rec = [e for e in catalog.events(kind="reconcile")]
    assert rec and rec[-1]["detail"]["scope"] == ["crash", 5] and rec[-1]["detail"]["actions"].get("confirm") == 1


def test_dry_run_changes_nothing(crashed, capsys):
    catalog, _folder, dest, _tmp = crashed
    capsys.readouterr()
    assert sp("--catalog", catalog.url, "reconcile", "--to", dest, "--grace", "0", "--dry-run") == 0
    text = capsys.readouterr().out
    assert "would confirm" in text
    row = catalog.get("crash", 5)
    assert row.state is CS.REPLICATING and [r.state for r in catalog.replicas(row.id)] == [RS.PENDING]
    assert sp("--catalog", catalog.url, "reconcile", "--to", dest, "--grace", "0") == 0
    assert catalog.get("crash", 5).state is CS.VERIFIED


def test_stuck_ingest_without_a_replica_is_abandoned_then_redone(tmp_path, template, sqlite_catalog):
    """An ingest killed before anything reached the destination: abandoned to `committed`, re-done."""
    folder = copy_template(template, tmp_path / "nvme" / "s")
    commit(folder, "ab", 1)
    from safepoint.local.snapshot import LocalSnapshot

    dest = (tmp_path / "durable").as_uri()
    row = steps.register(sqlite_catalog, LocalSnapshot.open(folder))
    sqlite_catalog.set_replica(row.id, f"{dest}/ab/1", dest, RS.PENDING)
    rep = reconcile(sqlite_catalog, [dest], grace_s=G, now=time.time() + G + 1)
    assert rep.count("abandon_replica") == 1 and rep.count("abandon") == 1, rep.to_dict()
    after = sqlite_catalog.get("ab", 1)
    assert after.state is CS.COMMITTED and "abandoned" in after.error
    assert pipeline.ingest(folder, [dest], sqlite_catalog).state is CS.VERIFIED


def test_reingest_takes_over_an_interrupted_validation(tmp_path, template, sqlite_catalog):
    """Killed while validating: the checkpoint sat in `validating`; a re-ingest must finish it."""
    folder = copy_template(template, tmp_path / "s")
    commit(folder, "val", 1)
    dest = (tmp_path / "d").as_uri()
    assert pipeline.ingest(folder, [dest], sqlite_catalog).state is CS.VERIFIED
    cid = sqlite_catalog.get("val", 1).id
    assert sqlite_catalog.transition(cid, CS.VALIDATING)  # as a kill during validation leaves it
    assert pipeline.ingest(folder, [dest], sqlite_catalog).state is CS.VERIFIED


def test_orphans_wait_for_the_grace_period(tmp_path, template, sqlite_catalog):
    """Partial replicas and temporary files go only once untouched for the grace period."""
    folder = copy_template(template, tmp_path / "s")
    commit(folder, "orph", 1)
    durable = tmp_path / "d"
    dest = durable.as_uri()
    assert pipeline.ingest(folder, [dest], sqlite_catalog).state is CS.VERIFIED
    partial = durable / "orph" / "2"
    (partial / "shards").mkdir(parents=True)
    (partial / "shards" / "a.bin").write_bytes(b"x" * 100)
    tmp_in_replica = durable / "orph" / "1" / f"{TMP_PREFIX}big.safetensors.123"
    tmp_in_replica.write_bytes(b"y")
    tmp_local = folder / f"{TMP_PREFIX}MANIFEST.json"
    tmp_local.write_bytes(b"{}")
    young = reconcile(sqlite_catalog, [dest], grace_s=G)
    assert not [s for s in young.steps if s.done]
    assert partial.exists() and tmp_in_replica.exists() and tmp_local.exists()
    old = reconcile(sqlite_catalog, [dest], grace_s=G, now=time.time() + G + 1)
    assert old.count("remove_partial") == 1 and old.count("remove_tmp") == 2, old.to_dict()
    assert not partial.exists() and not tmp_in_replica.exists() and not tmp_local.exists()
    assert (durable / "orph" / "1" / MARKER_NAME).exists()   # the committed replica is never touched
    assert sqlite_catalog.get("orph", 1).state is CS.VERIFIED


def test_partial_is_kept_while_an_ingest_holds_its_lease(tmp_path, sqlite_catalog):
    dest_root = tmp_path / "d"
    (dest_root / "l" / "3").mkdir(parents=True)
    (dest_root / "l" / "3" / "f").write_bytes(b"1")
    dest = dest_root.as_uri()
    assert sqlite_catalog.acquire_lease(ingest_lease("l", 3, dest), "someone", 600)
    rep = reconcile(sqlite_catalog, [dest], grace_s=0)
    assert rep.count("keep_partial") == 1 and (dest_root / "l" / "3" / "f").exists()
    sqlite_catalog.release_lease(ingest_lease("l", 3, dest), "someone")
    reconcile(sqlite_catalog, [dest], grace_s=0)
    assert not (dest_root / "l" / "3").exists()


def test_vanished_replica_is_marked_missing_and_replicated_again(tmp_path, template, sqlite_catalog):
    folder = copy_template(template, tmp_path / "s")
    commit(folder, "van", 1)
    durable = tmp_path / "d"
    assert pipeline.ingest(folder, [durable.as_uri()], sqlite_catalog).state is CS.VERIFIED
    (durable / "van" / "1" / "big.safetensors").unlink()   # an operator's rm, a lost object
    rep = reconcile(sqlite_catalog, [durable.as_uri()], grace_s=G)
    assert rep.count("mark_missing") == 1 and rep.count("replicate_again") == 1, rep.to_dict()
    assert rep.count("replica_verified") == 1
    row = sqlite_catalog.get("van", 1)
    assert row.state is CS.VERIFIED
    assert [r.state for r in sqlite_catalog.replicas(row.id)] == [RS.VERIFIED]
    assert (durable / "van" / "1" / "big.safetensors").is_file()


def test_reconcile_cli_exit_codes(tmp_path, sqlite_catalog_url, capsys):
    assert sp("--catalog", sqlite_catalog_url, "reconcile", "--to", (tmp_path / "none").as_uri()) == 0
    assert "consistent" in capsys.readouterr().out
    assert sp("--catalog", sqlite_catalog_url, "reconcile", "--step", "3") == 2
    # A marker nobody can read, at a destination: reported, left alone, exit 1.
    bad = tmp_path / "d" / "x" / "1"
    bad.mkdir(parents=True)
    (bad / MARKER_NAME).write_text("garbage")
    assert sp("--catalog", sqlite_catalog_url, "reconcile", "--to", (tmp_path / "d").as_uri(), "--grace", "0") == 1
    assert "unreadable" in capsys.readouterr().out and (bad / MARKER_NAME).exists()
