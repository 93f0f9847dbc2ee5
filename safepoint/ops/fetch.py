"""The one verified fetch of a snapshot: restore, multi-node assembly and reconcile's repair use it.

`fetch_snapshot(run, step, sources, into, ...)` reads the manifest that a source's COMMITTED
marker binds (and that the catalog recorded, when `expect_manifest` is given), then every file of
it into `into`, several at once:

- each file is BLAKE3-hashed as its bytes arrive, never more than the manifest's size is read, and
  only a regular file is read (a FIFO in a local copy is refused, it never blocks);
- it goes to a temporary name, is fsynced, and is renamed into place only when its size and hash
  match (safepoint.local.atomic.publish);
- a file that fails at one source is fetched from the next one in the ordered list (healing file by
  file); a source found bad is reported in the attempts, with the reason, for the catalog;
- files already in `into` that verify are reused (a fetch cut short is finished by running it again);
- a source that is one node's part (`Source.part`: the digest its manifest must have) supplies only
  the files it holds; when no whole source binds the manifest, the parts' merge must (multi-node);
- `scope` narrows the fetch to some of the files (a fleet restore of one node's part): the whole
  manifest is still read and held to the catalog's digest first, and every file to its entry there.

`commit_fetched(into, fetched)` then writes MANIFEST.json and COMMITTED (the source's exact bytes), fsynced:
`into` is a committed Safepoint snapshot. `fetched_copy(...)` does both into a temporary folder
under $SAFEPOINT_HOME/tmp and yields it as a LocalSnapshot (None when no copy is whole).
The decisions (which source first, what the attempts add up to) are safepoint.rules.restore's.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from safepoint.core.config import Config
from safepoint.core.errors import DestinationError, FormatError, SafepointError
from safepoint.core.format import (
    MANIFEST_NAME,
    MARKER_NAME,
    TMP_PREFIX,
    FileEntry,
    Manifest,
    digest_bytes,
    load_committed,
    marker_for,
)
from safepoint.core.hashing import hash_path
from safepoint.core.naming import tmp_dir
from safepoint.core.redact import redact
from safepoint.destinations import open_destination
from safepoint.destinations.base import Destination
from safepoint.destinations.parts import merge_manifests
from safepoint.local.atomic import fsync_dir, publish, write_replace
from safepoint.local.copy import copy_and_hash
from safepoint.local.snapshot import LocalSnapshot, read_small, resolve_inside
from safepoint.rules.restore import Attempt, Outcome, Source, Verdict, checkpoint_verdict, file_verdict, reuse_plan

__all__ = ["Fetched", "TargetDiskError", "fetch_snapshot", "commit_fetched", "fetched_copy"]

OnBytes = Callable[[int], None]
#: scope(whole manifest, its BLAKE3) -> (the manifest to fetch and commit, its bytes, its marker's bytes)
Scope = Callable[[Manifest, str], tuple[Manifest, bytes, bytes]]
LOCAL = "local"   # the key of bytes_from for the local folder and the node's own copies


class TargetDiskError(SafepointError):
    """The folder being fetched into failed (full, read-only): the sources are not at fault (exit 2)."""

    exit_code = 2


@dataclass
class Fetched:
    """What a fetch found: the verdict, every attempt (by file path, MANIFEST.json included), the manifest."""

    verdict: Verdict
    attempts: dict[str, list[Attempt]]
    manifest: Manifest | None = None
    manifest_bytes: bytes = b""
    marker_bytes: bytes = b""
    used: list[str] = field(default_factory=list)   # urls of the sources that supplied bytes
    fetched: int = 0                                # bytes fetched
    reused: int = 0                                 # bytes already in the folder, re-hashed
    bytes_from: dict[str, int] = field(default_factory=dict)  # "local" or a replica's base URL -> bytes
    whole: Manifest | None = None                   # a scoped fetch: the whole manifest it was held to
    whole_bytes: bytes = b""


class _Reader:
    """One source's files: a destination's replica, or a committed local folder."""

    def __init__(self, source: Source, run: str, step: int, dest: Destination | None):
        self.source, self.run, self.step, self.dest = source, run, step, dest
        self.holds: dict[str, FileEntry] | None = None   # a part's files; None: every file of the manifest

    def control(self, name: str) -> bytes | None:
        if self.dest is None:
            return read_small(Path(self.source.url) / name)
        return self.dest.read_control(self.run, self.step, name)

    def fetch(self, entry: FileEntry, target: Path, on_bytes: OnBytes | None) -> str:
        """The file into `target`; FileNotFoundError when absent, FormatError when not the manifest's size."""
        if self.dest is None:
            return copy_and_hash(resolve_inside(Path(self.source.url), entry.path), target, on_bytes, size=entry.size)
        # The destination checks the size itself, in the request that starts the read (one HEAD on S3).
        return self.dest.fetch(self.run, self.step, entry.path, target, on_bytes, size=entry.size)

    def close(self) -> None:
        if self.dest is not None:
            self.dest.close()


def _open_reader(source: Source, run: str, step: int, config: Config) -> _Reader:
    if source.local:
        return _Reader(source, run, step, None)
    return _Reader(source, run, step, open_destination(source.base, config.storage_options(source.base)))


def _read_manifest(reader: _Reader, run: str, step: int, expect_blake3: str | None,
                   part_of: str | None = None) -> tuple[Manifest, bytes, bytes]:
    """The source's manifest, bound by its marker, for (run, step), and the catalog's if it has one.

    `part_of`: a part source may instead be a part restored earlier from the whole manifest of
    that digest (its meta says so); it then supplies only files whose entries are the whole's.

    FormatError: the source's copy is bad; FileNotFoundError: it has none; others: unreadable.
    """
    marker = reader.control(MARKER_NAME)
    if marker is None:
        raise FileNotFoundError("no COMMITTED marker")
    manifest_bytes = reader.control(MANIFEST_NAME)
    manifest = load_committed(manifest_bytes, marker)
    assert manifest_bytes is not None
    if (manifest.run, manifest.step) != (run, step):
        raise FormatError(f"its manifest is of {manifest.run}/{manifest.step}")
    if (expect_blake3 is not None and digest_bytes(manifest_bytes) != expect_blake3
            and (part_of is None or manifest.meta.get("part_of") != part_of)):
        raise FormatError("its MANIFEST.json is not the one the catalog recorded (a stale or foreign copy)")
    return manifest, manifest_bytes, marker


def classify(e: BaseException) -> tuple[Outcome, str]:
    if isinstance(e, FileNotFoundError):
        return Outcome.MISSING, "missing"
    if isinstance(e, FormatError):
        return Outcome.BAD, str(e)
    return Outcome.ERROR, redact(str(e)) or type(e).__name__


def _on_disk(into: Path, entries: Sequence[FileEntry]) -> dict[str, int | None]:
    """Size of each manifest file already in the folder (None: absent, or not a regular file)."""
    sizes: dict[str, int | None] = {}
    for e in entries:
        try:
            st = os.stat(resolve_inside(into, e.path), follow_symlinks=False)
            sizes[e.path] = st.st_size if stat.S_ISREG(st.st_mode) else None
        except (FileNotFoundError, NotADirectoryError, FormatError):
            sizes[e.path] = None
    return sizes


def fetch_snapshot(run: str, step: int, sources: Sequence[Source], into: Path, *, config: Config,
                   expect_manifest: str | None = None, files_at_once: int = 8, on_bytes: OnBytes | None = None,
                   prepare: Callable[[Manifest, str], None] | None = None, scope: Scope | None = None) -> Fetched:
    """Every file of (run, step) from `sources` (best first) into `into`, verified; not yet sealed.

    `expect_manifest`: the BLAKE3 of the MANIFEST.json the catalog recorded (a source with another
    is bad). `prepare(manifest, its BLAKE3)` runs once the manifest is known, before any file is
    written (restore readies its target folder there). Raises TargetDiskError when `into` cannot
    be written; every other failure is in the result (verdict and attempts). `scope`: see Scope.
    """
    readers = [_open_reader(s, run, step, config) for s in sources]
    try:
        return _fetch(run, step, readers, into, expect_manifest, files_at_once, on_bytes, prepare, scope)
    finally:
        for r in readers:
            r.close()


