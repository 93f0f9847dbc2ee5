"""A committed snapshot folder on local disk: reading it back, safely."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from safepoint.core.errors import FormatError
from safepoint.core.format import (
    CONTROL_FILES,
    MANIFEST_NAME,
    MARKER_NAME,
    MAX_MANIFEST_BYTES,
    TMP_PREFIX,
    FileEntry,
    Manifest,
    load_committed,
    parse_marker,
    safe_relpath,
)
from safepoint.core.hashing import hash_path
from safepoint.core.verify import FileStatus, VerifyReport, verify_manifest


def read_small(path: Path, limit: int = MAX_MANIFEST_BYTES) -> bytes | None:
    """Read a control file without following symlinks and without reading past `limit`."""
    try:
        # O_NONBLOCK: a FIFO put in place of a control file must not block the reader
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        raise FormatError(f"{path.name}: cannot be read safely ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise FormatError(f"{path.name}: not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FormatError(f"{path.name}: larger than {limit} bytes")
    return data


def resolve_inside(root: Path, relpath: str) -> Path:
    """Map a manifest path to a file under root; refuse anything that escapes (.., symlinks)."""
    safe_relpath(relpath)
    # Refuse symlinks anywhere along the way, so a link cannot redirect a read outside root.
    # (Plain strings: this runs several times per file, and pathlib's overhead dominated 100k-file replications.)
    cur = os.fspath(root)
    for part in relpath.split("/"):
        cur = os.path.join(cur, part)
        if os.path.islink(cur):
            raise FormatError(f"unsafe path {relpath!r}: symlink")
    return Path(cur)


def is_committed(folder: str | os.PathLike) -> bool:
    return (Path(folder) / MARKER_NAME).is_file()


@dataclass(frozen=True)
class LocalSnapshot:
    root: Path
    manifest: Manifest
    manifest_bytes: bytes
    marker_bytes: bytes

    @classmethod
    def open(cls, folder: str | os.PathLike) -> LocalSnapshot:
        """Open a committed folder. Raises FormatError when it is not committed or the control files are bad."""
        root = Path(folder).resolve()
        if not root.is_dir():
            raise FormatError(f"{folder}: not a directory")
        marker = read_small(root / MARKER_NAME)
        manifest_bytes = read_small(root / MANIFEST_NAME)
        manifest = load_committed(manifest_bytes, marker)
        return cls(root, manifest, manifest_bytes, marker)  # type: ignore[arg-type]

    @classmethod
    def rebind(cls, folder: str | os.PathLike, marker: bytes, files: Sequence[FileEntry]) -> LocalSnapshot:
        """The folder a caller opened, still committed by the same `marker` (which binds its manifest),
        holding `files` of it: checked by re-reading the marker alone, never by parsing the manifest
        again (a batch of a large verify would otherwise parse it once per batch: quadratic)."""
        root = Path(folder).resolve()
        if read_small(root / MARKER_NAME) != marker:
            raise FormatError(f"{folder}: its COMMITTED marker changed or went away while it was verified")
        m = parse_marker(marker)
        return cls(root, Manifest(m.run, m.step, tuple(files)), b"", marker)

    def path_of(self, relpath: str) -> Path:
        return resolve_inside(self.root, relpath)

    def size_of(self, relpath: str) -> int | None:
        try:
            st = os.stat(self.path_of(relpath), follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:  # a manifest's path too long to exist here (ENAMETOOLONG), or a loop: not there
            if e.errno in (errno.ENAMETOOLONG, errno.ELOOP):
                return None
            raise
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def verify(self, workers: int = 2, progress: Callable[[int], None] | None = None,
               files: Sequence[FileEntry] | None = None) -> VerifyReport:
        """Re-hash every local file (or `files`, a batch of them) against the manifest; `progress` gets
        each file's size once hashed."""
        report = VerifyReport()
        safe = []
        for entry in self.manifest.files if files is None else files:
            try:
                self.path_of(entry.path)
                safe.append(entry)
            except FormatError:
                report.files[entry.path] = FileStatus.UNSAFE_PATH
        sub = Manifest(self.manifest.run, self.manifest.step, tuple(safe), self.manifest.created)
        def digest(path: str) -> str:
            out = hash_path(self.path_of(path))
            if progress is not None:
                progress(out[0])
            return out[1]

        inner = verify_manifest(sub, self.size_of, digest, workers=workers)
        report.files.update(inner.files)
        report.bytes_checked = inner.bytes_checked
        return report


def data_files(root: Path) -> list[str]:
    """Relative paths of the data files under root (docs/format.md: everything but control and tmp files)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = Path(dirpath).relative_to(root)
        for name in sorted(filenames):
            rel = (rel_dir / name).as_posix() if str(rel_dir) != "." else name
            if rel in CONTROL_FILES or name.startswith(TMP_PREFIX):
                continue
            out.append(rel)
    return out
