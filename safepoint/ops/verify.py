"""Verify, written once: re-hash a replica or a local snapshot against its manifest, record what was found.

`verify` is the one composition: `safepoint verify` runs it inline, the verify flow
(flows/scrub.py:verify_fanout) with a runner that fans the batches out (threads or Dask), and a
scrub calls it inline for a replica whose slice found damage. The files are cut into batches
(rules/batching.py) and each batch is one `verify-batch` (replica) or `verify-local-batch` step.

A replica the catalog knows must also be the checkpoint the catalog recorded (`bound_problem`): one
whose marker binds another manifest (stale, or forged: other bytes, a new MANIFEST.json and
COMMITTED to match), or that lacks a rank of a multi-node checkpoint, is corrupt without a re-hash.

Lean on purpose: it imports neither torch nor Prefect, and the catalog proper (SQLAlchemy) only
when the target is one the catalog may know (`catalog.probe`), so `safepoint verify` of a folder
starts about as fast as `b3sum`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safepoint.core.config import Config, fanout_settings
from safepoint.core.errors import FormatError
from safepoint.core.format import MARKER_NAME, FileEntry, Manifest, digest_bytes, load_committed
from safepoint.core.naming import parse_snapshot_url
from safepoint.core.redact import redact
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.core.urls import local_path, path_url
from safepoint.core.verify import VerifyReport, verify_manifest
from safepoint.destinations import block_url, is_block_url, open_destination
from safepoint.destinations.replica_commit import read_committed
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.progress import CountingDestination, hook
from safepoint.ops.runner import INLINE, StepRunner, all_or_raise
from safepoint.rules.batching import batch_limits, batches
from safepoint.rules.completeness import copy_problem
from safepoint.rules.settle import replica_state

if TYPE_CHECKING:
    from safepoint.catalog.store import Catalog
    from safepoint.catalog.views import CheckpointRow
    from safepoint.destinations.base import Destination


@dataclass(frozen=True)
class VerifyOutcome:
    """What one verification found: the report, where (a replica URL or a local folder), in how many batches."""

    report: VerifyReport
    where: str
    batches: int = 0

    @property
    def good(self) -> bool:
        return self.report.outcome is CS.VERIFIED

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.where, "outcome": str(self.report.outcome), "summary": self.report.summary(),
                "batches": self.batches}


def verify(catalog: Catalog | str | None, target: str, config: Config | None = None, *,
           runner: StepRunner = INLINE) -> VerifyOutcome:
    """Re-hash a replica URL or a local snapshot folder, record what was found (when the catalog knows
    the target) and return it. `catalog`: an open catalog, or its URL (None: the default), opened only
    when the target may be one it records."""
    config = config or Config()
    local = local_path(target)  # a path or file:// URL; None for a remote URL or a block
    local = local.resolve() if local is not None else None
    if is_block_url(target):
        url = block_url(target)
    elif local is not None:
        url = path_url(local)
    else:
        url = target.rstrip("/")
    committed_here = local is not None and (local / MARKER_NAME).exists()
    if committed_here and (catalog is None or isinstance(catalog, str)):
        from safepoint.catalog.probe import knows_local

        if knows_local(catalog, str(local), [url]) is False:  # a folder the catalog lacks: no SQLAlchemy
            return _verify_local(None, local, config, runner)  # type: ignore[arg-type]
    if catalog is None or isinstance(catalog, str):
        from safepoint.catalog.store import open_catalog

        catalog = open_catalog(catalog)
    found = catalog.find_replica(url)
    if found is None and committed_here:
        return _verify_local(catalog, local, config, runner)  # type: ignore[arg-type]
    return _verify_replica(catalog, url, found, config, runner)


def _verify_local(catalog: Catalog | None, local: Path, config: Config, runner: StepRunner) -> VerifyOutcome:
    try:
        snap = LocalSnapshot.open(local)
    except FormatError as e:
        report, groups = VerifyReport(error=str(e)), []
    else:
        groups = batches(list(snap.manifest.files), *batch_limits(fanout_settings(config)))
        report = _merged(runner.map("verify-local-batch", verify_local_batch,
                                    [(str(local), g, snap.marker_bytes) for g in groups]))
    row = catalog.find_by_local_path(str(local)) if catalog is not None else None
    if row is not None:
        _record_local_verify(catalog, row, report)  # type: ignore[arg-type]
    return VerifyOutcome(report, str(local), len(groups))


def _verify_replica(catalog: Catalog, url: str, found: Any, config: Config, runner: StepRunner) -> VerifyOutcome:
    base, run, step = parse_snapshot_url(url)
    dest = open_destination(base, config.storage_options(base))
    groups: list[list[FileEntry]] = []
    try:
        snap_url, dest_url = dest.snapshot_url(run, step), dest.url
        manifest_bytes, marker = read_committed(dest, run, step)
    finally:
        dest.close()
    manifest, why = _bound(catalog, found, manifest_bytes, marker)
    if manifest is None:
        report = VerifyReport(error=f"{snap_url}: {why}")
    else:
        groups = batches(list(manifest.files), *batch_limits(fanout_settings(config)))
        report = _merged(runner.map("verify-batch", verify_batch, [(base, run, step, g, config) for g in groups]))
    if found:
        from safepoint.ops.steps import settle_copies  # the catalog's side: only with a catalog

        row, _rep = found
        state = RS.MISSING if marker is None else replica_state(report.outcome)
        if state is RS.VERIFIED and row.world_size > 1 and not row.manifest_blake3 and manifest_bytes:
            # A set assembled before its whole digest was recorded: this copy, whole and the catalog's
            # files, binds it from now on.
            catalog.record_whole_manifest(row.id, digest_bytes(manifest_bytes))
        catalog.set_replica(row.id, snap_url, dest_url, state, error=None if state is RS.VERIFIED else report.summary(),
                            proof="read-back" if state is RS.VERIFIED else None)
        settle_copies(catalog, row.id)
    return VerifyOutcome(report, snap_url, len(groups))


def _bound(catalog: Catalog, found: Any, manifest_bytes: bytes | None, marker: bytes | None
           ) -> tuple[Manifest | None, str | None]:
    """The manifest the replica's marker binds, when it is the checkpoint the catalog recorded (`found`:
    the catalog's row and replica, or None); else (None, why not)."""
    if marker is None:
        return None, "no COMMITTED marker (replica missing or partial)"
    try:
        manifest = load_committed(manifest_bytes, marker)
    except FormatError as e:
        return None, str(e)
    problem = found and bound_problem(catalog, found[0], manifest, digest_bytes(manifest_bytes or b""))
    return (None, problem) if problem else (manifest, None)


