"""Numerical audit of every tensor: NaN/Inf counts, L2 norm and max |x|, and norm jumps between checkpoints.

Stats are computed piece by piece from a TensorSource (safepoint.validation.loaders), so a tensor is never
materialized whole. The fast path per piece is two reductions that torch runs multithreaded and
without temporaries: `aminmax` (finite min and max imply no NaN/Inf, and give max |x|) and
`vector_norm` (float32 accumulation, float64 only for a piece whose squares overflow). Only a piece
that holds NaN/Inf pays for masks and counts. 16-bit floats are reduced natively with a float32
accumulator; nothing is upcast to float64 wholesale.

The comparison with the previous verified checkpoint of the run (`norm_jumps`) is a pure function
of two lists of stats and the thresholds (`Thresholds`, from `[validation]` in config.toml).
"""

from __future__ import annotations

import fnmatch
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import blake3
import torch

from safepoint.core.states import CheckpointState
from safepoint.validation.loaders.base import Limits, LoadedTensor, LoadError, Problem, TensorSource

__all__ = [
    "Baseline", "Jump", "TensorStat", "Thresholds", "baseline_from_catalog", "baseline_heads", "norm_jumps",
    "stat_keys", "stat_of", "stat_rows", "tensor_stat",
]

HEAD_BYTES = 64 * 1024  # the head digest: where a trained tensor moves, its head moves too; ~1% of the audit's cost
DIGEST_HEX = 32  # 128 bits of BLAKE3: collision-safe for comparing two steps, compact at 10^5 tensors
_NATIVE = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
_HALF = frozenset({torch.float16, torch.bfloat16})


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


class _Acc:
    """Running sum of squares (float64), max |x|, NaN and Inf counts over pieces."""

    def __init__(self) -> None:
        self.sumsq, self.max_abs, self.nans, self.infs = 0.0, 0.0, 0, 0

    def add(self, c: torch.Tensor) -> None:
        if c.is_complex():
            c = torch.view_as_real(c).reshape(-1)  # real and imaginary parts, counted apart
        if c.dtype == torch.bool:
            n = int(c.sum())
            self.sumsq += n
            self.max_abs = max(self.max_abs, 1.0 if n else 0.0)
            return
        if not c.is_floating_point():
            x = c.to(torch.float64)
            self.sumsq += float(torch.linalg.vector_norm(x)) ** 2
            self.max_abs = max(self.max_abs, float(x.abs().max()))
            return
        if c.dtype not in _NATIVE:  # float8 and friends: upcast this piece only
            c = c.to(torch.float32)
        lo, hi = (float(x) for x in torch.aminmax(c))
        if math.isfinite(lo) and math.isfinite(hi):
            self.max_abs = max(self.max_abs, -lo, hi)
            n = float(torch.linalg.vector_norm(c, dtype=torch.float32 if c.dtype in _HALF else None))
            if not math.isfinite(n):  # squares overflowed the accumulator: redo this piece in float64
                n = float(torch.linalg.vector_norm(c, dtype=torch.float64))
            self.sumsq += n * n
            return
        finite = torch.isfinite(c)
        nans = int(torch.isnan(c).sum())
        self.nans += nans
        self.infs += c.numel() - int(finite.sum()) - nans
        c = c.masked_fill(~finite, 0.0)
        self.max_abs = max(self.max_abs, float(c.abs().max()))
        self.sumsq += float(torch.linalg.vector_norm(c, dtype=torch.float64)) ** 2


def _dtype_name(src: TensorSource) -> str:
    name = getattr(src, "dtype_name", None)
    return name or str(src.dtype).removeprefix("torch.")


def _readable(src: TensorSource) -> bool:
    # Only safetensors' sub-byte floats (F4, F6) have no torch dtype; they have no NaN/Inf encoding.
    # Every layout is read by pieces() or refused there (LoadError): never skipped as clean.
    return src.dtype is not None


