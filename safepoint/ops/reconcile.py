"""Reconcile the catalog with what destinations and local folders really hold, after any crash.

The pipeline writes in an order that makes every crash leave something safe (docs/format.md):
objects, then the replica's manifest and marker, then the catalog row. A process killed between
two of those steps leaves the catalog and the storage disagreeing, in one of a few ways that this
module repairs, like `restic check` and `restic prune` do for a repository:

- a replica committed at a destination that the catalog does not know (the catalog commit never
  happened, or the catalog was rebuilt) is **adopted**: row added, every byte re-hashed, recorded;
- a committed replica the catalog still has as pending, failed or missing is **confirmed** by
  re-hashing every byte (never by trusting the marker) and recorded as verified or corrupt;
- a catalog replica marked verified whose marker or objects are gone is **marked missing**, and
  one whose control files are unreadable or bind another manifest is **marked corrupt**; a
  checkpoint left without any verified copy becomes corrupt (safepoint.ops.steps.settle_copies);
- a bad replica of a good checkpoint is **replicated again** from a copy that verifies (the local
  folder, or another replica): the objects that still hash right are reused, the rest re-sent;
- partial replicas (no marker) and Safepoint's temporary files (`.safepoint-tmp-*`) untouched for
  longer than a **grace period** are removed: younger ones may belong to an upload in flight; stale
  multipart uploads are aborted where the destination offers it;
- a checkpoint stuck in a pipeline state (replicating, replicated, validating) for longer than the
  grace period is **finished** (validated from a verified copy) when a verified replica exists, or
  **abandoned** back to `committed` (so the next ingest or `watch` pass starts it again);
- what retention already marked `pruned` but did not finish deleting is deleted (marker first).

A committed replica is never deleted unless retention marked its checkpoint pruned, and a copy is
never trusted without re-hashing it. `decide` and `plan_checkpoint` are the pure rules; `reconcile`
observes, decides and acts (or only reports, with dry_run). (`safepoint.ops.steps.quarantine` records a
local folder whose control files are unusable, hostile or broken, as a corrupt checkpoint.)
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any

from safepoint.catalog.store import Catalog
from safepoint.catalog.views import CheckpointRow
from safepoint.core.config import Config, home
from safepoint.core.errors import FormatError, SafepointError
from safepoint.core.format import (
    MANIFEST_NAME,
    MARKER_NAME,
    TMP_PREFIX,
    Manifest,
    check_run,
    digest_bytes,
    load_committed,
)
from safepoint.core.naming import ingest_lease, join
from safepoint.core.redact import redact, redact_url
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.destinations import open_destination
from safepoint.destinations.base import Destination
from safepoint.destinations.local import LocalDestination
from safepoint.destinations.parts import PARTS_DIR
from safepoint.local.safe_delete import open_dir, remove_empty_under, unlink_files
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.leases import default_holder
from safepoint.ops.replicate import verify_replica
from safepoint.ops.steps import replicate_to, settle_copies
from safepoint.ops.validation import validate_checkpoint
from safepoint.rules.settle import replica_state

log = logging.getLogger("safepoint.ops.reconcile")

GRACE_S = 3600.0
# States the ingest pipeline passes through; a checkpoint left in one by a crash is "stale".
IN_FLIGHT = frozenset({CS.REPLICATING, CS.REPLICATED, CS.VALIDATING})
# Replica states that a repair re-replicates (for a checkpoint that has or had a good copy).
REPAIRABLE = frozenset({RS.CORRUPT, RS.MISSING, RS.FAILED})


# -- observations and pure decisions -----------------------------------------------------------

class Found(str, Enum):
    """What a destination holds at <base>/<run>/<step>/."""

    COMMITTED = "committed"   # a marker that binds a valid manifest
    BROKEN = "broken"         # a marker, but the control files do not load (missing, hostile, rotten)
    PARTIAL = "partial"       # objects but no marker
    PARTS = "parts"           # no marker yet, but committed parts of a multi-node checkpoint (safepoint.parts)
    ABSENT = "absent"         # nothing

    def __str__(self) -> str:
        return self.value


class Action(str, Enum):
    NONE = "none"
    ADOPT = "adopt"                       # committed, unknown to the catalog: add the row, re-verify
    CONFIRM = "confirm"                   # committed, catalog not verified: re-verify every byte
    MARK_MISSING = "mark_missing"         # catalog verified; marker or objects gone
    MARK_CORRUPT = "mark_corrupt"         # catalog has the replica; control files bad or not ours
    CONFLICT = "conflict"                 # committed with another manifest than the catalog's: left alone
    UNREADABLE = "unreadable"             # a marker nobody can read, unknown to the catalog: left alone
    REMOVE_PARTIAL = "remove_partial"     # no marker, untouched for longer than the grace period
    KEEP_PARTIAL = "keep_partial"         # no marker, but recent: an upload may be in flight
    ABANDON_REPLICA = "abandon_replica"   # catalog pending, nothing there, for longer than the grace period
    FINISH_PRUNE = "finish_prune"         # retention marked the checkpoint pruned: delete what is left

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Remote:
    """One snapshot location at a destination, as observed."""

    found: Found
    manifest_blake3: str | None = None      # what the marker binds (COMMITTED)
    age_s: float | None = None              # since the newest object under it was written
    complete: bool | None = None            # COMMITTED: every manifest file listed with its size
    size_mismatch: bool = False             # COMMITTED: some file listed with another size


@dataclass(frozen=True)
class Known:
    """What the catalog says about the same location."""

    state: CS | None                        # checkpoint state (None: no row)
    manifest_blake3: str | None = None
    replica: RS | None = None               # replica row at this URL (None: no row)
    replica_age_s: float | None = None      # since that row last changed


def decide(remote: Remote, known: Known, grace_s: float) -> Action:
    """The repair for one location: pure, so it is tested with tables and properties."""
    if known.state is CS.PRUNED:
        done = known.replica in (None, RS.DELETED)
        if remote.found is Found.ABSENT and done:
            return Action.NONE
        if remote.found is not Found.PARTIAL or not done:
            return Action.FINISH_PRUNE  # retention decided: finish its deletion now
        # Leftovers of a finished deletion (empty folders, temporary files) are orphans like any other.
    if remote.found is Found.COMMITTED:
        if known.state is None:
            return Action.ADOPT
        if known.manifest_blake3 and remote.manifest_blake3 != known.manifest_blake3:
            # Someone else's commit sits where the catalog expects ours: never touch it.
            return Action.MARK_CORRUPT if known.replica is RS.VERIFIED else Action.CONFLICT
        if remote.complete is False:
            if known.replica is RS.VERIFIED:
                return Action.MARK_CORRUPT if remote.size_mismatch else Action.MARK_MISSING
            return Action.CONFIRM  # re-verifying records exactly what is wrong
        return Action.NONE if known.replica is RS.VERIFIED else Action.CONFIRM
    if remote.found is Found.BROKEN:
        if known.state is None:
            return Action.UNREADABLE
        return Action.NONE if known.replica is RS.CORRUPT else Action.MARK_CORRUPT
    if remote.found is Found.PARTS:
        # Delivered parts wait for the others: safepoint.assemble (timeouts) and retention own them.
        return Action.NONE
    if remote.found is Found.PARTIAL:
        if known.replica is RS.VERIFIED and known.state is not CS.PRUNED:
            return Action.MARK_MISSING  # the marker vanished: its objects are kept for the repair to reuse
        ages = [a for a in (remote.age_s, known.replica_age_s if known.replica is RS.PENDING else None)
                if a is not None]
        return Action.REMOVE_PARTIAL if ages and min(ages) >= grace_s else Action.KEEP_PARTIAL
    # ABSENT
    if known.replica is RS.VERIFIED:
        return Action.MARK_MISSING
    if known.replica is RS.PENDING and known.replica_age_s is not None and known.replica_age_s >= grace_s:
        return Action.ABANDON_REPLICA
    return Action.NONE


class Settle(str, Enum):
    NONE = "none"
    FINISH = "finish"        # in flight (stale) or corrupt, with a verified replica: validate from it
    ABANDON = "abandon"      # in flight (stale), no verified replica: back to committed
    NO_COPY = "no_copy"      # verified, no verified replica: corrupt unless the local copy verifies

    def __str__(self) -> str:
        return self.value


def plan_checkpoint(state: CS, state_age_s: float, verified_replicas: int, grace_s: float,
                    world_size: int = 1) -> Settle:
    """What to do with a checkpoint's state once its replicas are reconciled (pure).

    Multi-node checkpoints in flight belong to safepoint.assemble (its timeouts and assembly),
    not to us.
    """
    if state in IN_FLIGHT:
        if world_size > 1 or state_age_s < grace_s:
            return Settle.NONE
        return Settle.FINISH if verified_replicas else Settle.ABANDON
    if state in (CS.CORRUPT, CS.COMMITTED) and verified_replicas and world_size == 1:
        # Corrupt because its copies went bad, and a repair or a confirmed replica brought one back;
        # or committed with a replica adopted or confirmed from a destination: validate it.
        return Settle.FINISH
    if state is CS.VERIFIED and not verified_replicas:
        return Settle.NO_COPY
    return Settle.NONE


def needs_repair(state: CS, replicas: Iterable[RS]) -> bool:
    """A checkpoint that is (or was, until its copies went bad) good, with a bad replica."""
    return state in (CS.VERIFIED, CS.CORRUPT) and any(r in REPAIRABLE for r in replicas)


# -- the report ---------------------------------------------------------------------------------

@dataclass
class Step:
    """One thing reconcile found, and what it did (or would do, with dry_run)."""

    action: str
    run: str | None
    step: int | None
    where: str
    detail: str = ""
    done: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "run": self.run, "step": self.step, "where": self.where,
                "detail": self.detail, "done": self.done}


@dataclass
class ReconcileReport:
    steps: list[Step] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    dry_run: bool = False

    def add(self, action: Any, run: str | None, step: int | None, where: str, detail: str = "",
            done: bool = False) -> Step:
        s = Step(str(action), run, step, redact(where) or "", redact(detail) or "", done)
        self.steps.append(s)
        return s

    def count(self, action: Any) -> int:
        return sum(1 for s in self.steps if s.action == str(action))

    def actions(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.steps:
            out[s.action] = out.get(s.action, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "steps": [s.to_dict() for s in self.steps], "errors": list(self.errors),
                "actions": self.actions()}


# -- observing a destination --------------------------------------------------------------------

@dataclass
class _Location:
    run: str
    step: int
    objects: dict[str, tuple[int, float | None]] = field(default_factory=dict)  # relpath -> (size, mtime)
    dir_mtime: float | None = None


def _mtime(info: dict[str, Any]) -> float | None:
    for key in ("mtime", "LastModified", "last_modified", "created"):
        v = info.get(key)
        if isinstance(v, datetime):
            return (v if v.tzinfo else v.replace(tzinfo=timezone.utc)).timestamp()
        if isinstance(v, (int, float)):
            return float(v)
    return None


def _listing(dest: Destination, scope: tuple[str, int] | None) -> dict[tuple[str, int], _Location] | None:
    """Every <run>/<step>/ location under the destination (or just `scope`), with its objects.

    None when the destination cannot be listed (not fsspec based): only catalog rows are checked.
    """
    fs, root = getattr(dest, "fs", None), getattr(dest, "root", None)
    if fs is None or root is None:
        return None
    base = join(root, scope[0], str(scope[1])) if scope else root
    with suppress(AttributeError):
        fs.invalidate_cache()  # a listing cached before a crash or another writer is stale
    try:
        found = fs.find(base, detail=True, withdirs=True)
    except FileNotFoundError:
        found = {}
    out: dict[tuple[str, int], _Location] = {}
    prefix = root.rstrip("/") + "/"
    for path, info in found.items():
        path = path.rstrip("/")
        if not path.startswith(prefix):
            continue
        rel = path[len(prefix):]
        parts = rel.split("/")
        if len(parts) < 2 or not parts[1].isdigit():
            continue
        try:
            key = (check_run(parts[0]), int(parts[1]))
        except FormatError:
            continue
        loc = out.setdefault(key, _Location(*key))
        if len(parts) == 2:
            loc.dir_mtime = _mtime(info)
        elif info.get("type") != "directory":
            loc.objects["/".join(parts[2:])] = (int(info.get("size") or 0), _mtime(info))
    return out


def _observe(dest: Destination, loc: _Location, now: float) -> tuple[Remote, Manifest | None]:
    run, step = loc.run, loc.step
    marker = loc.objects.get(MARKER_NAME)
    if marker is None and not loc.objects and loc.dir_mtime is None:
        return Remote(Found.ABSENT), None
    data_mtimes = [m for _s, m in loc.objects.values() if m is not None]
    newest = max(data_mtimes) if data_mtimes else loc.dir_mtime
    age = None if newest is None else max(0.0, now - newest)
    if marker is None:
        parts = any(p.startswith(PARTS_DIR + "/") and p.endswith("/" + MARKER_NAME) for p in loc.objects)
        return Remote(Found.PARTS if parts else Found.PARTIAL, age_s=age), None
    try:
        manifest_bytes = dest.read_control(run, step, MANIFEST_NAME)
        manifest = load_committed(manifest_bytes, dest.read_control(run, step, MARKER_NAME))
    except FormatError:
        return Remote(Found.BROKEN, age_s=age), None
    complete, mismatch = True, False
    for f in manifest.files:
        got = loc.objects.get(f.path)
        if got is None:
            complete = False
        elif got[0] != f.size:
            complete, mismatch = False, True
    assert manifest_bytes is not None
    return Remote(Found.COMMITTED, digest_bytes(manifest_bytes), age, complete, mismatch), manifest


@contextmanager
def _lease(catalog: Catalog, name: str) -> Iterator[bool]:
    """Try the lease once; yield whether we hold it. Reconcile never waits for a live ingest."""
    holder = default_holder()
    got = catalog.acquire_lease(name, holder, 300.0)
    try:
        yield got
    finally:
        if got:
            catalog.release_lease(name, holder)


# -- the reconciler -----------------------------------------------------------------------------

class Reconciler:
    """One reconcile pass. Use `reconcile(...)`; the class only keeps the shared state together."""

    def __init__(self, catalog: Catalog, config: Config, *, grace_s: float, dry_run: bool,
                 scope: tuple[str, int] | None, finish: bool, repair: bool, now: float | None = None):
        self.catalog, self.config = catalog, config
        self.grace_s, self.dry_run, self.scope = grace_s, dry_run, scope
        self.finish, self.repair = finish, repair
        self.now = time.time() if now is None else now
        self.report = ReconcileReport(dry_run=dry_run)
        self.touched: set[int] = set()   # checkpoint ids whose replicas changed

    # -- helpers -------------------------------------------------------------------------------
    def _age(self, t: datetime | None) -> float | None:
        if t is None:
            return None
        return max(0.0, self.now - (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp())

    def _rows(self) -> list[CheckpointRow]:
        if self.scope:
            row = self.catalog.get(*self.scope)
            return [row] if row else []
        out = []
        for v in self.catalog.list_checkpoints():
            row = self.catalog.get_by_id(v.id)
            if row is not None:
                out.append(row)
        return out

    def _act(self, action: Any, run: str | None, step: int | None, where: str, detail: str = "") -> Step | None:
        """Record a step; None (do nothing) in a dry run."""
        s = self.report.add(action, run, step, where, detail, done=not self.dry_run)
        return None if self.dry_run else s

    # -- per destination -----------------------------------------------------------------------
    def destination(self, url: str) -> None:
        dest = open_destination(url, self.config.storage_options(url))
        try:
            listing = _listing(dest, self.scope)
            if listing is None:
                self.report.add("unlisted", None, None, dest.url,
                                "this destination cannot be listed: only catalog rows are checked")
                listing = {}
            keys = set(listing)
            # Catalog replicas at this destination that the listing did not show are ABSENT there.
            for row in self._rows():
                for r in self.catalog.replicas(row.id):
                    if redact_url(r.destination).rstrip("/") == dest.url.rstrip("/"):
                        keys.add((row.run, row.step))
            for run, step in sorted(keys):
                loc = listing.get((run, step)) or _Location(run, step)
                try:
                    self._location(dest, loc)
                except (OSError, SafepointError, ValueError) as e:
                    self.report.errors.append(f"{dest.snapshot_url(run, step)}: {redact(str(e))}")
            self._multipart(dest)
        finally:
            dest.close()

    def _location(self, dest: Destination, loc: _Location) -> None:
        run, step = loc.run, loc.step
        url = dest.snapshot_url(run, step)
        remote, manifest = _observe(dest, loc, self.now)
        row = self.catalog.get(run, step)
        rep = None
        if row is not None:
            rep = next((r for r in self.catalog.replicas(row.id) if r.url.rstrip("/") == redact_url(url)), None)
        expected = row.manifest_blake3 if row else None
        if row is not None and not expected and manifest is not None:
            # A multi-node checkpoint's catalog row has no single manifest digest: compare the files.
            mine = {(f.path, f.size, f.blake3) for f in self.catalog.files(row.id)}
            theirs = {(f.path, f.size, f.blake3) for f in manifest.files}
            expected = remote.manifest_blake3 if mine == theirs else "(the catalog's files)"
        known = Known(row.state if row else None, expected,
                      rep.state if rep else None, self._age(rep.updated_at) if rep else None)
        action = decide(remote, known, self.grace_s)
        self._tmp_objects(dest, loc, remote)
        if action is Action.NONE:
            return
        detail = f"{remote.found}; catalog {known.state or 'has no row'}" + (f", replica {known.replica}"
                                                                              if known.replica else "")
        if action in (Action.CONFLICT, Action.UNREADABLE, Action.KEEP_PARTIAL):
            self.report.add(action, run, step, url, detail)
            return
        if action is Action.ADOPT:
            assert manifest is not None and remote.manifest_blake3 is not None
            if self._act(action, run, step, url, detail):
                row = self.catalog.record_commit(manifest, remote.manifest_blake3, None)
                self.catalog.add_event("reconcile.adopt", checkpoint_id=row.id, detail={"url": url})
                self._verify_and_record(dest, row, url)
            return
        if action is Action.CONFIRM:
            assert row is not None
            if self._act(action, run, step, url, detail):
                self._verify_and_record(dest, row, url)
            return
        if action in (Action.MARK_MISSING, Action.MARK_CORRUPT):
            assert row is not None
            state = RS.MISSING if action is Action.MARK_MISSING else RS.CORRUPT
            why = {Found.ABSENT: "nothing at the destination", Found.PARTIAL: "no COMMITTED marker",
                   Found.BROKEN: "COMMITTED does not bind a valid MANIFEST.json",
                   Found.COMMITTED: "objects missing or of the wrong size" if remote.manifest_blake3 ==
                   row.manifest_blake3 or not row.manifest_blake3 else "committed with another manifest"}
            if self._act(action, run, step, url, f"{detail}: {why[remote.found]}"):
                self.catalog.set_replica(row.id, url, dest.url, state, error=f"reconcile: {why[remote.found]}")
                self.touched.add(row.id)
            return
        if action is Action.ABANDON_REPLICA:
            assert row is not None
            if self._act(action, run, step, url, detail):
                self.catalog.set_replica(row.id, url, dest.url, RS.FAILED,
                                         error="reconcile: upload abandoned (nothing reached the destination)")
                self.touched.add(row.id)
            return
        if action is Action.REMOVE_PARTIAL:
            self._remove_partial(dest, loc, row, rep is not None, detail)
            return
        if action is Action.FINISH_PRUNE:
            assert row is not None
            if self._act(action, run, step, url, detail):
                files = sorted(set(self.catalog.file_paths(row.id)) | set(loc.objects) - {MARKER_NAME, MANIFEST_NAME})
                dest.delete_snapshot(run, step, files)  # COMMITTED, then MANIFEST.json, then data
                self._rm_empty(dest, run, step)
                self.catalog.set_replica(row.id, url, dest.url, RS.DELETED)

    def _verify_and_record(self, dest: Destination, row: CheckpointRow, url: str) -> None:
        report = verify_replica(dest, row.run, row.step)
        state = replica_state(report.outcome)
        total = self.catalog.get_by_id(row.id).total_bytes if state is RS.VERIFIED else 0
        self.catalog.set_replica(row.id, url, dest.url, state, bytes=total,
                                 error=None if state is RS.VERIFIED else f"reconcile: {report.summary()}")
        self.report.add(f"replica_{state}", row.run, row.step, url, report.summary(), done=True)
        self.touched.add(row.id)

    def _tmp_objects(self, dest: Destination, loc: _Location, remote: Remote) -> None:
        """Safepoint's own temporary objects left by a killed upload, once older than the grace period."""
        if remote.found is Found.PARTIAL:
            return  # the whole partial goes (or stays) as one
        stale = [p for p, (_size, m) in loc.objects.items()
                 if any(seg.startswith(TMP_PREFIX) for seg in p.split("/"))
                 and m is not None and self.now - m >= self.grace_s]
        if stale and self._act("remove_tmp", loc.run, loc.step, dest.snapshot_url(loc.run, loc.step),
                               f"{len(stale)} temporary object(s): {', '.join(sorted(stale)[:3])}"):
            _delete_objects(dest, loc.run, loc.step, stale)

    def _remove_partial(self, dest: Destination, loc: _Location, row: CheckpointRow | None, has_replica_row: bool,
                        detail: str) -> None:
        run, step = loc.run, loc.step
        url = dest.snapshot_url(run, step)
        with _lease(self.catalog, ingest_lease(run, step, dest.url)) as got:
            if not got:
                self.report.add(Action.KEEP_PARTIAL, run, step, url, "an ingest holds its lease")
                return
            if dest.read_control(run, step, MARKER_NAME) is not None:
                return  # committed meanwhile: the next pass looks at it as committed
            n = len(loc.objects)
            if not self._act(Action.REMOVE_PARTIAL, run, step, url, f"{detail}; {n} object(s)"):
                return
            _delete_objects(dest, run, step, sorted(loc.objects))
            self._rm_empty(dest, run, step)
            if row is not None and has_replica_row:
                rep = next((r for r in self.catalog.replicas(row.id) if r.url.rstrip("/") == redact_url(url)), None)
                if rep is not None and rep.state is RS.PENDING:
                    self.catalog.set_replica(row.id, url, dest.url, RS.FAILED,
                                             error="reconcile: partial upload abandoned and removed")
                    self.touched.add(row.id)

    @staticmethod
    def _rm_empty(dest: Destination, run: str, step: int) -> None:
        """Remove the snapshot's now-empty folders (file:// only; object stores have none)."""
        root = getattr(dest, "root", None)
        if not dest.url.startswith("file://") or root is None:
            return
        remove_empty_under(root, run, str(step))  # no symlink followed (safepoint.safe_delete)

    def _multipart(self, dest: Destination) -> None:
        """Abort multipart uploads older than the grace period, where the destination offers it."""
        abort = getattr(dest, "abort_stale_uploads", None) or getattr(dest, "abort_multipart_uploads", None)
        if abort is None:
            return
        if self.dry_run:
            self.report.add("abort_multipart", None, None, dest.url, f"older than {self.grace_s:.0f}s (dry run)")
            return
        try:
            n = abort(older_than_s=self.grace_s)
        except TypeError:
            n = abort(self.grace_s)
        if n:
            self.report.add("abort_multipart", None, None, dest.url, f"{n} stale multipart upload(s)", done=True)

    # -- local folders -------------------------------------------------------------------------
    def local(self, extra: Iterable[str | os.PathLike] = ()) -> None:
        """Temporary files a killed commit left at the top of a local snapshot folder."""
        folders = {r.local_path for r in self._rows() if r.local_path and r.state is not CS.PRUNED}
        folders |= {os.fspath(p) for p in extra}
        for folder in sorted(f for f in folders if f):
            try:
                entries = list(os.scandir(folder))
            except (FileNotFoundError, NotADirectoryError):
                continue
            stale = [e for e in entries if e.name.startswith(TMP_PREFIX) and e.is_file(follow_symlinks=False)
                     and self.now - e.stat(follow_symlinks=False).st_mtime >= self.grace_s]
            if stale and self._act("remove_tmp", None, None, folder,
                                   f"{len(stale)} temporary file(s): {', '.join(sorted(e.name for e in stale)[:3])}"):
                try:
                    with open_dir(folder) as fd:  # no symlink followed on the way (safepoint.safe_delete)
                        unlink_files(fd, [e.name for e in stale])
                except OSError as err:
                    self.report.errors.append(f"{folder}: {err}")

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoints(self, destinations: list[str]) -> None:
        for row in self._rows():
            if row.state is CS.PRUNED:
                continue
            reps = self.catalog.replicas(row.id)
            if self.repair and needs_repair(row.state, (r.state for r in reps)):
                self._repair(row, [r for r in reps if r.state in REPAIRABLE], destinations)
                reps = self.catalog.replicas(row.id)
            row = self.catalog.get_by_id(row.id)
            verified = sum(1 for r in reps if r.state is RS.VERIFIED)
            settle = plan_checkpoint(row.state, self._age(row.state_changed_at) or 0.0, verified, self.grace_s,
                                     row.world_size)
            if settle is Settle.NONE or (settle is not Settle.NO_COPY and not self.finish):
                continue
            if settle is Settle.NO_COPY:
                if row.id in self.touched and self._act("settle_copies", row.run, row.step, row.local_path or "-",
                                                        "no verified replica left"):
                    after = settle_copies(self.catalog, row.id)
                    if after is CS.CORRUPT:
                        self.report.add("checkpoint_corrupt", row.run, row.step, "-", "no verified copy left",
                                        done=True)
            elif settle is Settle.ABANDON:
                if self._act(settle, row.run, row.step, row.local_path or "-",
                             f"{row.state} for {self._age(row.state_changed_at):.0f}s with no verified replica"):
                    self._abandon(row)
            else:
                if self._act(settle, row.run, row.step, row.local_path or "-",
                             f"{row.state} with {verified} verified replica(s): validating from a verified copy"):
                    self._finish(row)

    def _abandon(self, row: CheckpointRow) -> None:
        c = self.catalog
        why = "reconcile: interrupted ingest abandoned; ingest again to finish it"
        if row.state is CS.VALIDATING:
            c.transition(row.id, CS.REPLICATED, expect={CS.VALIDATING})
        if self.catalog.get_by_id(row.id).state is CS.REPLICATED:
            c.transition(row.id, CS.REPLICATING, expect={CS.REPLICATED})
        c.transition(row.id, CS.COMMITTED, expect={CS.REPLICATING}, error=why)

    def _finish(self, row: CheckpointRow) -> None:
        """Bring a checkpoint with a verified replica to `replicated`, then validate a verified copy."""
        c = self.catalog
        if row.state is CS.VALIDATING:
            c.transition(row.id, CS.REPLICATED, expect={CS.VALIDATING})
        if row.state in (CS.CORRUPT, CS.COMMITTED):
            c.transition(row.id, CS.REPLICATING, expect={CS.CORRUPT, CS.COMMITTED})
        if c.get_by_id(row.id).state is CS.REPLICATING:
            c.transition(row.id, CS.REPLICATED, expect={CS.REPLICATING},
                         detail={"by": "reconcile", "why": "a verified replica exists"})
        if c.get_by_id(row.id).state is not CS.REPLICATED:
            return
        with verified_copy(c, row.id, self.config) as snap:
            if snap is None:
                self.report.errors.append(f"{row.run}/{row.step}: no copy verifies; left {CS.REPLICATED}")
                return
            state = validate_checkpoint(c, row.id, snap, model=self.config.run_setting(row.run, "model"))
        self.report.add(f"checkpoint_{state}", row.run, row.step, str(snap.root), "validated", done=True)

    def _repair(self, row: CheckpointRow, bad: list[Any], destinations: list[str]) -> None:
        """Re-replicate each bad replica from a copy that verifies (replicate() reuses good objects)."""
        wanted = {d.rstrip("/") for d in destinations}
        for rep in bad:
            if wanted and redact_url(rep.destination).rstrip("/") not in {redact_url(w) for w in wanted}:
                continue
            if not self._act("replicate_again", row.run, row.step, rep.url, f"replica was {rep.state}"):
                continue
            with good_source(self.catalog, row, self.config, exclude=rep.url) as snap:
                if snap is None:
                    self.report.add("no_good_copy", row.run, row.step, rep.url,
                                    "no copy verifies: nothing to replicate from; nothing deleted", done=True)
                    continue
                dest = open_destination(rep.destination, self.config.storage_options(rep.destination))
                try:
                    _clear_broken_marker(dest, row, snap)
                finally:
                    dest.close()
                try:
                    result = replicate_to(self.catalog, row.id, snap, rep.destination, self.config)
                except (OSError, SafepointError) as e:
                    self.report.errors.append(f"{rep.url}: {redact(str(e))}")
                    continue
                self.touched.add(row.id)
                self.report.add(f"replica_{result.state}", row.run, row.step, rep.url,
                                f"from {snap.root}: {result.bytes_uploaded} bytes sent, {result.bytes_reused} reused"
                                + (f"; {result.error}" if result.error else ""), done=True)


