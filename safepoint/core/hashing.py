"""BLAKE3 over files and streams. Hash while data moves; never trust a store's ETag."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO

import blake3

from safepoint.core.errors import FormatError

CHUNK = 8 * 1024 * 1024
# blake3's own threads pay off only for large inputs.
_MT_THRESHOLD = 64 * 1024 * 1024


def new_hasher(size_hint: int = 0) -> blake3.blake3:
    if size_hint >= _MT_THRESHOLD:
        return blake3.blake3(max_threads=blake3.blake3.AUTO)
    return blake3.blake3()


def hash_path(path: str | os.PathLike) -> tuple[int, str]:
    """(size, hex digest) of a local file, memory-mapped and multi-threaded for big files."""
    size = os.path.getsize(path)
    h = new_hasher(size)
    if size:
        h.update_mmap(os.fspath(path))
    return size, h.hexdigest()


def read_chunks(f: BinaryIO, chunk: int = CHUNK) -> Iterator[bytes]:
    while True:
        b = f.read(chunk)
        if not b:
            return
        yield b


def hash_stream(chunks: Iterable[bytes], size_hint: int = 0) -> tuple[int, str]:
    h = new_hasher(size_hint)
    n = 0
    for b in chunks:
        h.update(b)
        n += len(b)
    return n, h.hexdigest()


def copy_hashed(readinto: Callable[[memoryview], int], write: Callable[[int, memoryview], object],
                buffer: memoryview, *, limit: int | None = None, size_hint: int = 0,
                on_bytes: Callable[[int], None] | None = None, where: str = "") -> str:
    """Move every byte `readinto` gives to `write(offset, chunk)` through `buffer`, hashing each
    once as it goes; the BLAKE3 of the bytes moved. Every copy of a file (upload, fetch) is this loop.

    With `limit`, at most `limit` bytes are accepted: each read asks for one byte past what is
    left, and a byte past it is FormatError (a file that grew while it was read is refused, not
    followed). Errors of `readinto` and `write` are the caller's to name (a store's, or a disk's).
    """
    h = new_hasher(size_hint)
    done = 0
    while True:
        want = buffer if limit is None else buffer[: min(len(buffer), limit - done + 1)]
        n = readinto(want)
        if not n:
            return h.hexdigest()
        if limit is not None and done + n > limit:
            raise FormatError(f"{where}: longer than {limit} bytes (it changed while being read)")
        chunk = buffer[:n]
        h.update(chunk)
        write(done, chunk)
        done += n
        if on_bytes is not None:
            on_bytes(n)


class HashingReader:
    """Wrap a binary file: every byte read through it is hashed, so one read feeds copy and hash."""

    def __init__(self, f: BinaryIO, size_hint: int = 0):
        self._f = f
        self._h = new_hasher(size_hint)
        self.bytes_read = 0

    def read(self, n: int = -1) -> bytes:
        b = self._f.read(n)
        self._h.update(b)
        self.bytes_read += len(b)
        return b

    def readinto(self, buf) -> int:  # noqa: ANN001 - buffer protocol
        n = self._f.readinto(buf)
        if n:
            self._h.update(memoryview(buf)[:n])
            self.bytes_read += n
        return n

    def hexdigest(self) -> str:
        return self._h.hexdigest()
