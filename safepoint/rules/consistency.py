"""Consistency of a checkpoint with the one before it: the state that does not match its step. Pure.

An async writer can save files that are whole, hash-clean and loadable but hold the wrong state: the
optimizer state of an earlier step saved again (NeMo-RL#4183), weights from before `optimizer.step()`
next to the optimizer state from after it (Lightning PR#21079, nvidia-resiliency-ext PR#376), the
same bytes under a later step. No check of one checkpoint alone sees that; a comparison with the
previous verified checkpoint of the run (or its lineage parent) does.

Inputs are plain rows (dicts with the keys of `safepoint.validation.audit.TensorStat.to_dict`, named
by stat key, plus `role` on the current rows) and the step counters each checkpoint recorded, so the
rules are tested with tables (tests/test_consistency.py). No I/O and no torch here.

One tensor across two steps (`tensor_change`): a different head (BLAKE3 of the first 64 KiB) means it
moved; equal heads with both whole digests present are settled by the digests; equal heads where the
older step has no whole digest (its own baseline's head differed, so it was not hashed whole) are
settled by the stats (norm, max |x|, NaN/Inf counts and value all equal), and the finding says so.

Names are not trusted alone: a kind whose tensors moved by name is also compared as a multiset
(every tensor matched to a distinct earlier tensor of equal dtype, shape, head and whole digest, or
stats where the older one has no digest), so stale state whose equal-shape entries were swapped
(state.0 <-> state.1) is still stale.

A GradScaler step skipped on inf gradients is normal mixed-precision training: weights and moments
stay as they were, the optimizer's `step` does not advance, and the scaler's scale backs off. Where
the scaler's scale went down and the optimizer counter did not move, nothing is duplicate or stale.

A stale rule fires only when *every* compared tensor of a kind is unchanged while the other kind
moved: frozen layers (fine-tuning, LoRA) leave some parameters identical, never all of them while the
optimizer moves, and they hold no optimizer state at all. Adam's `step` counters are left out of the
optimizer's tensors (NeMo-RL's stale state repeats them too) and judged by the torn rule instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["DUPLICATE", "RULES", "STALE_OPTIMIZER", "STALE_WEIGHTS", "TORN", "Change", "ConsistencyFinding",
           "Counters", "consistency_findings", "is_step_counter", "scaler_skipped", "tensor_change", "torn_findings"]

STALE_OPTIMIZER, STALE_WEIGHTS, DUPLICATE, TORN = "stale_optimizer", "stale_weights", "duplicate", "torn"
RULES = (STALE_OPTIMIZER, STALE_WEIGHTS, DUPLICATE, TORN)
PARAMETER, OPTIMIZER_STATE = "parameter", "optimizer_state"
MAX_NAMED = 5  # tensors named in a finding; the count says how many there are

# torch.optim's per-parameter step counter, flattened: `...state.<param>.step` (Adam, AdamW, RAdam, ...).
_STEP_COUNTER = re.compile(r"(^|\.)state\.(.+\.)?step$")
_STATS = ("norm", "max_abs", "nan_count", "inf_count", "value")


def is_step_counter(name: str) -> bool:
    """Whether a flattened optimizer-state name is a per-parameter step counter (Adam `step`)."""
    return _STEP_COUNTER.search(name.split(":", 1)[-1]) is not None


class Change(str, Enum):
    MOVED = "moved"
    SAME = "same"                    # equal whole-tensor digests
    SAME_BY_STATS = "same_by_stats"  # equal heads and equal stats; the older step has no whole digest
    UNKNOWN = "unknown"              # no head on one side (a row written before digests were recorded)


def tensor_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> Change:
    """How one tensor changed between two checkpoints, from its two stat rows."""
    if not old.get("head") or not new.get("head"):
        return Change.UNKNOWN
    if list(old.get("shape") or []) != list(new.get("shape") or []) or old.get("dtype") != new.get("dtype"):
        return Change.MOVED
    if old["head"] != new["head"]:
        return Change.MOVED
    if old.get("digest") and new.get("digest"):
        return Change.SAME if old["digest"] == new["digest"] else Change.MOVED
    if all(old.get(k) == new.get(k) for k in _STATS):
        return Change.SAME_BY_STATS
    return Change.MOVED


@dataclass(frozen=True)
class ConsistencyFinding:
    """One rule that fired: the tensors (at most MAX_NAMED, `count` in all) and the two steps."""

    rule: str
    tensors: tuple[str, ...]
    count: int
    steps: tuple[int, int]  # (the checkpoint compared with, this checkpoint)
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "tensors": list(self.tensors), "count": self.count, "steps": list(self.steps),
                "message": self.message}


@dataclass(frozen=True)
class Counters:
    """The step counters one checkpoint recorded, each None where it has none.

    optimizer: the largest Adam `step` (= optimizer.step() calls; a parameter that had no gradient in
    some step lags, so the largest is the optimizer's own count); scheduler: the LR scheduler's
    `last_epoch` (= scheduler.step() calls); trainer: the trainer's `global_step` (HF Trainer and
    Lightning: optimizer steps taken by the loop); catalog: the step the checkpoint is cataloged under.
    """

    catalog: int
    optimizer: float | None = None
    scheduler: float | None = None
    trainer: float | None = None
    scaler: float | None = None   # a GradScaler's scale (fp16 mixed precision), not a step counter

    def to_dict(self) -> dict[str, Any]:
        return {"catalog": self.catalog, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "trainer": self.trainer, "scaler": self.scaler}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, catalog: int) -> Counters:
        d = d or {}
        return cls(catalog, d.get("optimizer"), d.get("scheduler"), d.get("trainer"), d.get("scaler"))


_COUNTER_NAMES = {"trainer": "trainer global_step", "scheduler": "scheduler last_epoch",
                  "catalog": "catalog step"}


@dataclass
class _Side:
    """The tensors of one kind, split by how they changed."""

    moved: list[str]
    same: list[str]
    by_stats: list[str]
    unknown: list[str]
    renamed: list[str] = field(default_factory=list)  # identical to an earlier tensor under another name

    @property
    def compared(self) -> int:
        return len(self.moved) + len(self.same) + len(self.by_stats) + len(self.renamed)

    @property
    def unchanged(self) -> bool:
        """Every tensor of this kind is known and identical (and there is at least one)."""
        return self.compared > 0 and not self.moved and not self.unknown

    @property
    def identical(self) -> list[str]:
        return self.same + self.by_stats + self.renamed


def _kind(row: Mapping[str, Any]) -> str | None:
    role = str(row.get("role") or "")
    if role == PARAMETER:
        return PARAMETER
    if role == OPTIMIZER_STATE and not is_step_counter(str(row["name"])):
        return OPTIMIZER_STATE
    return None


def _sides(current: Sequence[Mapping[str, Any]], baseline: Mapping[str, Mapping[str, Any]]) -> dict[str, _Side]:
    sides = {k: _Side([], [], [], []) for k in (PARAMETER, OPTIMIZER_STATE)}
    rows: dict[str, list[Mapping[str, Any]]] = {PARAMETER: [], OPTIMIZER_STATE: []}
    for row in current:
        kind = _kind(row)
        if kind is None:
            continue
        rows[kind].append(row)
        side, name = sides[kind], str(row["name"])
        old = baseline.get(name)
        if old is None:  # new state (a parameter unfrozen, state created lazily): a change
            side.moved.append(name)
            continue
        change = tensor_change(old, row)
        {Change.MOVED: side.moved, Change.SAME: side.same, Change.SAME_BY_STATS: side.by_stats,
         Change.UNKNOWN: side.unknown}[change].append(name)
    for kind, side in sides.items():
        if side.moved and not side.unknown and _same_multiset(rows[kind], baseline.values()):
            side.renamed, side.moved = side.moved, []
    return sides


def _same_multiset(rows: Sequence[Mapping[str, Any]], earlier: Iterable[Mapping[str, Any]]) -> bool:
    """Whether every row matches a distinct earlier tensor, whatever the names (swapped equal-shape entries)."""
    pool: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for old in earlier:
        if old.get("head"):
            pool.setdefault((old["head"], old.get("dtype"), tuple(old.get("shape") or ())), []).append(old)
    for row in rows:
        group = pool.get((row.get("head"), row.get("dtype"), tuple(row.get("shape") or ())), [])
        hit = next((i for i, old in enumerate(group) if tensor_change(old, row) in (Change.SAME, Change.SAME_BY_STATS)),
                   None)
        if hit is None:
            return False
        group.pop(hit)
    return bool(rows)


def _named(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(names)[:MAX_NAMED])


def _list(names: Sequence[str]) -> str:
    shown = ", ".join(_named(names))
    return shown + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")


def _by_stats_note(side: _Side, before: int) -> str:
    note = ""
    if side.renamed:
        note += (f" ({len(side.renamed)} of them identical to step {before}'s tensors under other names: "
                 f"entries swapped, e.g. {_list(side.renamed)})")
    if side.by_stats:
        note += (f" ({len(side.by_stats)} of them judged identical by equal norm, max |x| and counts: "
                 f"step {before} recorded no whole-tensor digest for them)")
    return note


def consistency_findings(current: Sequence[Mapping[str, Any]], baseline: Mapping[str, Mapping[str, Any]], *,
                         counters: Counters, before: Counters | None) -> list[ConsistencyFinding]:
    """The stale, duplicate and torn findings of a checkpoint against the one before it. Pure.

    current: this checkpoint's stat rows (`name` = stat key, `role`); baseline: the earlier one's rows by
    stat key; counters / before: the step counters of each (before None: no earlier checkpoint).
    """
    out: list[ConsistencyFinding] = []
    if before is not None and not scaler_skipped(counters, before):
        out += _stale_findings(_sides(current, baseline), before.catalog, counters.catalog)
    out += torn_findings(counters, before)
    return out


def scaler_skipped(counters: Counters, before: Counters) -> bool:
    """A GradScaler skipped the steps in between: its scale backed off and the optimizer did not step."""
    if counters.scaler is None or before.scaler is None or not counters.scaler < before.scaler:
        return False
    return counters.optimizer is None or before.optimizer is None or counters.optimizer == before.optimizer


def _stale_findings(sides: dict[str, _Side], before: int, step: int) -> list[ConsistencyFinding]:
    params, optim = sides[PARAMETER], sides[OPTIMIZER_STATE]
    steps = (before, step)
    if params.unchanged and optim.unchanged:
        same = params.identical + optim.identical
        return [ConsistencyFinding(
            DUPLICATE, _named(same), len(same), steps,
            f"duplicate of step {before}: all {params.compared} parameters and {optim.compared} optimizer tensors "
            f"of step {step} are byte-identical to step {before} ({_list(same)})"
            f"{_by_stats_note(params, before)}{_by_stats_note(optim, before)}")]
    if params.unchanged and not optim.compared and params.compared:
        return [ConsistencyFinding(
            DUPLICATE, _named(params.identical), len(params.identical), steps,
            f"duplicate of step {before}: all {params.compared} parameters of step {step} are byte-identical to "
            f"step {before} ({_list(params.identical)}){_by_stats_note(params, before)}")]
    if optim.unchanged and params.moved:
        return [ConsistencyFinding(
            STALE_OPTIMIZER, _named(optim.identical), len(optim.identical), steps,
            f"stale optimizer: all {optim.compared} optimizer tensors of step {step} are byte-identical to step "
            f"{before} ({_list(optim.identical)}) while {len(params.moved)} parameters moved "
            f"({_list(params.moved)}){_by_stats_note(optim, before)}")]
    if params.unchanged and optim.moved:
        return [ConsistencyFinding(
            STALE_WEIGHTS, _named(params.identical), len(params.identical), steps,
            f"stale weights: all {params.compared} parameters of step {step} are byte-identical to step {before} "
            f"({_list(params.identical)}) while {len(optim.moved)} optimizer tensors moved "
            f"({_list(optim.moved)}){_by_stats_note(params, before)}")]
    return []


def torn_findings(counters: Counters, before: Counters | None) -> list[ConsistencyFinding]:
    """The optimizer's step counter against the trainer's, the scheduler's and the catalog's. Pure.

    The convention, and why each comparison is one-sided: torch's Adam `step` counts optimizer.step()
    calls; HF Trainer's and Lightning's `global_step` count the loop's optimizer steps, which include
    the steps a fp16 GradScaler skips (it does not call optimizer.step() on inf gradients). So the
    optimizer may lag the trainer, never lead it:

    - in one checkpoint: Adam `step` > trainer `global_step` is torn (the optimizer state is from a
      later step than the trainer's, as in nvidia-resiliency-ext PR#376: `step` 2.0 next to step-1 weights);
    - between two checkpoints: for each other counter (trainer, scheduler, catalog step) that was equal
      to Adam `step` in the earlier checkpoint, Adam `step` must not have advanced more than it. A
      counter that was not equal there (a scheduler stepped per epoch, a catalog step counting samples)
      is not compared.
    """
    out: list[ConsistencyFinding] = []
    opt = counters.optimizer
    if opt is None:
        return out
    steps = (before.catalog if before is not None else counters.catalog, counters.catalog)
    if counters.trainer is not None and opt > counters.trainer:
        out.append(ConsistencyFinding(
            TORN, ("optimizer step", "trainer global_step"), 2, (counters.catalog, counters.catalog),
            f"torn: at step {counters.catalog} the optimizer has taken {_num(opt)} steps (Adam step) but the "
            f"trainer recorded global_step {_num(counters.trainer)}: optimizer state and trainer state are "
            f"from different steps"))
    if before is None or before.optimizer is None:
        return out
    d_opt = opt - before.optimizer
    for attr, label in _COUNTER_NAMES.items():
        was, now = getattr(before, attr), getattr(counters, attr)
        if was is None or now is None or was != before.optimizer or (attr == "trainer" and out):
            continue  # not defined equal here, or already torn against the trainer in this checkpoint
        if d_opt > now - was:
            out.append(ConsistencyFinding(
                TORN, ("optimizer step", label), 2, steps,
                f"torn: from step {before.catalog} to step {counters.catalog} the optimizer's Adam step went "
                f"{_num(before.optimizer)} -> {_num(opt)} (+{_num(d_opt)}) but the {label} went {_num(was)} -> "
                f"{_num(now)} (+{_num(now - was)})"))
    return out


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"
