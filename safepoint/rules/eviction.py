"""Which node-local copies to evict, as a pure function (safepoint.ops.evict measures and deletes).

Above the high-water fill, the oldest copies whose checkpoint has enough verified durable replicas
go first, until the fill would reach the low-water mark. A copy the pipeline may still read, one
without a verified replica, or the newest of each run (fast restart) stays; each copy gets a reason.

`plan_keep_local` is the trainer's count-based rule (`keep_local=N`, instead of HF's
`save_total_limit`): whatever the fill, a run keeps its newest N verified local copies and everything
newer than them; older copies go once they have a verified replica. The previous verified checkpoint
therefore stays until a newer one has passed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from safepoint.core.states import CheckpointState as CS
from safepoint.rules.resume import check_min_replicas

# Checkpoints whose local bytes nothing in the pipeline needs any more.
EVICTABLE = frozenset({CS.VERIFIED, CS.INVALID})


@dataclass(frozen=True)
class Usage:
    used: int
    total: int

    @property
    def fill(self) -> float:
        return self.used / self.total if self.total > 0 else 1.0


@dataclass(frozen=True)
class EvictionDecision:
    copy: Any                   # a catalog LocalCopy: run, step, path, state, created_at, verified_replicas
    evict: bool
    reason: str
    size: int


@dataclass(frozen=True)
class EvictionPlan:
    usage: Usage
    high_water: float
    low_water: float
    decisions: tuple[EvictionDecision, ...] = ()
    keep_local: int | None = None    # the count-based rule's N (plan_keep_local); None: by fill

    @property
    def evict(self) -> tuple[EvictionDecision, ...]:
        return tuple(d for d in self.decisions if d.evict)

    @property
    def projected_fill(self) -> float:
        freed = sum(d.size for d in self.evict)
        return Usage(max(0, self.usage.used - freed), self.usage.total).fill


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def plan_eviction(copies: Sequence[Any], sizes: Mapping[str, int], usage: Usage, *,
                  high_water: float = 0.85, low_water: float | None = None, min_replicas: int = 1,
                  keep_newest: int = 1) -> EvictionPlan:
    """Which local copies to delete, oldest first, with a reason for every copy.

    `sizes` maps a copy's path to its bytes on disk; `usage` is the root's fill. Nothing is
    evicted at or below `high_water`; above it, eligible copies go oldest first until the fill
    would reach `low_water` (default high_water - 0.10).
    """
    check_min_replicas(min_replicas)
    if not 0 < high_water <= 1:
        raise ValueError("high_water must be in (0, 1]")
    low = max(0.0, high_water - 0.10) if low_water is None else low_water
    if not 0 <= low <= high_water:
        raise ValueError("low_water must be in [0, high_water]")

    why_not: dict[int, str] = {}
    eligible: list[int] = []
    for i, c in enumerate(copies):
        if c.state not in EVICTABLE:
            why_not[i] = f"state {c.state}: only verified or invalid checkpoints lose their local copy"
        elif c.verified_replicas < max(1, min_replicas):
            why_not[i] = (f"{c.verified_replicas} verified durable replica(s), {max(1, min_replicas)} required "
                          "before the local copy may go")
        else:
            eligible.append(i)
    # The newest eligible copies of each run stay for fast restarts.
    by_run: dict[str, list[int]] = {}
    for i in eligible:
        by_run.setdefault(copies[i].run, []).append(i)
    for run, idx in by_run.items():
        for i in sorted(idx, key=lambda i: copies[i].step, reverse=True)[: max(0, keep_newest)]:
            why_not[i] = f"newest local copy of run {run}: kept for fast restarts"

    over = usage.fill > high_water
    need = usage.used - int(low * usage.total)
    freed = 0
    decisions: list[EvictionDecision] = []
    order = sorted(range(len(copies)), key=lambda i: (copies[i].created_at, copies[i].step, copies[i].path))
    for i in order:
        c, size = copies[i], int(sizes.get(copies[i].path, 0))
        if i in why_not:
            decisions.append(EvictionDecision(c, False, why_not[i], size))
        elif not over:
            decisions.append(EvictionDecision(
                c, False, f"fill {_pct(usage.fill)} is not above the {_pct(high_water)} high-water mark", size))
        elif freed >= need:
            decisions.append(EvictionDecision(c, False, f"enough freed: fill reaches the {_pct(low)} target", size))
        else:
            freed += size
            decisions.append(EvictionDecision(
                c, True, f"oldest replicated copy: fill {_pct(usage.fill)} > {_pct(high_water)}, "
                f"target {_pct(low)}", size))
    return EvictionPlan(usage, high_water, low, tuple(decisions))


def plan_keep_local(copies: Sequence[Any], sizes: Mapping[str, int], usage: Usage, keep: int, *,
                    min_replicas: int = 1) -> EvictionPlan:
    """Keep each run's newest `keep` verified local copies, and any newer copy; evict the older ones
    that have `min_replicas` verified durable replicas, whatever the fill. A reason for every copy.

    Rank parts of one checkpoint share its step and state, so they go or stay together."""
    check_min_replicas(min_replicas)
    if keep < 1:
        raise ValueError(f"keep_local must be at least 1, got {keep}")
    need = max(1, min_replicas)
    decisions: list[EvictionDecision] = []
    by_run: dict[str, list[Any]] = {}
    for c in copies:
        by_run.setdefault(c.run, []).append(c)
    for run, mine in sorted(by_run.items()):
        verified_steps = sorted({c.step for c in mine if c.state is CS.VERIFIED}, reverse=True)
        kept = verified_steps[:keep]
        oldest_kept = kept[-1] if len(kept) == keep else None
        for c in sorted(mine, key=lambda c: (c.step, c.path)):
            size = int(sizes.get(c.path, 0))
            if oldest_kept is None:
                why = (f"run {run} has {len(kept)} verified local checkpoint(s), {keep} kept: nothing older "
                       "goes before a newer one has passed")
            elif c.step >= oldest_kept:
                why = (f"one of the newest {keep} verified local checkpoint(s) of run {run}" if c.step in kept
                       else f"newer than the newest {keep} verified local checkpoint(s) of run {run}")
            elif c.state not in EVICTABLE:
                why = f"state {c.state}: only verified or invalid checkpoints lose their local copy"
            elif c.verified_replicas < need:
                why = (f"{c.verified_replicas} verified durable replica(s), {need} required before the local "
                       "copy may go")
            else:
                decisions.append(EvictionDecision(c, True, f"older than the newest {keep} verified local "
                                                  f"checkpoint(s) of run {run}, and replicated", size))
                continue
            decisions.append(EvictionDecision(c, False, why, size))
    order = {id(c): i for i, c in enumerate(sorted(copies, key=lambda c: (c.created_at, c.step, c.path)))}
    decisions.sort(key=lambda d: order[id(d.copy)])
    return EvictionPlan(usage, 1.0, 1.0, tuple(decisions), keep)