def _delete_objects(dest: Destination, run: str, step: int, relpaths: list[str]) -> None:
    """Delete objects of a snapshot; file:// ones through safepoint.safe_delete (no symlink followed)."""
    if isinstance(dest, LocalDestination):
        dest.delete_files(run, step, relpaths)
        return
    fs, root = dest.fs, dest.root  # type: ignore[attr-defined]
    for p in relpaths:
        with suppress(FileNotFoundError):
            fs.rm_file(join(root, run, str(step), p))


def _clear_broken_marker(dest: Destination, row: CheckpointRow, snap: LocalSnapshot) -> None:
    """A marker that binds no valid manifest (rot, truncation) blocks re-replication: remove it.

    Only when the catalog's manifest is the one we re-send; a marker that binds another valid
    manifest is someone else's commit and is left alone (replicate() then refuses).
    """
    marker = dest.read_control(row.run, row.step, MARKER_NAME)
    if marker is None or marker == snap.marker_bytes:
        return
    try:
        load_committed(dest.read_control(row.run, row.step, MANIFEST_NAME), marker)
    except FormatError:
        if row.manifest_blake3 == digest_bytes(snap.manifest_bytes):
            dest.delete_control(row.run, row.step, MARKER_NAME)


@contextmanager
def good_source(catalog: Catalog, row: CheckpointRow, config: Config, *, exclude: str | None = None
                ) -> Iterator[LocalSnapshot | None]:
    """A local snapshot of `row` whose every byte verifies against the catalog's manifest, or None.

    Tried in order: the local folder (single-node checkpoints), then verified replicas (file://
    in place, others downloaded to $SAFEPOINT_HOME/tmp). The last good copy is only ever read.
    """
    for snap in _candidates(catalog, row, config, exclude):
        with snap as s:
            if s is not None and s.verify().outcome is CS.VERIFIED and (
                    not row.manifest_blake3 or digest_bytes(s.manifest_bytes) == row.manifest_blake3):
                yield s
                return
    yield None