def _fetch(run: str, step: int, readers: list[_Reader], into: Path, expect: str | None, files_at_once: int,
           on_bytes: OnBytes | None, prepare: Callable[[Manifest, str], None] | None,
           scope: Scope | None = None) -> Fetched:
    attempts: dict[str, list[Attempt]] = {}
    good: list[_Reader] = []
    manifest = None
    manifest_bytes = marker_bytes = b""
    parts: list[tuple[Manifest, str]] = []
    for r in readers:
        try:
            m, mb, kb = _read_manifest(r, run, step, r.source.part or expect,
                                       part_of=expect if r.source.part else None)
        except Exception as e:  # noqa: BLE001 - classified: bad, missing or unreadable
            outcome, reason = classify(e)
            attempts.setdefault(MANIFEST_NAME, []).append(Attempt(r.source, outcome, reason))
            continue
        if r.source.part is not None:
            r.holds = {f.path: f for f in m.files}
            parts.append((m, r.source.part))
        elif manifest is None:
            manifest, manifest_bytes, marker_bytes, expect = m, mb, kb, digest_bytes(mb)
        good.append(r)
    if manifest is None and parts:
        merged = _merge_parts(parts, expect)
        if merged is not None:
            manifest, manifest_bytes, marker_bytes = merged
            expect = digest_bytes(manifest_bytes)
    if manifest is None:
        verdict = file_verdict(attempts.get(MANIFEST_NAME, []), len(readers)) or Verdict.NO_COPY
        return Fetched(verdict if readers else Verdict.NO_COPY, attempts)
    assert expect is not None
    out = Fetched(Verdict.WHOLE, attempts, manifest, manifest_bytes, marker_bytes)
    if scope is not None:
        out.whole, out.whole_bytes = manifest, manifest_bytes
        whole_entries = {f.path: f for f in manifest.files}
        manifest, out.manifest_bytes, out.marker_bytes = scope(manifest, expect)
        if any(whole_entries.get(f.path) != f for f in manifest.files):
            raise ValueError("a scope may only choose files of the whole manifest")
        out.manifest = manifest
    if prepare is not None:
        prepare(manifest, expect)

    expected = {f.path: f.size for f in manifest.files}
    rehash, to_fetch = reuse_plan(expected, _on_disk(into, manifest.files))
    by_path = {f.path: f for f in manifest.files}
    for path in rehash:
        if hash_path(resolve_inside(into, path))[1] == by_path[path].blake3:
            out.reused += by_path[path].size
            out.bytes_from[LOCAL] = out.bytes_from.get(LOCAL, 0) + by_path[path].size
            if on_bytes is not None:
                on_bytes(by_path[path].size)
        else:
            to_fetch.append(path)
    lock, stop = threading.Lock(), threading.Event()
    used: set[str] = set()

    def one(entry: FileEntry) -> Verdict:
        final = resolve_inside(into, entry.path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f"{TMP_PREFIX}{final.name}")
        tries: list[Attempt] = []
        holders = [r for r in good if r.holds is None or r.holds.get(entry.path) == entry]
        for r in holders:
            if stop.is_set():
                return Verdict.UNREADABLE
            outcome, reason = _fetch_one(r, entry, tmp, final, on_bytes)
            tries.append(Attempt(r.source, outcome, reason))
            if outcome is Outcome.OK:
                key = LOCAL if r.source.local else r.source.base
                with lock:
                    used.add(r.source.url)
                    out.bytes_from[key] = out.bytes_from.get(key, 0) + entry.size
                break
        with lock:
            attempts.setdefault(entry.path, []).extend(tries)
        return file_verdict(tries, len(holders)) or Verdict.NO_COPY

    entries = sorted((by_path[p] for p in to_fetch), key=lambda f: -f.size)  # big first: even the load
    verdicts: list[Verdict] = []
    disk_error: BaseException | None = None
    # Memory is bounded by each source's buffer pool, not by `files_at_once`. Eight at once lets the
    # shards of a typical checkpoint move together: with four, the files ended in waves, and each
    # wave's fsyncs and HEADs left the connections idle (8 x 128 MiB: about 3-7% slower, measured).
    with ThreadPoolExecutor(max(1, files_at_once), thread_name_prefix="safepoint-fetch") as pool:
        futures = [pool.submit(one, e) for e in entries]
        for fut in futures:
            try:
                verdicts.append(fut.result())
            except _DiskError as e:
                stop.set()
                disk_error = disk_error or e.__cause__ or e
    if disk_error is not None:
        msg = disk_error.strerror if isinstance(disk_error, OSError) and disk_error.strerror else str(disk_error)
        raise TargetDiskError(f"could not write into {into}: {msg}") from disk_error
    out.verdict = checkpoint_verdict(verdicts)
    out.used = [r.source.url for r in good if r.source.url in used]
    out.fetched = sum(by_path[p].size for p in to_fetch)
    return out


