"""The allowed changes of a checkpoint's and a replica's state, and the walk between states: one pure rule.

The catalog refuses any change `allowed` or `replica_allowed` says no to (catalog/transitions.py,
catalog/replicas.py); the operations (ingest, assembly, reconcile) never spell out the intermediate
states themselves: they ask `path` for the walk and the catalog applies it hop by hop
(safepoint.ops.steps.walk).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from safepoint.core.states import CheckpointState as C
from safepoint.core.states import ReplicaState as R

# Re-ingest and re-verify may move a checkpoint back from a bad state when the bytes turn out fine
# again (e.g. a replica was repaired), but `pruned` is final.
CHECKPOINT: dict[C, frozenset[C]] = {
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
# A walk passes only through the pipeline's own states: never through a verdict, `verified` or `pruned`.
THROUGH = frozenset({C.REPLICATING, C.REPLICATED, C.VALIDATING})


def allowed(src: C, dst: C) -> bool:
    """Whether the catalog may move a checkpoint from `src` to `dst` in one step."""
    return C(dst) in CHECKPOINT[C(src)]


def replica_allowed(checkpoint: C, dst: R) -> bool:
    """Whether a replica of a checkpoint in state `checkpoint` may be recorded `dst`. A replica moves
    freely (re-sent, re-verified, rotted, repaired) until retention marks its checkpoint `pruned`;
    then only `deleted`: an upload or scrub finishing late must not bring back what is being deleted."""
    return C(checkpoint) is not C.PRUNED or R(dst) is R.DELETED


def sources(dst: C, among: Iterable[C] | None = None) -> frozenset[C]:
    """The states (of `among`, default all) from which `dst` is one allowed step."""
    return frozenset(s for s in (C if among is None else map(C, among)) if allowed(s, dst))


def path(src: C, dst: C) -> tuple[C, ...]:
    """The shortest allowed walk from `src` to `dst` (the states after `src`, `dst` last), through
    pipeline states only; a state that may be entered again (`replicating`, `validating`) walks to
    itself in one hop, which records the new attempt. () when there is none."""
    src, dst = C(src), C(dst)
    if src == dst:
        return (dst,) if allowed(src, dst) else ()
    seen, todo = {src}, deque([(src, ())])
    while todo:
        at, walked = todo.popleft()
        for nxt in sorted(CHECKPOINT[at], key=list(C).index):
            if nxt == dst:
                return (*walked, nxt)
            if nxt in THROUGH and nxt not in seen:
                seen.add(nxt)
                todo.append((nxt, (*walked, nxt)))
    return ()
