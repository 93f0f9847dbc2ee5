"""The ingest pipeline as plain functions: register, replicate, validate, record.

Prefect flows (flows/ingest.py) compose these same steps as tasks; tests and benchmarks can call
them directly. Every step records its outcome in the catalog.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safepoint.catalog.store import Catalog
from safepoint.catalog.views import CheckpointRow
from safepoint.core.config import Config
from safepoint.core.errors import CatalogError, FormatError, SafepointError
from safepoint.core.format import MARKER_NAME
from safepoint.core.redact import redact
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.core.verify import FileStatus, VerifyReport
from safepoint.destinations import open_destination
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.replicate import Progress, ReplicaResult, replicate, verify_replica

log = logging.getLogger("safepoint")

EXIT_OK, EXIT_BAD, EXIT_ERROR = 0, 1, 2


@dataclass
class IngestOutcome:
    run: str
    step: int
    state: CS
    replicas: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""

    @property
    def exit_code(self) -> int:
        if self.state is CS.VERIFIED:
            return EXIT_OK
        if self.state in (CS.CORRUPT, CS.INVALID, CS.INCOMPLETE):
            return EXIT_BAD
        return EXIT_ERROR


def register(catalog: Catalog, snap: LocalSnapshot) -> CheckpointRow:
    """Record the commit (idempotent) and move the checkpoint to `replicating`."""
    from safepoint.core.format import digest_bytes

    row = catalog.record_commit(snap.manifest, digest_bytes(snap.manifest_bytes), str(snap.root))
    if row.state is CS.PRUNED:
        raise CatalogError(f"{row.run}/{row.step} was pruned; refusing to ingest it again")
    # A validation that a crash interrupted leaves `validating`, from which there is no way back to
    # `replicating`: step back through `replicated` so that the re-ingest takes the work over.
    catalog.transition(row.id, CS.REPLICATED, expect={CS.VALIDATING}, detail={"why": "re-ingest"})
    catalog.transition(row.id, CS.REPLICATING)
    row = catalog.get_by_id(row.id)
    if row.state is CS.PRUNED:  # retention marked it between record_commit and the transition
        raise CatalogError(f"{row.run}/{row.step} was pruned; refusing to ingest it again")
    return row


def replicate_to(
    catalog: Catalog, checkpoint_id: int, snap: LocalSnapshot, url: str, config: Config | None = None,
    *, attempts: int = 2, progress: Progress | None = None,
) -> ReplicaResult:
    """Replicate to one destination and record the replica. A replica that reads back wrong is re-sent once."""
    config = config or Config()
    dest = open_destination(url, config.storage_options(url))
    try:
        snap_url = dest.snapshot_url(snap.manifest.run, snap.manifest.step)
        catalog.set_replica(checkpoint_id, snap_url, dest.url, RS.PENDING)
        for _ in range(max(1, attempts)):
            try:
                result = replicate(snap, dest, progress=progress)
            except (OSError, SafepointError) as e:
                # Disk full, EIO, a network that gave up: never leave the replica `pending`. The
                # caller (a Prefect retry, the next ingest) sends it again; nothing is trusted.
                catalog.set_replica(checkpoint_id, snap_url, dest.url, RS.FAILED, error=_why(e))
                raise
            if result.state is not RS.CORRUPT:
                break
            # Remove what read back wrong so the next attempt uploads it again.
            dest.delete_files(snap.manifest.run, snap.manifest.step,
                              [p for p, s in result.remote.items() if s is not FileStatus.OK])
        catalog.set_replica(
            checkpoint_id, result.url, result.destination, result.state,
            bytes=snap.manifest.total_bytes if result.state is RS.VERIFIED else 0, error=result.error,
        )
        return result
    finally:
        dest.close()


def _why(e: BaseException) -> str:
    return redact(e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__


def _replicate_or_fail(catalog: Catalog, checkpoint_id: int, snap: LocalSnapshot, url: str,
                       config: Config) -> ReplicaResult:
    """replicate_to, with an I/O failure as a failed result (already recorded) instead of an exception."""
    try:
        return replicate_to(catalog, checkpoint_id, snap, url, config)
    except (OSError, SafepointError) as e:
        return ReplicaResult(url=url, destination=url, state=RS.FAILED, error=f"{redact(url)}: {_why(e)}")


def settle_replication(catalog: Catalog, checkpoint_id: int, results: list[ReplicaResult]) -> CS:
    """Decide the checkpoint's state after replication (pure rules, then one guarded transition)."""
    local = [r.local_outcome for r in results if r.local]
    if CS.CORRUPT in local:
        state, error = CS.CORRUPT, next(r.error for r in results if r.local_outcome is CS.CORRUPT)
    elif CS.INCOMPLETE in local:
        state, error = CS.INCOMPLETE, next(r.error for r in results if r.local_outcome is CS.INCOMPLETE)
    elif any(r.state is RS.VERIFIED for r in results):
        state, error = CS.REPLICATED, None
    else:
        state, error = CS.COMMITTED, "; ".join(r.error or str(r.state) for r in results) or "no destination"
    catalog.transition(checkpoint_id, state, expect={CS.REPLICATING}, error=error)
    return state


