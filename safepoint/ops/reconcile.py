"""Reconcile the catalog with what destinations and local folders really hold, after any crash.

The pipeline writes in an order that makes every crash leave something safe (docs/format.md);
the repairs, like `restic check` and `restic prune` for a repository, and the rules that choose
them are safepoint.rules.reconcile's. Here, one pass per destination: observe (the destination's
listing, then the control files of each location), decide (the pure rules), act (or only report,
with dry_run). A destination that cannot be used (no credentials, unreachable) is reported by name
and the others are still reconciled. Then each checkpoint's state is settled: a bad replica of a
good checkpoint is replicated again from a copy that verifies (safepoint.ops.good_copy), and a
checkpoint stuck in the pipeline is finished or abandoned.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any

from safepoint.catalog.store import Catalog
from safepoint.catalog.views import CheckpointRow
from safepoint.core.config import Config
from safepoint.core.errors import FormatError, SafepointError
from safepoint.core.format import (
    MANIFEST_NAME,
    MARKER_NAME,
    TMP_PREFIX,
    Manifest,
    digest_bytes,
    load_committed,
)
from safepoint.core.naming import ingest_lease
from safepoint.core.redact import redact, redact_url
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.destinations import open_destination
from safepoint.destinations.base import Destination, SnapshotListing
from safepoint.destinations.replica_commit import read_committed
from safepoint.local.safe_delete import open_dir, unlink_files
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.good_copy import good_source, verified_copy
from safepoint.ops.leases import try_once
from safepoint.ops.reconcile_report import ReconcileReport, Step
from safepoint.ops.steps import replicate_to, settle_copies, walk
from safepoint.ops.validation import validate_checkpoint
from safepoint.ops.verify import verify_replica
from safepoint.rules.reconcile import (
    IN_FLIGHT,
    REPAIRABLE,
    Action,
    Found,
    Known,
    Remote,
    Settle,
    decide,
    needs_repair,
    observe,
    plan_checkpoint,
)
from safepoint.rules.settle import replica_state

log = logging.getLogger("safepoint.ops.reconcile")

GRACE_S = 3600.0


# -- observing a destination --------------------------------------------------------------------

def _observe(dest: Destination, loc: SnapshotListing, now: float) -> tuple[Remote, Manifest | None]:
    """The location as listed, with the control files its marker binds (read only when there is one)."""
    objects = {p: (o.size, o.mtime) for p, o in loc.objects.items()}
    if MARKER_NAME not in objects:
        return observe(objects, loc.folder_mtime, now), None
    try:
        manifest_bytes, marker = read_committed(dest, loc.run, loc.step)
        manifest = load_committed(manifest_bytes, marker)
    except FormatError:
        return observe(objects, loc.folder_mtime, now, broken=True), None
    return observe(objects, loc.folder_mtime, now, manifest_files=manifest.files,
                   manifest_blake3=digest_bytes(manifest_bytes or b"")), manifest


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
            listing = dest.listing(*self.scope) if self.scope else dest.listing()
            keys = set(listing)
            # Catalog replicas at this destination that the listing did not show are ABSENT there.
            for row in self._rows():
                for r in self.catalog.replicas(row.id):
                    if redact_url(r.destination).rstrip("/") == dest.url.rstrip("/"):
                        keys.add((row.run, row.step))
            for run, step in sorted(keys):
                loc = listing.get((run, step)) or SnapshotListing(run, step)
                try:
                    self._location(dest, loc)
                except (OSError, SafepointError, ValueError) as e:
                    self.report.errors.append(f"{dest.snapshot_url(run, step)}: {redact(str(e))}")
            self._multipart(dest)
        finally:
            dest.close()

    def _location(self, dest: Destination, loc: SnapshotListing) -> None:
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
                dest.remove_empty_folders(run, step)
                self.catalog.set_replica(row.id, url, dest.url, RS.DELETED)

    def _verify_and_record(self, dest: Destination, row: CheckpointRow, url: str) -> None:
        report = verify_replica(dest, row.run, row.step)
        state = replica_state(report.outcome)
        total = self.catalog.get_by_id(row.id).total_bytes if state is RS.VERIFIED else 0
        self.catalog.set_replica(row.id, url, dest.url, state, bytes=total,
                                 error=None if state is RS.VERIFIED else f"reconcile: {report.summary()}")
        self.report.add(f"replica_{state}", row.run, row.step, url, report.summary(), done=True)
        self.touched.add(row.id)

    def _tmp_objects(self, dest: Destination, loc: SnapshotListing, remote: Remote) -> None:
        """Safepoint's own temporary objects left by a killed upload, once older than the grace period."""
        if remote.found is Found.PARTIAL:
            return  # the whole partial goes (or stays) as one
        stale = [p for p, o in loc.objects.items()
                 if any(seg.startswith(TMP_PREFIX) for seg in p.split("/"))
                 and o.mtime is not None and self.now - o.mtime >= self.grace_s]
        if stale and self._act("remove_tmp", loc.run, loc.step, dest.snapshot_url(loc.run, loc.step),
                               f"{len(stale)} temporary object(s): {', '.join(sorted(stale)[:3])}"):
            dest.delete_files(loc.run, loc.step, stale)

    def _remove_partial(self, dest: Destination, loc: SnapshotListing, row: CheckpointRow | None, has_replica_row: bool,
                        detail: str) -> None:
        run, step = loc.run, loc.step
        url = dest.snapshot_url(run, step)
        with try_once(self.catalog, ingest_lease(run, step, dest.url), ttl_s=300.0) as got:
            if not got:
                self.report.add(Action.KEEP_PARTIAL, run, step, url, "an ingest holds its lease")
                return
            if dest.read_control(run, step, MARKER_NAME) is not None:
                return  # committed meanwhile: the next pass looks at it as committed
            n = len(loc.objects)
            if not self._act(Action.REMOVE_PARTIAL, run, step, url, f"{detail}; {n} object(s)"):
                return
            dest.delete_files(run, step, sorted(loc.objects))
            dest.remove_empty_folders(run, step)
            if row is not None and has_replica_row:
                rep = next((r for r in self.catalog.replicas(row.id) if r.url.rstrip("/") == redact_url(url)), None)
                if rep is not None and rep.state is RS.PENDING:
                    self.catalog.set_replica(row.id, url, dest.url, RS.FAILED,
                                             error="reconcile: partial upload abandoned and removed")
                    self.touched.add(row.id)

    def _multipart(self, dest: Destination) -> None:
        """Abort multipart uploads older than the grace period, where the destination has them."""
        if not dest.capabilities.multipart_uploads:
            return
        if self.dry_run:
            self.report.add("abort_multipart", None, None, dest.url, f"older than {self.grace_s:.0f}s (dry run)")
            return
        n = dest.abort_stale_uploads(self.grace_s)
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
                    with open_dir(folder) as fd:  # no symlink followed on the way (safepoint.local.safe_delete)
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
        walk(c, row.id, CS.COMMITTED, start=IN_FLIGHT, error=why)

    def _finish(self, row: CheckpointRow) -> None:
        """Bring a checkpoint with a verified replica to `replicated`, then validate a verified copy."""
        c = self.catalog
        walk(c, row.id, CS.REPLICATED, start={*IN_FLIGHT, CS.CORRUPT, CS.COMMITTED},
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
        except Exception as e:  # noqa: BLE001 - one unusable destination (no credentials, gone) spares the others
            why = str(e) if isinstance(e, (OSError, SafepointError, ValueError)) else f"{type(e).__name__}: {e}"
            r.report.errors.append(f"{redact_url(url)}: destination not reconciled: {redact(why)}")
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
