"""Deletion that cannot leave its folder: every path is walked from an open directory handle.

A committed folder may be changed after commit by anyone who can write to it: a sub-folder
replaced by a symlink, MANIFEST.json rewritten to name other files. A deleter that joins path
strings follows such a link and unlinks files elsewhere. Here every component, from `/` down to
the file's folder, is opened with O_DIRECTORY | O_NOFOLLOW relative to its parent's handle, and
the file is unlinked by name relative to that handle (`dir_fd`): a symlink at any level stops
the walk for that path, which is kept and reported, never followed. What may be deleted is only
what a manifest names whose digest the marker (or the catalog) binds (`remove_snapshot_folder`).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

from safepoint.core.errors import FormatError
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME, digest_bytes, load_committed, parse_manifest

log = logging.getLogger("safepoint.local.safe_delete")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
MAX_CONTROL_BYTES = 64 * 1024 * 1024
MAX_DEPTH = 256


class UnsafePath(OSError):
    """A component of the path is a symlink or not a directory: the walk refuses to follow it."""


@dataclass
class Deletion:
    """What a deletion did: files unlinked, and paths it refused (a symlink or odd file on the way)."""

    deleted: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    reason: str | None = None          # set when nothing was deleted because the folder is not provably ours

    @property
    def done(self) -> bool:
        return self.reason is None


def _components(path: str | os.PathLike[str]) -> list[str]:
    p = os.path.abspath(os.fspath(path))
    return [c for c in p.split(os.sep) if c]


def _open_in(parent_fd: int | None, name: str, shown: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePath(e.errno, f"{shown}: a symlink or not a directory; not followed") from None
        raise


@contextmanager
def open_dir(path: str | os.PathLike[str], *rel: str) -> Iterator[int]:
    """An fd of `path`/`rel...`, reached from `/` with no symlink followed at any level."""
    fd = os.open("/", _DIR_FLAGS)
    shown = "/"
    try:
        for name in [*_components(path), *rel]:
            shown = os.path.join(shown, name)
            nxt = _open_in(fd, name, shown)
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def _segments(rel: str) -> list[str]:
    """Split a relative path, refusing any that could name something outside its folder."""
    parts = rel.split("/") if isinstance(rel, str) else [""]
    if any(p in ("", ".", "..") or "\x00" in p for p in parts):
        raise FormatError(f"unsafe path {rel!r}: not a plain relative path")
    return parts


def _unlink_rel(root_fd: int, rel: str) -> bool:
    """Unlink `rel` (a safe relative path) under root_fd; False when absent. UnsafePath on a link on the way."""
    *dirs, name = _segments(rel)
    fds: list[int] = []
    try:
        fd = root_fd
        for d in dirs:
            try:
                fd = _open_in(fd, d, rel)
            except FileNotFoundError:
                return False
            fds.append(fd)
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            raise UnsafePath(errno.EISDIR, f"{rel}: a directory where a file belongs; not deleted")
        try:
            os.unlink(name, dir_fd=fd)  # a symlink itself is removed, never what it points at
        except FileNotFoundError:
            return False
        return True
    finally:
        for f in fds:
            os.close(f)


def unlink_files(root_fd: int, relpaths: Iterable[str], out: Deletion | None = None) -> Deletion:
    """Unlink each relative path under the folder `root_fd`; unsafe or odd paths are refused, not raised."""
    out = out if out is not None else Deletion()
    for rel in relpaths:
        try:
            if _unlink_rel(root_fd, rel):
                out.deleted.append(rel)
        except (UnsafePath, FormatError) as e:
            out.refused.append(rel)
            log.warning("not deleted: %s", e)
    return out


def remove_empty_dirs(root_fd: int, _depth: int = 0) -> None:
    """Remove empty sub-folders under root_fd, deepest first; symlinks are neither followed nor removed.

    Folders deeper than MAX_DEPTH are left: a hostile tree cannot exhaust the stack or the fds.
    """
    if _depth >= MAX_DEPTH:
        return
    for entry in list(os.scandir(root_fd)):
        if not entry.is_dir(follow_symlinks=False):
            continue
        try:
            sub = _open_in(root_fd, entry.name, entry.name)
        except (UnsafePath, FileNotFoundError):
            continue
        try:
            remove_empty_dirs(sub, _depth + 1)
        finally:
            os.close(sub)
        with suppress(OSError):
            os.rmdir(entry.name, dir_fd=root_fd)


def _read_at(dir_fd: int, name: str, limit: int = MAX_CONTROL_BYTES) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


def bound_manifest_files(dir_fd: int, run: str, step: int, expect_digest: str | None) -> tuple[list[str], str | None]:
    """The files of this folder's manifest if it provably holds (run, step); else ([], why not).

    Proof: MANIFEST.json is bound by the folder's COMMITTED marker, or (the marker already gone,
    an earlier deletion interrupted) its digest equals `expect_digest`, the catalog's record.
    """
    manifest = _read_at(dir_fd, MANIFEST_NAME)
    if manifest is None:
        return [], "no MANIFEST.json"
    marker = _read_at(dir_fd, MARKER_NAME)
    try:
        if marker is not None:
            m = load_committed(manifest, marker)
            if expect_digest and digest_bytes(manifest) != expect_digest:
                return [], "MANIFEST.json is not the manifest the catalog recorded"
        elif expect_digest and digest_bytes(manifest) == expect_digest:
            m = parse_manifest(manifest)
        else:
            return [], "MANIFEST.json is bound by no marker and is not the manifest the catalog recorded"
    except FormatError as e:
        return [], str(e)
    if (m.run, m.step) != (run, step):
        return [], f"holds {m.run}/{m.step}, not {run}/{step}"
    return [f.path for f in m.files], None


def remove_snapshot_folder(folder: str | os.PathLike[str], run: str, step: int, *,
                           expect_digest: str | None = None, files: Sequence[str] = ()) -> Deletion:
    """Delete a local snapshot folder that provably holds (run, step): marker, data, manifest, empty folders.

    Only the bound manifest's files (and `files`, the catalog's list for this checkpoint) are
    unlinked, each relative to the folder's handle with no symlink followed; anything else stays.
    A folder that is not provably ours (reused, tampered, being written) is left alone with a reason.
    """
    out = Deletion()
    try:
        with open_dir(folder) as fd:
            names, why = bound_manifest_files(fd, run, step, expect_digest)
            if why is not None:
                out.reason = why
                return out
            unlink_files(fd, [MARKER_NAME], out)
            os.fsync(fd)  # the folder stops being a committed snapshot before any data goes
            unlink_files(fd, sorted(set(names) | set(files)), out)
            unlink_files(fd, [MANIFEST_NAME], out)
            remove_empty_dirs(fd)
    except (FileNotFoundError, UnsafePath) as e:
        out.reason = str(e) if isinstance(e, UnsafePath) else "folder is gone"
        return out
    parent, name = os.path.split(os.path.abspath(os.fspath(folder)))
    with suppress(OSError), open_dir(parent) as pfd:
        os.rmdir(name, dir_fd=pfd)  # only when empty
    return out


def delete_under(base: str | os.PathLike[str], rel: Sequence[str], relpaths: Iterable[str]) -> Deletion:
    """Unlink `relpaths` under base/rel... (a replica's snapshot folder); absent folders are fine."""
    try:
        with open_dir(base, *rel) as fd:
            return unlink_files(fd, relpaths)
    except FileNotFoundError:
        return Deletion()


def remove_empty_under(base: str | os.PathLike[str], *rel: str) -> None:
    """Remove base/rel... and its sub-folders when empty (no symlink followed)."""
    if not rel:
        return
    with suppress(FileNotFoundError, UnsafePath):
        with open_dir(base, *rel) as fd:
            remove_empty_dirs(fd)
        with open_dir(base, *rel[:-1]) as pfd, suppress(OSError):
            os.rmdir(rel[-1], dir_fd=pfd)
