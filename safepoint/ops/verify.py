"""Verify, written once: re-hash a replica or a local snapshot against its manifest, record what was found.

A replica the catalog knows must also be the checkpoint the catalog recorded (`copy_problem`): one
whose marker binds another manifest (stale, or forged: other bytes, a new MANIFEST.json and
COMMITTED to match), or that lacks a rank of a multi-node checkpoint, is corrupt without a re-hash.

Lean on purpose: it imports neither torch nor Prefect, so `safepoint verify` starts fast.
"""

from __future__ import annotations

from pathlib import Path

from safepoint.catalog.store import Catalog
from safepoint.catalog.views import CheckpointRow
from safepoint.core.config import Config
from safepoint.core.errors import FormatError
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME, digest_bytes, load_committed
from safepoint.core.naming import parse_snapshot_url
from safepoint.core.redact import redact
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.core.urls import local_path, path_url
from safepoint.core.verify import VerifyReport
from safepoint.destinations import block_url, is_block_url, open_destination
from safepoint.destinations.base import Destination
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.progress import CountingDestination, hook
from safepoint.ops.replicate import verify_replica
from safepoint.ops.steps import settle_copies
from safepoint.rules.completeness import copy_problem
from safepoint.rules.settle import replica_state


def _as_url(target: str) -> str:
    if is_block_url(target):
        return block_url(target)
    if "://" in target:
        return target.rstrip("/")
    return path_url(Path(target).resolve())


def verify_url(catalog: Catalog, target: str, config: Config | None = None) -> tuple[VerifyReport, str]:
    """Re-hash a replica URL or a local snapshot folder, record what was found, and return the report."""
    config = config or Config()
    url = _as_url(target)
    found = catalog.find_replica(url)
    local = local_path(url)
    if found is None and local is not None and (local / MARKER_NAME).exists():
        try:
            report = LocalSnapshot.open(local).verify(progress=hook())
        except FormatError as e:
            report = VerifyReport(error=str(e))
        row = catalog.find_by_local_path(str(local))
        if row is not None:
            _record_local_verify(catalog, row, report)
        return report, str(local)
    base, run, step = parse_snapshot_url(url)
    dest = open_destination(base, config.storage_options(base))
    counted = CountingDestination(dest, hook()) if hook() else dest  # feeds the CLI's progress bar
    control: tuple[bytes | None, bytes | None] = (None, None)
    try:
        snap_url = dest.snapshot_url(run, step)
        if dest.read_control(run, step, MARKER_NAME) is None:
            report = VerifyReport(error=f"{snap_url}: no COMMITTED marker (replica missing or partial)")
            state = RS.MISSING
        else:
            control = _control(dest, run, step)
            problem = found and bound_problem(catalog, found[0], *control)
            report = VerifyReport(error=f"{snap_url}: {problem}") if problem else \
                verify_replica(counted, run, step)  # type: ignore[arg-type]
            state = replica_state(report.outcome)
    finally:
        dest.close()
    if found:
        row, _rep = found
        if state is RS.VERIFIED and row.world_size > 1 and not row.manifest_blake3 and control[0]:
            # A set assembled before its whole digest was recorded: this copy, whole and the catalog's
            # files, binds it from now on.
            catalog.record_whole_manifest(row.id, digest_bytes(control[0]))
        catalog.set_replica(row.id, snap_url, dest.url, state, error=None if state is RS.VERIFIED else report.summary(),
                            proof="read-back" if state is RS.VERIFIED else None)
        settle_copies(catalog, row.id)
    return report, snap_url


def _control(dest: Destination, run: str, step: int) -> tuple[bytes | None, bytes | None]:
    return dest.read_control(run, step, MANIFEST_NAME), dest.read_control(run, step, MARKER_NAME)


def bound_problem(catalog: Catalog, row: CheckpointRow, manifest_bytes: bytes | None, marker: bytes | None
                  ) -> str | None:
    """Why the copy whose marker binds `manifest_bytes` is not `row` as the catalog recorded it, or None.

    None too when the marker binds nothing valid: verifying the copy reports that itself.
    """
    try:
        m = load_committed(manifest_bytes, marker)
    except FormatError:
        return None
    assert manifest_bytes is not None
    legacy = row.world_size > 1 and not row.manifest_blake3  # assembled before the whole digest was recorded
    return copy_problem(row.world_size, m.held_ranks, digest_bytes(manifest_bytes),
                        ((f.path, f.size, f.blake3) for f in m.files), recorded=row.manifest_blake3,
                        recorded_files=[(f.path, f.size, f.blake3) for f in catalog.files(row.id)] if legacy else None)


def _record_local_verify(catalog: Catalog, row: CheckpointRow, report: VerifyReport) -> None:
    catalog.add_event(checkpoint_id=row.id, kind="verify.local", detail={"outcome": str(report.outcome),
                                                                           "summary": redact(report.summary())})
    if report.outcome is not CS.VERIFIED and row.state in (CS.COMMITTED, CS.REPLICATING):
        catalog.transition(row.id, report.outcome, error=report.summary())
