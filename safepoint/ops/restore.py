"""Restore: the verified way back to training, from any replica, falling back past bad copies.

`restore(run, into)` brings the resume point (or `step`) into the local folder `into` and returns
only when every byte there was BLAKE3-hashed as it arrived and matched the manifest that the
source's COMMITTED marker binds (and that the catalog recorded). The order of work:

1. choose the checkpoint (the pure resume rule, safepoint.rules.resume);
2. order its sources (safepoint.rules.restore.source_order): the local copy, then the replicas; a
   multi-node checkpoint's local parts (every node's folder the catalog recorded that this machine
   can read, each held to its part's digest and supplying only its own files) come first;
3. read each source's marker and manifest; a source whose manifest is not the checkpoint's is bad
   (for a multi-node checkpoint: the whole, merged manifest whose digest the last part recorded);
4. fetch the files (safepoint.ops.fetch, the one verified fetch), several at once (S3: parallel
   ranged GETs with pooled buffers), each into a temporary name, hashed as it arrives, fsynced,
   then renamed; a file that fails is fetched from the next source that holds it, and the source
   is recorded bad in the catalog with the reason;
5. MANIFEST.json, then COMMITTED, both fsynced: `into` is then a committed Safepoint snapshot,
   never one that lacks a rank (safepoint.rules.completeness.copy_problem).

Files already in `into` that verify are reused, so a restore cut short (kill -9, a reset) is
finished by running it again; until step 5, `into` holds no marker. When no copy of the chosen
checkpoint is whole, the next older verified checkpoint is tried (not when `step` was given); a
failure to read (network, store) is never taken for a bad copy, and a local disk error aborts.

A fleet restart restores one node's part on each node (`node=` or `ranks=`, docs/fleet-restore.md):
the whole manifest is read and held to the catalog's digest, and only the files of those ranks, with
every file no rank owns (DCP's `.metadata`), are fetched: from the folder itself and the node's own
part first, then the replicas in the configured order. `into` is committed as a part (its manifest
names its ranks, world size and node). A scoped restore never falls back on its own: when its part
has no whole copy, the replicas found bad are recorded (which moves the resume point back for every
node), it says so in the catalog (`restore.part_failed`) and exits 1, and the launcher runs the
round again, so no two nodes resume different steps. `into` may hold `{step}` (e.g.
`/nvme/ckpt/step-{step}`), filled in with the step chosen.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safepoint.catalog.lite import LiteCatalog, open_fast
from safepoint.catalog.views import CheckpointRow
from safepoint.core import resumed
from safepoint.core.config import Config, load_config
from safepoint.core.errors import FormatError, SafepointError, UsageError
from safepoint.core.format import (
    MANIFEST_NAME,
    MARKER_NAME,
    TMP_PREFIX,
    Manifest,
    build_manifest,
    digest_bytes,
    load_committed,
    marker_for,
)
from safepoint.core.naming import this_host
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.local.atomic import fsync_dir, write_replace
from safepoint.local.snapshot import LocalSnapshot, read_small
from safepoint.ops.fetch import LOCAL, Fetched, Scope, TargetDiskError, commit_fetched, fetch_snapshot
from safepoint.ops.resume import find_resume_point
from safepoint.ops.runner import INLINE, StepRunner
from safepoint.rules.completeness import FileRow, copy_problem
from safepoint.rules.restore import (
    Outcome,
    ScopeError,
    Source,
    TargetAction,
    Verdict,
    format_ranks,
    part_meta,
    replica_findings,
    scope_ranks,
    scoped_files,
    source_order,
    target_action,
)

if TYPE_CHECKING:
    from safepoint.catalog.store import Catalog

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


class BadScope(RestoreError, UsageError):
    """A rank or node the checkpoint does not have (exit code 2)."""


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
    bytes_from: dict[str, int] = field(default_factory=dict)  # "local" (folder, own part) or replica base -> bytes
    ranks: tuple[int, ...] | None = None      # a scoped restore: the ranks brought back
    node: str | None = None                   # ... and the node its part is committed under
    world_size: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "step": self.step, "path": str(self.path), "sources": self.sources,
                "bytes_fetched": self.bytes_fetched, "bytes_reused": self.bytes_reused,
                "bytes_from": {LOCAL: 0, **self.bytes_from}, "world_size": self.world_size,
                "ranks": list(self.ranks) if self.ranks is not None else None, "node": self.node,
                "seconds": round(self.seconds, 3), "failed": self.failed, "fell_back_from": self.fell_back_from}

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return os.fspath(self.path)

    def __truediv__(self, other: str | os.PathLike[str]) -> Path:
        return self.path / other


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


# -- the steps ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Choice:
    checkpoint_id: int
    step: int
    manifest_blake3: str | None
    local_path: str | None
    replicas: tuple[tuple[str, str], ...]   # (snapshot url, destination base) of verified replicas
    total_bytes: int
    world_size: int = 1
    parts: tuple[tuple[str, str], ...] = ()  # multi-node: (local folder, part manifest BLAKE3), rank order
    files: tuple[FileRow, ...] = ()          # the catalog's per-file rows (multi-node, no whole digest)
    holders: tuple[tuple[int, str | None, str | None, str | None], ...] = ()  # rank, node, folder, part BLAKE3


def _choice(catalog: Catalog, row: CheckpointRow, replicas: tuple[tuple[str, str], ...]) -> _Choice:
    if row.world_size <= 1:
        return _Choice(row.id, row.step, row.manifest_blake3, row.local_path, replicas, row.total_bytes)
    rows = catalog.ranks(row.id)
    parts = tuple(dict.fromkeys((r["local_path"], r["manifest_blake3"]) for r in rows
                                if r["local_path"] and r["manifest_blake3"]))
    holders = tuple((r["rank"], r["node"], r["local_path"], r["manifest_blake3"]) for r in rows)
    files = () if row.manifest_blake3 else tuple((f.path, f.size, f.blake3) for f in catalog.files(row.id))
    return _Choice(row.id, row.step, row.manifest_blake3, None, replicas, row.total_bytes, row.world_size,
                   parts, files, holders)


@dataclass(frozen=True)
class _Scoped:
    """A fleet restore's part: the ranks, the node it is committed under, and its own copies."""

    ranks: tuple[int, ...]
    node: str | None
    parts: tuple[tuple[str, str], ...]   # the node's own part folders (those holding any of the ranks)


