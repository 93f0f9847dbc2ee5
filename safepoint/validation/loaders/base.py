"""What every loader shares: limits, problem kinds, the load error, and the tensor walker."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

MiB = 1024 * 1024


class Problem(str, Enum):
    """Why a file or a tensor failed validation."""

    NAN = "nan"                  # a tensor holds NaN values
    INF = "inf"                  # a tensor holds +/-inf values
    UNLOADABLE = "unloadable"    # the loader failed (truncated, corrupt, unsupported)
    UNSAFE = "unsafe"            # loading would run code or escape the folder: refused
    OPAQUE = "opaque"            # a pickle the weights-only unpickler refuses (no code named): not loaded
    MALFORMED = "malformed"      # the bytes break the format (bad header, bad offsets, bad metadata)
    MISSING = "missing"          # a file the snapshot needs is absent
    # Strict dry-run load against the model factory (safepoint.harness):
    MISSING_KEY = "missing_key"        # the model expects a tensor the checkpoint lacks
    UNEXPECTED_KEY = "unexpected_key"  # the checkpoint has a model tensor the model does not know
    SHAPE = "shape"                    # a tensor's shape differs from the model's
    DTYPE = "dtype"                    # a tensor's dtype differs from the model's
    OPTIMIZER = "optimizer"            # optimizer state does not match the optimizer's parameter groups
    STEP = "step"                      # the step recorded inside the checkpoint is not the catalog's
    LOAD = "load"                      # the model's own load_state_dict (dry run on meta) refused it
    # Numerical audit against the previous verified checkpoint (safepoint.audit):
    NORM_JUMP = "norm_jump"            # a tensor's norm moved by more than the configured factor
    # Consistency with the previous verified checkpoint (safepoint.rules.consistency), named as its rules:
    STALE_OPTIMIZER = "stale_optimizer"  # every optimizer tensor byte-identical while the parameters moved
    STALE_WEIGHTS = "stale_weights"      # every parameter byte-identical while the optimizer state moved
    DUPLICATE = "duplicate"              # the whole state byte-identical to an earlier step
    TORN = "torn"                        # the optimizer's step counter disagrees with the trainer's or the catalog's
    # The validation sandbox (safepoint.sandbox):
    LIMIT = "limit"                    # validation ran past its memory, CPU or wall-clock limit

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Limits:
    """Bounds on what validation will read or allocate for one file (bounded memory)."""

    max_safetensors_header_bytes: int = 100 * MiB
    max_dcp_metadata_bytes: int = 512 * MiB
    max_dcp_metadata_objects: int = 4_000_000  # objects made and memo entries fetched while decoding .metadata
    max_dcp_bytes_entry: int = 64 * MiB       # a non-tensor DCP entry (e.g. param_groups)
    max_tensor_bytes: int | None = None       # refuse to materialize a bigger tensor (None: no limit)
    stats_chunk_elems: int = 1 << 20          # elements per piece when computing stats (fits in L2/L3)
    max_nesting: int = 200                    # depth of nested dicts/lists walked in a loaded object


class LoadError(Exception):
    """A file (or one tensor of it) could not be validated; `problem` says why, message is one line."""

    def __init__(self, problem: Problem, message: str, *, file: str | None = None, tensor: str | None = None):
        super().__init__(message)
        self.problem = problem
        self.message = message
        self.file = file
        self.tensor = tensor


# on_problem(LoadError) receives non-fatal problems (one tensor, one referenced file) and lets the
# loader continue; a fatal problem is raised instead.
OnProblem = Callable[[LoadError], None]


def raise_problem(err: LoadError) -> None:
    raise err


def one_line(exc: BaseException, limit: int = 300) -> str:
    """A short one-line description of an exception (no tracebacks, no paragraphs)."""
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    boiler = ("Weights only load failed", "Please file an issue", "Check the documentation", "In PyTorch 2.6")
    useful = [ln for ln in lines if not ln.startswith(boiler)]
    msg = (useful or lines or [""])[0]
    if msg.startswith("WeightsUnpickler error:"):
        msg = msg[len("WeightsUnpickler error:"):].strip() or (useful[1] if len(useful) > 1 else msg)
    msg = f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def join_name(prefix: str, key: Any) -> str:
    key = str(key)
    return f"{prefix}.{key}" if prefix else key


def iter_tensors(obj: Any, prefix: str = "", *, max_nesting: int = 200) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (dotted name, tensor) for every tensor in nested dicts, lists and tuples.

    `{"optimizer": {"state": {3: {"exp_avg_sq": t}}}}` yields `("optimizer.state.3.exp_avg_sq", t)`.
    Cycles are visited once; nesting deeper than `max_nesting` raises LoadError(MALFORMED).
    """
    seen: set[int] = set()

    def walk(o: Any, name: str, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(o, torch.Tensor):
            yield name, o
            return
        if isinstance(o, (dict, list, tuple)):
            if depth > max_nesting:
                raise LoadError(Problem.MALFORMED, f"{name or '<root>'}: nested deeper than {max_nesting} levels")
            if id(o) in seen:
                return
            seen.add(id(o))
            items = o.items() if isinstance(o, dict) else enumerate(o)
            for k, v in items:
                yield from walk(v, join_name(name, k), depth + 1)

    yield from walk(obj, prefix, 0)


def file_size(path: str | os.PathLike) -> int:
    return os.stat(path).st_size


# ------------------------------------------------------------------------------------ streamed tensors

class TensorSource:
    """A tensor known by dtype and shape first, whose data is read piece by piece when asked.

    `pieces(n)` yields flat, contiguous 1-D tensors of at most n elements that together cover every
    element once; a piece is only valid until the next one is requested (its memory may be reused
    or released), so peak memory is about one piece, not one tensor or one file.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def pieces(self, max_elems: int) -> Iterator[torch.Tensor]:
        raise NotImplementedError


class LoadedTensor(TensorSource):
    """A tensor already addressable in memory (possibly memory-mapped). `release(piece)` is called
    after each piece is consumed, e.g. to drop the file pages it mapped (safepoint.validation.loaders.mapped)."""

    def __init__(self, t: torch.Tensor, release: Callable[[torch.Tensor], None] | None = None) -> None:
        self.tensor = t.detach()
        self.dtype = t.dtype
        self.shape = tuple(int(d) for d in t.shape)
        self._release = release

    def pieces(self, max_elems: int) -> Iterator[torch.Tensor]:
        t = self.tensor
        if t.is_quantized:
            raise LoadError(Problem.UNLOADABLE, "quantized tensors cannot be audited: refused")
        if t.layout == torch.sparse_coo:
            t = t._values()  # stored values: NaN/Inf and max |x| are exact, the norm counts duplicates
        elif t.layout in _COMPRESSED:
            t = t.values()   # CSR/CSC/BSR/BSC: every stored value (blocks included)
        elif t.layout != torch.strided:
            raise LoadError(Problem.UNLOADABLE, f"{t.layout} tensors cannot be audited: refused")
        for piece in _flat_pieces(t, max(1, max_elems)):
            yield piece
            if self._release is not None:
                self._release(piece)


_COMPRESSED = frozenset({torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})


def _flat_pieces(t: torch.Tensor, max_elems: int) -> Iterator[torch.Tensor]:
    """Views of a contiguous tensor, or row-block copies of a strided one (one block at a time)."""
    if t.numel() == 0:
        return
    if t.dim() == 0:
        yield t.reshape(1)
        return
    if t.is_contiguous():
        flat = t.view(-1)
        for i in range(0, flat.numel(), max_elems):
            yield flat[i: i + max_elems]
        return
    row = max(1, t.numel() // t.shape[0])
    rows = max(1, max_elems // row)
    for i in range(0, t.shape[0], rows):
        yield from _flat_pieces(t[i: i + rows].contiguous(), max_elems)


def is_container_leaf(o: Any) -> bool:
    """A list/tuple of plain values is one leaf (like DCP's flattening: param_groups.0.params)."""
    return isinstance(o, (list, tuple)) and not any(isinstance(x, (dict, list, tuple, torch.Tensor)) for x in o)


def iter_leaves(obj: Any, prefix: str = "", *, max_nesting: int = 200) -> Iterator[tuple[str, Any]]:
    """Yield (dotted name, leaf) for every tensor and every plain value of nested dicts/lists/tuples.

    Names match DCP's flattened keys: `{"optimizer": {"param_groups": [{"params": [0, 1]}]}}` yields
    `("optimizer.param_groups.0.params", [0, 1])`. Cycles are visited once; nesting deeper than
    `max_nesting` raises LoadError(MALFORMED).
    """
    seen: set[int] = set()

    def walk(o: Any, name: str, depth: int) -> Iterator[tuple[str, Any]]:
        if isinstance(o, torch.Tensor):
            yield name, o
            return
        if isinstance(o, (dict, list, tuple)) and not (is_container_leaf(o) and name):
            if depth > max_nesting:
                raise LoadError(Problem.MALFORMED, f"{name or '<root>'}: nested deeper than {max_nesting} levels")
            if id(o) in seen:
                return
            seen.add(id(o))
            items = o.items() if isinstance(o, dict) else enumerate(o)
            for k, v in items:
                yield from walk(v, join_name(name, k), depth + 1)
            return
        yield name, o

    yield from walk(obj, prefix, 0)
