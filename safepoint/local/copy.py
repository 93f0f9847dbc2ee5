"""Copying a local file durably while hashing it: the local half of every verified fetch.

Only a regular file is read (a FIFO, a device or a symlink in a local copy is refused at once,
without blocking), and never more than the size the caller expects: a file that grows while it is
copied is refused, not followed. Written through safepoint.local.durable_write (direct I/O from a
page-aligned buffer where the disk allows) and fsynced.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from safepoint.core.errors import DestinationError, FormatError
from safepoint.core.hashing import CHUNK, copy_hashed
from safepoint.local.durable_write import FileWriter, aligned_buffer

__all__ = ["copy_and_hash", "open_regular"]

_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def open_regular(source: str | os.PathLike[str]) -> tuple[int, int]:
    """(descriptor, size) of a regular file, opened without following a symlink and without blocking.

    FileNotFoundError when absent; FormatError when it is not a regular file (a FIFO would block
    a reader forever); DestinationError when it cannot be opened.
    """
    try:
        fd = os.open(source, _FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(str(source)) from None
    except OSError as e:
        if e.errno == getattr(os, "ELOOP", -1):
            raise FormatError(f"{source}: a symlink, not a regular file") from None
        raise DestinationError(f"{source}: {e.strerror}") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FormatError(f"{source}: not a regular file")
    return fd, st.st_size


def copy_and_hash(source: str | os.PathLike[str], target: Path, on_bytes: Callable[[int], None] | None = None,
                  *, size: int | None = None) -> str:
    """Copy the regular file `source` to `target`, hashing each byte once as it goes, and fsync it.

    Returns the BLAKE3 of what was read. `size`: the size the file must have (FormatError before a
    byte is copied when it has another; never more than `size` bytes are read). A read failure is
    the source's (DestinationError); a write failure is the target disk's (OSError), so a caller
    can tell a bad source from a full disk.
    """
    fd, found = open_regular(source)
    limit = found if size is None else size
    if found != limit:
        os.close(fd)
        raise FormatError(f"size {found}, the manifest says {limit}")
    with open(fd, "rb", buffering=0) as src, FileWriter(target) as out:
        def read(view: memoryview) -> int:
            try:
                return src.readinto(view)
            except OSError as e:
                raise DestinationError(f"{source}: {e.strerror}") from e

        digest = copy_hashed(read, out.write_at, memoryview(aligned_buffer(CHUNK)), limit=limit, on_bytes=on_bytes,
                             where=str(source))
        out.sync()
    return digest
