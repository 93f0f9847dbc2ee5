"""Scrub flow: re-verify a rotating slice of every verified replica (safepoint.scrub), fanned out.

Deployed on an interval (prefect.yaml `scrub`, `safepoint serve`). Each pass hashes slice `i` of
`n` of every replica's files in batches on the configured task runner (threads, or Dask via
prefect-dask, see safepoint.fanout); a replica whose slice shows a problem is verified in full at
once (pipeline.verify_url), which records it and settles its checkpoint. `verify_fanout` verifies
one large replica or local snapshot in full the same way.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from safepoint.catalog.store import open_catalog
from safepoint.core.config import Config, load_config
from safepoint.core.format import FileEntry
from safepoint.core.naming import parse_snapshot_url
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.core.verify import VerifyReport
from safepoint.destinations import open_destination
from safepoint.flows import fanout
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops import ingest as pipeline
from safepoint.ops import scrub
from safepoint.tasks.scrub import verify_batch, verify_local_batch

Job = tuple[str, str, int, list[FileEntry]]  # destination base URL, run, step, files


@flow(name="safepoint-verify-batches")
def verify_batches(jobs: list[Job], config: Config) -> list[VerifyReport]:
    """One task per batch on this flow's task runner (set at call time by `run_batches`)."""
    futures = [verify_batch.submit(dest, run, step, files, config) for dest, run, step, files in jobs]
    return [f.result() for f in futures]


@flow(name="safepoint-verify-local-batches")
def verify_local_batches(root: str, groups: list[list[FileEntry]]) -> list[VerifyReport]:
    futures = [verify_local_batch.submit(root, files) for files in groups]
    return [f.result() for f in futures]


def run_batches(jobs: list[Job], config: Config) -> list[VerifyReport]:
    if not jobs:
        return []
    return verify_batches.with_options(task_runner=fanout.task_runner(config))(jobs, config)


def _jobs(destination: str, run: str, step: int, files: list[FileEntry], config: Config) -> list[Job]:
    size, count = fanout.batch_limits(config)
    return [(destination, run, step, b) for b in fanout.batches(files, size, count)]


@flow(name="safepoint-scrub")
def scrub_replicas(subset: str = "16", run: str | None = None, catalog_url: str | None = None) -> dict[str, Any]:
    """Verify slice i of n of every verified replica. `subset`: 'n' rotates, 'i/n' picks slice i (1-based)."""
    logger = get_run_logger()
    config = load_config()
    catalog = open_catalog(catalog_url or config.catalog_url)
    index, of = scrub.parse_subset(subset)
    if index is None:
        index = scrub.next_slice(scrub.last_pass(catalog), of)
    jobs: list[Job] = []
    planned: dict[str, tuple[scrub.Target, int]] = {}
    unusable: list[tuple[scrub.Target, str]] = []
    for target in scrub.targets(catalog, run):
        dest = open_destination(target.destination, config.storage_options(target.destination))
        try:
            files, error = scrub.slice_plan(dest, target, index, of)
        finally:
            dest.close()
        if error:
            unusable.append((target, error))
            continue
        planned[target.url] = (target, len(files))
        jobs += _jobs(target.destination, target.run, target.step, files, config)
    reports = run_batches(jobs, config)
    by_url: dict[str, list[VerifyReport]] = {}
    for (dest_url, run_, step, _files), rep in zip(jobs, reports):
        by_url.setdefault(_snapshot_url(dest_url, run_, step), []).append(rep)
    rows, problems, total_files, total_bytes = [], 0, 0, 0
    damaged: set[int] = set()
    for url, (target, n) in planned.items():
        rep = scrub.merge_reports(by_url.get(url, []))
        bad = rep.problems
        outcome = "ok"
        if bad:
            # A slice found rot: verify the whole replica now, which records it and settles the checkpoint.
            full, _ = pipeline.verify_url(catalog, target.url, config)
            outcome = str(full.outcome)
            problems += 1
            damaged.add(target.checkpoint_id)
            logger.warning("scrub: %s slice %d/%d: %s; full verify: %s", target.url, index + 1, of, rep.summary(),
                           full.summary())
        catalog.add_event(scrub.SCRUB_EVENT, checkpoint_id=target.checkpoint_id, detail={
            "url": target.url, "index": index, "of": of, "files": n, "bytes": rep.bytes_checked,
            "problems": {p: str(s) for p, s in bad.items()}, "outcome": outcome})
        rows.append((target.url, n, rep.bytes_checked, outcome))
        total_files += n
        total_bytes += rep.bytes_checked
    for target, error in unusable:
        full, _ = pipeline.verify_url(catalog, target.url, config)
        problems += 1
        damaged.add(target.checkpoint_id)
        catalog.add_event(scrub.SCRUB_EVENT, checkpoint_id=target.checkpoint_id, detail={
            "url": target.url, "index": index, "of": of, "files": 0, "bytes": 0, "error": error,
            "outcome": str(full.outcome)})
        rows.append((target.url, 0, 0, f"{full.outcome}: {error}"))
    summary = {"pass": True, "index": index, "of": of, "replicas": len(rows), "files": total_files,
               "bytes": total_bytes, "problems": problems}
    if damaged:  # re-replicate what rot damaged from a copy that still verifies (safepoint.reconcile)
        from safepoint.ops.reconcile import repair

        summary["repaired"] = repair(catalog, damaged, config).actions()
    catalog.add_event(scrub.SCRUB_EVENT, detail=summary)
    table = "\n".join(f"| {u} | {n} | {b} | {o} |" for u, n, b, o in rows)
    create_markdown_artifact(
        key="scrub", description=f"Safepoint scrub, slice {index + 1}/{of}",
        markdown=(f"# Scrub slice {index + 1}/{of}: {problems} replica(s) with problems\n\n"
                  f"| replica | files | bytes read | outcome |\n|---|---|---|---|\n{table}\n"))
    logger.info("scrub slice %d/%d: %d replicas, %d files, %d bytes, %d with problems", index + 1, of, len(rows),
                total_files, total_bytes, problems)
    return summary