def scope_of(choice: _Choice, node: str | None, ranks: Sequence[int] | None) -> _Scoped | None:
    """The part to restore (None: the whole checkpoint); BadScope for a rank or node it does not have."""
    if node is None and ranks is None:
        return None
    holders = [(r, n) for r, n, _p, _d in choice.holders]
    try:
        if choice.world_size <= 1:  # one node's checkpoint: its part is the whole
            scope_ranks(1, holders, ranks=ranks if ranks is not None else (0,))
            return None
        want = scope_ranks(choice.world_size, holders, node=node, ranks=ranks)
    except ScopeError as e:
        raise BadScope(f"{e}") from None
    if set(want) == set(range(choice.world_size)):
        return None  # every rank: the whole checkpoint, as a whole
    if node is None:
        owners = {n for r, n in holders if r in want}
        node = owners.pop() if len(owners) == 1 and None not in owners else this_host()
    own = tuple(dict.fromkeys((p, d) for r, _n, p, d in choice.holders if r in want and p and d))
    return _Scoped(want, node, own)


def part_scope(scoped: _Scoped, into: Path) -> Scope:
    """The Scope of fetch_snapshot: the part's manifest, made from the whole one (pure and deterministic,
    so every node restoring the same ranks commits the same bytes), or the folder's own committed part
    when it is exactly that part already (a node's own checkpoint folder stays as it was sealed)."""
    held = _committed(into)

    def scope(whole: Manifest, whole_blake3: str) -> tuple[Manifest, bytes, bytes]:
        keep = set(scoped_files((f.path for f in whole.files), whole.world_size, scoped.ranks))
        files = tuple(f for f in whole.files if f.path in keep)
        if held is not None:
            m, mb, kb = held
            if ((m.run, m.step, m.world_size, tuple(sorted(m.held_ranks)), m.node, m.files)
                    == (whole.run, whole.step, whole.world_size, scoped.ranks, scoped.node, files)):
                return m, mb, kb
        part = build_manifest(whole.run, whole.step, list(files), created=whole.created,
                              world_size=whole.world_size, ranks=scoped.ranks, node=scoped.node,
                              parent=whole.parent, meta=part_meta(whole.meta, whole_blake3))
        data = part.to_json_bytes()
        return part, data, marker_for(data, part).to_json_bytes()

    return scope