@contextmanager
def verified_copy(catalog: Catalog, checkpoint_id: int, config: Config) -> Iterator[LocalSnapshot | None]:
    """Like good_source, for validating: any copy that verifies."""
    row = catalog.get_by_id(checkpoint_id)
    with good_source(catalog, row, config) as snap:
        yield snap


def _candidates(catalog: Catalog, row: CheckpointRow, config: Config, exclude: str | None):
    if row.world_size == 1 and row.local_path:
        yield _open_local(row.local_path)
    for rep in catalog.replicas(row.id):
        if rep.state is not RS.VERIFIED or (exclude and rep.url.rstrip("/") == redact_url(exclude).rstrip("/")):
            continue
        if rep.url.startswith("file://"):
            yield _open_local(rep.url[len("file://"):])
        else:
            yield _download(rep, row, config)


@contextmanager
def _open_local(path: str) -> Iterator[LocalSnapshot | None]:
    try:
        snap: LocalSnapshot | None = LocalSnapshot.open(path)
    except (FormatError, OSError):
        snap = None
    yield snap


@contextmanager
def _download(rep: Any, row: CheckpointRow, config: Config) -> Iterator[LocalSnapshot | None]:
    """A remote replica copied to a temporary folder (removed afterwards)."""
    dest = open_destination(rep.destination, config.storage_options(rep.destination))
    tmp_root = home() / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"reconcile-{row.run}-{row.step}-", dir=tmp_root))
    try:
        try:
            for name in (MANIFEST_NAME, MARKER_NAME):
                (folder / name).write_bytes(dest.read_control(row.run, row.step, name) or b"")
            snap = LocalSnapshot.open(folder)
            fs, base = dest.fs, dest._path(row.run, row.step, "")  # type: ignore[attr-defined]
            for f in snap.manifest.files:
                target = snap.path_of(f.path)
                target.parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(base.rstrip("/") + "/" + f.path, str(target))
        except (FormatError, OSError, AttributeError):
            yield None
            return
        yield snap
    finally:
        dest.close()
        shutil.rmtree(folder, ignore_errors=True)


