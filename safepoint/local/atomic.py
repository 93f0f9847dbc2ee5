"""Atomic, durable writes of local files: the one home of temp-file-fsync-rename.

No module outside safepoint/local renames a file (tests/test_architecture.py checks it). Every
control file Safepoint writes on a local disk (MANIFEST.json, COMMITTED, a replica's
control files) must be all-or-nothing and durable before anyone trusts it: the bytes go to a
temporary file with a unique name (two writers never share one), are fsynced, then either
renamed over the target (`write_replace`) or hard-linked to it (`write_exclusive`, which fails
when the target exists: the marker of a commit race has exactly one winner), and the folder is
fsynced. Data files are streamed into `new_file` (renamed into place once complete and fsynced)
or written elsewhere and moved with `publish`. A failed fsync is final: the caller aborts, it
never retries and trusts.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from safepoint.core.format import TMP_PREFIX

__all__ = ["fsync_dir", "fsync_file", "new_file", "publish", "write_exclusive", "write_replace"]


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, so that a rename, link or unlink in it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temp(folder: Path, name: str, data: bytes, mode: int = 0o644) -> Path:
    """A fsynced temporary file next to `name`, with a name no other writer uses, created with `mode`."""
    tmp = folder / f"{TMP_PREFIX}{name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_replace(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644) -> None:
    """Write `path` atomically (temp file, fsync, rename over it, fsync the folder).

    A folder fsync that fails after the rename leaves a file of unknown durability: it is removed
    and the error raised (a control file left there would commit what the caller reports failed).
    """
    dst = Path(path)
    tmp = _write_temp(dst.parent, dst.name, data, mode)
    try:
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    try:
        fsync_dir(dst.parent)
    except OSError:
        dst.unlink(missing_ok=True)
        raise


def write_exclusive(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644) -> bool:
    """Create `path` with `data` only if it does not exist; False when it does (someone else won).

    The link of a complete, fsynced temporary file is the atomic step: readers never see a partial
    file, and of two writers exactly one succeeds. A folder fsync that fails after the link leaves
    a file of unknown durability: it is removed and the error raised.
    """
    dst = Path(path)
    tmp = _write_temp(dst.parent, dst.name, data, mode)
    try:
        os.link(tmp, dst)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    try:
        fsync_dir(dst.parent)
    except OSError:
        dst.unlink(missing_ok=True)
        raise
    return True


def publish(tmp: str | os.PathLike[str], final: str | os.PathLike[str], *, sync: bool = True,
            sync_folder: bool = True) -> None:
    """Move a complete temporary file to its final name: fsync it (`sync`), rename, fsync the folder."""
    if sync:
        fsync_file(tmp)
    os.replace(tmp, final)
    if sync_folder:
        fsync_dir(Path(final).parent)


@contextmanager
def new_file(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """An unbuffered file that appears at `path` only complete and fsynced (temp name, fsync, rename).

    On an exception the temporary file is removed and `path` is untouched. The folder is not
    fsynced: a commit fsyncs every folder before its marker (safepoint.local.commit).
    """
    dst = Path(path)
    tmp = dst.with_name(f"{TMP_PREFIX}{dst.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb", buffering=0) as out:
            yield out  # type: ignore[misc]
            os.fsync(out.fileno())
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
