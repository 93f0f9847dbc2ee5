"""What every loader shares: limits, problem kinds, the load error, and the tensor walker."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from safepoint.validation.problems import (  # noqa: F401 - the loaders' shared names, re-exported
    Limits,
    LoadError,
    MiB,
    OnProblem,
    Problem,
    one_line,
    raise_problem,
)


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