def _snapshot_url(destination: str, run: str, step: int) -> str:
    from safepoint.core.naming import snapshot_url

    return snapshot_url(destination, run, step)


@flow(name="safepoint-verify-fanout")
def verify_fanout(target: str, catalog_url: str | None = None) -> dict[str, Any]:
    """Verify one (very large) replica URL or local snapshot folder in full, batches fanned out."""
    config = load_config()
    catalog = open_catalog(catalog_url or config.catalog_url)
    if "://" not in target or target.startswith("file://") and _is_local_snapshot(target):
        folder = target[len("file://"):] if target.startswith("file://") else target
        snap = LocalSnapshot.open(folder)
        size, count = fanout.batch_limits(config)
        groups = fanout.batches(list(snap.manifest.files), size, count)
        runner = fanout.task_runner(config)
        report = scrub.merge_reports(verify_local_batches.with_options(task_runner=runner)(str(snap.root), groups))
        row = catalog.find_by_local_path(str(snap.root))
        if row is not None:
            catalog.add_event("verify.local", checkpoint_id=row.id,
                              detail={"outcome": str(report.outcome), "summary": report.summary(), "fanout": True})
        return {"target": str(snap.root), "outcome": str(report.outcome), "summary": report.summary(),
                "batches": len(groups)}
    base, run, step = parse_snapshot_url(target.rstrip("/"))
    dest = open_destination(base, config.storage_options(base))
    try:
        manifest = scrub.replica_manifest(dest, run, step)
        snap_url = dest.snapshot_url(run, step)
        dest_url = dest.url
    finally:
        dest.close()
    jobs = _jobs(base, run, step, list(manifest.files), config)
    report = scrub.merge_reports(run_batches(jobs, config))
    found = catalog.find_replica(snap_url)
    if found is not None:
        row, _ = found
        state = {CS.VERIFIED: RS.VERIFIED, CS.INCOMPLETE: RS.MISSING}.get(report.outcome, RS.CORRUPT)
        catalog.set_replica(row.id, snap_url, dest_url, state,
                            error=None if state is RS.VERIFIED else report.summary())
        pipeline.settle_copies(catalog, row.id)
    return {"target": snap_url, "outcome": str(report.outcome), "summary": report.summary(), "batches": len(jobs)}


def _is_local_snapshot(url: str) -> bool:
    from pathlib import Path

    from safepoint.core.format import MARKER_NAME

    path = Path(url[len("file://"):])
    if not (path / MARKER_NAME).is_file():
        return False
    try:
        parse_snapshot_url(url)
    except ValueError:
        return True
    return False