def _merged(answers: Sequence[VerifyReport | BaseException]) -> VerifyReport:
    """One report from the batches' (a batch that raised raises here: an infrastructure error, not a verdict)."""
    return merge_reports(all_or_raise(answers))


def merge_reports(reports: Sequence[VerifyReport]) -> VerifyReport:
    out = VerifyReport()
    for r in reports:
        out.files.update(r.files)
        out.bytes_checked += r.bytes_checked
        if r.error and not out.error:
            out.error = r.error
    return out


def verify_files(dest: Destination, run: str, step: int, files: Sequence[FileEntry], *, workers: int = 4
                 ) -> VerifyReport:
    """Hash some files of a replica against their manifest entries (a batch of a verify or a scrub)."""
    return verify_manifest(files, lambda p: dest.size(run, step, p), lambda p: dest.digest(run, step, p),
                           workers=workers)


def verify_replica(dest: Destination, run: str, step: int, *, workers: int = 4) -> VerifyReport:
    """Re-hash a whole replica against its own manifest (which its marker must bind), in this thread:
    what reconcile and evict ask of one copy before they rely on it."""
    try:
        manifest = load_committed(*read_committed(dest, run, step))
    except FormatError as e:
        return VerifyReport(error=f"{dest.snapshot_url(run, step)}: {e}")
    return verify_files(dest, run, step, manifest.files, workers=workers)


def verify_batch(destination: str, run: str, step: int, files: list[FileEntry], config: Config) -> VerifyReport:
    """Hash a batch of a replica's files (runs wherever the runner puts it: here, a thread or a Dask worker)."""
    dest = open_destination(destination, config.storage_options(destination))
    counted = CountingDestination(dest, hook()) if hook() else dest  # feeds the CLI's progress bar
    try:
        return verify_files(counted, run, step, files)  # type: ignore[arg-type]
    finally:
        dest.close()


def verify_local_batch(root: str, files: list[FileEntry], marker: bytes) -> VerifyReport:
    """Hash a batch of a local snapshot folder's files (still committed by `marker`, which binds its manifest)."""
    try:
        return LocalSnapshot.rebind(root, marker, files).verify(progress=hook(), files=files)
    except FormatError as e:
        return VerifyReport(error=str(e))


def bound_problem(catalog: Catalog, row: CheckpointRow, m: Manifest, manifest_blake3: str) -> str | None:
    """Why the copy whose marker binds `m` (a MANIFEST.json of digest `manifest_blake3`) is not `row`
    as the catalog recorded it, or None."""
    legacy = row.world_size > 1 and not row.manifest_blake3  # assembled before the whole digest was recorded
    return copy_problem(row.world_size, m.held_ranks, manifest_blake3,
                        ((f.path, f.size, f.blake3) for f in m.files), recorded=row.manifest_blake3,
                        recorded_files=[(f.path, f.size, f.blake3) for f in catalog.files(row.id)] if legacy else None)


def _record_local_verify(catalog: Catalog, row: CheckpointRow, report: VerifyReport) -> None:
    catalog.add_event(checkpoint_id=row.id, kind="verify.local", detail={"outcome": str(report.outcome),
                                                                           "summary": redact(report.summary())})
    if report.outcome is not CS.VERIFIED and row.state in (CS.COMMITTED, CS.REPLICATING):
        catalog.transition(row.id, report.outcome, error=report.summary())