def stat_of(name: str, src: TensorSource, *, file: str = "", chunk_elems: int = Limits.stats_chunk_elems,
            full_digest: Callable[[str], bool] | None = None) -> TensorStat:
    """Stats of a tensor, read piece by piece. A LoadError while reading propagates (it is a finding);
    a dtype or layout the stats cannot handle gives norm/max_abs None.

    The head digest covers the first HEAD_BYTES; `full_digest(head)` says, once the head is known,
    whether to hash the rest too (None: always). Validation asks for it only where the previous
    checkpoint holds the same head, the one case where byte identity is in question: a tensor whose
    head moved has moved, and hashing it whole would double the cost of the audit.
    """
    shape = tuple(int(d) for d in src.shape)
    numel = math.prod(shape)
    base = dict(name=name, file=file, dtype=_dtype_name(src), shape=shape, numel=numel)
    if not _readable(src):
        return TensorStat(**base, norm=None, max_abs=None, nan_count=0, inf_count=0)
    acc, usable, value, digest = _Acc(), True, None, _Digest(full_digest)
    for piece in src.pieces(max(1, chunk_elems)):
        if digest.wants_bytes:  # once the head is known and the rest is not asked for, no view is made
            digest.update(_bytes_of(piece))
        if numel == 1 and not piece.is_complex():
            try:
                value = float(piece[0])
            except (RuntimeError, TypeError, ValueError):
                value = None
        if usable:
            try:
                acc.add(piece)
            except (RuntimeError, TypeError, NotImplementedError):
                usable = False  # keep reading: a bad chunk further on is still a finding
        del piece
    head, full = digest.result()
    if not usable:
        if src.dtype.is_floating_point or src.dtype.is_complex:  # could hold NaN/Inf: fail closed
            raise LoadError(Problem.UNLOADABLE, f"{name}: the audit cannot read {base['dtype']} values: refused")
        return TensorStat(**base, norm=None, max_abs=None, nan_count=0, inf_count=0, value=value, head=head,
                          digest=full)
    return TensorStat(**base, norm=math.sqrt(acc.sumsq), max_abs=acc.max_abs, nan_count=acc.nans,
                      inf_count=acc.infs, value=value, head=head, digest=full)


class _Digest:
    """BLAKE3 of a tensor's first HEAD_BYTES (always) and of all its bytes (when asked, once the head is known).

    The head's bytes are kept (at most HEAD_BYTES) until the decision, so pieces of any size work."""

    def __init__(self, full_digest: Callable[[str], bool] | None) -> None:
        self.policy = full_digest
        self.head_bytes = bytearray()
        self.head: str | None = None
        self.full: blake3.blake3 | None = None

    @property
    def wants_bytes(self) -> bool:
        return self.head is None or self.full is not None

    def update(self, data: memoryview) -> None:
        if self.head is None:
            take = HEAD_BYTES - len(self.head_bytes)
            if not self.head_bytes and len(data) >= HEAD_BYTES:  # the usual case: one piece holds the head
                self._decide(data[:HEAD_BYTES])
            else:
                self.head_bytes += data[:take]
                if len(self.head_bytes) < HEAD_BYTES:
                    return
                self._decide(self.head_bytes)
            data = data[take:]
        if self.full is not None and len(data):
            self.full.update(data)

    def _decide(self, head: memoryview | bytearray) -> None:
        self.head = blake3.blake3(head).hexdigest(DIGEST_HEX // 2)
        if self.policy is None or self.policy(self.head):
            # One thread: this runs in the sandbox child, forked from a caller whose blake3 (rayon) pool
            # may already exist; its threads are not in the child, and a job sent to them never returns.
            self.full = blake3.blake3()
            self.full.update(head)
        self.head_bytes = bytearray()

    def result(self) -> tuple[str, str | None]:
        if self.head is None:  # the whole tensor fits in the head: its digest is the head's
            self.head = blake3.blake3(self.head_bytes).hexdigest(DIGEST_HEX // 2)
            return self.head, self.head
        return self.head, self.full.hexdigest(DIGEST_HEX // 2) if self.full is not None else None


def _bytes_of(piece: torch.Tensor) -> memoryview:
    """The raw bytes of a flat contiguous piece, without a copy (any dtype: viewed as bytes)."""
    return memoryview(piece.contiguous().view(torch.uint8).numpy()).cast("B")


def tensor_stat(name: str, t: torch.Tensor, *, file: str = "", chunk_elems: int = Limits.stats_chunk_elems,
                ) -> TensorStat:
    """Stats of an in-memory tensor (same computation as stat_of)."""
    try:
        return stat_of(name, LoadedTensor(t), file=file, chunk_elems=chunk_elems)
    except Exception:
        shape = tuple(int(d) for d in t.shape)
        return TensorStat(name=name, file=file, dtype=str(t.dtype).removeprefix("torch."), shape=shape,
                          numel=math.prod(shape), norm=None, max_abs=None, nan_count=0, inf_count=0)


# ------------------------------------------------------------------------------------ naming in the catalog

def stat_keys(stats: Iterable[TensorStat]) -> list[str]:
    """The name each stat is stored and compared under: the tensor name, or `file:name` when the same
    tensor name appears in several files of the snapshot (e.g. one file per tensor-parallel rank)."""
    stats = list(stats)
    counts = Counter(s.name for s in stats)
    return [s.name if counts[s.name] == 1 else f"{s.file}:{s.name}" for s in stats]


def stat_rows(stats: Iterable[TensorStat]) -> list[dict[str, Any]]:
    """Rows for catalog.record_validation (names from stat_keys)."""
    stats = list(stats)
    return [{**s.to_dict(), "name": key} for s, key in zip(stats, stat_keys(stats))]


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
