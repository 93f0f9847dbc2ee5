"""Resume-point rules: the pure decision (tables and properties), the catalog's paging query that
feeds it (same answer as the pure function on the whole run, both backends), and the CLI."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from safepoint.cli.main import main
from safepoint.core.format import FileEntry, build_manifest, digest_bytes
from safepoint.core.states import CheckpointState as C
from safepoint.core.states import ReplicaState as R
from safepoint.ops.resume import find_resume_point
from safepoint.rules.resume import PENDING, is_good, resume_point, resume_point_paged
from tests.helpers_catalog import durable, seed, view

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
V, OK, BAD, MISS = C.VERIFIED, R.VERIFIED, R.CORRUPT, R.MISSING


def hist(*rows):
    """rows: (step, state, replica states[, extra kwargs])"""
    return [view(s, st_, reps, created=T0 + timedelta(hours=s), **(kw[0] if kw else {}))
            for s, st_, reps, *kw in rows]


CASES = [
    # (name, history, rules, expected step or None, expected passed-over steps)
    ("newest verified wins", [(1, V, (OK,)), (2, V, (OK,))], {}, 2, []),
    ("corrupt newest falls back", [(1, V, (OK,)), (2, C.CORRUPT, (OK,))], {}, 1, [2]),
    ("newest replica corrupt", [(1, V, (OK,)), (2, V, (BAD,))], {}, 1, [2]),
    ("pending newest is passed over", [(1, V, (OK,)), (2, C.VALIDATING, (OK,)), (3, C.REPLICATING, ())],
     {}, 1, [3, 2]),
    ("invalid, incomplete, pruned passed over",
     [(1, V, (OK,)), (2, C.PRUNED, (R.DELETED,)), (3, C.INVALID, (OK,)), (4, C.INCOMPLETE, ())], {}, 1, [4, 3, 2]),
    ("min replicas 2", [(1, V, (OK, OK)), (2, V, (OK, BAD)), (3, V, (OK,))], {"min_replicas": 2}, 1, [3, 2]),
    ("one good replica is enough by default", [(1, V, (OK,)), (2, V, (BAD, OK))], {}, 2, []),
    ("max step out of scope, not listed", [(1, V, (OK,)), (2, V, (OK,)), (3, C.CORRUPT, ())],
     {"max_step": 1}, 1, []),
    ("max step with a loser in scope", [(1, V, (OK,)), (2, C.CORRUPT, ()), (3, V, (OK,))], {"max_step": 2}, 1, [2]),
    ("before", [(1, V, (OK,)), (2, V, (OK,)), (3, V, (OK,))], {"before": T0 + timedelta(hours=2)}, 1, []),
    ("tag", [(1, V, (OK,), {"tags": ("best",)}), (2, V, (OK,)), (3, C.CORRUPT, (), {"tags": ("best",)})],
     {"tag": "best"}, 1, [3]),
    ("nothing good", [(1, C.CORRUPT, ()), (2, V, (MISS,))], {}, None, [2, 1]),
    ("empty", [], {}, None, []),
]


@pytest.mark.parametrize("name,rows,rules,expected,passed", CASES, ids=[c[0] for c in CASES])
def test_resume_point_table(name, rows, rules, expected, passed):
    d = resume_point(hist(*rows), **rules)
    assert (d.chosen.step if d.chosen else None) == expected
    assert [c.step for c, _why in d.passed_over] == passed
    assert all(why for _c, why in d.passed_over)


def test_explanations_name_the_reason():
    d = resume_point(hist((1, V, (OK,)), (2, V, (BAD,)), (3, C.CORRUPT, ()), (4, C.VALIDATING, ())))
    why = {c.step: w for c, w in d.passed_over}
    assert "pending validation" in why[4] and "validating" in why[4]
    assert why[3].startswith("state is corrupt")
    assert "0 verified replica(s), 1 required" in why[2] and "is corrupt" in why[2]


def test_urls_are_every_verified_replica():
    d = resume_point(hist((1, V, (OK, BAD, OK))))
    assert d.urls == ["file:///d0/r/1", "file:///d2/r/1"]
    assert resume_point([]).urls == []


def test_negative_min_replicas_is_an_error():
    with pytest.raises(ValueError):
        resume_point([], min_replicas=-1)


_state = st.sampled_from(list(C))
_rep = st.sampled_from([R.VERIFIED, R.CORRUPT, R.MISSING, R.PENDING, R.DELETED, R.FAILED])
_history = st.lists(st.tuples(_state, st.lists(_rep, max_size=3), st.booleans()), max_size=25)


@settings(max_examples=300, deadline=None)
@given(_history, st.integers(1, 3), st.one_of(st.none(), st.integers(0, 30)), st.one_of(st.none(), st.booleans()))
def test_resume_point_properties(rows, k, max_step, tagged_only):
    cks = [view(i * 10, s, tuple(reps), tags=("t",) if tagged else ()) for i, (s, reps, tagged) in enumerate(rows)]
    tag = "t" if tagged_only else None
    d = resume_point(cks, min_replicas=k, max_step=max_step, tag=tag)

    def in_scope(c):
        return (max_step is None or c.step <= max_step) and (tag is None or tag in c.tags)

    eligible = [c for c in cks if in_scope(c) and c.state is C.VERIFIED
                and sum(r.state is R.VERIFIED for r in c.replicas) >= k]
    if not eligible:
        assert d.chosen is None
        assert sorted(c.step for c, _ in d.passed_over) == sorted(c.step for c in cks if in_scope(c))
        return
    best = max(eligible, key=lambda c: c.step)
    assert d.chosen is best                       # never a non-verified one, never an older one
    assert [c.step for c, _ in d.passed_over] == sorted((c.step for c in cks if in_scope(c) and c.step > best.step),
                                                        reverse=True)


def test_is_good():
    assert is_good(view(1, V, (OK,)))
    assert not is_good(view(1, V, (OK, BAD)))      # a known-bad copy disqualifies
    assert not is_good(view(1, V, (OK, MISS)))
    assert is_good(view(1, V, (OK, R.DELETED, R.PENDING)))
    assert not is_good(view(1, V, (OK,)), min_replicas=2)
    assert not is_good(view(1, C.VALIDATING, (OK,)))
    assert C.VERIFIED not in PENDING and C.COMMITTED in PENDING


# -- the catalog's paging query gives the pure function's answer --------------------------------

def _fake_checkpoint(catalog, run, step, state, reps, created, tags=()):
    m = build_manifest(run, step, [FileEntry("w.bin", 10, f"{step:064x}")], meta={"tags": list(tags)})
    row = catalog.record_commit(m, digest_bytes(m.to_json_bytes()), None)
    for i, r in enumerate(reps):
        catalog.set_replica(row.id, f"file:///d{i}/{run}/{step}", f"file:///d{i}", r)
    from tests.helpers_catalog import PATHS

    for to in PATHS[state]:
        assert catalog.transition(row.id, to)
    import sqlalchemy as sa

    from safepoint.catalog.models import Checkpoint
    with catalog.engine.begin() as c:
        c.execute(sa.update(Checkpoint).where(Checkpoint.id == row.id).values(created_at=created))


@pytest.mark.catalog_backends
def test_catalog_resume_point_equals_pure_function(catalog):
    import random

    rnd = random.Random(5)
    states = [C.VERIFIED] * 4 + [C.CORRUPT, C.INVALID, C.VALIDATING, C.INCOMPLETE, C.PRUNED]
    for step in range(0, 400, 10):
        st_ = rnd.choice(states)
        reps = tuple(rnd.choice([R.VERIFIED, R.VERIFIED, R.CORRUPT, R.MISSING]) for _ in range(rnd.randint(0, 2)))
        _fake_checkpoint(catalog, "pg", step, st_, reps, T0 + timedelta(minutes=step),
                         tags=("keep",) if step % 70 == 0 else ())
    # A newest stretch with no winner forces several pages.
    for step in range(400, 460, 2):
        _fake_checkpoint(catalog, "pg", step, C.CORRUPT, (), T0 + timedelta(minutes=step))
    _fake_checkpoint(catalog, "other", 1000, C.VERIFIED, (R.VERIFIED,), T0)
    everything = catalog.list_checkpoints("pg")
    rules = [{}, {"min_replicas": 2}, {"max_step": 205}, {"max_step": 3},
             {"before": T0 + timedelta(minutes=123)}, {"tag": "keep"}, {"tag": "nope"},
             {"max_step": 300, "tag": "keep", "min_replicas": 1}]
    for r in rules:
        for page in (1, 3, 8):
            got = find_resume_point(catalog, "pg", page=page, **r)
            want = resume_point(everything, **r)
            assert (got.chosen.id if got.chosen else None) == (want.chosen.id if want.chosen else None), (r, page)
            assert [(c.id, w) for c, w in got.passed_over] == [(c.id, w) for c, w in want.passed_over], (r, page)
    assert find_resume_point(catalog, "nobody").chosen is None


@pytest.mark.catalog_backends
def test_candidates_for_resume_pages_newest_first(catalog):
    for step in (5, 10, 20, 40):
        _fake_checkpoint(catalog, "p", step, C.VERIFIED, (R.VERIFIED,), T0 + timedelta(minutes=step))
    assert [c.step for c in catalog.candidates_for_resume("p", limit=2)] == [40, 20]
    assert [c.step for c in catalog.candidates_for_resume("p", below_step=20, limit=2)] == [10, 5]
    assert [c.step for c in catalog.candidates_for_resume("p", max_step=19)] == [10, 5]
    assert [c.step for c in catalog.candidates_for_resume("p", before=T0 + timedelta(minutes=10))] == [5]
    c = catalog.candidates_for_resume("p", limit=1)[0]
    assert c.replicas[0].state is R.VERIFIED and c.version > 1


# -- through the CLI, both backends --------------------------------------------------------------

def sp(*args) -> int:
    return main([str(a) for a in args])


def test_cli_resume_point_rules(catalog, catalog_url, tmp_path, capsys):
    seed(catalog, tmp_path, "r", 100, replicas=(OK, OK), tags=("best",), created=T0)
    seed(catalog, tmp_path, "r", 200, replicas=(OK,), created=T0 + timedelta(hours=1))
    seed(catalog, tmp_path, "r", 300, replicas=(BAD,), created=T0 + timedelta(hours=2))
    seed(catalog, tmp_path, "r", 400, state=C.VALIDATING, created=T0 + timedelta(hours=3))

    def run(*extra):
        capsys.readouterr()
        code = sp("--catalog", catalog_url, "resume-point", "--run", "r", "--json", *extra)
        return code, json.loads(capsys.readouterr().out)

    code, doc = run()
    assert code == 0 and doc["step"] == 200 and doc["url"] == f"{durable(tmp_path)}/r/200"
    assert [p["step"] for p in doc["passed_over"]] == [400, 300]
    code, doc = run("--min-replicas", "2")
    assert doc["step"] == 100
    assert doc["urls"] == [f"{durable(tmp_path, 0)}/r/100", f"{durable(tmp_path, 1)}/r/100"]
    assert run("--max-step", "150")[1]["step"] == 100
    assert run("--tag", "best")[1]["step"] == 100
    assert run("--before", (T0 + timedelta(minutes=30)).isoformat())[1]["step"] == 100
    code, doc = run("--max-step", "50")
    assert code == 1 and doc["step"] is None

    capsys.readouterr()
    assert sp("--catalog", catalog_url, "resume-point", "--run", "r", "--explain", "--max-step", "350") == 0
    cap = capsys.readouterr()
    assert "r step 200" in cap.out
    assert "considered only checkpoints step <= 350" in cap.err
    assert "skipped r/300: 0 verified replica(s), 1 required" in cap.err and "r/400" not in cap.err
    assert sp("--catalog", catalog_url, "resume-point", "--run", "ghost") == 1
    assert "no checkpoints recorded" in capsys.readouterr().err
    assert sp("--catalog", catalog_url, "resume-point", "--run", "r", "--before", "yesterday-ish") == 2



PAGED = [
    # (name, history, rules, first page size, expected fetch_page calls (below_step, limit))
    ("newest wins: one page", [(s, V, (OK,)) for s in range(1, 11)], {}, 8, [(None, 8)]),
    ("pages grow until the winner", [(1, V, (OK,))] + [(s, C.CORRUPT, ()) for s in range(2, 12)], {}, 2,
     [(None, 2), (10, 8), (2, 32)]),
    ("a short page ends the run", [(s, C.CORRUPT, ()) for s in range(1, 6)], {}, 2, [(None, 2), (4, 8)]),
    ("empty run", [], {}, 8, [(None, 8)]),
    ("scope is the fetcher's", [(s, V, (OK,)) for s in range(1, 11)], {"max_step": 5}, 1, [(None, 1)]),
    ("too few replicas everywhere", [(s, V, (OK,)) for s in range(1, 4)], {"min_replicas": 2}, 1,
     [(None, 1), (3, 4)]),
]


@pytest.mark.parametrize("name,rows,rules,page,calls", PAGED, ids=[c[0] for c in PAGED])
def test_resume_point_paged_reads_only_the_pages_it_needs(name, rows, rules, page, calls):
    cks = hist(*rows)
    seen_calls = []

    def fetch_page(below_step, limit):
        seen_calls.append((below_step, limit))
        scope = [c for c in sorted(cks, key=lambda c: c.step, reverse=True)
                 if (below_step is None or c.step < below_step) and c.step <= rules.get("max_step", c.step)]
        return scope[:limit]

    assert resume_point_paged(fetch_page, page=page, **rules) == resume_point(cks, **rules)
    assert seen_calls == calls


def test_resume_point_paged_refuses_an_empty_page():
    with pytest.raises(ValueError):
        resume_point_paged(lambda below_step, limit: [], page=0)


@pytest.mark.parametrize("k", [0, -1])
def test_resume_point_needs_a_verified_copy(k):
    """min_replicas 0 would pick a checkpoint with no verified copy at all (issue 14): refused."""
    with pytest.raises(ValueError, match="min_replicas"):
        resume_point(hist((1, V, (OK,)), (2, V, ())), min_replicas=k)
