"""file:// destinations (local disks, NFS, Lustre, GPFS): temp file, fsync, rename."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from safepoint.commit import fsync_path
from safepoint.destinations.fsspec_dest import FsspecDestination
from safepoint.durable_write import FileWriter, aligned_buffer
from safepoint.errors import DestinationError
from safepoint.format import TMP_PREFIX, FileEntry
from safepoint.hashing import CHUNK, hash_path, new_hasher


class LocalDestination(FsspecDestination):
    """POSIX semantics let us make each file and the marker atomic and durable."""

    def _local(self, run: str, step: int, relpath: str) -> Path:
        return Path(self._path(run, step, relpath))

    def size(self, run: str, step: int, relpath: str) -> int | None:
        """A plain lstat (fsspec's info() costs more than the syscall); a symlink counts as absent."""
        try:
            st = os.stat(self._local(run, step, relpath), follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def digest(self, run: str, step: int, relpath: str) -> str:
        return hash_path(self._local(run, step, relpath))[1]

    def fetch(self, run: str, step: int, relpath: str, target: Path,
              on_bytes: Callable[[int], None] | None = None) -> str:
        return copy_and_hash(self._local(run, step, relpath), target, on_bytes)

    def upload(self, run: str, step: int, entry: FileEntry, source: Path) -> str:
        dst = self._local(run, step, entry.path)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f"{TMP_PREFIX}{dst.name}.{os.getpid()}")
        h = new_hasher(entry.size)
        # Sized to the file: a fresh 8 MiB buffer per tiny file cost ~1 ms of zeroing each.
        buf = bytearray(min(CHUNK, entry.size + 1))
        view = memoryview(buf)
        try:
            with open(source, "rb", buffering=0) as src, open(tmp, "wb", buffering=0) as out:
                while True:
                    n = src.readinto(buf)
                    if not n:
                        break
                    h.update(view[:n])
                    rest = view[:n]
                    while rest:  # a raw write may be short (a disk filling up): the rest raises ENOSPC
                        rest = rest[out.write(rest):]
                os.fsync(out.fileno())
            os.replace(tmp, dst)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return h.hexdigest()

    def write_control(self, run: str, step: int, name: str, data: bytes, *, exclusive: bool = False) -> bool:
        dst = self._local(run, step, name)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f"{TMP_PREFIX}{dst.name}.{os.getpid()}")  # name may be a sub-path
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            for d in {p for p in dst.parent.rglob("*") if p.is_dir()} | {dst.parent}:
                fsync_path(d, directory=True)
            if exclusive:
                try:
                    os.link(tmp, dst)  # atomic: fails if the marker exists
                except FileExistsError:
                    return False
                finally:
                    tmp.unlink(missing_ok=True)
            else:
                os.replace(tmp, dst)
            try:
                fsync_path(dst.parent, directory=True)
            except OSError:
                # Its durability is unknown after a failed fsync: it must not stand (a marker
                # left here would commit a replica the caller reports as failed).
                dst.unlink(missing_ok=True)
                raise
        finally:
            tmp.unlink(missing_ok=True)
        return True


def copy_and_hash(source: Path, target: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """Copy a local file, hashing each byte once as it goes, and fsync it; returns the BLAKE3 of what was read.

    Written through safepoint.durable_write (direct I/O from a page-aligned buffer where the disk
    allows). A read failure other than a missing file is the source's (DestinationError); a write
    failure is the target disk's (OSError), so a caller can tell a bad source from a full disk.
    """
    h = new_hasher(0)
    buf = aligned_buffer(CHUNK)
    view = memoryview(buf)
    done = 0
    try:
        src = open(source, "rb", buffering=0)  # noqa: SIM115 - closed below
    except FileNotFoundError:
        raise
    except OSError as e:
        raise DestinationError(f"{source}: {e.strerror}") from e
    with src, FileWriter(target) as out:
        while True:
            try:
                n = src.readinto(view)
            except OSError as e:
                raise DestinationError(f"{source}: {e.strerror}") from e
            if not n:
                break
            h.update(view[:n])
            out.write_at(done, view[:n])
            done += n
            if on_bytes is not None:
                on_bytes(n)
        out.sync()
    return h.hexdigest()
