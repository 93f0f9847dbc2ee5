"""Catalog behaviour on SQLite and PostgreSQL (see tests/conftest_catalog.py for the fixtures)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from safepoint.catalog import open_catalog
from safepoint.core.errors import CatalogError
from safepoint.core.format import FileEntry, build_manifest, digest_bytes
from safepoint.core.redact import redact, redact_url
from safepoint.core.states import CheckpointState as C
from safepoint.core.states import ReplicaState as R

pytestmark = pytest.mark.catalog_backends  # catalog-level: on SQLite and PostgreSQL

H = "ab" * 32


def _h(i: int) -> str:
    return f"{i:064x}"


def _manifest(run="run-a", step=10, files=None, **kw):
    files = files if files is not None else [FileEntry("model.pt", 100, _h(1)), FileEntry("opt/state.pt", 50, _h(2))]
    m = build_manifest(run, step, files, **kw)
    return m, digest_bytes(m.to_json_bytes())


def test_record_commit_inserts_and_is_idempotent(catalog, tmp_path):
    m, d = _manifest(meta={"tags": ["best"], "metrics": {"loss": 1.5}})
    row = catalog.record_commit(m, d, str(tmp_path / "s"))
    assert (row.run, row.step, row.state) == ("run-a", 10, C.COMMITTED)
    assert (row.total_bytes, row.file_count, row.manifest_blake3) == (150, 2, d)
    assert row.tags == ("best",) and row.metrics == {"loss": 1.5}
    assert row.delivered_ranks == (0,) and row.complete
    assert row.created_at.tzinfo is not None
    again = catalog.record_commit(m, d, str(tmp_path / "s"))
    assert again == row
    assert [e["kind"] for e in catalog.events(row.id)] == ["commit"]
    assert catalog.get("run-a", 10) == row
    assert catalog.get_by_id(row.id) == row
    assert catalog.get("run-a", 11) is None
    assert catalog.find_by_local_path(str(tmp_path / "s") + "/") == row
    assert [f.path for f in catalog.files(row.id)] == ["model.pt", "opt/state.pt"]
    assert catalog.file_paths(row.id) == ["model.pt", "opt/state.pt"]
    assert catalog.runs() == ["run-a"]


def test_recommit_with_other_manifest(catalog):
    m, d = _manifest()
    row = catalog.record_commit(m, d, None)
    m2, d2 = _manifest(files=[FileEntry("model.pt", 7, _h(9))])
    # committed: files are replaced
    row2 = catalog.record_commit(m2, d2, None)
    assert (row2.id, row2.manifest_blake3, row2.file_count, row2.total_bytes) == (row.id, d2, 1, 7)
    assert row2.version > row.version
    # corrupt: replaced and reset to committed
    assert catalog.transition(row.id, C.CORRUPT)
    row3 = catalog.record_commit(m, d, None)
    assert row3.state == C.COMMITTED and row3.manifest_blake3 == d
    # downstream state: refused
    assert catalog.transition(row.id, C.REPLICATING)
    with pytest.raises(CatalogError):
        catalog.record_commit(m2, d2, None)
    assert catalog.get_by_id(row.id).manifest_blake3 == d


def test_parent_lineage(catalog):
    p, pd = _manifest(step=5)
    prow = catalog.record_commit(p, pd, None)
    c, cd = _manifest(step=10, parent=("run-a", 5))
    crow = catalog.record_commit(c, cd, None)
    assert crow.parent_id == prow.id
    orphan, od = _manifest(step=20, parent=("other", 1))
    orow = catalog.record_commit(orphan, od, None)
    assert orow.parent_id is None
    assert "parent_missing" in [e["kind"] for e in catalog.events(orow.id)]
    views = {v.step: v for v in catalog.list_checkpoints("run-a")}
    assert views[10].parent == ("run-a", 5) and views[5].parent is None


def test_multinode_parts_merge(catalog):
    a, ad = _manifest(files=[FileEntry("r0/x", 10, _h(1)), FileEntry("shared", 1, _h(7))],
                      world_size=2, ranks=(0,), node="n0")
    b, bd = _manifest(files=[FileEntry("r1/x", 20, _h(2)), FileEntry("shared", 1, _h(7))],
                      world_size=2, ranks=(1,), node="n1")
    r1 = catalog.record_commit(a, ad, "/nvme/n0/run-a/10")
    assert r1.delivered_ranks == (0,) and not r1.complete
    r2 = catalog.record_commit(b, bd, "/nvme/n1/run-a/10")
    assert r2.id == r1.id and r2.delivered_ranks == (0, 1) and r2.complete
    assert (r2.file_count, r2.total_bytes) == (3, 31)
    assert catalog.record_commit(b, bd, "/nvme/n1/run-a/10") == r2  # idempotent
    assert catalog.find_by_local_path("/nvme/n1/run-a/10").id == r1.id
    assert [r["node"] for r in catalog.ranks(r1.id)] == ["n0", "n1"]
    bad, badd = _manifest(files=[FileEntry("shared", 1, _h(8))], world_size=2, ranks=(1,), node="n1")
    with pytest.raises(CatalogError):
        catalog.record_commit(bad, badd, None)
    ws, wsd = _manifest(files=[FileEntry("z", 1, _h(3))], world_size=4, ranks=(3,))
    with pytest.raises(CatalogError):
        catalog.record_commit(ws, wsd, None)


def test_guarded_transitions(catalog):
    m, d = _manifest()
    ck = catalog.record_commit(m, d, None).id
    assert not catalog.transition(ck, C.VERIFIED)  # committed -> verified is illegal
    assert catalog.get_by_id(ck).state == C.COMMITTED
    assert not catalog.transition(ck, C.REPLICATED, expect={C.REPLICATING})
    assert catalog.transition(ck, C.REPLICATING, detail={"by": "test"})
    assert not catalog.transition(ck, C.REPLICATED, expect={C.COMMITTED})
    assert catalog.transition(ck, C.REPLICATED, expect={C.REPLICATING})
    assert catalog.transition(ck, C.VALIDATING)
    assert catalog.transition(ck, C.INVALID, error="bad tensor; s3://K:S@h/b")
    row = catalog.get_by_id(ck)
    assert row.state == C.INVALID and row.error == "bad tensor; s3://h/b"
    assert row.version == 5
    states = [(e["detail"]["from"], e["detail"]["to"]) for e in catalog.events(ck) if e["kind"] == "state"]
    assert states == [("committed", "replicating"), ("replicating", "replicated"), ("replicated", "validating"),
                      ("validating", "invalid")]
    assert catalog.transition(ck, C.PRUNED)
    assert not catalog.transition(ck, C.REPLICATING)  # pruned is final
    assert not catalog.transition(999_999, C.REPLICATING)


def test_replica_upsert_and_lookup(catalog):
    m, d = _manifest()
    ck = catalog.record_commit(m, d, None).id
    url = "s3://AKIAX:se/cr+et@bucket/prefix/run-a/10/"
    catalog.set_replica(ck, url, "s3://AKIAX:se/cr+et@bucket/prefix", R.PENDING, bytes=10)
    catalog.set_replica(ck, url, "s3://bucket/prefix", R.PENDING, bytes=100)
    catalog.set_replica(ck, url, "s3://bucket/prefix", R.VERIFIED, bytes=150)
    catalog.set_replica(ck, "file:///mnt/pfs/run-a/10", "file:///mnt/pfs", R.FAILED,
                        error="denied: aws_secret_access_key=abc123 token=xyz")
    reps = catalog.replicas(ck)
    assert [r.url for r in reps] == ["s3://bucket/prefix/run-a/10", "file:///mnt/pfs/run-a/10"]
    assert reps[0].state == R.VERIFIED and reps[0].bytes == 150 and reps[0].verified_at is not None
    assert reps[0].destination == "s3://bucket/prefix"
    assert reps[1].error == "denied: aws_secret_access_key=*** token=***"
    for r in reps:
        assert "AKIAX" not in r.url + r.destination and "abc123" not in (r.error or "")
    found = catalog.find_replica("s3://bucket/prefix/run-a/10/")
    assert found is not None and found[0].id == ck and found[1].id == reps[0].id
    assert catalog.find_replica("s3://bucket/prefix/run-a/11") is None
    # Events only on state/error changes, never with secrets.
    ev = [e for e in catalog.events(ck) if e["kind"] == "replica"]
    assert [e["detail"]["state"] for e in ev] == ["pending", "verified", "failed"]
    assert "AKIAX" not in repr(catalog.events(ck)) and "abc123" not in repr(catalog.events(ck))
    with pytest.raises(CatalogError):
        catalog.set_replica(123456, "file:///x/run-a/1", "file:///x", R.PENDING)


@pytest.mark.parametrize("text,expected", [
    ("s3://KEY:SECRET@bucket/p", "s3://bucket/p"),
    ("https://user:p%40ss@host/x?y=1", "https://host/x?y=1"),
    ("AWS_SECRET_ACCESS_KEY=abc/def+g", "AWS_SECRET_ACCESS_KEY=***"),
    ('{"aws_secret_access_key": "abc"}', '{"aws_secret_access_key": "***"}'),
    ("https://h/o?X-Amz-Signature=deadbeef&X-Amz-Credential=AK%2F1", "https://h/o?X-Amz-Signature=***&X-Amz-Credential=***"),
    ("GET ?token=abc&x=1", "GET ?token=***&x=1"),
    ("file:///data/a@b/c", "file:///data/a@b/c"),
    ("max_tokens=5", "max_tokens=5"),
])
def test_redact(text, expected):
    assert redact(text) == expected
    assert redact(redact(text)) == redact(text)


def test_redact_url_trailing_slash():
    assert redact_url("file:///x/run/10/") == "file:///x/run/10"
    assert redact_url("file:///") == "file:///"


def test_list_checkpoints_with_replicas(catalog):
    ids = {}
    for run, step in [("b", 2), ("a", 3), ("a", 1)]:
        m, d = _manifest(run=run, step=step)
        ids[(run, step)] = catalog.record_commit(m, d, None).id
    catalog.set_replica(ids[("a", 1)], "memory://x/a/1", "memory://x", R.VERIFIED, bytes=150)
    catalog.set_replica(ids[("a", 1)], "file:///y/a/1", "file:///y", R.PENDING)
    catalog.set_replica(ids[("b", 2)], "memory://x/b/2", "memory://x", R.CORRUPT)
    catalog.set_pinned(ids[("a", 3)], True)
    catalog.set_tags(ids[("a", 3)], ["keep", "best", "keep"])
    catalog.set_metrics(ids[("a", 3)], {"loss": float("nan"), "acc": 0.5})
    views = catalog.list_checkpoints()
    assert [(v.run, v.step) for v in views] == [("a", 1), ("a", 3), ("b", 2)]
    a1, a3, b2 = views
    assert [(r.url, r.state) for r in a1.replicas] == [("memory://x/a/1", R.VERIFIED), ("file:///y/a/1", R.PENDING)]
    assert [r.url for r in a1.verified_replicas()] == ["memory://x/a/1"]
    assert a3.replicas == () and a3.pinned and a3.tags == ("best", "keep") and a3.metrics["acc"] == 0.5
    assert b2.replicas[0].state == R.CORRUPT
    assert [v.step for v in catalog.list_checkpoints("a")] == [1, 3]
    catalog.transition(ids[("a", 3)], C.REPLICATING)
    assert [(v.run, v.step) for v in catalog.list_checkpoints(states={C.REPLICATING})] == [("a", 3)]
    assert catalog.list_checkpoints("zzz") == []


def test_latest(catalog):
    for step in (1, 2, 3):
        m, d = _manifest(step=step)
        ck = catalog.record_commit(m, d, None).id
        if step < 3:
            for to in (C.REPLICATING, C.REPLICATED, C.VALIDATING, C.VERIFIED):
                assert catalog.transition(ck, to)
    assert catalog.latest("run-a").step == 2
    assert catalog.latest("run-a", states=[C.COMMITTED]).step == 3
    assert catalog.latest("nope") is None


def test_validations(catalog):
    m, d = _manifest()
    ck = catalog.record_commit(m, d, None).id
    assert catalog.latest_validation(ck) is None
    stats = [{"name": f"layer.{i}.weight", "dtype": "torch.bfloat16", "shape": [64, i + 1], "numel": 64 * (i + 1),
              "norm": 1.0 + i, "max_abs": 0.5, "nan_count": 0, "inf_count": 0,
              "head": f"{i:032x}", "digest": f"{i:032x}" if i % 2 else None, "value": None} for i in range(10_000)]
    stats[3]["norm"] = float("nan")
    stats[7]["value"] = 7.0  # a step counter's value (Adam `step`)
    stats[4]["max_abs"] = float("inf")
    t0 = time.monotonic()
    v1 = catalog.record_validation(ck, False, "nan in layer.3", {"n": 1}, stats[:2])
    v2 = catalog.record_validation(ck, True, "ok", {"tensors": 10_000, "worst": float("inf")}, stats)
    assert time.monotonic() - t0 < 30
    latest = catalog.latest_validation(ck)
    assert latest.id == v2 and latest.ok and latest.report["tensors"] == 10_000 and v2 > v1
    got = catalog.tensor_stats(v2)
    # stats recorded without a file or role (older validations) read back with both None (migration 0004)
    assert len(got) == 10_000 and got[0] == {**stats[0], "file": None, "role": None} and got[3]["norm"] is None
    assert got[4]["max_abs"] == float("inf")
    assert got[9_999]["shape"] == [64, 10_000]
    one = f"{1:032x}"
    assert (got[1]["head"], got[1]["digest"], got[2]["digest"], got[7]["value"]) == (one, one, None, 7.0)


def test_events_and_runs(catalog):
    m, d = _manifest()
    ck = catalog.record_commit(m, d, None).id
    catalog.add_event("note", checkpoint_id=ck, detail={"x": 1})
    catalog.add_event("run-note", run="run-a")
    assert [e["kind"] for e in catalog.events(ck)] == ["commit", "note"]
    assert [e["kind"] for e in catalog.events(run="run-a")] == ["commit", "note", "run-note"]
    catalog.ensure_run("run-b", settings={"model_factory": "pkg.mod:make"})
    assert catalog.run_settings("run-b") == {"model_factory": "pkg.mod:make"}
    catalog.set_run_settings("run-b", {"x": 2})
    assert catalog.run_settings("run-b") == {"x": 2}
    assert catalog.runs() == ["run-a", "run-b"]


def test_lease_exclusivity(catalog):
    assert catalog.acquire_lease("ingest:1:s3://b", "host-a", 60)
    assert not catalog.acquire_lease("ingest:1:s3://b", "host-b", 60)
    assert catalog.acquire_lease("ingest:1:s3://b", "host-a", 60)  # renewal
    assert catalog.lease_holder("ingest:1:s3://b") == "host-a"
    assert not catalog.release_lease("ingest:1:s3://b", "host-b")
    assert catalog.release_lease("ingest:1:s3://b", "host-a")
    assert catalog.acquire_lease("ingest:1:s3://b", "host-b", 0.05)
    time.sleep(0.1)  # expired: another holder may take it
    assert catalog.acquire_lease("ingest:1:s3://b", "host-c", 60)
    assert catalog.lease_holder("ingest:1:s3://b") == "host-c"


def test_open_catalog_default_url(sqlite_catalog_url):
    """With $SAFEPOINT_CATALOG_URL set (by the fixture), open_catalog() needs no argument."""
    cat = open_catalog()
    assert cat.runs() == []
    assert cat.url == sqlite_catalog_url


# -- concurrency (real processes) -------------------------------------------------------------

def _race_transition(url: str, ck: int, barrier, out) -> None:
    cat = open_catalog(url)
    cat.get_by_id(ck)  # connect before the start line
    barrier.wait(timeout=60)
    out.put(cat.transition(ck, C.VERIFIED, expect={C.VALIDATING}, detail={"pid": mp.current_process().pid}))


def _race_lease(url: str, holder: str, barrier, out) -> None:
    cat = open_catalog(url)
    cat.runs()
    barrier.wait(timeout=60)
    out.put((holder, cat.acquire_lease("race", holder, 60)))


def _race_commit(url: str, m, d: str, barrier, out) -> None:
    cat = open_catalog(url)
    barrier.wait(timeout=60)
    out.put(cat.record_commit(m, d, None).id)


def _run_racers(target, args_list):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(args_list))
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, barrier, out)) for a in args_list]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return results


N = 8


def test_concurrent_transition_one_winner(catalog, catalog_url):
    m, d = _manifest()
    ck = catalog.record_commit(m, d, None).id
    for to in (C.REPLICATING, C.REPLICATED, C.VALIDATING):
        assert catalog.transition(ck, to)
    results = _run_racers(_race_transition, [(catalog_url, ck)] * N)
    assert sorted(results) == [False] * (N - 1) + [True]
    assert catalog.get_by_id(ck).state == C.VERIFIED
    wins = [e for e in catalog.events(ck) if e["kind"] == "state" and e["detail"]["to"] == "verified"]
    assert len(wins) == 1 and wins[0]["detail"]["from"] == "validating"


def test_concurrent_lease_one_holder(catalog, catalog_url):
    results = _run_racers(_race_lease, [(catalog_url, f"h{i}") for i in range(N)])
    winners = [h for h, ok in results if ok]
    assert len(winners) == 1
    assert catalog.lease_holder("race") == winners[0]


def test_concurrent_record_commit(catalog, catalog_url):
    m, d = _manifest(step=77)  # one manifest: `created` differs per call
    results = _run_racers(_race_commit, [(catalog_url, m, d)] * 4)
    assert len(set(results)) == 1
    assert [e["kind"] for e in catalog.events(results[0])] == ["commit"]