def _committed(into: Path) -> tuple[Manifest, bytes, bytes] | None:
    """The folder's committed manifest and marker bytes, or None (absent, unreadable, not committed)."""
    try:
        mb, kb = read_small(into / MANIFEST_NAME), read_small(into / MARKER_NAME)
        return (load_committed(mb, kb), mb, kb) if mb is not None and kb is not None else None
    except (OSError, FormatError):
        return None


def choose(catalog: Catalog | LiteCatalog, run: str, step: int | None, *, min_replicas: int = 1,
           max_step: int | None = None) -> _Choice:
    """The checkpoint to restore: `step` exactly, or the resume point at or below `max_step`; every
    read in one catalog transaction (a fleet's N nodes: N reads, one snapshot each)."""
    with catalog.one_read():
        return _choose(catalog, run, step, min_replicas=min_replicas, max_step=max_step)


def _choose(catalog: Catalog | LiteCatalog, run: str, step: int | None, *, min_replicas: int,
            max_step: int | None) -> _Choice:
    if step is not None:
        row = catalog.get(run, step)
        if row is None:
            raise NothingToRestore(f"no checkpoint {run}/{step} in the catalog")
        if row.state is not CS.VERIFIED:
            raise NothingToRestore(f"{run}/{step} is {row.state}" + (f": {row.error}" if row.error else ""))
        reps = tuple((r.url, r.destination) for r in catalog.replicas(row.id) if r.state is RS.VERIFIED)
        return _choice(catalog, row, reps)
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
    return _choice(catalog, row, tuple((r.url, r.destination) for r in c.verified_replicas()))


def fetch_checkpoint(run: str, choice: _Choice, sources: Sequence[Source], into: Path, *, force: bool,
                     config: Config, files_at_once: int = 8,
                     on_bytes: Callable[[int], None] | None = None, scoped: _Scoped | None = None) -> Fetched:
    """Steps 3 and 4 (safepoint.ops.fetch): find the manifest, then every file whole in `into` (not committed)."""

    def prepare(manifest: Manifest, manifest_blake3: str) -> None:
        action = _prepare_target(into, (run, choice.step), force)
        if action is not TargetAction.FRESH:
            _unmark(into)
        state = {"run": run, "step": choice.step, "manifest_blake3": manifest_blake3}
        write_replace(into / STATE_NAME, json.dumps(state).encode())
        _remove_extras(into, manifest)

    try:
        return fetch_snapshot(run, choice.step, sources, into, config=config, expect_manifest=choice.manifest_blake3,
                              files_at_once=files_at_once, on_bytes=on_bytes, prepare=prepare,
                              scope=part_scope(scoped, into) if scoped is not None else None)
    except TargetDiskError as e:
        raise RestoreError(f"{e}; nothing was committed "
                           "(free space and run the restore again: files that verify are kept)") from e.__cause__


def whole_problem(choice: _Choice, fetched: Fetched) -> str | None:
    """Why a multi-node fetch is not the checkpoint the catalog recorded with every rank, or None.

    A scoped fetch is held to it through the whole manifest it was cut from."""
    m = fetched.whole or fetched.manifest
    if choice.world_size <= 1 or m is None or fetched.verdict is not Verdict.WHOLE:
        return None
    return copy_problem(choice.world_size, m.held_ranks, digest_bytes(fetched.whole_bytes or fetched.manifest_bytes),
                        ((f.path, f.size, f.blake3) for f in m.files), recorded=choice.manifest_blake3,
                        recorded_files=choice.files)


def commit_restored(into: Path, fetched: Fetched) -> None:
    """Step 5: fsync the folders, then MANIFEST.json, then COMMITTED (exactly the source's bytes)."""
    try:
        commit_fetched(into, fetched)
    except OSError as e:
        raise RestoreError(f"could not commit {into}: {e.strerror or e}; nothing was committed") from e
    (into / STATE_NAME).unlink(missing_ok=True)
    fsync_dir(into)


