"""States of checkpoints and replicas (the transitions between them: safepoint.core.transitions)."""

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


BAD_END_STATES = frozenset({CheckpointState.CORRUPT, CheckpointState.INVALID, CheckpointState.INCOMPLETE})

