"""file:// destinations (local disks, NFS, Lustre, GPFS): temp file, fsync, rename.

Plain POSIX calls, no fsspec: each file and the marker are atomic and durable
(safepoint.local.atomic), exclusive create is a hard link (one winner, atomic), and deletion never
follows a symlink (safepoint.local.safe_delete).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safepoint.core.errors import FormatError
from safepoint.core.format import MARKER_NAME, FileEntry, check_run, check_step
from safepoint.core.hashing import CHUNK, copy_hashed, hash_path
from safepoint.core.naming import file_url
from safepoint.core.redact import redact
from safepoint.core.urls import local_path, path_url
from safepoint.destinations.base import (
    Capabilities,
    Destination,
    SnapshotListing,
    StoredObject,
    group_listing,
)
from safepoint.local.atomic import fsync_dir, new_file, write_exclusive, write_replace
from safepoint.local.copy import copy_and_hash
from safepoint.local.safe_delete import delete_under, remove_empty_under
from safepoint.local.snapshot import read_small

__all__ = ["LocalDestination", "copy_and_hash"]


class LocalDestination(Destination):
    """POSIX semantics let us make each file and the marker atomic and durable."""

    capabilities = Capabilities(atomic_exclusive_create=True, folders=True)

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        path = local_path(url)
        if path is None:
            raise ValueError(f"{redact(url)}: not a file:// URL")
        self.root = os.path.abspath(path).rstrip("/") or "/"
        self.url = path_url(self.root)  # one spelling per folder: what the catalog records

    def _local(self, run: str, step: int, relpath: str) -> Path:
        return Path(file_url(self.root, run, step, relpath))

    def size(self, run: str, step: int, relpath: str) -> int | None:
        """A plain lstat; a symlink or anything but a regular file counts as absent."""
        try:
            st = os.stat(self._local(run, step, relpath), follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def digest(self, run: str, step: int, relpath: str) -> str:
        return hash_path(self._local(run, step, relpath))[1]

    def fetch(self, run: str, step: int, relpath: str, target: Path,
              on_bytes: Callable[[int], None] | None = None, *, size: int | None = None) -> str:
        # FormatError for a FIFO, device or symlink: opened without blocking, never read
        return copy_and_hash(self._local(run, step, relpath), target, on_bytes, size=size)

    def upload(self, run: str, step: int, entry: FileEntry, source: Path) -> str:
        dst = self._local(run, step, entry.path)
        dst.parent.mkdir(parents=True, exist_ok=True)
        # Sized to the file: a fresh 8 MiB buffer per tiny file cost ~1 ms of zeroing each.
        buf = memoryview(bytearray(min(CHUNK, entry.size + 1)))
        with open(source, "rb", buffering=0) as src, new_file(dst) as out:
            def write(_offset: int, chunk: memoryview) -> None:
                while chunk:  # a raw write may be short (a disk filling up): the rest raises ENOSPC
                    chunk = chunk[out.write(chunk):]

            return copy_hashed(src.readinto, write, buf, size_hint=entry.size)

    def read_control(self, run: str, step: int, name: str) -> bytes | None:
        try:
            return read_small(self._local(run, step, name))
        except NotADirectoryError:
            return None

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

    # Deletion walks from an open folder handle and never follows a symlink (safepoint.local.safe_delete):
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

    def remove_empty_folders(self, run: str, step: int) -> None:
        remove_empty_under(self.root, check_run(run), str(check_step(step)))

    def listing(self, run: str | None = None, step: int | None = None) -> dict[tuple[str, int], SnapshotListing]:
        rel = "/".join(x for x in (run, None if step is None else str(step)) if x is not None)
        top = os.path.join(self.root, rel) if rel else self.root
        entries: list[tuple[str, StoredObject | None, float | None]] = []
        for dirpath, dirnames, filenames in os.walk(top):  # os.walk never follows a symlinked folder
            base = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            base = "" if base == "." else base + "/"
            for name in dirnames + filenames:
                try:
                    st = os.stat(os.path.join(dirpath, name), follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    entries.append((base + name, None, st.st_mtime))
                else:
                    entries.append((base + name, StoredObject(st.st_size, st.st_mtime), None))
        return group_listing(entries)

    def committed_snapshots(self) -> list[tuple[str, int]]:
        out = []
        for run in _folders(self.root):
            try:
                check_run(run)
            except FormatError:
                continue
            for step in _folders(os.path.join(self.root, run)):
                if step.isdigit() and str(int(step)) == step and self.size(run, int(step), MARKER_NAME) is not None:
                    out.append((run, int(step)))
        return sorted(out)


def _folders(path: str) -> list[str]:
    try:
        return [e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []
