"""Restore: the verified way back to training, from any replica, falling back past bad copies.

`restore(run, into)` brings the resume point (or `step`) into the local folder `into` and returns
only when every byte there was BLAKE3-hashed as it arrived and matched the manifest that the
source's COMMITTED marker binds (and that the catalog recorded). The order of work:

1. choose the checkpoint (the pure resume rule, safepoint.decisions.resume_point);
2. order its sources (safepoint.rules.restore.source_order): the local copy, then the replicas;
3. read each source's marker and manifest; a source whose manifest is not the checkpoint's is bad;
4. fetch the files, several at once (S3: parallel ranged GETs with pooled buffers), each into a
   temporary name, hashed as it arrives, fsynced, then renamed; a file that fails is fetched from
   the next source that holds it, and the source is recorded bad in the catalog with the reason;
5. MANIFEST.json, then COMMITTED, both fsynced: `into` is then a committed Safepoint snapshot.

Files already in `into` that verify are reused, so a restore cut short (kill -9, a reset) is
finished by running it again; until step 5, `into` holds no marker. When no copy of the chosen
checkpoint is whole, the next older verified checkpoint is tried (not when `step` was given); a
failure to read (network, store) is never taken for a bad copy, and a local disk error aborts.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safepoint.catalog.store import Catalog, open_catalog
from safepoint.core import resumed
from safepoint.core.config import Config, load_config
from safepoint.core.errors import DestinationError, FormatError, SafepointError, UsageError
from safepoint.core.format import (
    MANIFEST_NAME,
    MARKER_NAME,
    TMP_PREFIX,
    FileEntry,
    Manifest,
    digest_bytes,
    load_committed,
)
from safepoint.core.hashing import hash_path
from safepoint.core.redact import redact
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.destinations import open_destination
from safepoint.destinations.base import Destination, check_size
from safepoint.destinations.local import copy_and_hash
from safepoint.local.atomic import fsync_dir, fsync_file, write_replace
from safepoint.local.snapshot import LocalSnapshot, read_small, resolve_inside
from safepoint.ops.resume import find_resume_point
from safepoint.ops.runner import INLINE, StepRunner
from safepoint.ops.steps import settle_copies
from safepoint.rules.restore import (
    Attempt,
    Outcome,
    Source,
    TargetAction,
    Verdict,
    checkpoint_verdict,
    file_verdict,
    replica_findings,
    reuse_plan,
    source_order,
    target_action,
)

STATE_NAME = f"{TMP_PREFIX}restore.json"   # present while a restore into the folder is unfinished
EVENT = "restore"


class RestoreError(SafepointError):
    """A restore that could not finish for a reason of infrastructure or usage (exit code 2)."""

    exit_code = 2


class NothingToRestore(RestoreError):
    """No checkpoint in scope has a whole, verified copy anywhere (exit code 1)."""

    exit_code = 1


class TargetNotEmpty(RestoreError, UsageError):
    """The folder holds something other than this checkpoint (use force=True to replace it)."""


@dataclass
class RestoreResult(os.PathLike):
    """What a restore did; also the restored folder itself (`os.fspath`, `str`, `/`, `Path(...)`), so a
    trainer's loader takes it as it is: `resume_from_checkpoint=os.fspath(safepoint.restore(run, into))`."""

    run: str
    step: int
    path: Path
    sources: list[str] = field(default_factory=list)     # the sources that supplied bytes
    bytes_fetched: int = 0
    bytes_reused: int = 0
    seconds: float = 0.0
    failed: list[dict[str, str]] = field(default_factory=list)        # sources found bad: url, state, reason
    fell_back_from: list[dict[str, Any]] = field(default_factory=list)  # step, reason

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "step": self.step, "path": str(self.path), "sources": self.sources,
                "bytes_fetched": self.bytes_fetched, "bytes_reused": self.bytes_reused,
                "seconds": round(self.seconds, 3), "failed": self.failed, "fell_back_from": self.fell_back_from}

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return os.fspath(self.path)

    def __truediv__(self, other: str | os.PathLike[str]) -> Path:
        return self.path / other


# -- reading from one source ------------------------------------------------------------------

class _Reader:
    """One source's files: a destination's replica, or the node's committed local folder."""

    def __init__(self, source: Source, run: str, step: int, dest: Destination | None):
        self.source, self.run, self.step, self.dest = source, run, step, dest

    def control(self, name: str) -> bytes | None:
        if self.dest is None:
            return read_small(Path(self.source.url) / name)
        return self.dest.read_control(self.run, self.step, name)

    def fetch(self, entry: FileEntry, target: Path, on_bytes: Callable[[int], None] | None) -> str:
        """The file into `target`; FileNotFoundError when absent, FormatError when not the manifest's size."""
        if self.dest is None:
            src = resolve_inside(Path(self.source.url), entry.path)
            try:
                found: int | None = os.stat(src, follow_symlinks=False).st_size
            except FileNotFoundError:
                found = None
            check_size(found, entry.size, str(src))
            return copy_and_hash(src, target, on_bytes)
        # The destination checks the size itself, in the request that starts the read (one HEAD on S3).
        return self.dest.fetch(self.run, self.step, entry.path, target, on_bytes, size=entry.size)

    def close(self) -> None:
        if self.dest is not None:
            self.dest.close()


class _DiskError(Exception):
    """The folder being restored into failed (full, read-only): abort, the sources are not at fault."""


def _open_reader(source: Source, run: str, step: int, config: Config) -> _Reader:
    if source.local:
        return _Reader(source, run, step, None)
    return _Reader(source, run, step, open_destination(source.base, config.storage_options(source.base)))