def validate_checkpoint(
    catalog: Catalog, checkpoint_id: int, snap: LocalSnapshot, *, model: str | None = None,
    options: dict[str, Any] | None = None, config: Config | None = None,
) -> CS:
    """Dry-run load of the (verified) local bytes; record the report, the tensor stats and the final state.

    Settings come from `[validation]` and `[runs.RUN]` of `config` (default: the config file);
    `model` (--model, the flow parameter) overrides the run's factory. The numerical audit compares
    with the newest verified checkpoint of the run before this step. A model factory that cannot be
    built raises HarnessError (a UsageError) before the checkpoint changes state.
    """
    from datetime import datetime, timezone

    from safepoint.core.config import load_config
    from safepoint.validation.audit import baseline_from_catalog, stat_rows
    from safepoint.validation.harness import build_harness
    from safepoint.validation.settings import ValidationSettings
    from safepoint.validation.validate import validate_snapshot

    m = snap.manifest
    settings = ValidationSettings.from_config(config or load_config(), m.run, model=model)
    harness = build_harness(settings.model, settings.device) if settings.model else None
    if not catalog.transition(checkpoint_id, CS.VALIDATING, expect={CS.REPLICATED, CS.VERIFIED}):
        return catalog.get_by_id(checkpoint_id).state
    started = datetime.now(timezone.utc)
    baseline = baseline_from_catalog(catalog, m.run, m.step)
    report = validate_snapshot(snap.root, [f.path for f in m.files], model=harness, settings=settings, step=m.step,
                               baseline=baseline, **(options or {}))
    catalog.record_validation(checkpoint_id, report.ok, report.summary(), report.to_dict(), stat_rows(report.stats),
                              started_at=started)
    state = {"verified": CS.VERIFIED, "incomplete": CS.INCOMPLETE}.get(str(report.outcome), CS.INVALID)
    catalog.transition(checkpoint_id, state, expect={CS.VALIDATING},
                       error=None if state is CS.VERIFIED else report.summary())
    return state


def outcome(catalog: Catalog, checkpoint_id: int, message: str = "") -> IngestOutcome:
    row = catalog.get_by_id(checkpoint_id)
    reps = [{"url": r.url, "state": str(r.state), "error": r.error} for r in catalog.replicas(checkpoint_id)]
    return IngestOutcome(row.run, row.step, row.state, reps, message or (row.error or ""))


