"""Seal a folder written by any tool: hash, fsync, manifest, then the marker last (docs/format.md)."""

from __future__ import annotations

import fcntl
import json
import os
import stat
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
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
    digest_bytes,
    marker_for,
    safe_relpath,
)
from safepoint.core.hashing import hash_path
from safepoint.local.atomic import fsync_dir, fsync_file, write_exclusive, write_replace
from safepoint.local.snapshot import LocalSnapshot, data_files, is_committed


@contextmanager
def _exclusive(root: Path, shown: str | os.PathLike) -> Iterator[None]:
    """Hold the folder's commit lock (flock on the folder itself; the kernel drops it if we die).

    A second commit of the same folder meanwhile fails at once instead of racing for the marker.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CommitError(f"{shown}: another commit of this folder is in progress; nothing was committed") from None
        yield
    finally:
        os.close(fd)  # releases the lock


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
    fsync_file(path)
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
    reseal: bool = False,
) -> Manifest:
    """Seal `folder` as checkpoint (run, step) and return its manifest.

    `files` lets a writer that already hashed its bytes (the Snapshotter) skip re-hashing; they
    are still fsynced. Re-committing an already committed folder with the same run and step is a
    no-op while its files still match the manifest. When they no longer do (a trainer re-saved the
    step after a resume), it is a CommitError unless `reseal`: then the old marker goes first, and
    the new manifest records the one it supersedes (`meta["supersedes"]`), so the catalog keeps the
    re-saved bytes as a new version instead of the old ones. Raises CommitError and writes no
    marker on any failure.
    """
    root = Path(folder)
    if not root.is_dir() or root.is_symlink():
        raise CommitError(f"{folder}: not a directory")
    root = root.resolve()
    with _exclusive(root, folder):
        if is_committed(root):
            existing = _sealed_before(root, folder, run, step, reseal=reseal, workers=workers)
            if existing is not None:
                return existing
        supersedes = _superseded(root)
        if supersedes is not None and "supersedes" not in (meta or {}):
            meta = {**(meta or {}), "supersedes": supersedes}
        return _commit_locked(root, folder, run, step, parent=parent, world_size=world_size, ranks=ranks, node=node,
                              meta=meta, files=files, workers=workers)


#: left by `unseal` until the folder is sealed again: which seal the new one supersedes
SUPERSEDED_NAME = f"{TMP_PREFIX}superseded.json"


def unseal(folder: str | os.PathLike) -> None:
    """Take a folder's seal away before its files change: the marker first (made durable), then the manifest.

    From then on the folder is an unsealed one being written, never a sealed one whose bytes lie. A
    note of the old manifest's digest stays until the next commit, which records it as superseded
    (`meta["supersedes"]`), even when the process died in between.
    """
    root = Path(folder)
    try:
        digest: str | None = digest_bytes(LocalSnapshot.open(root).manifest_bytes)
    except FormatError:
        digest = None  # a marker that binds nothing: there is no seal to supersede
    if digest is not None and _superseded(root) is None:
        write_replace(root / SUPERSEDED_NAME, json.dumps({"supersedes": digest}).encode())
    (root / MARKER_NAME).unlink(missing_ok=True)
    fsync_dir(root)
    (root / MANIFEST_NAME).unlink(missing_ok=True)


def _superseded(root: Path) -> str | None:
    data = _read_or_none(root / SUPERSEDED_NAME)
    try:
        value = json.loads(data or b"null")
    except ValueError:
        return None
    found = value.get("supersedes") if isinstance(value, dict) else None
    return found if isinstance(found, str) and len(found) == 64 else None


def still_matches(snap: LocalSnapshot, workers: int = 2) -> str | None:
    """None when a sealed folder holds exactly its manifest's files, byte for byte; else what differs."""
    listed = set(data_files(snap.root))
    named = {f.path for f in snap.manifest.files}
    if listed != named:
        extra, gone = sorted(listed - named), sorted(named - listed)
        return ", ".join(x for x in (f"new files {extra[:3]}" if extra else "",
                                     f"missing {gone[:3]}" if gone else "") if x)
    report = snap.verify(workers=workers)
    return None if not report.problems else report.summary()


def _sealed_before(root: Path, folder: str | os.PathLike, run: str, step: int, *, reseal: bool,
                   workers: int) -> Manifest | None:
    """A folder that already has a marker: its manifest when committing again is a no-op, None when
    it is to be sealed anew (its old seal was removed, noted as superseded)."""
    try:
        snap = LocalSnapshot.open(root)
    except FormatError as e:
        if not reseal:
            raise CommitError(f"{folder}: has a COMMITTED marker that is not valid: {e}") from None
        unseal(root)
        return None
    existing = snap.manifest
    if (existing.run, existing.step) != (run, step):
        raise CommitError(f"{folder}: already committed as {existing.run}/{existing.step}")
    differs = still_matches(snap, workers)
    if differs is None:
        return existing
    if not reseal:
        raise CommitError(f"{folder}: sealed as {run}/{step}, but its files no longer match that seal ({differs}); "
                          "nothing was committed. If the trainer re-saved this step, seal it again with "
                          "`safepoint commit --reseal`")
    unseal(root)
    return None


def _commit_locked(root: Path, folder: str | os.PathLike, run: str, step: int, *, parent: tuple[str, int] | None,
                   world_size: int, ranks: Iterable[int] | None, node: str | None, meta: dict[str, Any] | None,
                   files: Iterable[FileEntry] | None, workers: int) -> Manifest:
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
                fsync_file(root / e.path)
        manifest = build_manifest(
            run, step, entries, parent=parent, world_size=world_size,
            ranks=tuple(ranks) if ranks is not None else None, node=node, meta=dict(meta or {}),
        )
        manifest_bytes = manifest.to_json_bytes()
        write_replace(root / MANIFEST_NAME, manifest_bytes)  # we hold the folder: no other writer replaces it
        for dirpath, _dirs, _files in os.walk(root):
            fsync_dir(dirpath)
        ours = marker_for(manifest_bytes, manifest).to_json_bytes()
        if not write_exclusive(root / MARKER_NAME, ours):  # never replaces a marker, even one we did not see
            raise CommitError(f"could not commit {folder}: committed concurrently by another writer")
        (root / SUPERSEDED_NAME).unlink(missing_ok=True)
    except (OSError, FormatError) as e:
        # A marker renamed into place before a failed fsync of the folder is of unknown durability:
        # it must not stand, or the "nothing was committed" below would be a lie.
        if ours is not None and _read_or_none(root / MARKER_NAME) == ours:
            (root / MARKER_NAME).unlink(missing_ok=True)
        if not (root / MARKER_NAME).exists():
            (root / MANIFEST_NAME).unlink(missing_ok=True)
        msg = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise CommitError(f"could not commit {folder}: {msg}; nothing was committed") from e
    return manifest