def _read_manifest(reader: _Reader, run: str, step: int, expect_blake3: str | None) -> tuple[Manifest, bytes, bytes]:
    """The source's manifest, bound by its marker, for (run, step), and the catalog's if it has one.

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
    if expect_blake3 is not None and digest_bytes(manifest_bytes) != expect_blake3:
        raise FormatError("its MANIFEST.json is not the one the catalog recorded (a stale or foreign copy)")
    return manifest, manifest_bytes, marker


def _classify(e: BaseException) -> tuple[Outcome, str]:
    if isinstance(e, FileNotFoundError):
        return Outcome.MISSING, "missing"
    if isinstance(e, FormatError):
        return Outcome.BAD, str(e)
    return Outcome.ERROR, redact(str(e)) or type(e).__name__


# -- the target folder ------------------------------------------------------------------------

def _prepare_target(into: Path, want: tuple[str, int], force: bool) -> TargetAction:
    if into.exists() and (not into.is_dir() or into.is_symlink()):
        raise TargetNotEmpty(f"{into}: exists and is not a directory")
    into.mkdir(parents=True, exist_ok=True)
    names = os.listdir(into)
    committed_as = None
    if (into / MARKER_NAME).exists():
        try:
            m = LocalSnapshot.open(into).manifest
            committed_as = (m.run, m.step)
        except FormatError:
            committed_as = None
    action = target_action(names, committed_as=committed_as, restore_state=(into / STATE_NAME).exists(),
                           want=want, force=force)
    if action is TargetAction.REFUSE:
        what = f"a committed snapshot of {committed_as[0]}/{committed_as[1]}" if committed_as else "other files"
        raise TargetNotEmpty(f"{into}: not empty (holds {what}); restore into an empty folder, or use --force "
                             "to replace its contents")
    if action is TargetAction.CLEAR:
        _unmark(into)
        for name in names:
            p = into / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
    return action


def _unmark(into: Path) -> None:
    """Marker first, then manifest: a folder being changed must never look committed."""
    for name in (MARKER_NAME, MANIFEST_NAME):
        (into / name).unlink(missing_ok=True)
    fsync_dir(into)


def _remove_extras(into: Path, manifest: Manifest) -> None:
    """Remove what is not part of the checkpoint (leftovers of an earlier, different restore)."""
    keep = {f.path for f in manifest.files} | {STATE_NAME, MARKER_NAME, MANIFEST_NAME}
    for dirpath, dirnames, filenames in os.walk(into, topdown=False):
        for name in filenames:
            p = Path(dirpath) / name
            if p.relative_to(into).as_posix() not in keep:
                p.unlink(missing_ok=True)
        for name in dirnames:
            p = Path(dirpath) / name
            if p.is_symlink():
                p.unlink()
            elif not any(p.iterdir()):
                p.rmdir()


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


# -- the steps ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Choice:
    checkpoint_id: int
    step: int
    manifest_blake3: str | None
    local_path: str | None
    replicas: tuple[tuple[str, str], ...]   # (snapshot url, destination base) of verified replicas
    total_bytes: int


def choose(catalog: Catalog, run: str, step: int | None, *, min_replicas: int = 1,
           max_step: int | None = None) -> _Choice:
    """The checkpoint to restore: `step` exactly, or the resume point at or below `max_step`."""
    if step is not None:
        row = catalog.get(run, step)
        if row is None:
            raise NothingToRestore(f"no checkpoint {run}/{step} in the catalog")
        if row.state is not CS.VERIFIED:
            raise NothingToRestore(f"{run}/{step} is {row.state}" + (f": {row.error}" if row.error else ""))
        reps = tuple((r.url, r.destination) for r in catalog.replicas(row.id) if r.state is RS.VERIFIED)
        return _Choice(row.id, row.step, row.manifest_blake3, row.local_path, reps, row.total_bytes)
    decision = find_resume_point(catalog, run, min_replicas=min_replicas, max_step=max_step)
    c = decision.chosen
    if c is None:
        why = "; ".join(f"step {v.step}: {reason}" for v, reason in decision.passed_over[:5])
        known = bool(decision.passed_over) or catalog.get_run_id(run) is not None
        raise NothingToRestore(
            (f"no verified checkpoint with {min_replicas} verified replica(s) for run {run!r}"
             + (f" at or below step {max_step}" if max_step is not None else "") + (f" ({why})" if why else ""))
            if known else f"no checkpoints recorded for run {run!r}")
    row = catalog.get(run, c.step)
    assert row is not None
    reps = tuple((r.url, r.destination) for r in c.verified_replicas())
    return _Choice(c.id, c.step, row.manifest_blake3, c.local_path, reps, c.total_bytes)


@dataclass
class _Fetched:
    verdict: Verdict
    attempts: dict[str, list[Attempt]]
    manifest: Manifest | None = None
    manifest_bytes: bytes = b""
    marker_bytes: bytes = b""
    used: list[str] = field(default_factory=list)
    fetched: int = 0
    reused: int = 0


def fetch_checkpoint(run: str, choice: _Choice, sources: Sequence[Source], into: Path, *, force: bool,
                     config: Config, files_at_once: int = 8,
                     on_bytes: Callable[[int], None] | None = None) -> _Fetched:
    """Steps 3 and 4: find the manifest, then every file whole in `into` (not yet committed)."""
    readers = [_open_reader(s, run, choice.step, config) for s in sources]
    try:
        return _fetch(run, choice, readers, into, force=force, files_at_once=files_at_once, on_bytes=on_bytes)
    finally:
        for r in readers:
            r.close()


def _fetch(run: str, choice: _Choice, readers: list[_Reader], into: Path, *, force: bool, files_at_once: int,
           on_bytes: Callable[[int], None] | None) -> _Fetched:
    attempts: dict[str, list[Attempt]] = {}
    good: list[_Reader] = []
    manifest = None
    manifest_bytes = marker_bytes = b""
    expect = choice.manifest_blake3
    for r in readers:
        try:
            m, mb, kb = _read_manifest(r, run, choice.step, expect)
        except Exception as e:  # noqa: BLE001 - classified: bad, missing or unreadable
            outcome, reason = _classify(e)
            attempts.setdefault(MANIFEST_NAME, []).append(Attempt(r.source, outcome, reason))
            continue
        if manifest is None:
            manifest, manifest_bytes, marker_bytes, expect = m, mb, kb, digest_bytes(mb)
        good.append(r)
    if manifest is None:
        verdict = file_verdict(attempts.get(MANIFEST_NAME, []), len(readers)) or Verdict.NO_COPY
        return _Fetched(verdict if readers else Verdict.NO_COPY, attempts)
    out = _Fetched(Verdict.WHOLE, attempts, manifest, manifest_bytes, marker_bytes)

    action = _prepare_target(into, (run, choice.step), force)
    if action is not TargetAction.FRESH:
        _unmark(into)
    (into / STATE_NAME).write_text(json.dumps({"run": run, "step": choice.step, "manifest_blake3": expect}))
    _remove_extras(into, manifest)

    expected = {f.path: f.size for f in manifest.files}
    rehash, to_fetch = reuse_plan(expected, _on_disk(into, manifest.files))
    by_path = {f.path: f for f in manifest.files}
    for path in rehash:
        if hash_path(resolve_inside(into, path))[1] == by_path[path].blake3:
            out.reused += by_path[path].size
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
        for r in good:
            if stop.is_set():
                return Verdict.UNREADABLE
            outcome, reason = _fetch_one(r, entry, tmp, final, on_bytes)
            tries.append(Attempt(r.source, outcome, reason))
            if outcome is Outcome.OK:
                with lock:
                    used.add(r.source.url)
                break
        with lock:
            attempts.setdefault(entry.path, []).extend(tries)
        return file_verdict(tries, len(good)) or Verdict.NO_COPY

    entries = sorted((by_path[p] for p in to_fetch), key=lambda f: -f.size)  # big first: even the load
    verdicts: list[Verdict] = []
    disk_error: BaseException | None = None
    # Memory is bounded by each source's buffer pool, not by `files_at_once`. Eight at once lets the
    # shards of a typical checkpoint move together: with four, the files ended in waves, and each
    # wave's fsyncs and HEADs left the connections idle (8 x 128 MiB: about 3-7% slower, measured).
    with ThreadPoolExecutor(max(1, files_at_once), thread_name_prefix="safepoint-restore") as pool:
        futures = [pool.submit(one, e) for e in entries]
        for fut in futures:
            try:
                verdicts.append(fut.result())
            except _DiskError as e:
                stop.set()
                disk_error = disk_error or e.__cause__ or e
    if disk_error is not None:
        msg = disk_error.strerror if isinstance(disk_error, OSError) and disk_error.strerror else str(disk_error)
        raise RestoreError(f"could not write into {into}: {msg}; nothing was committed "
                           "(free space and run the restore again: files that verify are kept)") from disk_error
    out.verdict = checkpoint_verdict(verdicts)
    out.used = [r.source.url for r in good if r.source.url in used]
    out.fetched = sum(by_path[p].size for p in to_fetch)
    return out


def _fetch_one(r: _Reader, entry: FileEntry, tmp: Path, final: Path,
               on_bytes: Callable[[int], None] | None) -> tuple[Outcome, str]:
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
        fsync_file(tmp)
        os.replace(tmp, final)
        return Outcome.OK, ""
    except (FileNotFoundError, DestinationError, FormatError) as e:
        tmp.unlink(missing_ok=True)
        return _classify(e)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _DiskError(str(e)) from e
    except Exception as e:  # noqa: BLE001 - a store's own exception type: unreadable, not bad
        tmp.unlink(missing_ok=True)
        return _classify(e)


def seal(into: Path, fetched: _Fetched) -> None:
    """Step 5: fsync the folders, then MANIFEST.json, then COMMITTED (exactly the source's bytes)."""
    for dirpath, _dirs, _files in os.walk(into):
        fsync_dir(Path(dirpath))
    try:
        write_replace(into / MANIFEST_NAME, fetched.manifest_bytes)
        write_replace(into / MARKER_NAME, fetched.marker_bytes)
    except OSError as e:
        (into / MARKER_NAME).unlink(missing_ok=True)
        raise RestoreError(f"could not commit {into}: {e.strerror or e}; nothing was committed") from e
    (into / STATE_NAME).unlink(missing_ok=True)
    fsync_dir(into)


def record_findings(catalog: Catalog, choice: _Choice, fetched: _Fetched) -> list[dict[str, str]]:
    """Mark each replica found bad (corrupt or missing, with the reason); settle the checkpoint."""
    failed = []
    for source, (state, reason) in replica_findings(fetched.attempts).items():
        catalog.set_replica(choice.checkpoint_id, source.url, source.base, RS(state), error=f"restore: {reason}")
        failed.append({"url": source.url, "state": state, "reason": reason})
    for path, tries in sorted(fetched.attempts.items()):
        for a in tries:
            if a.source.local and a.outcome is Outcome.BAD:  # a local copy that is gone is no news
                failed.append({"url": a.source.url, "state": "corrupt", "reason": f"{path}: {a.reason}"})
                break
    if failed:
        settle_copies(catalog, choice.checkpoint_id)
    return failed


# -- the operation ------------------------------------------------------------------------------

def restore(
    run: str,
    into: str | os.PathLike[str],
    step: int | None = None,
    *,
    sources: Sequence[str] = (),
    min_replicas: int = 1,
    force: bool = False,
    catalog: Catalog | None = None,
    config: Config | None = None,
    files_at_once: int = 8,
    on_bytes: Callable[[int], None] | None = None,
    say: Callable[[str], None] | None = None,
    runner: StepRunner = INLINE,
) -> RestoreResult:
    """Restore `run`'s resume point (or `step`) into the folder `into`, verified; see the module doc.

    Returns a RestoreResult (`.step`, `.path`). Raises NothingToRestore when no checkpoint in scope
    has a whole copy (with `step`: when that one has none), TargetNotEmpty when `into` holds
    something else and not `force`, RestoreError on an infrastructure failure.
    """
    t0 = time.perf_counter()
    config = config or load_config()
    catalog = catalog or open_catalog(config.catalog_url)
    target = Path(into).absolute()
    prefer = [str(p) for p in config.section("restore").get("prefer", [])]
    say = say or (lambda _msg: None)
    fell_back: list[dict[str, Any]] = []
    failed_all: list[dict[str, str]] = []
    max_step: int | None = None
    while True:
        choice = runner.run("choose checkpoint", choose, catalog, run, step, min_replicas=min_replicas,
                          max_step=max_step)
        srcs = source_order(choice.local_path, choice.replicas, run=run, step=choice.step, prefer=prefer,
                            forced=sources)
        fetched = runner.run("fetch files", fetch_checkpoint, run, choice, srcs, target, force=force, config=config,
                           files_at_once=files_at_once, on_bytes=on_bytes)
        failed = runner.run("record findings", record_findings, catalog, choice, fetched)
        failed_all.extend(failed)
        for f in failed:
            say(f"{f['url']}: {f['state']} ({f['reason']})")
        if fetched.verdict is Verdict.WHOLE:
            runner.run("commit", seal, target, fetched)
            result = RestoreResult(run, choice.step, target, fetched.used, fetched.fetched, fetched.reused,
                                   time.perf_counter() - t0, failed_all, fell_back)
            catalog.add_event(EVENT, checkpoint_id=choice.checkpoint_id,
                              detail={**result.to_dict(), "path": str(target)})
            resumed.note_resumed(run, choice.step)  # the next checkpoint sealed here follows this one
            return result
        reason = "no whole copy" if fetched.verdict is Verdict.NO_COPY else "copies could not be read"
        catalog.add_event(f"{EVENT}.failed", checkpoint_id=choice.checkpoint_id,
                          detail={"verdict": str(fetched.verdict), "failed": failed,
                                  "sources": [s.url for s in srcs],
                                  "errors": [{"url": a.source.url, "file": p, "reason": a.reason}
                                             for p, tries in fetched.attempts.items() for a in tries
                                             if a.outcome is Outcome.ERROR][:20]})
        if fetched.verdict is Verdict.UNREADABLE:
            errs = [f"{a.source.url}: {p}: {a.reason}" for p, tries in fetched.attempts.items() for a in tries
                    if a.outcome is Outcome.ERROR]
            raise RestoreError(f"{run}/{choice.step}: {reason} ({errs[0] if errs else 'no source'}); "
                               "nothing was committed")
        if step is not None:
            raise NothingToRestore(f"{run}/{step}: no whole copy in {len(srcs)} source(s)"
                                   + (f" ({failed[0]['url']}: {failed[0]['reason']})" if failed else ""))
        fell_back.append({"step": choice.step, "reason": reason})
        say(f"{run}/{choice.step}: no whole copy in {len(srcs)} source(s); falling back to an older checkpoint")
        max_step = choice.step - 1
        if max_step < 0:
            raise NothingToRestore(f"no checkpoint of {run!r} has a whole copy")
