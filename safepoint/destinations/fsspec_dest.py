"""Any fsspec filesystem as a destination (memory://, gcs://, hdfs://, ...).

fsspec gives no atomic exclusive create in general: `write_control(exclusive=True)` opens with
mode "xb", which most filesystems implement as look-then-write (capabilities say so).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import suppress
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fsspec

from safepoint.core.errors import DestinationError, FormatError
from safepoint.core.format import MARKER_NAME, FileEntry, check_run
from safepoint.core.hashing import CHUNK, copy_hashed, hash_stream, read_chunks
from safepoint.core.naming import file_url, join, snapshot_key
from safepoint.core.redact import redact
from safepoint.destinations.base import (
    Capabilities,
    Destination,
    SnapshotListing,
    StoredObject,
    check_size,
    group_listing,
)


def info_mtime(info: dict[str, Any]) -> float | None:
    """The modification time in an fsspec info dict, whatever the backend calls it."""
    for key in ("mtime", "LastModified", "last_modified", "created"):
        v = info.get(key)
        if isinstance(v, datetime):
            return (v if v.tzinfo else v.replace(tzinfo=timezone.utc)).timestamp()
        if isinstance(v, (int, float)):
            return float(v)
    return None


class FsspecDestination(Destination):
    capabilities = Capabilities(atomic_exclusive_create=False, folders=False)

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = redact(url.rstrip("/"))
        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.root = self.root.rstrip("/")

    def _path(self, run: str, step: int, relpath: str) -> str:
        return file_url(self.root, run, step, relpath)

    def size(self, run: str, step: int, relpath: str) -> int | None:
        try:
            info = self.fs.info(self._path(run, step, relpath))
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    def upload(self, run: str, step: int, entry: FileEntry, source: Path) -> str:
        path = self._path(run, step, entry.path)
        self.fs.makedirs(self.fs._parent(path), exist_ok=True)
        buf = memoryview(bytearray(min(CHUNK, entry.size + 1)))
        with open(source, "rb", buffering=0) as src, self.fs.open(path, "wb") as dst:
            # bytes(): a store's file may keep what it is given until it flushes; the buffer is reused
            return copy_hashed(src.readinto, lambda _at, chunk: dst.write(bytes(chunk)), buf, size_hint=entry.size)

    def digest(self, run: str, step: int, relpath: str) -> str:
        with self.fs.open(self._path(run, step, relpath), "rb") as f:
            return hash_stream(read_chunks(f, CHUNK))[1]

    def fetch(self, run: str, step: int, relpath: str, target: Path,
              on_bytes: Callable[[int], None] | None = None, *, size: int | None = None) -> str:
        found = self.size(run, step, relpath)  # None too for a folder: only regular files are fetched
        check_size(found, size, self._path(run, step, relpath))
        assert found is not None
        limit = found if size is None else size
        try:
            src = self.fs.open(self._path(run, step, relpath), "rb")
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001 - any store failure; the local disk is below
            raise DestinationError(redact(f"open {self.url}/{run}/{step}/{relpath}: {e}") or "open failed") from e

        def read(view: memoryview) -> int:
            try:
                return src.readinto(view)
            except Exception as e:  # noqa: BLE001
                raise DestinationError(redact(f"read {self.url}/{run}/{step}/{relpath}: {e}") or "read failed") from e

        buf = memoryview(bytearray(min(CHUNK, limit + 1)))
        with src, open(target, "wb") as out:
            digest = copy_hashed(read, lambda _at, chunk: out.write(chunk), buf, limit=limit, on_bytes=on_bytes,
                                 where=f"{self.url}/{run}/{step}/{relpath}")
            out.flush()
            os.fsync(out.fileno())
        return digest

    def read_control(self, run: str, step: int, name: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._path(run, step, name))
        except FileNotFoundError:
            return None

    def write_control(self, run: str, step: int, name: str, data: bytes, *, exclusive: bool = False) -> bool:
        path = self._path(run, step, name)
        self.fs.makedirs(self.fs._parent(path), exist_ok=True)
        if not exclusive:
            self.fs.pipe_file(path, data)
            return True
        if self.fs.exists(path):
            return False
        try:
            with self.fs.open(path, "xb") as f:  # look-then-write on most fsspec filesystems
                f.write(data)
        except FileExistsError:
            return False
        return True

    def delete_files(self, run: str, step: int, relpaths: list[str]) -> None:
        paths = [self._path(run, step, p) for p in relpaths]
        for p in paths:
            try:
                self.fs.rm_file(p)
            except FileNotFoundError:
                pass

    def delete_control(self, run: str, step: int, name: str) -> None:
        try:
            self.fs.rm_file(self._path(run, step, name))
        except FileNotFoundError:
            pass

    def listing(self, run: str | None = None, step: int | None = None) -> dict[tuple[str, int], SnapshotListing]:
        base = join(self.root, *([run] if run is not None else []), *([str(step)] if step is not None else []))
        with suppress(AttributeError):
            self.fs.invalidate_cache()  # a listing cached before a crash or another writer is stale
        try:
            found = self.fs.find(base, detail=True, withdirs=True)
        except FileNotFoundError:
            found = {}
        prefix = self.root.rstrip("/") + "/"
        entries = []
        for path, info in found.items():
            path = path.rstrip("/")
            if path.startswith(prefix):
                is_dir = info.get("type") == "directory"
                obj = None if is_dir else StoredObject(int(info.get("size") or 0), info_mtime(info))
                entries.append((path[len(prefix):], obj, info_mtime(info) if is_dir else None))
        return group_listing(entries)

    def committed_snapshots(self) -> list[tuple[str, int]]:
        out = []
        for marker in self.fs.glob(join(self.root, "*", "*", MARKER_NAME)):
            parts = marker.rstrip("/").split("/")
            run, step = parts[-3], parts[-2]
            try:
                if step.isdigit() and snapshot_key(check_run(run), int(step)):
                    out.append((run, int(step)))
            except FormatError:
                continue
        return sorted(out)
