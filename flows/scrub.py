"""Scrub flow: safepoint.ops.scrub.scrub_pass with its verify batches fanned out, plus an artifact.

Deployed on an interval (prefect.yaml `scrub`, `safepoint serve`). The pass is the library's (the
CLI's `safepoint scrub` runs the same code inline); here each batch of files is a Prefect task on
the configured task runner (threads, or Dask via prefect-dask, see safepoint.flows.fanout).
`verify_fanout` verifies one large replica or local snapshot in full the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from safepoint.catalog.store import open_catalog
from safepoint.core.config import Config, fanout_settings, load_config
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME, FileEntry
from safepoint.core.naming import parse_snapshot_url
from safepoint.core.states import ReplicaState as RS
from safepoint.core.urls import local_path
from safepoint.core.verify import VerifyReport
from safepoint.destinations import open_destination
from safepoint.flows import fanout
from safepoint.flows.run_logs import route_to_run_logs
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops import scrub, steps
from safepoint.ops.verify import bound_problem
from safepoint.rules.batching import batch_limits, batches
from safepoint.rules.settle import replica_state
from safepoint.tasks.runner import PrefectSteps


@flow(name="safepoint-verify-batches")
def verify_batches(jobs: list[tuple[str, str, int, list[FileEntry]]], config: Config) -> list[Any]:
    """One task per batch on this flow's task runner (set at call time by FanoutSteps)."""
    return PrefectSteps().map("verify-batch", scrub.verify_batch, [(*job, config) for job in jobs])


@flow(name="safepoint-verify-local-batches")
def verify_local_batches(root: str, groups: list[list[FileEntry]]) -> list[Any]:
    return PrefectSteps().map("verify-local-batch", scrub.verify_local_batch, [(root, g) for g in groups])


class FanoutSteps(PrefectSteps):
    """Prefect steps whose batch verification runs on the `[fanout]` task runner (threads or Dask)."""

    def __init__(self, config: Config):
        super().__init__()
        self.config = config

    def map(self, name: str, fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], /) -> list[Any]:
        if name != "verify-batch" or not calls:
            return super().map(name, fn, calls)
        jobs = [(dest, run, step, files) for dest, run, step, files, _config in calls]
        return verify_batches.with_options(task_runner=fanout.task_runner(self.config))(jobs, self.config)


@flow(name="safepoint-scrub")
def scrub_replicas(subset: str = "16", run: str | None = None, catalog_url: str | None = None) -> dict[str, Any]:
    """Verify slice i of n of every verified replica. `subset`: 'n' rotates, 'i/n' picks slice i (1-based)."""
    route_to_run_logs()
    config = load_config()
    catalog = open_catalog(catalog_url or config.catalog_url)
    summary = scrub.scrub_pass(catalog, config, subset=subset, run=run, runner=FanoutSteps(config))
    index, of, rows = summary["index"], summary["of"], summary["rows"]
    table = "\n".join(f"| {r['url']} | {r['files']} | {r['bytes']} | {r['outcome']} |" for r in rows)
    create_markdown_artifact(
        key="scrub", description=f"Safepoint scrub, slice {index + 1}/{of}",
        markdown=(f"# Scrub slice {index + 1}/{of}: {summary['problems']} replica(s) with problems\n\n"
                  f"| replica | files | bytes read | outcome |\n|---|---|---|---|\n{table}\n"))
    get_run_logger().info("scrub slice %d/%d: %d replicas, %d files, %d bytes, %d with problems", index + 1, of,
                          summary["replicas"], summary["files"], summary["bytes"], summary["problems"])
    return summary


def _merged(answers: list[Any]) -> VerifyReport:
    for a in answers:
        if isinstance(a, BaseException):
            raise a
    return scrub.merge_reports(answers)


@flow(name="safepoint-verify-fanout")
def verify_fanout(target: str, catalog_url: str | None = None) -> dict[str, Any]:
    """Verify one (very large) replica URL or local snapshot folder in full, batches fanned out."""
    route_to_run_logs()
    config = load_config()
    catalog = open_catalog(catalog_url or config.catalog_url)
    size, count = batch_limits(fanout_settings(config))
    runner = fanout.task_runner(config)
    folder = local_path(target)
    if folder is not None and ("://" not in target or _is_local_snapshot(target, folder)):
        snap = LocalSnapshot.open(folder)
        groups = batches(list(snap.manifest.files), size, count)
        report = _merged(verify_local_batches.with_options(task_runner=runner)(str(snap.root), groups))
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
        found = catalog.find_replica(snap_url)
        problem = found and bound_problem(catalog, found[0], *(dest.read_control(run, step, n)
                                                              for n in (MANIFEST_NAME, MARKER_NAME)))
    finally:
        dest.close()
    jobs = [] if problem else [(base, run, step, b) for b in batches(list(manifest.files), size, count)]
    report = VerifyReport(error=f"{snap_url}: {problem}") if problem else \
        _merged(verify_batches.with_options(task_runner=runner)(jobs, config))
    if found is not None:
        row, _ = found
        state = replica_state(report.outcome)
        catalog.set_replica(row.id, snap_url, dest_url, state, error=None if state is RS.VERIFIED else report.summary(),
                            proof="read-back" if state is RS.VERIFIED else None)  # a scrub always re-reads
        steps.settle_copies(catalog, row.id)
    return {"target": snap_url, "outcome": str(report.outcome), "summary": report.summary(), "batches": len(jobs)}


def _is_local_snapshot(url: str, path: Path) -> bool:
    if not (path / MARKER_NAME).is_file():
        return False
    try:
        parse_snapshot_url(url)
    except ValueError:
        return True
    return False
