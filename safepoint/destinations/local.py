"""file:// destinations (local disks, NFS, Lustre, GPFS): temp file, fsync, rename."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from safepoint.core.errors import DestinationError
from safepoint.core.format import TMP_PREFIX, FileEntry, check_run, check_step
from safepoint.core.hashing import CHUNK, hash_path, new_hasher
from safepoint.destinations.base import check_size
from safepoint.destinations.fsspec_dest import FsspecDestination
from safepoint.local.atomic import fsync_dir, write_exclusive, write_replace
from safepoint.local.durable_write import FileWriter, aligned_buffer
from safepoint.local.safe_delete import delete_under


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
              on_bytes: Callable[[int], None] | None = None, *, size: int | None = None) -> str:
        if size is not None:
            check_size(self.size(run, step, relpath), size, self._path(run, step, relpath))
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
        dst = self._local(run, step, name)  # name may be a sub-path
        dst.parent.mkdir(parents=True, exist_ok=True)
        # Every folder's entries must be durable before a control file can commit them.
        for d in {p for p in dst.parent.rglob("*") if p.is_dir()} | {dst.parent}:
            fsync_dir(d)
        if exclusive:
            return write_exclusive(dst, data)  # atomic: False if it exists
        write_replace(dst, data)
        return True

    # Deletion walks from an open folder handle and never follows a symlink (safepoint.safe_delete):
    # a snapshot folder changed after commit cannot steer it outside.
    def _unlink(self, run: str, step: int, relpaths: list[str]) -> None:
        out = delete_under(self.root, (check_run(run), str(check_step(step))), relpaths)
        if out.refused:
            raise OSError(errno.ELOOP, f"{self.snapshot_url(run, step)}: {len(out.refused)} path(s) not deleted, "
                                       f"a symlink or folder on the way: {', '.join(out.refused[:3])}")

    def delete_files(self, run: str, step: int, relpaths: list[str]) -> None:
        self._unlink(run, step, relpaths)

    def delete_control(self, run: str, step: int, name: str) -> None:
        self._unlink(run, step, [name])

def copy_and_hash(source: Path, target: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """Copy a local file, hashing each byte once as it goes, and fsync it; returns the BLAKE3 of what was read.

    Written through safepoint.local.durable_write (direct I/O from a page-aligned buffer where the disk
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
