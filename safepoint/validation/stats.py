"""Tensor stats as data, and what is decided from them alone: catalog names, norm jumps, the baseline.

Torch-free on purpose: the process that judges and records a checkpoint uses these, while the
stats themselves are computed in the sandboxed reader (safepoint.validation.audit).
"""

from __future__ import annotations

import fnmatch
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from safepoint.core.states import CheckpointState
from safepoint.rules.magnitude import DEFAULT_MAX_ABS_PARAMETER

__all__ = [
    "DIGEST_HEX", "HEAD_BYTES", "Baseline", "Jump", "TensorStat", "Thresholds", "baseline_from_catalog",
    "baseline_heads", "jump_ratio", "norm_jumps", "stat_keys", "stat_rows",
]

HEAD_BYTES = 64 * 1024  # the head digest: where a trained tensor moves, its head moves too; ~1% of the audit's cost
DIGEST_HEX = 32  # 128 bits of BLAKE3: collision-safe for comparing two steps, compact at 10^5 tensors


@dataclass(frozen=True)
class TensorStat:
    """Stats of one tensor. norm and max_abs cover the finite values only (NaN/Inf are counted apart).

    `value` holds the value of a one-element tensor (e.g. a step counter), for the step check.
    `head` and `digest` (BLAKE3 over the bytes as they stream, no second pass) let the consistency rules
    tell a tensor that did not change between two checkpoints from one that did (safepoint.rules.consistency):
    a different head proves a change; equal heads are settled by the whole-tensor digests, or by equal
    stats where the older step has none (see stat_of).
    """

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    norm: float | None
    max_abs: float | None
    nan_count: int
    inf_count: int
    value: float | None = None
    head: str | None = None    # BLAKE3 of the first HEAD_BYTES of the tensor's bytes as stored (DIGEST_HEX chars)
    digest: str | None = None  # BLAKE3 of all its bytes, where identity with the previous step is in question

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


# ------------------------------------------------------------------------------------ naming in the catalog

def stat_keys(stats: Iterable[TensorStat]) -> list[str]:
    """The name each stat is stored and compared under: the tensor name, or `file:name` when the same
    tensor name appears in several files of the snapshot (e.g. one file per tensor-parallel rank)."""
    stats = list(stats)
    counts = Counter(s.name for s in stats)
    return [s.name if counts[s.name] == 1 else f"{s.file}:{s.name}" for s in stats]


def stat_rows(stats: Iterable[TensorStat], role: Callable[[str, str], Any] | None = None) -> list[dict[str, Any]]:
    """Rows for catalog.record_validation (names from stat_keys), each with its file and, given
    `role(file, name)` (the configured Rules.role), its role."""
    stats = list(stats)
    return [{**s.to_dict(), "name": key, "role": str(role(s.file, s.name)) if role else None}
            for s, key in zip(stats, stat_keys(stats))]


# ------------------------------------------------------------------------------------ norm jumps

@dataclass(frozen=True)
class Thresholds:
    """When a tensor's norm has moved too much since the previous verified checkpoint of the run.

    A tensor is flagged when its norm grew or shrank by more than `norm_jump_factor` (symmetric:
    x10 or /10 by default). Norms below `norm_floor` count as `norm_floor` (a bias that leaves zero
    is not an infinite jump), and so do norms whose RMS (norm / sqrt(numel)) is below `rms_floor`:
    a zero-initialised bias or LayerNorm shift that starts to move in the first steps of a correct run
    is growth from nothing, not divergence. Tensors with fewer than `min_numel` elements (step
    counters) and names matching an `ignore` glob are not compared. `norm_jump_factor` None or 0 turns
    the check off. Which tensors are compared at all is the rules table's call (safepoint.validation.roles:
    Adam's moments start at zero and grow >10x early, so optimizer state is not compared by default).
    """

    norm_jump_factor: float | None = 10.0
    norm_floor: float = 1e-6
    rms_floor: float = 1e-2
    min_numel: int = 2
    ignore: tuple[str, ...] = ()
    max_abs_parameter: float | None = DEFAULT_MAX_ABS_PARAMETER  # safepoint.rules.magnitude; 0: off


