"""Pure decisions over catalog views: where to resume, what to keep. No I/O here.

Inputs are `catalog.views.CheckpointView` values (or anything with the same attributes), so these
functions are tested with plain tables and properties.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from safepoint.states import CheckpointState as CS
from safepoint.states import ReplicaState as RS


@dataclass(frozen=True)
class ResumeDecision:
    chosen: object | None                      # the CheckpointView to resume from, or None
    passed_over: tuple[tuple[object, str], ...]  # newer checkpoints and why each was skipped

    @property
    def urls(self) -> list[str]:
        if self.chosen is None:
            return []
        return [r.url for r in self.chosen.replicas if r.state is RS.VERIFIED]


def verified_replicas(ckpt) -> list:
    return [r for r in ckpt.replicas if r.state is RS.VERIFIED]


def resume_point(
    checkpoints: Iterable,
    *,
    min_replicas: int = 1,
    max_step: int | None = None,
    before: datetime | None = None,
    tag: str | None = None,
) -> ResumeDecision:
    """The newest checkpoint that is `verified` with at least `min_replicas` verified replicas.

    Every newer checkpoint that loses is listed with the reason, so the answer can be explained.
    """
    passed: list[tuple[object, str]] = []
    for c in sorted(checkpoints, key=lambda c: c.step, reverse=True):
        if max_step is not None and c.step > max_step:
            continue
        if before is not None and c.created_at is not None and c.created_at >= before:
            continue
        if tag is not None and tag not in (c.tags or ()):
            continue
        if c.state is not CS.VERIFIED:
            passed.append((c, f"state is {c.state}"))
            continue
        n = len(verified_replicas(c))
        if n < min_replicas:
            passed.append((c, f"{n} verified replica(s), {min_replicas} required"))
            continue
        return ResumeDecision(c, tuple(passed))
    return ResumeDecision(None, tuple(passed))


@dataclass(frozen=True)
class RetentionPlan:
    keep: dict[int, list[str]] = field(default_factory=dict)   # checkpoint id -> reasons
    delete: tuple = ()                                          # CheckpointViews to delete


def keep_last_plan(checkpoints: Sequence, keep_last: int) -> RetentionPlan:
    """Keep the `keep_last` newest verified checkpoints (never fewer than one), delete older verified ones.

    Checkpoints in other states are left alone here; a newer checkpoint still in flight blocks
    deletion entirely, so a failure in progress can never leave the run without a good checkpoint.
    """
    live = [c for c in checkpoints if c.state is not CS.PRUNED]
    verified = sorted((c for c in live if c.state is CS.VERIFIED and verified_replicas(c)),
                      key=lambda c: c.step, reverse=True)
    keep: dict[int, list[str]] = {}
    for i, c in enumerate(verified):
        if i < max(1, keep_last):
            keep.setdefault(c.id, []).append(f"among the {max(1, keep_last)} newest verified")
    in_flight = [c for c in live if c.state in (CS.COMMITTED, CS.REPLICATING, CS.REPLICATED, CS.VALIDATING)]
    if not keep:
        return RetentionPlan({}, ())
    oldest_kept = min(c.step for c in verified if c.id in keep)
    delete = []
    for c in sorted(live, key=lambda c: c.step):
        if c.id in keep or c.step >= oldest_kept or c in in_flight:
            continue
        if any(f.step > c.step for f in in_flight):
            keep.setdefault(c.id, []).append("a newer checkpoint is still pending validation")
            continue
        delete.append(c)
    return RetentionPlan(keep, tuple(delete))
