"""Pure rules that turn verification results into states. No I/O here.

- `replica_state`: what a verify report of one replica makes that replica (the one mapping used by
  ingest, verify, scrub and reconcile);
- `settle_replication`: what the replication results of one ingest make the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS


def replica_state(outcome: CS) -> RS:
    """A replica whose bytes all verify is verified; one missing files is missing; anything else is corrupt."""
    return {CS.VERIFIED: RS.VERIFIED, CS.INCOMPLETE: RS.MISSING}.get(outcome, RS.CORRUPT)


class Replicated(Protocol):
    """What settling needs of one destination's result (ops.replicate.ReplicaResult has it)."""

    local: Mapping[str, object]  # per-file statuses found reading the local bytes; empty when none were read
    local_outcome: CS | None
    state: RS
    error: str | None


@dataclass(frozen=True)
class Settlement:
    state: CS
    error: str | None


def settle_replication(results: Sequence[Replicated]) -> Settlement:
    """The checkpoint's state once every destination has answered.

    Damage found in the *local* bytes while sending them decides first (corrupt, then incomplete):
    no replica can be better than its source. Otherwise one verified replica makes the checkpoint
    `replicated` (validation comes next), and none leaves it `committed`, with every reason.
    """
    for bad in (CS.CORRUPT, CS.INCOMPLETE):
        for r in results:
            if r.local and r.local_outcome is bad:
                return Settlement(bad, r.error)
    if any(r.state is RS.VERIFIED for r in results):
        return Settlement(CS.REPLICATED, None)
    return Settlement(CS.COMMITTED, "; ".join(r.error or str(r.state) for r in results) or "no destination")
