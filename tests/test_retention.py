"""Retention: policies and invariants of the pure planner (tables, properties), the guarded
execution (catalog first, then marker, then files; re-checked against a fresh read), the CLI on
both backends, and the scheduled Prefect flow."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from safepoint.cli.main import main
from safepoint.core.errors import UsageError
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME
from safepoint.core.states import CheckpointState as C
from safepoint.core.states import ReplicaState as R
from safepoint.ops.prune import execute, execute_plan
from safepoint.ops.resume import find_resume_point
from safepoint.rules import retention as rt
from safepoint.rules.resume import PENDING, is_good
from tests.helpers_catalog import durable, local_folder, seed, view

NOW = datetime(2026, 6, 1, tzinfo=timezone.utc)
V, OK, BAD, MISS = C.VERIFIED, R.VERIFIED, R.CORRUPT, R.MISSING


def hist(*rows, run="r"):
    out = []
    for row in rows:
        step, state, reps, *kw = row
        kw = kw[0] if kw else {}
        out.append(view(step, state, reps, run=run, created=kw.pop("created", NOW - timedelta(days=100 - step)),
                        **kw))
    return out


def kept(plan) -> list[int]:
    return [d.checkpoint.step for d in plan.decisions if d.keep]


def deleted(plan) -> list[int]:
    return [d.checkpoint.step for d in plan.decisions if not d.keep]


GOOD5 = [(s, V, (OK,)) for s in (1, 2, 3, 4, 5)]

TABLE = [
    # name, history, policy, kept steps
    ("keep last 3", GOOD5, rt.KeepLastN(3), [3, 4, 5]),
    ("keep last 1 still keeps two", GOOD5, rt.KeepLastN(1), [4, 5]),
    ("keep last 0 still keeps two", GOOD5, rt.KeepLastN(0), [4, 5]),
    ("single verified is kept", [(1, V, (OK,)), (2, C.CORRUPT, ())], rt.KeepLastN(0), [1]),
    ("bad states older than the newest are deleted",
     [(1, C.INVALID, (OK,)), (2, V, (OK,)), (3, C.CORRUPT, ()), (4, V, (OK,)), (5, C.INCOMPLETE, ())],
     rt.KeepLastN(1), [2, 4]),
    ("corrupt replica on the newest: not counted as good",
     [(1, V, (OK,)), (2, V, (OK,)), (3, V, (OK,)), (4, V, (BAD,))], rt.KeepLastN(1), [2, 3, 4]),
    ("missing replica is not good either",
     [(1, V, (OK,)), (2, V, (OK,)), (3, V, (OK, MISS))], rt.KeepLastN(1), [1, 2, 3]),
    ("one good, two verified with bad replicas: two verified kept",
     [(1, V, (BAD,)), (2, V, (OK,)), (3, V, (BAD,))], rt.KeepLastN(0), [2, 3]),
    ("pending newer blocks every deletion",
     [(1, V, (OK,)), (2, V, (OK,)), (3, V, (OK,)), (4, C.REPLICATING, ())], rt.KeepLastN(1), [1, 2, 3, 4]),
    ("pending older does not block newer deletions",
     [(1, C.VALIDATING, (OK,)), (2, V, (OK,)), (3, V, (OK,)), (4, V, (OK,)), (5, V, (OK,))],
     rt.KeepLastN(1), [1, 4, 5]),
    ("committed counts as pending", [(1, V, (OK,)), (2, V, (OK,)), (3, V, (OK,)), (4, C.COMMITTED, ())],
     rt.KeepLastN(0), [1, 2, 3, 4]),
    ("pinned is never deleted", [(1, V, (OK,), {"pinned": True}), *GOOD5[1:]], rt.KeepLastN(1), [1, 4, 5]),
    ("pinned corrupt is kept too", [(1, C.CORRUPT, (), {"pinned": True}), *GOOD5[1:]], rt.KeepLastN(2), [1, 4, 5]),
    ("every 100 steps", [(s, V, (OK,)) for s in (50, 100, 150, 200, 250, 300, 350)], rt.KeepEveryNSteps(100),
     [50, 100, 200, 300, 350]),
    ("every N skips bad ones", [(100, C.CORRUPT, ()), (120, V, (OK,)), (150, V, (OK,)), (200, V, (OK,)),
                                (260, V, (OK,)), (270, V, (OK,))], rt.KeepEveryNSteps(100), [120, 200, 260, 270]),
    ("within 3 days keeps recent of any state",
     [(1, V, (OK,), {"created": NOW - timedelta(days=9)}), (2, V, (OK,), {"created": NOW - timedelta(days=8)}),
      (3, C.CORRUPT, (), {"created": NOW - timedelta(days=2)}), (4, V, (OK,), {"created": NOW - timedelta(days=7)}),
      (5, V, (OK,), {"created": NOW - timedelta(days=1)})], rt.KeepWithin(timedelta(days=3)), [3, 4, 5]),
    ("tagged any", [(1, V, (OK,), {"tags": ("x",)}), *GOOD5[1:]], rt.KeepPinnedOrTagged(), [1, 4, 5]),
    ("tagged only best", [(1, V, (OK,), {"tags": ("x",)}), (2, V, (OK,), {"tags": ("best",)}), *GOOD5[2:]],
     rt.KeepPinnedOrTagged(frozenset({"best"})), [2, 4, 5]),
    ("best 2 by loss",
     [(s, V, (OK,), {"metrics": {"loss": loss}}) for s, loss in ((1, 0.5), (2, 0.1), (3, 0.3), (4, 0.9), (5, 0.8))],
     rt.KeepBestN("loss", 2), [2, 3, 4, 5]),
    ("best by max ignores non-finite and bad",
     [(1, V, (OK,), {"metrics": {"acc": "nan"}}), (2, V, (BAD,), {"metrics": {"acc": 0.99}}),
      (3, V, (OK,), {"metrics": {"acc": 0.7}}), (4, V, (OK,), {"metrics": {"acc": 0.6}}), (5, V, (OK,)),
      (6, V, (OK,))], rt.KeepBestN("acc", 1, "max"), [3, 5, 6]),
    ("any of", [(s, V, (OK,), {"tags": ("best",)} if s == 2 else {}) for s in range(1, 9)],
     rt.AnyOf(rt.KeepLastN(2), rt.KeepEveryNSteps(4), rt.KeepPinnedOrTagged()), [1, 2, 4, 7, 8]),
    ("pruned ones are not planned", [(1, C.PRUNED, (R.DELETED,)), *GOOD5[1:]], rt.KeepLastN(2), [4, 5]),
]


@pytest.mark.parametrize("name,rows,policy,expected", TABLE, ids=[t[0] for t in TABLE])
def test_plan_table(name, rows, policy, expected):
    p = rt.plan(hist(*rows), policy, NOW)
    assert kept(p) == expected
    assert sorted(kept(p) + deleted(p)) == sorted(r[0] for r in rows if r[1] is not C.PRUNED)
    for d in p.decisions:
        assert d.reasons and all(d.reasons)  # a reason for every keep and every delete


def test_reasons_name_the_rule():
    p = rt.plan(hist((1, V, (OK,)), (2, V, (OK,)), (3, V, (BAD,)), (4, C.VALIDATING, ()),
                     (0, V, (OK,), {"pinned": True})), rt.KeepLastN(1), NOW)
    why = {d.checkpoint.step: " | ".join(d.reasons) for d in p.decisions}
    assert "invariant: newest verified" in why[3]
    assert "among the 1 newest verified" in why[2] and "newest verified with intact replicas" in why[2]
    assert "pending validation (state validating)" in why[4]
    assert "a newer checkpoint, step 4, is still pending validation" in why[1]
    assert "invariant: pinned" in why[0]
    p = rt.plan(hist(*GOOD5), rt.KeepLastN(1), NOW)
    why = {d.checkpoint.step: d.reasons for d in p.decisions}
    assert why[4] == ("invariant: one of the two newest verified checkpoints",)
    assert why[1] == ("not kept by any policy",)


def test_invariants_are_per_run():
    p = rt.plan(hist(*GOOD5, run="a") + hist((1, V, (OK,)), (2, C.REPLICATING, ()), run="b"), rt.KeepLastN(1), NOW)
    assert [(d.checkpoint.run, d.checkpoint.step) for d in p.decisions if not d.keep] == [("a", 1), ("a", 2),
                                                                                       ("a", 3)]
    assert p.runs() == ["a", "b"]


def test_keep_last_n_plan():
    p = rt.plan(hist(*GOOD5), rt.KeepLastN(3))
    assert isinstance(p, rt.RetentionPlan) and deleted(p) == [1, 2]
    assert set(p.keep) == {3, 4, 5}


def test_policy_from_spec():
    assert rt.policy_from_spec({"keep_last": 3}) == rt.KeepLastN(3)
    p = rt.policy_from_spec({"keep_last": 2, "keep_every": 1000, "keep_within": "7d", "keep_tagged": ["best"],
                             "keep_best": "loss:3:min"})
    assert p == rt.AnyOf(rt.KeepLastN(2), rt.KeepEveryNSteps(1000), rt.KeepWithin(timedelta(days=7)),
                         rt.KeepPinnedOrTagged(frozenset({"best"})), rt.KeepBestN("loss", 3, "min"))
    assert rt.policy_from_spec({"keep_best": {"metric": "acc", "n": 1, "mode": "max"}}) == rt.KeepBestN("acc", 1, "max")
    assert rt.policy_from_spec({"keep_tagged": True}) == rt.KeepPinnedOrTagged()
    for bad in ({}, {"keep_forever": 1}, {"keep_within": "soon"}, {"keep_best": "loss"}):
        with pytest.raises(UsageError):
            rt.policy_from_spec(bad)
    assert rt.parse_duration("90s") == timedelta(seconds=90) and rt.format_duration(timedelta(days=14)) == "2w"


_states = st.sampled_from(list(C))
_reps = st.lists(st.sampled_from([R.VERIFIED, R.VERIFIED, R.CORRUPT, R.MISSING, R.PENDING, R.DELETED]), max_size=3)
_policy = st.one_of(
    st.builds(rt.KeepLastN, st.integers(0, 4)),
    st.builds(rt.KeepEveryNSteps, st.integers(1, 50)),
    st.builds(rt.KeepWithin, st.builds(timedelta, days=st.integers(0, 60))),
    st.just(rt.KeepPinnedOrTagged()),
    st.builds(rt.KeepBestN, st.just("loss"), st.integers(0, 3), st.sampled_from(["min", "max"])),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(_states, _reps, st.booleans(), st.floats(0, 10), st.integers(0, 100)), max_size=20),
       st.lists(_policy, min_size=1, max_size=3), st.integers(1, 2))
def test_no_policy_overrides_the_invariants(rows, policies, k):
    cks = [view(i * 7, s, tuple(reps), pinned=pin, metrics={"loss": loss}, created=NOW - timedelta(days=age))
           for i, (s, reps, pin, loss, age) in enumerate(rows)]
    p = rt.plan(cks, rt.AnyOf(*policies), NOW, min_replicas=k)
    live = [c for c in cks if c.state is not C.PRUNED]
    keep = {d.checkpoint.id for d in p.decisions if d.keep}
    assert {d.checkpoint.id for d in p.decisions} == {c.id for c in live}
    verified = sorted((c for c in live if c.state is C.VERIFIED), key=lambda c: c.step)
    good = [c for c in verified if is_good(c, k)]
    if verified:
        assert verified[-1].id in keep                                  # 1. newest verified
    assert all(c.id in keep for c in good[-2:])                          # 2. the two newest good ...
    assert sum(c.id in keep for c in verified) >= min(2, len(verified))  # ... and two verified
    pending = [c for c in live if c.state in PENDING]
    if pending:                                                          # 3. nothing older than pending
        newest = max(c.step for c in pending)
        assert all(c.id in keep for c in live if c.step <= newest)
    assert all(c.id in keep for c in live if c.pinned)
    assert all(d.reasons for d in p.decisions)


def test_still_deletable_rechecks_against_a_fresh_read():
    old = hist(*GOOD5)
    p = rt.plan(old, rt.KeepLastN(2), NOW)
    assert deleted(p) == [1, 2, 3]
    recheck = rt.still_deletable(p)
    assert recheck(old) == {1, 2, 3}
    # Since planning: the newest turned corrupt and 2's replica went missing: 3 is needed now.
    now_ = hist((1, V, (OK,)), (2, V, (MISS,)), (3, V, (OK,)), (4, V, (OK,)), (5, C.CORRUPT, ()))
    assert recheck(now_) == {1, 2}
    # A newer checkpoint started ingesting: nothing may go.
    assert recheck(old + hist((6, C.REPLICATING, ()))) == set()


# -- execution against a real catalog and real files ---------------------------------------------

def test_execute_marks_catalog_then_marker_then_files(catalog, tmp_path, monkeypatch):
    from safepoint.destinations.local import LocalDestination as FsspecDestination  # what file:// opens

    rows = [seed(catalog, tmp_path, "e", s) for s in (1, 2, 3)]
    calls = []
    real_ctrl, real_files = FsspecDestination.delete_control, FsspecDestination.delete_files

    def ctrl(self, run, step, name):
        calls.append((name, catalog.get(run, step).state, catalog.replicas(rows[0].id)[0].state))
        return real_ctrl(self, run, step, name)

    def files(self, run, step, relpaths):
        calls.append(("data", catalog.get(run, step).state, catalog.replicas(rows[0].id)[0].state))
        assert not Path(tmp_path / "durable0" / run / str(step) / MARKER_NAME).exists()
        return real_files(self, run, step, relpaths)

    monkeypatch.setattr(FsspecDestination, "delete_control", ctrl)
    monkeypatch.setattr(FsspecDestination, "delete_files", files)
    p = rt.plan(catalog.list_checkpoints("e"), rt.KeepLastN(1), NOW)
    assert execute(catalog, p) == [("e", 1)]
    assert calls == [(MARKER_NAME, C.PRUNED, R.VERIFIED), (MANIFEST_NAME, C.PRUNED, R.VERIFIED),
                     ("data", C.PRUNED, R.VERIFIED)]
    assert catalog.replicas(rows[0].id)[0].state is R.DELETED
    assert not (tmp_path / "durable0" / "e" / "1" / "weights.bin").exists()
    assert not local_folder(tmp_path, "e", 1).exists() and local_folder(tmp_path, "e", 2).is_dir()
    states = [e["detail"] for e in catalog.events(rows[0].id) if e["kind"] == "state"]
    assert states[-1] == {"from": "verified", "to": "pruned", "by": "retention"}


def test_execute_rechecks_a_stale_plan(catalog, tmp_path):
    for s in (1, 2, 3, 4):
        seed(catalog, tmp_path, "s", s)
    p = rt.plan(catalog.list_checkpoints("s"), rt.KeepLastN(2), NOW)
    assert deleted(p) == [1, 2]
    # After planning, a scrub finds the newest replica corrupt: 2 must stay (two good kept).
    four = catalog.get("s", 4)
    catalog.set_replica(four.id, f"{durable(tmp_path)}/s/4", durable(tmp_path), R.CORRUPT)
    res = execute_plan(catalog, p)
    assert res.pruned == [("s", 1)] and res.skipped == [("s", 2)]
    assert catalog.get("s", 2).state is C.VERIFIED
    assert (tmp_path / "durable0" / "s" / "2" / MARKER_NAME).exists()


def test_interrupted_deletion_is_finished_next_time(catalog, tmp_path, monkeypatch):
    from safepoint.destinations.local import LocalDestination as FsspecDestination  # what file:// opens

    for s in (1, 2, 3):
        seed(catalog, tmp_path, "i", s)
    real = FsspecDestination.delete_files

    def boom(self, run, step, relpaths):
        raise OSError("storage went away")

    monkeypatch.setattr(FsspecDestination, "delete_files", boom)
    res = execute_plan(catalog, rt.plan(catalog.list_checkpoints("i"), rt.KeepLastN(1), NOW))
    one = catalog.get("i", 1)
    assert res.pruned == [("i", 1)] and res.errors and "storage went away" in res.errors[0]
    assert one.state is C.PRUNED and catalog.replicas(one.id)[0].state is R.VERIFIED
    replica = tmp_path / "durable0" / "i" / "1"
    assert not (replica / MARKER_NAME).exists() and (replica / "weights.bin").exists()  # partial, never committed
    # Nothing resumes from it meanwhile, and a late scrub cannot revive the replica.
    assert find_resume_point(catalog, "i").chosen.step == 3
    assert catalog.set_replica(one.id, f"{durable(tmp_path)}/i/1", durable(tmp_path), R.VERIFIED) is False
    monkeypatch.setattr(FsspecDestination, "delete_files", real)
    res = execute_plan(catalog, rt.plan(catalog.list_checkpoints("i"), rt.KeepLastN(1), NOW))
    assert res.pruned == [] and res.errors == []
    assert catalog.replicas(one.id)[0].state is R.DELETED and not (replica / "weights.bin").exists()


def test_local_folder_reused_by_a_newer_checkpoint_is_left_alone(catalog, tmp_path):
    from safepoint.ops.evict import remove_local_snapshot

    seed(catalog, tmp_path, "u", 1)
    folder = local_folder(tmp_path, "u", 1)
    assert not remove_local_snapshot(folder, "u", 2)  # the manifest names u/1, not u/2
    assert (folder / MARKER_NAME).exists()
    (folder / "extra.txt").write_text("not ours")
    assert remove_local_snapshot(folder, "u", 1, ["weights.bin"])
    assert sorted(p.name for p in folder.iterdir()) == ["extra.txt"]


# -- through the CLI, both backends --------------------------------------------------------------

def sp(*args) -> int:
    return main([str(a) for a in args])


def _states(catalog, run):
    return {c.step: str(c.state) for c in catalog.list_checkpoints(run)}


def test_cli_prune_invariants(catalog, catalog_url, tmp_path, capsys):
    for s in (1, 2, 3, 4):
        seed(catalog, tmp_path, "c", s)
    seed(catalog, tmp_path, "c", 5, replicas=(BAD,))                   # newest verified, replica corrupt
    capsys.readouterr()
    assert sp("--catalog", catalog_url, "prune", "--run", "c", "--keep-last", "1", "--dry-run") == 0
    text = capsys.readouterr().out
    assert "would delete c/1 (verified): not kept by any policy" in text
    assert "keep   c/5 (verified): invariant: newest verified" in text
    assert "keep   c/4 (verified): among the 1 newest verified; invariant: newest verified with intact" in text
    assert "keep   c/3 (verified): invariant: one of the two newest verified checkpoints" in text
    assert _states(catalog, "c") == dict.fromkeys(range(1, 6), "verified")  # dry run changed nothing

    assert sp("--catalog", catalog_url, "pin", "c", 1) == 0
    assert capsys.readouterr().out.strip() == "c/1: pinned"
    assert sp("--catalog", catalog_url, "prune", "--run", "c", "--keep-last", "0", "--json") == 0
    doc = json.loads(capsys.readouterr().out)[0]
    assert doc["pruned"] == [2] and doc["errors"] == []
    assert _states(catalog, "c") == {1: "verified", 2: "pruned", 3: "verified", 4: "verified", 5: "verified"}
    assert not local_folder(tmp_path, "c", 2).exists() and local_folder(tmp_path, "c", 1).exists()
    assert not (tmp_path / "durable0" / "c" / "2").joinpath(MARKER_NAME).exists()
    assert sp("--catalog", catalog_url, "resume-point", "--run", "c") == 0
    assert "c step 4" in capsys.readouterr().out


def test_cli_prune_waits_for_pending_and_other_policies(catalog, catalog_url, tmp_path, capsys):
    t0 = datetime.now(timezone.utc)
    for s, loss in ((1, 0.1), (2, 0.5), (3, 0.4), (4, 0.3), (5, 0.2)):
        seed(catalog, tmp_path, "w", s, metrics={"loss": loss}, tags=("keep",) if s == 2 else (),
             created=t0 - timedelta(days=10 - s))
    seed(catalog, tmp_path, "w", 6, state=C.REPLICATED)
    capsys.readouterr()
    assert sp("--catalog", catalog_url, "prune", "--run", "w", "--keep-last", "1") == 0
    assert set(_states(catalog, "w").values()) == {"verified", "replicated"}  # 6 pending: nothing goes
    catalog.transition(catalog.get("w", 6).id, C.VALIDATING)
    catalog.transition(catalog.get("w", 6).id, C.VERIFIED)
    assert sp("--catalog", catalog_url, "prune", "--run", "w", "--keep-best", "loss:1", "--keep-tagged", "keep",
              "--keep-within", "6d") == 0
    # best loss: 1; tagged: 2; within 6 days: 5 (4 days old), 6; 4 is 6 days old: out (and not two newest)
    assert _states(catalog, "w") == {1: "verified", 2: "verified", 3: "pruned", 4: "pruned", 5: "verified",
                                     6: "verified"}
    assert sp("--catalog", catalog_url, "prune", "--keep-last", "1") == 2           # --run or --all-runs
    assert sp("--catalog", catalog_url, "prune", "--run", "w") == 2                 # no policy anywhere


def test_cli_prune_all_runs_from_config(catalog, catalog_url, tmp_path, capsys, monkeypatch, safepoint_home):
    for run in ("a", "b"):
        for s in (1, 2, 3):
            seed(catalog, tmp_path, run, s)
    (safepoint_home / "config.toml").write_text('[retention]\nkeep_last = 2\n[runs.b]\nretention = {keep_last = 3}\n')
    assert sp("--catalog", catalog_url, "prune", "--all-runs") == 0
    assert _states(catalog, "a") == {1: "pruned", 2: "verified", 3: "verified"}
    assert set(_states(catalog, "b").values()) == {"verified"}


# -- the Prefect flow and its deployment -------------------------------------------------------

def test_retention_deployment_is_scheduled():
    doc = yaml.safe_load((Path(__file__).resolve().parents[1] / "prefect.yaml").read_text())
    dep = {d["name"]: d for d in doc["deployments"]}["retention"]
    assert dep["entrypoint"] == "flows/retention.py:retention"
    assert dep["schedules"][0]["cron"].split()[1:] == ["*", "*", "*", "*"]
    from safepoint.flows.retention import retention

    assert set(dep["parameters"]) <= set(retention.parameters.properties)
    rt.policy_from_spec(dep["parameters"]["policy"])


def test_retention_flow_prunes_and_evicts(prefect_api, sqlite_catalog_url, tmp_path):
    from safepoint.catalog import open_catalog
    from safepoint.flows.retention import retention

    cat = open_catalog(sqlite_catalog_url)
    for s in (1, 2, 3, 4):
        seed(cat, tmp_path, "f", s, size=4096)
    seed(cat, tmp_path, "g", 1)
    out = retention(runs=["f", "g"], policy={"keep_last": 2}, evict_roots=[str(tmp_path / "nvme")],
                    high_water=0.5, low_water=0.0, capacity_bytes=4 * 4096, catalog_url=sqlite_catalog_url)
    assert {r["run"]: r["pruned"] for r in out["runs"]} == {"f": [1, 2], "g": []}
    assert _states(cat, "f") == {1: "pruned", 2: "pruned", 3: "verified", 4: "verified"}
    # Eviction after pruning: f/3 goes (replicated, older); f/4 and g/1 are their runs' newest.
    ev = out["eviction"][0]
    assert ev["evicted"] == [str(local_folder(tmp_path, "f", 3).resolve())]
    assert cat.get("f", 3).local_path is None and cat.get("f", 4).local_path is not None
    assert find_resume_point(cat, "f").chosen.step == 4
