"""Do a DCP tensor's chunks tile it exactly: every element stored once, none outside the tensor? (pure)

Summing chunk volumes is not enough: one chunk listed twice "covers" a tensor whose other half is
stored nowhere. Here every chunk must lie inside the tensor, no two chunks may share an element,
and the volumes must add up to the tensor's; together these mean no gap either.

Overlap is found with a sweep along the dimension that has the most distinct chunk offsets (row
or column sharding: one chunk active at a time, so O(n log n)); only chunks whose intervals meet
on that dimension are compared on the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Box = tuple[Sequence[int], Sequence[int]]   # (offsets, sizes)


def _empty(sizes: Sequence[int]) -> bool:
    return any(s == 0 for s in sizes)


def _overlap(a: Box, b: Box) -> bool:
    return all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1]))


def tiling_problem(shape: Sequence[int], chunks: Sequence[Box]) -> str | None:
    """Why `chunks` do not tile a tensor of `shape` exactly, or None when they do."""
    rank = len(shape)
    total = 0
    boxes: list[Box] = []
    for offs, sizes in chunks:
        if len(offs) != rank or len(sizes) != rank:
            return "chunk rank does not match the tensor's"
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offs, sizes, shape)):
            return f"chunk at {list(offs)} of size {list(sizes)} is outside {list(shape)}"
        if not _empty(sizes):
            boxes.append((tuple(offs), tuple(sizes)))
            total += math.prod(sizes)
    if rank == 0:  # a scalar: exactly one chunk holds it
        return None if len(chunks) == 1 else f"{len(chunks)} chunks for a scalar"
    want = math.prod(shape)
    if total > want:
        return f"chunks overlap: they hold {total} elements of {want}"
    axis = max(range(rank), key=lambda d: len({b[0][d] for b in boxes})) if boxes else 0
    boxes.sort(key=lambda b: b[0][axis])
    active: list[Box] = []
    for box in boxes:
        start = box[0][axis]
        active = [a for a in active if a[0][axis] + a[1][axis] > start]
        for other in active:
            if _overlap(box, other):
                return f"chunks at {list(other[0])} and {list(box[0])} overlap"
        active.append(box)
    if total != want:
        return f"chunks cover {total} of {want} elements"
    return None


__all__ = ["tiling_problem"]
