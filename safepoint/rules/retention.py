"""Retention: which checkpoints to keep, as small composable policies and one pure planner.

A policy looks at one run's live checkpoints (oldest first) and returns, for each, the reason to
keep it or None (like Orbax's preservation policies, plus a reason). `plan()` combines a policy
with invariants that no policy can override:

1. the newest verified checkpoint is never deleted;
2. at least two verified checkpoints are kept while two exist (here: the two newest good ones);
3. nothing is deleted while a newer checkpoint is still pending validation;
4. a checkpoint whose replica is corrupt or missing is never counted as a kept good one
   (so invariants 1 and 2 keep more, older, good ones instead);

and pinned checkpoints are never deleted. Everything else no policy keeps is deleted. `plan` is
pure (no clock, no I/O: `now` is a parameter); safepoint.ops.prune.execute does the deleting.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from safepoint.core.errors import UsageError
from safepoint.core.states import CheckpointState as CS
from safepoint.rules.resume import PENDING, check_min_replicas, is_good

Reason = str | None


@dataclass(frozen=True)
class Context:
    """What policies may look at besides the checkpoints themselves."""

    now: datetime
    min_replicas: int = 1

    def good(self, c: Any) -> bool:
        return is_good(c, self.min_replicas)


class Policy(Protocol):
    def keep(self, checkpoints: Sequence[Any], ctx: Context) -> list[Reason]:
        """One entry per checkpoint (same order): the reason to keep it, or None."""
        ...


def _newest_good(checkpoints: Sequence[Any], ctx: Context) -> list[int]:
    """Indices of good checkpoints, newest first."""
    return [i for i in range(len(checkpoints) - 1, -1, -1) if ctx.good(checkpoints[i])]


@dataclass(frozen=True)
class KeepLastN:
    """The `n` newest good (verified, replicas intact) checkpoints."""

    n: int

    def keep(self, checkpoints: Sequence[Any], ctx: Context) -> list[Reason]:
        out: list[Reason] = [None] * len(checkpoints)
        for i in _newest_good(checkpoints, ctx)[: max(0, self.n)]:
            out[i] = f"among the {self.n} newest verified"
        return out


@dataclass(frozen=True)
class KeepEveryNSteps:
    """One good checkpoint per `n` steps: the first at or after each multiple of `n`.

    With checkpoints saved at multiples of `n` that is exactly those steps; with unaligned saves it
    is the first good one in each window, and it stays the same as newer ones arrive.
    """

    n: int

    def keep(self, checkpoints: Sequence[Any], ctx: Context) -> list[Reason]:
        if self.n <= 0:
            raise ValueError("KeepEveryNSteps: n must be > 0")
        out: list[Reason] = [None] * len(checkpoints)
        seen: set[int] = set()
        for i, c in enumerate(checkpoints):
            bucket = c.step // self.n
            if ctx.good(c) and bucket not in seen:
                seen.add(bucket)
                out[i] = f"first verified at or after step {bucket * self.n} (every {self.n} steps)"
        return out


@dataclass(frozen=True)
class KeepWithin:
    """Every checkpoint created within `duration` of now, whatever its state (recent failures
    stay for inspection)."""

    duration: timedelta

    def keep(self, checkpoints: Sequence[Any], ctx: Context) -> list[Reason]:
        cutoff = ctx.now - self.duration
        text = format_duration(self.duration)
        return [f"created within {text}" if c.created_at is not None and c.created_at >= cutoff else None
                for c in checkpoints]


@dataclass(frozen=True)
class KeepPinnedOrTagged:
    """Pinned checkpoints, and tagged ones: any tag when `tags` is None, else one of `tags`."""

    tags: frozenset[str] | None = None

    def keep(self, checkpoints: Sequence[Any], ctx: Context) -> list[Reason]:
        out: list[Reason] = []
        for c in checkpoints:
            hit = sorted(t for t in (c.tags or ()) if self.tags is None or t in self.tags)
            if c.pinned:
                out.append("pinned")
            elif hit:
                out.append("tagged " + ", ".join(hit))
            else:
                out.append(None)
        return out


def _metric(c: Any, name: str) -> float | None:
    v = (c.metrics or {}).get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        return None
    try:
        x = float(v)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


@dataclass(frozen=True)
class KeepBestN:
    """The `n` good checkpoints with the best recorded `metric` (mode "min" or "max"); checkpoints
    without a finite value of the metric are not ranked. Ties go to the newer checkpoint."""

    metric: str
    n: int
    mode: str = "min"

    def keep(self, checkpoints: Sequence[Any], ctx: Context) -> list[Reason]:
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBestN: mode must be 'min' or 'max', got {self.mode!r}")
        ranked = [(v, c.step, i) for i, c in enumerate(checkpoints)
                  if ctx.good(c) and (v := _metric(c, self.metric)) is not None]
        sign = 1.0 if self.mode == "min" else -1.0
        ranked.sort(key=lambda t: (sign * t[0], -t[1]))
        out: list[Reason] = [None] * len(checkpoints)
        for rank, (v, _step, i) in enumerate(ranked[: max(0, self.n)], start=1):
            out[i] = f"best {self.n} by {self.metric} ({self.mode}): #{rank}, {v:g}"
        return out


class AnyOf:
    """Keep what any of the policies keeps; the reasons of all that keep are joined."""

    def __init__(self, *policies: Policy):
        self.policies: tuple[Policy, ...] = policies

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AnyOf) and self.policies == other.policies

    def __hash__(self) -> int:
        return hash(self.policies)

    def keep(self, checkpoints: Sequence[Any], ctx: Context) -> list[Reason]:
        out: list[Reason] = [None] * len(checkpoints)
        for p in self.policies:
            for i, why in enumerate(p.keep(checkpoints, ctx)):
                if why:
                    out[i] = why if out[i] is None else f"{out[i]}; {why}"
        return out


@dataclass(frozen=True)
class KeepIds:
    """Keep exactly these checkpoint ids (used to re-check a plan against a fresh catalog read)."""

    ids: frozenset[int]
    reason: str = "kept by the plan being executed"

    def keep(self, checkpoints: Sequence[Any], ctx: Context) -> list[Reason]:
        return [self.reason if c.id in self.ids else None for c in checkpoints]


# -- the plan ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Decision:
    checkpoint: Any
    keep: bool
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class RetentionPlan:
    """One decision per live checkpoint (runs by name, then steps ascending), with reasons."""

    decisions: tuple[Decision, ...] = ()
    policy: Any = None
    now: datetime | None = None
    min_replicas: int = 1

    @property
    def keep(self) -> dict[int, list[str]]:
        """Checkpoint id -> reasons, for everything kept."""
        return {d.checkpoint.id: list(d.reasons) for d in self.decisions if d.keep}

    @property
    def delete(self) -> tuple[Any, ...]:
        return tuple(d.checkpoint for d in self.decisions if not d.keep)

    def runs(self) -> list[str]:
        return sorted({d.checkpoint.run for d in self.decisions})

    def to_rows(self) -> list[dict[str, Any]]:
        return [{"run": d.checkpoint.run, "step": d.checkpoint.step, "state": str(d.checkpoint.state),
                 "action": "keep" if d.keep else "delete", "reasons": list(d.reasons)} for d in self.decisions]


INV = "invariant: "


def _plan_run(live: list[Any], policy: Policy, ctx: Context) -> list[Decision]:
    reasons: list[list[str]] = [[] for _ in live]
    for i, why in enumerate(policy.keep(live, ctx)):
        if why:
            reasons[i].append(why)

    pending = [c for c in live if c.state in PENDING]
    newest_pending = max(pending, key=lambda c: c.step) if pending else None
    verified = [i for i, c in enumerate(live) if c.state is CS.VERIFIED]
    good = [i for i in verified if ctx.good(live[i])]

    for i, c in enumerate(live):
        if c.pinned and not any("pinned" in r for r in reasons[i]):
            reasons[i].append(INV + "pinned")
        if c.state in PENDING:
            reasons[i].append(f"{INV}pending validation (state {c.state})")
        elif newest_pending is not None and c.step < newest_pending.step:
            reasons[i].append(f"{INV}a newer checkpoint, step {newest_pending.step}, is still pending validation "
                              f"(state {newest_pending.state})")
    if verified:
        reasons[verified[-1]].append(INV + "newest verified")
    if good and good[-1] != (verified[-1] if verified else None):
        reasons[good[-1]].append(INV + "newest verified with intact replicas")

    # At least two verified kept while two exist, and the strongest reading of it: the two newest
    # good ones (a checkpoint with a corrupt or missing replica does not count), so a fallback
    # close to the newest always exists. With fewer than two good, verified ones fill in.
    two = INV + "one of the two newest verified checkpoints"
    for i in good[-2:]:
        if not reasons[i]:
            reasons[i].append(two)
    have = sum(1 for i in verified if reasons[i])
    for i in reversed(verified):
        if have >= min(2, len(verified)):
            break
        if not reasons[i]:
            reasons[i].append(two + " (fewer than two have intact replicas)")
            have += 1
    return [Decision(c, bool(r), tuple(r) if r else ("not kept by any policy",)) for c, r in zip(live, reasons)]


def plan(checkpoints: Iterable[Any], policy: Policy, now: datetime | None = None, *,
         min_replicas: int = 1) -> RetentionPlan:
    """Decide keep/delete for every live (not yet pruned) checkpoint, run by run.

    `now` defaults to the Unix epoch, never the clock, so the function stays pure: pass the time
    when a policy (KeepWithin) depends on it.
    """
    ctx = Context(now or datetime(1970, 1, 1, tzinfo=timezone.utc), check_min_replicas(min_replicas))
    by_run: dict[str, list[Any]] = {}
    for c in checkpoints:
        if c.state is not CS.PRUNED:
            by_run.setdefault(c.run, []).append(c)
    decisions: list[Decision] = []
    for run in sorted(by_run):
        live = sorted(by_run[run], key=lambda c: c.step)
        decisions.extend(_plan_run(live, policy, ctx))
    return RetentionPlan(tuple(decisions), policy, now, min_replicas)


def still_deletable(original: RetentionPlan) -> Callable[[list[Any]], set[int]]:
    """A re-check for catalog.mark_pruned: what the original plan deletes AND a fresh plan (same
    policy, same now) over the current rows still deletes."""
    deleting = {c.id for c in original.delete}
    policy = original.policy if original.policy is not None else KeepIds(frozenset(original.keep))

    def recheck(views: list[Any]) -> set[int]:
        fresh = plan(views, policy, original.now, min_replicas=original.min_replicas)
        return deleting & {c.id for c in fresh.delete}

    return recheck


# -- policies from words (CLI, flow parameters, config) -----------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """'90s', '30m', '12h', '7d', '2w' -> timedelta."""
    m = _DURATION.match(str(text).lower())
    if not m:
        raise UsageError(f"not a duration: {text!r} (use e.g. 30m, 12h, 7d, 2w)")
    return timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])


def format_duration(d: timedelta) -> str:
    s = d.total_seconds()
    for unit in ("w", "d", "h", "m"):
        if s >= _UNITS[unit] and s % _UNITS[unit] == 0:
            return f"{int(s // _UNITS[unit])}{unit}"
    return f"{s:g}s"


def parse_best(text: str) -> KeepBestN:
    """'loss:3' or 'loss:3:min' or 'accuracy:2:max' -> KeepBestN."""
    parts = str(text).split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        return KeepBestN(parts[0], int(parts[1]), parts[2] if len(parts) == 3 else "min")
    except ValueError:
        raise UsageError(f"--keep-best wants METRIC:N[:min|max], got {text!r}") from None


SPEC_KEYS = ("keep_last", "keep_every", "keep_within", "keep_tagged", "keep_best")


def policy_from_spec(spec: Mapping[str, Any]) -> Policy:
    """A policy from a small dict (CLI flags, flow parameters, [runs.R.retention] in config.toml).

    keep_last: int; keep_every: int (steps); keep_within: "7d"; keep_tagged: true or [tags];
    keep_best: "loss:3:min" or {"metric": "loss", "n": 3, "mode": "min"}. Several combine with AnyOf.
    """
    unknown = set(spec) - set(SPEC_KEYS)
    if unknown:
        raise UsageError(f"unknown retention setting(s): {', '.join(sorted(unknown))}; know {', '.join(SPEC_KEYS)}")
    parts: list[Policy] = []
    if spec.get("keep_last") is not None:
        parts.append(KeepLastN(int(spec["keep_last"])))
    if spec.get("keep_every") is not None:
        parts.append(KeepEveryNSteps(int(spec["keep_every"])))
    if spec.get("keep_within") is not None:
        parts.append(KeepWithin(parse_duration(spec["keep_within"])))
    tagged = spec.get("keep_tagged")
    if tagged is True:
        parts.append(KeepPinnedOrTagged())
    elif isinstance(tagged, (list, tuple, set, frozenset)) and tagged:
        parts.append(KeepPinnedOrTagged(frozenset(str(t) for t in tagged)))
    best = spec.get("keep_best")
    if isinstance(best, str):
        parts.append(parse_best(best))
    elif isinstance(best, Mapping):
        parts.append(KeepBestN(str(best["metric"]), int(best.get("n", 1)), str(best.get("mode", "min"))))
    if not parts:
        raise UsageError("no retention policy: give at least one of " + ", ".join(SPEC_KEYS))
    return parts[0] if len(parts) == 1 else AnyOf(*parts)