def ingest(folder: str | Path, destinations: list[str], catalog: Catalog, config: Config | None = None,
           *, model: str | None = None) -> IngestOutcome:
    """The whole pipeline without Prefect (the flow runs the same steps as tasks)."""
    config = config or Config()
    try:
        snap = LocalSnapshot.open(folder)
    except FormatError as e:
        from safepoint.ops.reconcile import quarantine

        quarantine(catalog, folder, str(e))  # corrupt in the catalog, so watchers stop retrying it
        raise
    from safepoint.destinations.parts import is_part

    if is_part(snap.manifest):  # one node's part of a multi-node checkpoint (safepoint.assemble)
        from safepoint.ops.assemble import ingest_part

        ingest_part(folder, destinations, catalog, config, model=model)
        return outcome(catalog, catalog.get(snap.manifest.run, snap.manifest.step).id)
    row = register(catalog, snap)
    results = [_replicate_or_fail(catalog, row.id, snap, url, config) for url in destinations]
    state = settle_replication(catalog, row.id, results)
    if state is CS.REPLICATED:
        validate_checkpoint(catalog, row.id, snap, model=model or config.run_setting(snap.manifest.run, "model"),
                            config=config)
    return outcome(catalog, row.id)


def _as_url(target: str) -> str:
    if "://" in target:
        return target.rstrip("/")
    return "file://" + str(Path(target).resolve())


def verify_url(catalog: Catalog, target: str, config: Config | None = None) -> tuple[VerifyReport, str]:
    """Re-hash a replica URL or a local snapshot folder, record what was found, and return the report."""
    config = config or Config()
    url = _as_url(target)
    found = catalog.find_replica(url)
    local = Path(url[len("file://"):]) if url.startswith("file://") else None
    if found is None and local is not None and (local / MARKER_NAME).exists():
        try:
            report = LocalSnapshot.open(local).verify()
        except FormatError as e:
            report = VerifyReport(error=str(e))
        row = catalog.find_by_local_path(str(local))
        if row is not None:
            _record_local_verify(catalog, row, report)
        return report, str(local)
    from safepoint.core.naming import parse_snapshot_url

    base, run, step = parse_snapshot_url(url)
    dest = open_destination(base, config.storage_options(base))
    from safepoint.ops.progress import CountingDestination, hook

    counted = CountingDestination(dest, hook()) if hook() else dest  # feeds the CLI's progress bar
    try:
        snap_url = dest.snapshot_url(run, step)
        if dest.read_control(run, step, MARKER_NAME) is None:
            report = VerifyReport(error=f"{snap_url}: no COMMITTED marker (replica missing or partial)")
            state = RS.MISSING
        else:
            report = verify_replica(counted, run, step)  # type: ignore[arg-type]
            state = {CS.VERIFIED: RS.VERIFIED, CS.INCOMPLETE: RS.MISSING}.get(report.outcome, RS.CORRUPT)
    finally:
        dest.close()
    if found:
        row, _rep = found
        catalog.set_replica(row.id, snap_url, dest.url, state, error=None if state is RS.VERIFIED else report.summary())
        settle_copies(catalog, row.id)
    return report, snap_url


def _record_local_verify(catalog: Catalog, row: CheckpointRow, report: VerifyReport) -> None:
    catalog.add_event(checkpoint_id=row.id, kind="verify.local", detail={"outcome": str(report.outcome),
                                                                           "summary": redact(report.summary())})
    if report.outcome is not CS.VERIFIED and row.state in (CS.COMMITTED, CS.REPLICATING):
        catalog.transition(row.id, report.outcome, error=report.summary())


def settle_copies(catalog: Catalog, checkpoint_id: int) -> CS:
    """A verified checkpoint with no verified copy left (no good replica, no good local copy) is corrupt."""
    row = catalog.get_by_id(checkpoint_id)
    if row.state is not CS.VERIFIED:
        return row.state
    if any(r.state is RS.VERIFIED for r in catalog.replicas(checkpoint_id)):
        return row.state
    local_ok = False
    if row.local_path and (Path(row.local_path) / MARKER_NAME).exists():
        try:
            local_ok = LocalSnapshot.open(row.local_path).verify().outcome is CS.VERIFIED
        except FormatError:
            local_ok = False
    if not local_ok:
        catalog.transition(checkpoint_id, CS.CORRUPT, expect={CS.VERIFIED}, error="no verified copy left")
        return CS.CORRUPT
    return row.state
