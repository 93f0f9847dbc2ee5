"""Any fsspec filesystem as a destination (memory://, gcs://, hdfs://, ...)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec

from safepoint.core.errors import DestinationError, FormatError
from safepoint.core.format import MARKER_NAME, FileEntry, check_run
from safepoint.core.hashing import CHUNK, hash_stream, new_hasher, read_chunks
from safepoint.core.naming import file_url, join, snapshot_key
from safepoint.core.redact import redact
from safepoint.destinations.base import Destination, check_size


class FsspecDestination(Destination):
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
        h = new_hasher(entry.size)
        with open(source, "rb") as src, self.fs.open(path, "wb") as dst:
            for chunk in read_chunks(src, CHUNK):
                h.update(chunk)
                dst.write(chunk)
        return h.hexdigest()

    def digest(self, run: str, step: int, relpath: str) -> str:
        with self.fs.open(self._path(run, step, relpath), "rb") as f:
            return hash_stream(read_chunks(f, CHUNK))[1]

    def fetch(self, run: str, step: int, relpath: str, target: Path,
              on_bytes: Callable[[int], None] | None = None, *, size: int | None = None) -> str:
        if size is not None:
            check_size(self.size(run, step, relpath), size, self._path(run, step, relpath))
        h = new_hasher(0)
        try:
            src = self.fs.open(self._path(run, step, relpath), "rb")
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001 - any store failure; the local disk is below
            raise DestinationError(redact(f"open {self.url}/{run}/{step}/{relpath}: {e}") or "open failed") from e
        with src, open(target, "wb") as out:
            while True:
                try:
                    chunk = src.read(CHUNK)
                except Exception as e:  # noqa: BLE001
                    raise DestinationError(redact(f"read {self.url}/{run}/{step}/{relpath}: {e}") or "read failed") \
                        from e
                if not chunk:
                    break
                out.write(chunk)
                h.update(chunk)
                if on_bytes is not None:
                    on_bytes(len(chunk))
        return h.hexdigest()

    def read_control(self, run: str, step: int, name: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._path(run, step, name))
        except FileNotFoundError:
            return None

    def write_control(self, run: str, step: int, name: str, data: bytes, *, exclusive: bool = False) -> bool:
        path = self._path(run, step, name)
        if exclusive and self.fs.exists(path):
            return False
        self.fs.makedirs(self.fs._parent(path), exist_ok=True)
        self.fs.pipe_file(path, data)
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
