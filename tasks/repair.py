"""Thin Prefect task over safepoint.reconcile: the cheap, scoped reconcile every ingest starts with."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task

from safepoint.catalog.store import open_catalog
from safepoint.core.config import Config
from safepoint.core.errors import SafepointError
from safepoint.ops import reconcile


@task(name="reconcile")
def reconcile_snapshot(catalog_url: str | None, run: str, step: int, to: list[str], config: Config) -> dict[str, Any]:
    """Reconcile one (run, step) at the destinations an ingest is about to write to.

    Scoped and cheap: one listing of `<dest>/<run>/<step>/` per destination. It adopts or confirms a
    replica a crashed ingest committed, marks vanished ones, and removes orphans older than the
    grace period (`[reconcile] grace_s`, default 3600). It never finishes or repairs here: the
    ingest that follows does that work. Never fails the ingest: problems are logged.
    """
    grace = float(config.section("reconcile").get("grace_s", reconcile.GRACE_S))
    try:
        report = reconcile.reconcile(open_catalog(catalog_url), to, config, grace_s=grace, scope=(run, step),
                                     finish=False, repair=False)
    except (OSError, SafepointError, ValueError) as e:
        get_run_logger().warning("reconcile of %s/%s skipped: %s", run, step, e)
        return {"error": str(e)}
    done = {k: v for k, v in report.actions().items()}
    if any(s.done for s in report.steps) or report.errors:
        get_run_logger().info("reconcile %s/%s: %s%s", run, step, done,
                              f"; errors: {report.errors}" if report.errors else "")
    return done
