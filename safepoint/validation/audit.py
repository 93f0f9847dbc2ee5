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

import math
from collections.abc import Callable

import blake3
import torch

from safepoint.validation.loaders.base import Limits, LoadedTensor, LoadError, Problem, TensorSource
from safepoint.validation.stats import (  # noqa: F401 - re-exported: the audit's results and rules
    DIGEST_HEX,
    HEAD_BYTES,
    Baseline,
    Jump,
    TensorStat,
    Thresholds,
    baseline_from_catalog,
    baseline_heads,
    jump_ratio,
    norm_jumps,
    stat_keys,
    stat_rows,
)

__all__ = [
    "Baseline", "Jump", "TensorStat", "Thresholds", "baseline_from_catalog", "baseline_heads", "norm_jumps",
    "stat_keys", "stat_of", "stat_rows", "tensor_stat",
]

_NATIVE = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
_HALF = frozenset({torch.float16, torch.bfloat16})


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
