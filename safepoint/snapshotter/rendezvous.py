"""Multi-rank commit through the filesystem, never through a collective a dead rank could hang.

Every rank writes its shard into the shared step folder, then a small "done" file that lists its
files with their sizes and BLAKE3 digests. The committer rank polls the folder until every rank's
done file is there (or a timeout passes: then nothing is committed), and commits once, with the
files of all ranks and `world_size`. Done files are temporary files for the format (their names
start with `.safepoint-tmp-`), so they are never data files; the committer removes them after
the commit. A `session` string (the same on every rank of one job attempt) keeps a done file left
by an earlier, crashed attempt at the same step from being taken for a fresh one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from safepoint.core.errors import FormatError
from safepoint.core.format import MARKER_NAME, TMP_PREFIX, FileEntry, Manifest, safe_relpath
from safepoint.local.atomic import write_replace
from safepoint.local.snapshot import LocalSnapshot
from safepoint.snapshotter.errors import CommitTimeout, SnapshotError

DONE_VERSION = 1


def done_name(rank: int) -> str:
    return f"{TMP_PREFIX}rank-{rank:05d}.done"


def missing_ranks(present: set[int], world_size: int) -> list[int]:
    """The ranks of 0..world_size-1 not yet present (pure)."""
    return [r for r in range(world_size) if r not in present]


def write_done(folder: Path, rank: int, world_size: int, session: str, files: list[FileEntry]) -> None:
    """Durably announce that `rank` has written `files` (write, fsync, rename, fsync folder)."""
    doc = {"format": "safepoint.rank-done", "version": DONE_VERSION, "rank": rank, "world_size": world_size,
           "session": session, "files": [{"path": f.path, "size": f.size, "blake3": f.blake3} for f in files]}
    write_replace(folder / done_name(rank), json.dumps(doc).encode())  # safepoint.local.atomic


def remove_done(folder: Path, rank: int) -> None:
    for name in (done_name(rank), done_name(rank) + ".partial"):
        (folder / name).unlink(missing_ok=True)


def read_done(folder: Path, rank: int, world_size: int, session: str) -> list[FileEntry] | None:
    """The files a rank announced for this session, or None when it has not (yet) announced them."""
    try:
        with open(folder / done_name(rank), "rb") as f:
            doc = json.loads(f.read(16 * 1024 * 1024).decode())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != "safepoint.rank-done" or doc.get("session") != session:
        return None
    if doc.get("rank") != rank or doc.get("world_size") != world_size:
        raise SnapshotError(f"{folder}: rank {rank} announced world_size {doc.get('world_size')!r}, "
                            f"expected {world_size}")
    try:
        return [FileEntry(safe_relpath(e["path"]), int(e["size"]), str(e["blake3"])) for e in doc["files"]]
    except (KeyError, TypeError, ValueError, FormatError) as e:
        raise SnapshotError(f"{folder}: rank {rank}'s done file is malformed: {e}") from None


def _poll_delays(timeout_s: float):
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        yield deadline - time.monotonic()
        time.sleep(delay)
        delay = min(0.2, delay * 1.5)


def wait_for_ranks(folder: Path, world_size: int, session: str, timeout_s: float) -> list[FileEntry]:
    """All ranks' files once every rank has announced them; CommitTimeout naming the missing ranks otherwise."""
    got: dict[int, list[FileEntry]] = {}
    for left in _poll_delays(timeout_s):
        for r in missing_ranks(set(got), world_size):
            entries = read_done(folder, r, world_size, session)
            if entries is not None:
                got[r] = entries
        missing = missing_ranks(set(got), world_size)
        if not missing:
            return [e for r in sorted(got) for e in got[r]]
        if left <= 0:
            shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
            raise CommitTimeout(f"{folder}: rank(s) {shown} of {world_size} did not write their shard within "
                                f"{timeout_s:g} s; nothing was committed")
    raise AssertionError("unreachable")


def wait_for_marker(folder: Path, timeout_s: float, expect: FileEntry) -> Manifest:
    """The committed manifest once the committer has committed; it must hold this rank's file as written."""
    for left in _poll_delays(timeout_s):
        if (folder / MARKER_NAME).is_file():
            try:
                manifest = LocalSnapshot.open(folder).manifest
            except FormatError as e:
                raise SnapshotError(f"{folder}: committed, but the marker does not hold: {e}") from None
            try:
                entry = manifest.file(expect.path)
            except KeyError:
                raise SnapshotError(f"{folder}: committed without this rank's file {expect.path}") from None
            if entry != expect:
                raise SnapshotError(f"{folder}: committed with other bytes for {expect.path} than this rank wrote")
            return manifest
        if left <= 0:
            raise CommitTimeout(f"{folder}: not committed within {timeout_s:g} s (the committer rank or another "
                                "rank did not finish)")
    raise AssertionError("unreachable")
