"""The settlement rules as tables: replication results -> checkpoint state; verify report -> replica state."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.rules.settle import replica_state, settle_replication


@dataclass
class R:
    state: RS
    local_outcome: CS | None = None
    error: str | None = None
    local: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.local_outcome is not None:
            self.local = {"f": "read"}


@pytest.mark.parametrize(("results", "state", "error"), [
    ([R(RS.VERIFIED, CS.VERIFIED)], CS.REPLICATED, None),
    ([R(RS.FAILED, error="s3: reset"), R(RS.VERIFIED, CS.VERIFIED)], CS.REPLICATED, None),
    ([R(RS.FAILED, error="s3: reset"), R(RS.FAILED, error="nfs: ENOSPC")], CS.COMMITTED, "s3: reset; nfs: ENOSPC"),
    ([R(RS.PENDING)], CS.COMMITTED, "pending"),
    ([], CS.COMMITTED, "no destination"),
    # damage in the local bytes decides first: no replica is better than its source
    ([R(RS.VERIFIED, CS.VERIFIED), R(RS.CORRUPT, CS.CORRUPT, "w.bin: checksum mismatch")], CS.CORRUPT,
     "w.bin: checksum mismatch"),
    ([R(RS.FAILED, CS.INCOMPLETE, "w.bin missing"), R(RS.CORRUPT, CS.CORRUPT, "x.bin: mismatch")], CS.CORRUPT,
     "x.bin: mismatch"),
    ([R(RS.FAILED, CS.INCOMPLETE, "w.bin missing"), R(RS.VERIFIED, CS.VERIFIED)], CS.INCOMPLETE, "w.bin missing"),
    # a corrupt *replica* of good local bytes is the destination's problem, not the checkpoint's
    ([R(RS.CORRUPT, CS.VERIFIED, "read back wrong"), R(RS.VERIFIED, CS.VERIFIED)], CS.REPLICATED, None),
    ([R(RS.CORRUPT, CS.VERIFIED, "read back wrong")], CS.COMMITTED, "read back wrong"),
])
def test_settle_replication(results, state, error):
    s = settle_replication(results)
    assert (s.state, s.error) == (state, error)


@pytest.mark.parametrize(("outcome", "expected"), [
    (CS.VERIFIED, RS.VERIFIED), (CS.INCOMPLETE, RS.MISSING), (CS.CORRUPT, RS.CORRUPT), (CS.INVALID, RS.CORRUPT),
])
def test_replica_state(outcome, expected):
    assert replica_state(outcome) is expected
