"""States of checkpoints and replicas, and the transitions the catalog allows."""

from __future__ import annotations

from enum import Enum


class CheckpointState(str, Enum):
    COMMITTED = "committed"        # sealed locally, not yet replicated
    REPLICATING = "replicating"
    REPLICATED = "replicated"      # every expected rank has a verified replica
    VALIDATING = "validating"
    VERIFIED = "verified"          # bytes verified and content validated: safe to resume from
    CORRUPT = "corrupt"            # bytes differ from the manifest, or no verified copy is left
    INVALID = "invalid"            # bytes intact, content bad or unloadable
    INCOMPLETE = "incomplete"      # files or ranks missing
    PRUNED = "pruned"              # deleted by retention

    def __str__(self) -> str:
        return self.value


class ReplicaState(str, Enum):
    PENDING = "pending"            # upload in progress (or interrupted): never trusted
    VERIFIED = "verified"
    CORRUPT = "corrupt"
    MISSING = "missing"
    FAILED = "failed"              # replication failed hard; `error` says why
    DELETED = "deleted"

    def __str__(self) -> str:
        return self.value


C = CheckpointState
# Allowed transitions. Re-ingest and re-verify may move a checkpoint back from a bad state when
# the bytes turn out fine again (e.g. a replica was repaired), but `pruned` is final.
ALLOWED: dict[CheckpointState, frozenset[CheckpointState]] = {
    C.COMMITTED: frozenset({C.REPLICATING, C.CORRUPT, C.INCOMPLETE, C.PRUNED}),
    C.REPLICATING: frozenset({C.REPLICATED, C.CORRUPT, C.INCOMPLETE, C.COMMITTED, C.REPLICATING}),
    C.REPLICATED: frozenset({C.VALIDATING, C.CORRUPT, C.REPLICATING}),
    C.VALIDATING: frozenset({C.VERIFIED, C.INVALID, C.INCOMPLETE, C.CORRUPT, C.VALIDATING, C.REPLICATED}),
    C.VERIFIED: frozenset({C.CORRUPT, C.PRUNED, C.REPLICATING, C.VALIDATING}),
    C.CORRUPT: frozenset({C.REPLICATING, C.PRUNED}),
    C.INVALID: frozenset({C.REPLICATING, C.PRUNED}),
    C.INCOMPLETE: frozenset({C.REPLICATING, C.PRUNED}),
    C.PRUNED: frozenset(),
}

BAD_END_STATES = frozenset({C.CORRUPT, C.INVALID, C.INCOMPLETE})


def can_transition(src: CheckpointState, dst: CheckpointState) -> bool:
    return dst in ALLOWED[src]