# -- entry points -------------------------------------------------------------------------------

def known_destinations(catalog: Catalog, config: Config, scope: tuple[str, int] | None = None) -> list[str]:
    """Destinations the catalog has replicas at (in scope), plus [ingest] to = [...] from config."""
    urls: set[str] = set(config.section("ingest").get("to", []) or [])
    views = catalog.list_checkpoints(scope[0] if scope else None)
    for v in views:
        if scope and v.step != scope[1]:
            continue
        urls |= {r.destination for r in v.replicas}
    return sorted(u.rstrip("/") for u in urls)


def reconcile(catalog: Catalog, destinations: Iterable[str] | None = None, config: Config | None = None, *,
              grace_s: float = GRACE_S, dry_run: bool = False, scope: tuple[str, int] | None = None,
              finish: bool = True, repair: bool = True, local: Iterable[str | os.PathLike] = (),
              now: float | None = None) -> ReconcileReport:
    """Repair the catalog from the destinations (see the module docstring); returns what was done.

    destinations: base URLs to look at (default: every destination the catalog knows, plus the
    configured ones). scope: only this (run, step). finish: also finish or abandon checkpoints
    stuck in a pipeline state longer than `grace_s`. repair: re-replicate bad replicas of good
    checkpoints from a copy that verifies. local: extra local snapshot folders to clean of stale
    temporary files. dry_run: report only.
    """
    config = config or Config()
    r = Reconciler(catalog, config, grace_s=grace_s, dry_run=dry_run, scope=scope, finish=finish, repair=repair,
                   now=now)
    urls = [u.rstrip("/") for u in destinations] if destinations is not None else []
    if not urls:
        urls = known_destinations(catalog, config, scope)
    for url in urls:
        try:
            r.destination(url)
        except (OSError, SafepointError, ValueError) as e:
            r.report.errors.append(f"{redact_url(url)}: {redact(str(e))}")
    r.local(local)
    r.checkpoints(urls)
    if not dry_run and any(s.done for s in r.report.steps):
        catalog.add_event("reconcile", run=scope[0] if scope else None,
                          detail={"scope": list(scope) if scope else None, "actions": r.report.actions(),
                                  "errors": len(r.report.errors), "grace_s": grace_s})
    for e in r.report.errors:
        log.warning("reconcile: %s", e)
    return r.report


def repair(catalog: Catalog, checkpoint_ids: Iterable[int], config: Config | None = None) -> ReconcileReport:
    """Re-replicate the bad replicas of these checkpoints from a copy that verifies, then settle them.

    What a scrub calls after it found rot: a checkpoint whose replicas all went bad (corrupt) and
    that still has a good copy somewhere becomes verified again; one with no good copy left stays
    corrupt, and none of its copies is deleted.
    """
    config = config or Config()
    out = ReconcileReport()
    for cid in sorted(set(checkpoint_ids)):
        row = catalog.get_by_id(cid)
        if row is None or row.state is CS.PRUNED:
            continue
        r = Reconciler(catalog, config, grace_s=GRACE_S, dry_run=False, scope=(row.run, row.step), finish=True,
                       repair=True)
        r.touched.add(cid)
        r.checkpoints([])
        out.steps += r.report.steps
        out.errors += r.report.errors
    if out.steps:
        catalog.add_event("repair", detail={"checkpoints": sorted(set(checkpoint_ids)), "actions": out.actions(),
                                            "errors": len(out.errors)})
    return out