def record_findings(catalog: Catalog | LiteCatalog, choice: _Choice, fetched: Fetched) -> list[dict[str, str]]:
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
        from safepoint.ops.steps import settle_copies  # only then: it imports the catalog proper

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
    catalog: Catalog | LiteCatalog | None = None,
    config: Config | None = None,
    files_at_once: int = 8,
    on_bytes: Callable[[int], None] | None = None,
    say: Callable[[str], None] | None = None,
    runner: StepRunner = INLINE,
    node: str | None = None,
    ranks: Sequence[int] | None = None,
) -> RestoreResult:
    """Restore `run`'s resume point (or `step`) into the folder `into`, verified; see the module doc.

    `node` / `ranks`: only that node's part, or those ranks (a fleet restart; `into` may hold
    `{step}`). Returns a RestoreResult (`.step`, `.path`). Raises NothingToRestore when no
    checkpoint in scope has a whole copy (with `step`, or scoped: when the one chosen has none),
    BadScope for a rank or node the checkpoint lacks, TargetNotEmpty when `into` holds something
    else and not `force`, RestoreError on an infrastructure failure.
    """
    t0 = time.perf_counter()
    config = config or load_config()
    catalog = catalog or open_fast(config.catalog_url)  # SQLite at head: no SQLAlchemy (catalog.lite)
    into_text = os.fspath(into)
    prefer = [str(p) for p in config.section("restore").get("prefer", [])]
    say = say or (lambda _msg: None)
    fell_back: list[dict[str, Any]] = []
    failed_all: list[dict[str, str]] = []
    max_step: int | None = None
    while True:
        choice = runner.run("choose checkpoint", choose, catalog, run, step, min_replicas=min_replicas,
                          max_step=max_step)
        scoped = scope_of(choice, node, ranks)
        target = Path(into_text.replace("{step}", str(choice.step))).absolute()
        srcs = source_order(choice.local_path, choice.replicas, run=run, step=choice.step, prefer=prefer,
                            forced=sources, parts=scoped.parts if scoped is not None else choice.parts)
        fetched = runner.run("fetch files", fetch_checkpoint, run, choice, srcs, target, force=force, config=config,
                           files_at_once=files_at_once, on_bytes=on_bytes, scoped=scoped)
        failed = runner.run("record findings", record_findings, catalog, choice, fetched)
        problem = whole_problem(choice, fetched)
        if problem is not None:  # never commit a folder that is not the whole checkpoint
            fetched.verdict = Verdict.NO_COPY
            failed.append({"url": ", ".join(fetched.used) or "(no source)", "state": "corrupt", "reason": problem})
        failed_all.extend(failed)
        for f in failed:
            say(f"{f['url']}: {f['state']} ({f['reason']})")
        if fetched.verdict is Verdict.WHOLE:
            runner.run("commit", commit_restored, target, fetched)
            result = RestoreResult(run, choice.step, target, fetched.used, fetched.fetched, fetched.reused,
                                   time.perf_counter() - t0, failed_all, fell_back, dict(fetched.bytes_from),
                                   scoped.ranks if scoped else None, scoped.node if scoped else None,
                                   choice.world_size)
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
        if scoped is not None:  # the fleet must agree on the step: record, and let the round run again
            part = f"ranks {format_ranks(scoped.ranks)}" + (f" (node {scoped.node})" if scoped.node else "")
            catalog.add_event(f"{EVENT}.part_failed", checkpoint_id=choice.checkpoint_id,
                              detail={"node": scoped.node, "ranks": list(scoped.ranks), "failed": failed,
                                      "host": this_host()})
            raise NothingToRestore(
                f"{run}/{choice.step}: {part} has no whole copy in {len(srcs)} source(s)"
                + (f" ({failed[0]['url']}: {failed[0]['reason']})" if failed else "")
                + ("; recorded, the resume point moves back for every node: run the restore again on every node"
                   if step is None else ""))
        if step is not None:
            raise NothingToRestore(f"{run}/{step}: no whole copy in {len(srcs)} source(s)"
                                   + (f" ({failed[0]['url']}: {failed[0]['reason']})" if failed else ""))
        fell_back.append({"step": choice.step, "reason": reason})
        say(f"{run}/{choice.step}: no whole copy in {len(srcs)} source(s); falling back to an older checkpoint")
        max_step = choice.step - 1
        if max_step < 0:
            raise NothingToRestore(f"no checkpoint of {run!r} has a whole copy")