@dataclass(frozen=True)
class Baseline:
    """Stats of the previous verified checkpoint of the same run: `label` (e.g. "run/100"), rows by name,
    and the step counters it recorded (report.checks["counters"], for the torn rule)."""

    label: str
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    step: int | None = None
    counters: dict[str, Any] | None = None


@dataclass(frozen=True)
class Jump:
    key: str
    name: str
    file: str
    norm: float
    previous: float
    ratio: float  # >= 1: growth or shrink factor
    grew: bool

    def message(self, label: str, factor: float) -> str:
        how = "grew" if self.grew else "shrank"
        return (f"{self.name}: norm {how} x{self.ratio:.3g} since {label} ({self.previous:.6g} -> {self.norm:.6g}; "
                f"limit x{factor:g})")


def norm_jumps(current: Iterable[TensorStat], baseline: Baseline, thresholds: Thresholds,
               include: Callable[[TensorStat], bool] | None = None) -> tuple[list[Jump], int]:
    """(jumps over the threshold, number of tensors compared). Pure. `include` picks the tensors
    compared (the rules table's norm_jump column); None compares all."""
    factor = thresholds.norm_jump_factor
    if not factor or factor <= 1:
        return [], 0
    current = list(current)
    jumps: list[Jump] = []
    compared = 0
    for s, key in zip(current, stat_keys(current)):
        prev = baseline.stats.get(key)
        if prev is None or s.norm is None or prev.get("norm") is None or s.numel < thresholds.min_numel:
            continue
        if list(prev.get("shape") or []) != list(s.shape):
            continue
        if include is not None and not include(s):
            continue
        if any(fnmatch.fnmatchcase(key, pat) or fnmatch.fnmatchcase(s.name, pat) for pat in thresholds.ignore):
            continue
        if not math.isfinite(s.norm) or not math.isfinite(float(prev["norm"])):
            continue
        compared += 1
        ratio, grew = jump_ratio(s.norm, float(prev["norm"]), s.numel, thresholds)
        if ratio > factor:
            jumps.append(Jump(key, s.name, s.file, s.norm, float(prev["norm"]), ratio, grew))
    return jumps, compared


def jump_ratio(norm: float, previous: float, numel: int, thresholds: Thresholds) -> tuple[float, bool]:
    """(growth or shrink factor >= 1, grew). Growth is measured from at least the RMS floor (a tensor
    leaving zero is not diverging); shrinking is measured down to the absolute floor (a live tensor
    collapsing to zero is)."""
    small = max(thresholds.norm_floor, thresholds.rms_floor * math.sqrt(max(numel, 1)))
    if norm >= previous:
        return max(norm, thresholds.norm_floor) / max(previous, small), True
    if previous <= small:
        return 1.0, False
    return previous / max(norm, thresholds.norm_floor), False


def baseline_heads(baseline: Baseline | None) -> dict[str, str]:
    """The head digest of each tensor of the baseline, by stat key (what stat_of's full_digest asks about)."""
    if baseline is None:
        return {}
    return {key: row["head"] for key, row in baseline.stats.items() if row.get("head")}


def baseline_from_catalog(catalog: Any, run: str, step: int, parent: tuple[str, int] | None = None,
                          ) -> Baseline | None:
    """The stats of the checkpoint this one follows (its latest validation): the declared lineage
    `parent` (run, step) where it is verified (a resume or a fork continues from there, not from the
    newest earlier step), else the newest verified checkpoint of `run` before `step`."""

    prev = None
    if parent is not None:
        declared = catalog.get(*parent)
        if declared is not None and declared.state is CheckpointState.VERIFIED:
            prev = declared
    if prev is None:
        earlier = [c for c in catalog.list_checkpoints(run, states=[CheckpointState.VERIFIED]) if c.step < step]
        if not earlier:
            return None
        prev = max(earlier, key=lambda c: c.step)
    validation = catalog.latest_validation(prev.id)
    if validation is None or not validation.ok:
        return None
    rows = catalog.tensor_stats(validation.id)
    counters = (validation.report.get("checks") or {}).get("counters")
    return Baseline(label=f"{prev.run}/{prev.step}", stats={r["name"]: r for r in rows}, step=prev.step,
                    counters=counters)
