"""From an ingest's outcome to its verdict, its Prefect final state and its exit code: one rule.

The operation (safepoint.ops.steps.IngestOutcome), the ingest flow's run state
(safepoint.flows.ingest) and the CLI's exit code all read `decide`, so a run that Prefect shows
Completed is exactly one that exits 0, and a verdict on the checkpoint is exactly exit 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from safepoint.core.exits import EXIT_BAD, EXIT_ERROR, EXIT_OK
from safepoint.core.redact import redact
from safepoint.core.states import BAD_END_STATES
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS


class Verdict(str, Enum):
    VERIFIED = "verified"      # the checkpoint is good
    DELIVERED = "delivered"    # this node's part is safely sent; the checkpoint waits for the other nodes
    BAD = "bad"                # corrupt, invalid or incomplete: a verdict on the checkpoint
    UNFINISHED = "unfinished"  # no verdict: a copy failed or read back wrong, or the work stopped mid-way

    def __str__(self) -> str:
        return self.value


EXIT_CODES = {Verdict.VERIFIED: EXIT_OK, Verdict.DELIVERED: EXIT_OK, Verdict.BAD: EXIT_BAD,
              Verdict.UNFINISHED: EXIT_ERROR}
VERDICTS = frozenset(str(s) for s in BAD_END_STATES)
# A replica in one of these states is no copy to wait on: a part with one is not delivered. A part's
# replica row stays `pending` until the set is assembled, so `pending` is not among them.
BAD_REPLICAS = frozenset(str(s) for s in (RS.FAILED, RS.CORRUPT, RS.MISSING))


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    completed: bool      # the Prefect run's final state: Completed, else Failed with `message`
    exit_code: int
    message: str = ""    # the Failed state's one line; empty when completed


def verdict(state: str, replica_states: Iterable[str], *, part: bool) -> Verdict:
    """Pure: a verified checkpoint is good; a bad end state is a verdict; a part is delivered while
    nothing is wrong with it or its copies (the other nodes' parts are to come); else unfinished."""
    state = str(state)
    if state == str(CS.VERIFIED):
        return Verdict.VERIFIED
    if state in VERDICTS:
        return Verdict.BAD
    if part and not any(str(s) in BAD_REPLICAS for s in replica_states):
        return Verdict.DELIVERED
    return Verdict.UNFINISHED


def decide(result: Mapping[str, Any]) -> Decision:
    """The ingest result (run, step, state, replicas, message, part) -> verdict, final state, exit code.

    A Failed run's message is `RUN/STEP STATE: why`: the verdict's reason, or, with no verdict, the
    copies that went wrong and why.
    """
    replicas = list(result.get("replicas") or ())
    v = verdict(result["state"], (r["state"] for r in replicas), part=bool(result.get("part")))
    if v in (Verdict.VERIFIED, Verdict.DELIVERED):
        return Decision(v, True, EXIT_CODES[v])
    why = redact(result.get("message") or "") or ""
    bad = [r for r in replicas if str(r["state"]) in BAD_REPLICAS]
    if bad and v is Verdict.UNFINISHED:
        why = "; ".join(f"{r['url']}: {r.get('error') or r['state']}" for r in bad)
    return Decision(v, False, EXIT_CODES[v],
                    f"{result['run']}/{result['step']} {result['state']}" + (f": {why}" if why else ""))
