"""Copy tensors into pool buffers, in file order, chunk by chunk: the only part of a save training waits for.

Each full buffer is handed to the writer at once (with the CUDA events of the copies into it), so
when the state is larger than the pool the writer drains buffers while later tensors are still
being copied, and staging blocks only while every buffer is in flight (backpressure). A tensor
larger than what is left of a buffer is split: flat element ranges for contiguous tensors, blocks
of rows (recursively) for strided ones, so no temporary copy of a whole tensor is ever made.

Device tensors are copied on a side stream per device that first waits for the current stream, so
the copy sees every kernel queued before save(); `stage()` returns only when all copies completed,
so the next optimizer step cannot race with them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from safepoint.snapshotter.pool import Buffer, BufferPool


@dataclass
class Chunk:
    """`nbytes` staged bytes at the start of `buffer`; they are ready once every event has completed."""

    buffer: Buffer
    nbytes: int
    events: list = field(default_factory=list)

    def wait_ready(self) -> None:
        for e in self.events:
            e.synchronize()


class Stager:
    """Stages tensors into a BufferPool. One save at a time (the Snapshotter serializes saves)."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def stage(self, tensors: Iterable[torch.Tensor], emit: Callable[[Chunk], None],
              check: Callable[[], None] | None = None) -> None:
        """Copy `tensors` back to back into buffers; `emit` each chunk; return once every copy is complete."""
        tensors = list(tensors)
        devices = sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)
        for d in devices:
            self._stream(d).wait_stream(torch.cuda.current_stream(d))
        cur: Buffer | None = None
        off = 0
        cur_devs: set[torch.device] = set()

        def room() -> int:
            nonlocal cur, off
            if cur is None:
                cur, off = self.pool.acquire(check), 0
            return cur.nbytes - off

        def flush() -> None:
            nonlocal cur
            assert cur is not None
            events = []
            for d in sorted(cur_devs, key=str):
                ev = torch.cuda.Event()
                ev.record(self._stream(d))
                events.append(ev)
            cur_devs.clear()
            buf, cur = cur, None
            emit(Chunk(buf, off, events))

        def copy(src: torch.Tensor, n: int) -> None:
            nonlocal off
            assert cur is not None
            if src.device.type == "cpu" and src.is_contiguous() and not (src.is_conj() or src.is_neg()):
                # A plain memcpy (GIL released): torch's multi-threaded copy_ degrades badly when the
                # cores are busy with other work, a single-threaded memcpy does not.
                ctypes.memmove(cur.tensor.data_ptr() + off, src.data_ptr(), n)
            else:
                dst = cur.tensor[off: off + n].view(src.dtype).view(src.shape)
                if src.device.type == "cuda":
                    with torch.cuda.stream(self._stream(src.device)):
                        dst.copy_(src, non_blocking=True)
                    cur_devs.add(src.device)
                else:
                    dst.copy_(src)
            off += n
            if off == cur.nbytes:
                flush()

        def put(t: torch.Tensor) -> None:
            item = t.element_size()
            n = t.numel() * item
            if n == 0:
                return
            if n <= room():
                copy(t, n)
                return
            if t.is_contiguous() or t.dim() <= 1:
                flat = t.view(-1) if t.is_contiguous() else t
                i, total = 0, flat.numel()
                while i < total:
                    k = min(total - i, room() // item)
                    copy(flat[i: i + k], k * item)
                    i += k
                return
            rows, row_bytes, i = t.shape[0], n // t.shape[0], 0
            while i < rows:
                k = min(rows - i, room() // row_bytes)
                if k >= 1:
                    copy(t[i: i + k], k * row_bytes)
                    i += k
                else:
                    put(t[i])  # one row is larger than what is left: split the row itself
                    i += 1

        try:
            with torch.no_grad():
                for t in tensors:
                    put(t)
                if cur is not None:
                    if off:
                        flush()
                    else:
                        self.pool.release(cur)
                        cur = None
        except BaseException:
            if cur is not None:
                for d in cur_devs:
                    self._stream(d).synchronize()
                self.pool.release(cur)
            raise
        for d in devices:
            self._stream(d).synchronize()
