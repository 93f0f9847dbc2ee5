"""The consistency check of a validated checkpoint: its stats and step counters, as the rules want them.

The decisions are safepoint.rules.consistency's (pure); this module only gathers their inputs from
what validation read: the role of every stat row (safepoint.validation.roles), the step counters the
checkpoint holds (Adam `step` tensors or values, the LR scheduler's `last_epoch`, the trainer's
recorded `global_step`), and the previous checkpoint's rows and counters (audit.Baseline).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from safepoint.rules.consistency import ConsistencyFinding, Counters, consistency_findings, is_step_counter
from safepoint.validation.layouts import RecordedStep
from safepoint.validation.roles import Role
from safepoint.validation.stats import Baseline, TensorStat, stat_keys

__all__ = ["check_consistency", "counters_of"]


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _one(values: Iterable[float]) -> float | None:
    """The single value of a counter, None where there is none or the checkpoint holds several."""
    found = set(values)
    return found.pop() if len(found) == 1 else None


def counters_of(stats: Iterable[TensorStat], values: Mapping[str, Any], recorded: Iterable[RecordedStep],
                roles: Mapping[tuple[str, str], Role], step: int) -> Counters:
    """The step counters one checkpoint holds (see Counters for what each one counts).

    Adam `step` is a one-element tensor since torch 2.0 (a stat with a value) and a plain float before
    (a value); the largest is the optimizer's own count. A scheduler's `last_epoch` and the trainer's
    `global_step` are plain values; several different ones (two schedulers) give no counter.
    """
    stats = list(stats)
    optimizer = [s.value for s in stats if s.value is not None and is_step_counter(s.name)
                 and roles.get((s.file, s.name)) is Role.OPTIMIZER_STATE]
    optimizer += [x for k, v in values.items() if is_step_counter(k) and (x := _number(v)) is not None]
    scheduler = [x for k, v in values.items() if (k == "last_epoch" or k.endswith(".last_epoch"))
                 and (x := _number(v)) is not None]
    trainer = [x for r in recorded if (x := _number(r.value)) is not None]
    return Counters(catalog=step, optimizer=max(optimizer) if optimizer else None, scheduler=_one(scheduler),
                    trainer=max(trainer) if trainer else None, scaler=_one(_scaler_scales(values)))


def _scaler_scales(values: Mapping[str, Any]) -> list[float]:
    """A GradScaler's `scale` (its state_dict: scale, growth_factor, backoff_factor, _growth_tracker)."""
    out = []
    for k, v in values.items():
        if k == "scale" or k.endswith(".scale"):
            prefix = k[: -len("scale")]
            if f"{prefix}_growth_tracker" in values or f"{prefix}backoff_factor" in values:
                if (x := _number(v)) is not None:
                    out.append(x)
    return out


def check_consistency(stats: list[TensorStat], counters: Counters, baseline: Baseline | None,
                      roles: Mapping[tuple[str, str], Role]) -> list[ConsistencyFinding]:
    """The consistency findings of a checkpoint against its baseline (None: the torn rule alone).

    `roles`: the role of each tensor by (file, name). Rows are the stats' own fields (no copies: 10^5
    tensors per checkpoint), named by stat key as the baseline's are."""
    rows = [{**vars(s), "name": key, "role": str(roles.get((s.file, s.name), Role.UNKNOWN))}
            for s, key in zip(stats, stat_keys(stats))]
    before = None
    if baseline is not None and baseline.step is not None:
        before = Counters.from_dict(baseline.counters, baseline.step)
    return consistency_findings(rows, baseline.stats if baseline is not None else {}, counters=counters,
                                before=before)
