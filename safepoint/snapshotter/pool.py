"""A pool of reusable host staging buffers with a hard byte budget.

Pinned (page-locked) when CUDA is available, so device-to-host copies run at full PCIe speed and
asynchronously; plain, pre-faulted host memory otherwise. The pool never holds more than
`budget_bytes`: when every buffer is in use, `acquire` blocks until the writer returns one
(backpressure). It records its high-water marks so tests and benchmarks can check the budget.

Buffers are powers of two, so the caching host allocator does not round them up (the budget is
exact) and tensors split across buffers split on element boundaries (see layout.py): `buffer_bytes`
buffers, then smaller powers of two for the rest of the budget, so a state of exactly
`budget_bytes` fits (to within 16 bytes) and a budget of "the state size" means what it says.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from safepoint.snapshotter.errors import MemoryFloorError
from safepoint.snapshotter.memory import MemoryGuard

MiB = 1024 * 1024
MIN_BUFFER = 4096
TAIL_MIN = 16  # the smallest tail piece: keeps every buffer boundary 16-byte aligned (the largest element)
DEFAULT_MAX_BUFFER = 64 * MiB


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def plan_sizes(budget_bytes: int, buffer_bytes: int) -> list[int]:
    """Buffer sizes covering the budget: full buffers, then the remainder as powers of two >= 16 bytes (pure)."""
    sizes = [buffer_bytes] * (budget_bytes // buffer_bytes)
    rest = budget_bytes % buffer_bytes
    while rest >= TAIL_MIN:
        sizes.append(_pow2_floor(rest))
        rest -= sizes[-1]
    return sizes


def choose_buffer_bytes(budget_bytes: int, requested: int | None = None) -> int:
    """Buffer size: the requested power of two, or about budget/8 clamped to [1 MiB, 64 MiB] (pure)."""
    if budget_bytes < MIN_BUFFER:
        raise ValueError(f"budget_bytes must be at least {MIN_BUFFER}")
    if requested is not None:
        if requested < MIN_BUFFER or requested & (requested - 1) or requested > budget_bytes:
            raise ValueError(f"buffer_bytes must be a power of two in [{MIN_BUFFER}, budget_bytes]")
        return requested
    return min(_pow2_floor(budget_bytes), max(MiB, min(DEFAULT_MAX_BUFFER, _pow2_floor(max(1, budget_bytes // 8)))))


class Buffer:
    """One staging buffer: a flat uint8 host tensor and a zero-copy memoryview of it."""

    __slots__ = ("tensor", "nbytes", "index", "_mv")

    def __init__(self, tensor: torch.Tensor, index: int) -> None:
        self.tensor = tensor
        self.nbytes = tensor.numel()
        self.index = index
        self._mv = memoryview(tensor.numpy()).cast("B")

    def view(self, nbytes: int) -> memoryview:
        return self._mv[:nbytes]


class BufferPool:
    """Reusable staging buffers, `budget_bytes` at most, allocated up front or on demand."""

    def __init__(
        self, budget_bytes: int, buffer_bytes: int | None = None, *, pin: bool | None = None,
        preallocate: bool = True, guard: MemoryGuard | None = None, floor_timeout_s: float = 60.0,
    ) -> None:
        self.budget_bytes = int(budget_bytes)
        self.buffer_bytes = choose_buffer_bytes(self.budget_bytes, buffer_bytes)
        self.sizes = plan_sizes(self.budget_bytes, self.buffer_bytes)  # every buffer the pool may hold
        self.capacity_bytes = sum(self.sizes)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.guard = guard
        self.floor_timeout_s = floor_timeout_s
        self._cond = threading.Condition()
        self._free: list[Buffer] = []
        self._allocated = 0      # buffers allocated (or being allocated): the first ones of self.sizes
        self._allocated_bytes = 0
        self._in_use_bytes = 0
        self.high_water_in_use = 0       # bytes
        self.high_water_allocated = 0    # bytes
        self.wait_s = 0.0                # time acquire() spent waiting for a buffer, cumulative
        self.acquired = 0                # buffers handed out, cumulative (more than the pool holds: reuse)
        self.guard_wait_s = 0.0          # of which, waiting because the memory floor refused growth
        self._closed = False
        if preallocate:
            want = self.capacity_bytes
            if guard is not None and not guard.allows(want):
                raise MemoryFloorError(f"refusing to allocate the {want / 2**30:.2f} GiB staging pool: "
                                       f"{guard.last_refusal.message() if guard.last_refusal else ''}; "
                                       "lower budget_bytes or the memory floor")
            self._allocated, self._allocated_bytes = len(self.sizes), want
            self._free = [self._new_buffer(i) for i in range(len(self.sizes))]
            self.high_water_allocated = want

    # -- accounting ---------------------------------------------------------------------------

    @property
    def allocated_bytes(self) -> int:
        return self._allocated_bytes

    @property
    def in_use_bytes(self) -> int:
        return self._in_use_bytes

    def available_bytes(self) -> int:
        """Bytes acquire() could hand out now without waiting for the writer (free or still allocatable)."""
        with self._cond:
            return sum(b.nbytes for b in self._free) + self.capacity_bytes - self._allocated_bytes

    def _new_buffer(self, index: int) -> Buffer:
        t = torch.empty(self.sizes[index], dtype=torch.uint8, pin_memory=self.pin)
        if not self.pin:
            t.fill_(0)  # fault the pages in now, not during the first save's copy
        return Buffer(t, index)

    # -- acquire / release --------------------------------------------------------------------

    def acquire(self, check: Callable[[], None] | None = None) -> Buffer:
        """A free buffer; blocks while all are in use. `check()` runs while waiting and may raise."""
        t0 = time.perf_counter()
        guard_since: float | None = None
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the staging pool is closed")
                if self._free:  # the largest first: small tail buffers end a save
                    i = max(range(len(self._free)), key=lambda j: self._free[j].nbytes)
                    buf = self._free.pop(i)
                    break
                if self._allocated < len(self.sizes):
                    size = self.sizes[self._allocated]
                    if self.guard is None or self.guard.allows(size):
                        index = self._allocated
                        self._allocated += 1
                        self._allocated_bytes += size
                        self._cond.release()
                        try:
                            buf = self._new_buffer(index)
                        except BaseException:
                            self._cond.acquire()
                            self._allocated -= 1
                            self._allocated_bytes -= size
                            raise
                        self._cond.acquire()
                        self.high_water_allocated = max(self.high_water_allocated, self.allocated_bytes)
                        break
                    # The floor refuses growth: wait for the writer to return a buffer, or for memory.
                    now = time.perf_counter()
                    guard_since = guard_since or now
                    if self._in_use_bytes == 0 and now - guard_since > self.floor_timeout_s:
                        why = self.guard.last_refusal.message() if self.guard.last_refusal else ""
                        raise MemoryFloorError(f"staging delayed {now - guard_since:.1f} s by the memory floor "
                                               f"and no memory came back: {why}")
                self._cond.wait(0.05)
                if check is not None:
                    self._cond.release()
                    try:
                        check()
                    finally:
                        self._cond.acquire()
            self._in_use_bytes += buf.nbytes
            self.acquired += 1
            self.high_water_in_use = max(self.high_water_in_use, self._in_use_bytes)
            waited = time.perf_counter() - t0
            self.wait_s += waited
            if guard_since is not None:
                self.guard_wait_s += time.perf_counter() - guard_since
            return buf

    def release(self, buf: Buffer) -> None:
        with self._cond:
            self._in_use_bytes -= buf.nbytes
            if not self._closed:
                self._free.append(buf)
            self._cond.notify()

    def close(self) -> None:
        """Drop the buffers (in use ones are dropped when released) and give pinned memory back."""
        with self._cond:
            self._closed = True
            self._free.clear()
            self._cond.notify_all()
        if self.pin:
            empty = getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()
