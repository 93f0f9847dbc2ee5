"""Writing a restored file fast and durably: direct I/O where the disk allows it, early writeback otherwise.

A restore must fsync what it wrote before it commits. Through the page cache, every byte is copied
once more (buffer to cache), and the fsync at the end waits for the whole file to reach the disk
after the last byte arrived: on this project's machines that was about half the time of a 1 GiB
restore. With O_DIRECT, an aligned buffer goes from our memory to the disk in one step, while the
network fills the next buffer, and the final fsync has only metadata left (measured: 1 GiB written
and fsynced in 0.7 s against 1.9-3.4 s through the cache, on a loaded 2-core machine).

`FileWriter.write_at` sends each aligned chunk (offset, length and buffer address multiples of
4 KiB: the buffers come from `aligned_buffer`) through an O_DIRECT descriptor, and anything else
(the tail of a file, a disk that refuses O_DIRECT such as tmpfs) through an ordinary one, whose
writeback is started at once (Linux sync_file_range) so that its fsync has little left to do.
`sync()` fsyncs both. Durability comes from `sync()`, never from O_DIRECT alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
from pathlib import Path

ALIGN = 4096
SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range():  # noqa: ANN202 - a ctypes function or None
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_start_writeback = _sync_file_range()


def aligned_buffer(size: int) -> mmap.mmap:
    """A page-aligned, writable buffer of private anonymous memory, usable with O_DIRECT.

    Private, not `mmap.mmap(-1, size)`'s shared mapping: shared anonymous memory lives in shmem,
    whose page faults and unmapping cost more (measured: unmapping 256 MiB of touched buffers took
    0.07-0.09 s shared, 0.02 s private; a restore does it once per source, at its end).
    """
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    return mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)


class FileWriter:
    """Positional writes to a new file (truncated), direct where possible; use as a context manager."""

    def __init__(self, path: str | os.PathLike[str], *, direct: bool = True):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.direct_fd: int | None = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError:  # tmpfs and some network filesystems refuse O_DIRECT
                self.direct_fd = None
        self._direct_ok = self.direct_fd is not None

    def write_at(self, offset: int, view: memoryview) -> None:
        n = len(view)
        if self._direct_ok and offset % ALIGN == 0 and n % ALIGN == 0 and _address(view) % ALIGN == 0:
            assert self.direct_fd is not None
            try:
                _pwrite_all(self.direct_fd, view, offset)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:  # this disk wants another alignment; anything else is real
                    raise
                self._direct_ok = False  # other threads may be writing: the descriptor stays open
        _pwrite_all(self.fd, view, offset)
        if _start_writeback is not None and n:
            _start_writeback(self.fd, offset, n, SYNC_FILE_RANGE_WRITE)

    def sync(self) -> None:
        for fd in (self.direct_fd, self.fd):
            if fd is not None:
                os.fsync(fd)

    def close(self) -> None:
        for fd in (self.direct_fd, self.fd):
            if fd is not None:
                os.close(fd)
        self.direct_fd = None

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _address(view: memoryview) -> int:
    if view.readonly or not view.contiguous or not len(view):
        return 1  # not provably aligned: the ordinary path
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def direct_supported(folder: str | os.PathLike[str]) -> bool:
    """Whether files in `folder` can be opened with O_DIRECT (for tests and reports)."""
    probe = Path(folder) / ".safepoint-tmp-direct-probe"
    try:
        with FileWriter(probe) as w:
            return w._direct_ok
    finally:
        probe.unlink(missing_ok=True)
