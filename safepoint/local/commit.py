"""Seal a folder written by any tool: hash, fsync, manifest, then the marker last (docs/format.md)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from safepoint.core.errors import CommitError, FormatError
from safepoint.core.format import (
    MANIFEST_NAME,
    MARKER_NAME,
    TMP_PREFIX,
    FileEntry,
    Manifest,
    build_manifest,
    marker_for,
    safe_relpath,
)
from safepoint.core.hashing import hash_path
from safepoint.local.snapshot import LocalSnapshot, data_files, is_committed


def fsync_path(path: Path, directory: bool = False) -> None:
    """fsync a file or directory. A failure is final: the caller aborts, it never retries and trusts."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(folder: Path, name: str, data: bytes) -> None:
    """Write `name` in `folder` via a temp file: write, fsync, rename, fsync folder."""
    tmp = folder / f"{TMP_PREFIX}{name}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / name)
        fsync_path(folder, directory=True)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _scan(root: Path) -> list[str]:
    """List data files, refusing anything that is not a regular file inside root."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                raise CommitError(f"refusing to commit {root}: {p.relative_to(root)} is a symlink")
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise CommitError(f"refusing to commit {root}: {p.relative_to(root)} is not a regular file")
    files = data_files(root)
    for rel in files:
        try:
            safe_relpath(rel)
        except FormatError as e:
            raise CommitError(f"refusing to commit {root}: {e}") from None
    return files


def _threads(workers: int, files: int) -> int:
    """Many small files are bound by fsync latency, not CPU: overlap more of them (up to 16)."""
    return max(1, workers, min(16, files // 64))


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _hash_and_sync(path: Path) -> tuple[int, str]:
    size, digest = hash_path(path)
    fsync_path(path)
    return size, digest


def commit(
    folder: str | os.PathLike,
    run: str,
    step: int,
    *,
    parent: tuple[str, int] | None = None,
    world_size: int = 1,
    ranks: Iterable[int] | None = None,
    node: str | None = None,
    meta: dict[str, Any] | None = None,
    files: Iterable[FileEntry] | None = None,
    workers: int = 2,
) -> Manifest:
    """Seal `folder` as checkpoint (run, step) and return its manifest.

    `files` lets a writer that already hashed its bytes (the Snapshotter) skip re-hashing; they
    are still fsynced. Re-committing an already committed folder with the same run and step is a
    no-op. Raises CommitError and writes no marker on any failure.
    """
    root = Path(folder)
    if not root.is_dir() or root.is_symlink():
        raise CommitError(f"{folder}: not a directory")
    root = root.resolve()
    if is_committed(root):
        try:
            existing = LocalSnapshot.open(root).manifest
        except FormatError as e:
            raise CommitError(f"{folder}: has a COMMITTED marker that is not valid: {e}") from None
        if (existing.run, existing.step) != (run, step):
            raise CommitError(f"{folder}: already committed as {existing.run}/{existing.step}")
        return existing
    ours: bytes | None = None
    try:
        names = _scan(root)
        if files is None:
            with ThreadPoolExecutor(max_workers=_threads(workers, len(names))) as pool:
                digests = list(pool.map(lambda rel: _hash_and_sync(root / rel), names))
            entries = [FileEntry(rel, size, d) for rel, (size, d) in zip(names, digests)]
        else:
            entries = list(files)
            if sorted(e.path for e in entries) != sorted(names):
                raise CommitError(f"{folder}: the files given do not match the files on disk")
            for e in entries:
                fsync_path(root / e.path)
        manifest = build_manifest(
            run, step, entries, parent=parent, world_size=world_size,
            ranks=tuple(ranks) if ranks is not None else None, node=node, meta=dict(meta or {}),
        )
        manifest_bytes = manifest.to_json_bytes()
        write_durably(root, MANIFEST_NAME, manifest_bytes)
        for dirpath, _dirs, _files in os.walk(root):
            fsync_path(Path(dirpath), directory=True)
        ours = marker_for(manifest_bytes, manifest).to_json_bytes()
        write_durably(root, MARKER_NAME, ours)
    except (OSError, FormatError) as e:
        for name in (MANIFEST_NAME, MARKER_NAME):
            (root / f"{TMP_PREFIX}{name}").unlink(missing_ok=True)
        # A marker renamed into place before a failed fsync of the folder is of unknown durability:
        # it must not stand, or the "nothing was committed" below would be a lie.
        if ours is not None and _read_or_none(root / MARKER_NAME) == ours:
            (root / MARKER_NAME).unlink(missing_ok=True)
        if not (root / MARKER_NAME).exists():
            (root / MANIFEST_NAME).unlink(missing_ok=True)
        msg = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise CommitError(f"could not commit {folder}: {msg}; nothing was committed") from e
    return manifest
