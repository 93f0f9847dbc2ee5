"""Release the pages of a memory-mapped checkpoint once they have been read (bounded RSS).

`torch.load(path, mmap=True)` maps the whole file (MAP_PRIVATE) and tensors are zero-copy views of
it: reading is as fast as it gets, but every page read stays resident *in this process* (RSS) until
the mapping goes away, so validating a 40 GiB file would show 40 GiB of RSS. After a piece of a
tensor has been read, `MappedFile.release(piece)` calls `madvise(MADV_DONTNEED)` on its pages: the
process drops them (the page cache keeps them, nothing is written), and touching them again simply
faults them back in from the file.

MADV_DONTNEED on *anonymous* memory would zero it, so a range is released only when it lies inside
a mapping of this very file (same device and inode in /proc/self/maps). Elsewhere (not Linux, no
/proc) release is a no-op: validation stays correct, only RSS is not bounded.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Iterable
from typing import Any

import torch

MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_libc: ctypes.CDLL | None = None


def _madvise() -> Any:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        except OSError:
            return None
    fn = getattr(_libc, "madvise", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


def file_mappings(path: str | os.PathLike, maps: Iterable[str] | None = None) -> list[tuple[int, int]]:
    """[start, end) address ranges where this process maps `path` (matched by device and inode)."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read().splitlines()
        except OSError:
            return []
    ranges = []
    for line in maps:
        parts = line.split(maxsplit=5)
        if len(parts) < 5 or parts[4] != str(st.st_ino):
            continue
        major, _, minor = parts[3].partition(":")
        if f"{int(major, 16):02x}:{int(minor, 16):02x}" != dev:
            continue
        start, _, end = parts[0].partition("-")
        ranges.append((int(start, 16), int(end, 16)))
    return sorted(ranges)


class MappedFile:
    """The mappings of one file in this process; `release(t)` drops the pages under tensor `t`."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        self.ranges = ranges
        self._madvise = _madvise() if ranges else None
        self.released_bytes = 0

    @classmethod
    def of(cls, path: str | os.PathLike) -> MappedFile:
        return cls(file_mappings(path))

    def release(self, t: torch.Tensor) -> None:
        if self._madvise is None or t.numel() == 0:
            return
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        # Whole pages only, inside one mapping of this file; a page shared with the next tensor is
        # dropped too, which costs at most one refault.
        lo, hi = start - start % _PAGE, -(-end // _PAGE) * _PAGE
        for a, b in self.ranges:
            if a <= start and end <= b:
                lo, hi = max(lo, a), min(hi, b)
                if self._madvise(lo, hi - lo, MADV_DONTNEED) == 0:
                    self.released_bytes += hi - lo
                return


__all__ = ["MappedFile", "file_mappings"]
