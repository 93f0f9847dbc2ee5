"""Pure decisions over catalog views: where to resume. No I/O here.

Inputs are `catalog.views.CheckpointView` values (or anything with the same attributes), so these
functions are tested with plain tables and properties. Retention lives in safepoint.rules.retention,
which builds on `is_good` and `PENDING` here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS

# Checkpoints the pipeline is still working on: their outcome is not known yet.
PENDING = frozenset({CS.COMMITTED, CS.REPLICATING, CS.REPLICATED, CS.VALIDATING})
# Replica states that say a copy is bad, not merely absent by design (deleted) or in progress.
BAD_REPLICA = frozenset({RS.CORRUPT, RS.MISSING})


def verified_replicas(ckpt: Any) -> list:
    return [r for r in ckpt.replicas if r.state is RS.VERIFIED]


def check_min_replicas(n: int) -> int:
    """`n` if it is a usable replica requirement; ValueError otherwise.

    0 would let a checkpoint with no verified copy count as good (chosen for resume, kept as a
    good one by retention): never a safe answer, so it is refused rather than honoured.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"min_replicas must be an integer >= 1, got {n!r}: a checkpoint needs a verified copy")
    return n


def is_good(ckpt: Any, min_replicas: int = 1) -> bool:
    """Verified, with at least `min_replicas` verified replicas and no replica known bad.

    This is what retention may count as a kept good checkpoint: a checkpoint one of whose replicas
    was found corrupt or missing is not counted, even if another copy still verifies.
    """
    return (ckpt.state is CS.VERIFIED and len(verified_replicas(ckpt)) >= min_replicas
            and not any(r.state in BAD_REPLICA for r in ckpt.replicas))


@dataclass(frozen=True)
class ResumeDecision:
    chosen: Any | None                          # the CheckpointView to resume from, or None
    passed_over: tuple[tuple[Any, str], ...]    # newer candidates and why each was skipped, newest first
    scope: tuple[str, ...] = ()                 # the rules that limited the candidates (for --explain)

    @property
    def urls(self) -> list[str]:
        """The URL of every verified replica of the chosen checkpoint."""
        if self.chosen is None:
            return []
        return [r.url for r in verified_replicas(self.chosen)]


def _why_not(c: Any, min_replicas: int) -> str | None:
    if c.state in PENDING:
        return f"still pending validation (state {c.state})"
    if c.state is not CS.VERIFIED:
        return f"state is {c.state}" + (f": {c.error}" if getattr(c, "error", None) else "")
    good = verified_replicas(c)
    if len(good) < min_replicas:
        others = ", ".join(f"{r.url} is {r.state}" for r in c.replicas if r.state is not RS.VERIFIED)
        return (f"{len(good)} verified replica(s), {min_replicas} required"
                + (f" ({others})" if others else ""))
    return None


def resume_point(
    checkpoints: Iterable,
    *,
    min_replicas: int = 1,
    max_step: int | None = None,
    before: datetime | None = None,
    tag: str | None = None,
) -> ResumeDecision:
    """The newest checkpoint in scope that is `verified` with >= `min_replicas` verified replicas.

    Scope: step <= `max_step`, created strictly before `before`, tagged `tag` (each optional).
    Checkpoints out of scope are not candidates and are not listed. Every newer candidate that
    loses is listed with the reason, so the answer can be explained.
    """
    check_min_replicas(min_replicas)
    scope = []
    if max_step is not None:
        scope.append(f"step <= {max_step}")
    if before is not None:
        scope.append(f"created before {before.isoformat()}")
    if tag is not None:
        scope.append(f"tagged {tag!r}")
    passed: list[tuple[Any, str]] = []
    for c in sorted(checkpoints, key=lambda c: c.step, reverse=True):
        if max_step is not None and c.step > max_step:
            continue
        if before is not None and c.created_at is not None and c.created_at >= before:
            continue
        if tag is not None and tag not in (c.tags or ()):
            continue
        why = _why_not(c, min_replicas)
        if why is None:
            return ResumeDecision(c, tuple(passed), tuple(scope))
        passed.append((c, why))
    return ResumeDecision(None, tuple(passed), tuple(scope))


#: fetch_page(below_step, limit): up to `limit` candidates in scope with step < below_step (None: no
#: bound), newest first; e.g. Catalog.resume_pages.
FetchPage = Callable[[int | None, int], Sequence[Any]]


def resume_point_paged(
    fetch_page: FetchPage,
    *,
    min_replicas: int = 1,
    max_step: int | None = None,
    before: datetime | None = None,
    tag: str | None = None,
    page: int = 8,
) -> ResumeDecision:
    """`resume_point` over only the rows it needs, fetched newest first in growing pages.

    Pages of 8, 32, 128, ... (at most 4096) rows until the decision has a winner: the rows seen are
    then exactly the winner and every newer candidate, so the decision (and its explanation) is the
    one `resume_point` gives on the whole run. A short page means there is nothing older. For the
    same answer as on the whole run, every page must come from one snapshot of the run.
    """
    if page < 1:
        raise ValueError("page must be >= 1")
    seen: list[Any] = []
    below: int | None = None
    while True:
        batch = list(fetch_page(below, page))
        seen.extend(batch)
        decision = resume_point(seen, min_replicas=min_replicas, max_step=max_step, before=before, tag=tag)
        if decision.chosen is not None or len(batch) < page:
            return decision
        below, page = batch[-1].step, min(page * 4, 4096)
