"""Burst-buffer eviction: local copies go only after a durable replica is verified, oldest first,
once the local root passes its fill level (pure plan, then real folders on both backends)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from safepoint.catalog.views import LocalCopy
from safepoint.cli.main import main
from safepoint.core.format import MARKER_NAME
from safepoint.core.states import CheckpointState as C
from safepoint.core.states import ReplicaState as R
from safepoint.ops.evict import Usage, evict, plan_eviction
from safepoint.ops.resume import find_resume_point
from tests.helpers_catalog import local_folder, seed

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def copy(step, state=C.VERIFIED, nver=1, run="r"):
    return LocalCopy(checkpoint_id=step, run=run, step=step, state=C(state), version=3,
                     created_at=T0 + timedelta(hours=step), path=f"/nvme/{run}/{step}", verified_replicas=nver)


def evicted(plan):
    return [d.copy.step for d in plan.evict]


CASES = [
    # copies, used of 100, high, low, keep_newest -> evicted steps
    ("below high water: nothing", [copy(s) for s in (1, 2, 3)], 80, 0.85, None, 1, []),
    ("oldest first down to low water", [copy(s) for s in (1, 2, 3, 4)], 99, 0.85, 0.70, 1, [1, 2, 3]),
    ("low water defaults to high - 10%", [copy(s) for s in (1, 2, 3, 4)], 86, 0.85, None, 1, [1, 2]),
    ("no verified replica: never", [copy(1, nver=0), copy(2), copy(3)], 99, 0.5, 0.0, 1, [2]),
    ("pending states: never", [copy(1, C.REPLICATED), copy(2, C.VALIDATING), copy(3, C.COMMITTED), copy(4),
                               copy(5)], 99, 0.5, 0.0, 1, [4]),
    ("corrupt or incomplete: never (local may be the good copy)", [copy(1, C.CORRUPT), copy(2, C.INCOMPLETE),
                                                                   copy(3), copy(4)], 99, 0.5, 0.0, 1, [3]),
    ("invalid with a replica: may go", [copy(1, C.INVALID), copy(2)], 99, 0.5, 0.0, 1, [1]),
    ("newest per run kept", [copy(1, run="a"), copy(2, run="b"), copy(3, run="a")], 99, 0.5, 0.0, 1, [1]),
    ("keep_newest 0 lets all go", [copy(1), copy(2)], 99, 0.5, 0.0, 0, [1, 2]),
]


@pytest.mark.parametrize("name,copies,used,high,low,keep,expected", CASES, ids=[c[0] for c in CASES])
def test_plan_eviction_table(name, copies, used, high, low, keep, expected):
    sizes = {c.path: 10 for c in copies}
    p = plan_eviction(copies, sizes, Usage(used, 100), high_water=high, low_water=low, keep_newest=keep)
    assert evicted(p) == expected
    assert len(p.decisions) == len(copies) and all(d.reason for d in p.decisions)
    assert p.projected_fill == pytest.approx((used - 10 * len(expected)) / 100)


def test_plan_eviction_rejects_bad_levels():
    with pytest.raises(ValueError):
        plan_eviction([], {}, Usage(1, 2), high_water=0)
    with pytest.raises(ValueError):
        plan_eviction([], {}, Usage(1, 2), high_water=0.5, low_water=0.6)


def test_evict_real_folders(catalog, catalog_url, tmp_path, capsys):
    rows = {s: seed(catalog, tmp_path, "e", s, size=1000) for s in (1, 2, 3)}
    seed(catalog, tmp_path, "e", 4, state=C.REPLICATED, size=1000)      # still to be validated from local
    seed(catalog, tmp_path, "e", 5, replicas=(R.CORRUPT,), size=1000)   # replica bad: local is the good copy
    seed(catalog, tmp_path, "e", 6, size=1000)                          # newest: kept for restarts
    root = tmp_path / "nvme"
    assert [c.step for c in catalog.local_copies(root)] == [1, 2, 3, 4, 5, 6]
    dry = evict(catalog, root, high_water=0.5, low_water=0.0, capacity_bytes=6 * 1000, dry_run=True)
    assert evicted(dry.plan) == [1, 2, 3] and dry.evicted == []
    assert local_folder(tmp_path, "e", 1).exists()

    # A re-ingest of 2 starts after planning: its claim fails, its files stay.
    catalog.transition(rows[2].id, C.REPLICATING)
    res = evict(catalog, root, high_water=0.5, low_water=0.0, capacity_bytes=6 * 1000)
    assert sorted(res.evicted) == sorted(str(local_folder(tmp_path, "e", s).resolve()) for s in (1, 3))
    for s in (1, 3):
        assert not local_folder(tmp_path, "e", s).exists()
        assert catalog.get("e", s).local_path is None and catalog.get("e", s).state is C.VERIFIED
    for s in (2, 4, 5, 6):
        assert (local_folder(tmp_path, "e", s) / MARKER_NAME).exists()
    kinds = [e["kind"] for e in catalog.events(rows[1].id)]
    assert kinds[-2:] == ["evict", "evicted"]
    # The replica is untouched and still the resume point's source.
    assert find_resume_point(catalog, "e").chosen.step == 6

    capsys.readouterr()
    assert main(["--catalog", catalog_url, "evict", str(root), "--capacity", "100", "--high-water", "0.5",
                 "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "keep        e/5" in text and "verified durable replica(s)" in text
    assert "keep        e/4" in text and "state replicated" in text


@pytest.mark.catalog_backends
def test_claim_refuses_a_stale_plan(catalog, tmp_path):
    seed(catalog, tmp_path, "k", 1)
    c = catalog.local_copies(tmp_path / "nvme")[0]
    catalog.set_tags(c.checkpoint_id, ["x"])  # any change bumps the version
    assert not catalog.claim_local_eviction(c, states={C.VERIFIED})
    fresh = catalog.local_copies(tmp_path / "nvme")[0]
    assert catalog.claim_local_eviction(fresh, states={C.VERIFIED})
    assert not catalog.claim_local_eviction(fresh, states={C.VERIFIED})  # the claim itself bumped it
