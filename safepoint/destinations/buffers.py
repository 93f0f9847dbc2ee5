"""A bounded pool of reusable part buffers: the memory bound of S3 transfers.

Every part being read, hashed, sent or read back holds one buffer, so a destination never holds
more than `count * size` bytes of file data, whatever the file sizes. Buffers are allocated on
first use and then reused: a fresh 32 MiB allocation per part costs page faults and zeroing that
show up as real CPU on a small machine.

Deadlock rule for callers: block in `acquire()` only while holding no buffer of this pool; a
caller that already holds some uses `try_acquire()` and consumes what it holds when that fails.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from safepoint.local.durable_write import aligned_buffer


class BufferPool:
    def __init__(self, count: int, size: int, *, aligned: bool = False):
        if count < 1 or size < 1:
            raise ValueError("a buffer pool needs count >= 1 and size >= 1")
        self.count = count
        self.size = size
        # Page-aligned buffers (anonymous mmaps) can be written with O_DIRECT (safepoint.local.durable_write).
        self._new: Callable[[int], bytearray] = aligned_buffer if aligned else bytearray  # type: ignore[assignment]
        self._free: list[bytearray] = []
        self._allocated = 0
        self._in_use = 0
        self.high_water = 0  # most buffers ever in use at once (tests check the bound)
        self._cond = threading.Condition()

    def _take(self, size: int) -> bytearray | None:
        if size > self.size:
            # An oversized part (a file so large that S3's 10,000-part limit forces bigger parts):
            # it takes a slot like any buffer, and is freed, not pooled, when released.
            if self._in_use >= self.count:
                return None
            if len(self._free) + self._in_use >= self.count and self._free:
                self._free.pop()
                self._allocated -= 1
            buf = self._new(size)
            self._allocated += 1
        elif self._free:
            buf = self._free.pop()
        elif self._allocated < self.count:
            buf = self._new(self.size)
            self._allocated += 1
        else:
            return None
        self._in_use += 1
        self.high_water = max(self.high_water, self._in_use)
        return buf

    def acquire(self, size: int = 0) -> bytearray:
        """A buffer of at least `size` bytes (default: the pool's size); waits for a free slot."""
        with self._cond:
            while (buf := self._take(size)) is None:
                self._cond.wait()
            return buf

    def try_acquire(self, size: int = 0) -> bytearray | None:
        with self._cond:
            return self._take(size)

    def release(self, buf: bytearray) -> None:
        with self._cond:
            self._in_use -= 1
            if len(buf) == self.size:
                self._free.append(buf)
            else:
                self._allocated -= 1
            self._cond.notify_all()

    def drain(self) -> None:
        """Free the idle buffers (the memory comes back; the pool refills on demand)."""
        with self._cond:
            self._allocated -= len(self._free)
            self._free.clear()

    @property
    def in_use(self) -> int:
        return self._in_use