def _merge_parts(parts: list[tuple[Manifest, str]], expect: str | None) -> tuple[Manifest, bytes, bytes] | None:
    """The whole manifest and marker made from the parts (the merge is deterministic), or None when
    they do not hold every rank or do not merge into the manifest the catalog recorded."""
    try:
        merged = merge_manifests(parts)
    except FormatError:
        return None
    data = merged.to_json_bytes()
    if set(merged.held_ranks) != set(range(merged.world_size)) or expect not in (None, digest_bytes(data)):
        return None
    return merged, data, marker_for(data, merged).to_json_bytes()


class _DiskError(Exception):
    """The target folder failed: abort, the sources are not at fault."""


def _fetch_one(r: _Reader, entry: FileEntry, tmp: Path, final: Path, on_bytes: OnBytes | None) -> tuple[Outcome, str]:
    """One file from one source into `tmp`, verified, fsynced, renamed to `final`."""
    try:
        digest = r.fetch(entry, tmp, on_bytes)  # FileNotFoundError: missing; FormatError: another size
        got = os.stat(tmp).st_size
        if got != entry.size:
            tmp.unlink(missing_ok=True)
            return Outcome.BAD, f"{got} bytes arrived, the manifest says {entry.size}"
        if digest != entry.blake3:
            tmp.unlink(missing_ok=True)
            return Outcome.BAD, "BLAKE3 mismatch: the bytes are not the manifest's"
        publish(tmp, final, sync_folder=False)  # the folders are fsynced once, by commit_fetched()
        return Outcome.OK, ""
    except (FileNotFoundError, DestinationError, FormatError) as e:
        tmp.unlink(missing_ok=True)
        return classify(e)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _DiskError(str(e)) from e
    except Exception as e:  # noqa: BLE001 - a store's own exception type: unreadable, not bad
        tmp.unlink(missing_ok=True)
        return classify(e)


def commit_fetched(into: Path, fetched: Fetched) -> None:
    """fsync the folders, then write MANIFEST.json, then COMMITTED (exactly the source's bytes).

    An OSError leaves no marker behind and is raised: nothing was committed.
    """
    for dirpath, _dirs, _files in os.walk(into):
        fsync_dir(Path(dirpath))
    try:
        write_replace(into / MANIFEST_NAME, fetched.manifest_bytes)
        write_replace(into / MARKER_NAME, fetched.marker_bytes)
    except OSError:
        (into / MARKER_NAME).unlink(missing_ok=True)
        raise


@contextmanager
def fetched_copy(run: str, step: int, sources: Sequence[Source], config: Config, *,
                 expect_manifest: str | None = None, label: str = "fetch") -> Iterator[tuple[LocalSnapshot | None,
                                                                                             Fetched]]:
    """(snapshot, result): a verified, sealed copy in a temporary folder (removed afterwards), or None."""
    tmp_root = tmp_dir()
    tmp_root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"{label}-{run}-{step}-", dir=tmp_root))
    try:
        result = fetch_snapshot(run, step, sources, folder, config=config, expect_manifest=expect_manifest)
        snap = None
        if result.verdict is Verdict.WHOLE:
            commit_fetched(folder, result)
            snap = LocalSnapshot.open(folder)
        yield snap, result
    finally:
        shutil.rmtree(folder, ignore_errors=True)
