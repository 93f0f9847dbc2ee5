"""The one rule for a checkpoint's state changes (safepoint.core.transitions), by table, and the walk
the operations take through it (safepoint.ops.steps.walk) on a real catalog."""

from __future__ import annotations

import pytest

from safepoint.core.states import CheckpointState as C
from safepoint.core.transitions import CHECKPOINT, THROUGH, allowed, path, sources


@pytest.mark.parametrize("src, dst, walk", [
    (C.COMMITTED, C.REPLICATING, (C.REPLICATING,)),
    (C.REPLICATING, C.REPLICATING, (C.REPLICATING,)),                 # a new attempt is recorded
    (C.VALIDATING, C.REPLICATING, (C.REPLICATED, C.REPLICATING)),      # a re-ingest after a killed validation
    (C.VERIFIED, C.REPLICATING, (C.REPLICATING,)),
    (C.INCOMPLETE, C.REPLICATED, (C.REPLICATING, C.REPLICATED)),      # a late part completes the set
    (C.CORRUPT, C.REPLICATED, (C.REPLICATING, C.REPLICATED)),         # reconcile finishes from a good copy
    (C.COMMITTED, C.REPLICATED, (C.REPLICATING, C.REPLICATED)),
    (C.VALIDATING, C.COMMITTED, (C.REPLICATED, C.REPLICATING, C.COMMITTED)),  # reconcile abandons
    (C.REPLICATED, C.COMMITTED, (C.REPLICATING, C.COMMITTED)),
    (C.REPLICATED, C.REPLICATED, ()),                                  # no self-loop there
    (C.VERIFIED, C.VERIFIED, ()),
    (C.PRUNED, C.REPLICATING, ()),                                     # pruned is final
    (C.VERIFIED, C.PRUNED, (C.PRUNED,)),
    (C.REPLICATING, C.PRUNED, ()),                                     # never through a verdict or verified
    (C.COMMITTED, C.VERIFIED, (C.REPLICATING, C.REPLICATED, C.VALIDATING, C.VERIFIED)),
])
def test_path_table(src, dst, walk):
    assert path(src, dst) == walk


def test_every_walk_is_allowed_hop_by_hop_and_passes_only_pipeline_states():
    for src in C:
        for dst in C:
            hops = path(src, dst)
            if allowed(src, dst):
                assert hops == (dst,)  # one allowed step is the walk
            for a, b in zip((src, *hops), hops):
                assert allowed(a, b)
            assert all(h in THROUGH for h in hops[:-1])


def test_pruned_is_final_and_sources_agree_with_allowed():
    assert CHECKPOINT[C.PRUNED] == frozenset() and sources(C.PRUNED) == {C.COMMITTED, C.VERIFIED, C.CORRUPT,
                                                                           C.INVALID, C.INCOMPLETE}
    assert sources(C.REPLICATED, {C.REPLICATING, C.VERIFIED}) == {C.REPLICATING}
    assert not allowed(C.INVALID, C.VERIFIED) and not allowed(C.REPLICATING, C.VERIFIED)


def test_the_catalog_refuses_what_the_rule_refuses_and_walk_takes_the_rule_s_path(sqlite_catalog, tmp_path):
    from safepoint.ops.steps import walk
    from tests.helpers_catalog import seed

    row = seed(sqlite_catalog, tmp_path, "t", 1, state=C.VALIDATING)
    assert not sqlite_catalog.transition(row.id, C.COMMITTED)           # not one allowed step
    assert walk(sqlite_catalog, row.id, C.COMMITTED, error="abandoned")
    moves = [(e["detail"]["from"], e["detail"]["to"]) for e in sqlite_catalog.events(row.id, kind="state")][-3:]
    assert moves == [("validating", "replicated"), ("replicated", "replicating"), ("replicating", "committed")]
    assert sqlite_catalog.get_by_id(row.id).error == "abandoned"
    assert not walk(sqlite_catalog, row.id, C.REPLICATED, start={C.INCOMPLETE})  # not from where it is
    assert sqlite_catalog.get_by_id(row.id).state is C.COMMITTED


@pytest.mark.parametrize("checkpoint, replica, ok", [
    (C.VERIFIED, "corrupt", True), (C.VERIFIED, "pending", True), (C.CORRUPT, "verified", True),
    (C.REPLICATING, "deleted", True), (C.PRUNED, "deleted", True),
    (C.PRUNED, "verified", False), (C.PRUNED, "pending", False), (C.PRUNED, "failed", False),
])
def test_replica_state_table(checkpoint, replica, ok, sqlite_catalog, tmp_path):
    from safepoint.core.states import ReplicaState as R
    from safepoint.core.transitions import replica_allowed
    from tests.helpers_catalog import seed

    assert replica_allowed(checkpoint, R(replica)) is ok
    row = seed(sqlite_catalog, tmp_path, "r", 1, state=checkpoint)
    (rep,) = sqlite_catalog.replicas(row.id)
    assert sqlite_catalog.set_replica(row.id, rep.url, rep.destination, R(replica)) is ok  # the catalog obeys it
