"""Scrub flow: safepoint.ops.scrub.scrub_pass with its verify batches fanned out, plus an artifact.

Deployed on an interval (prefect.yaml `scrub`, `safepoint serve`). The pass is the library's (the
CLI's `safepoint scrub` runs the same code inline); here each batch of files is a Prefect task on
the configured task runner (threads, or Dask via prefect-dask, see safepoint.flows.fanout).
`verify_fanout` runs safepoint.ops.verify.verify (what `safepoint verify` runs inline) the same way:
one large replica or local snapshot in full.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from safepoint.catalog.store import open_catalog
from safepoint.core.config import Config, load_config
from safepoint.flows import fanout
from safepoint.flows.run_logs import route_to_run_logs
from safepoint.ops import scrub
from safepoint.ops.verify import verify, verify_batch, verify_local_batch
from safepoint.tasks.runner import PrefectSteps

#: the steps that hash batches of files, fanned out on the `[fanout]` task runner
FANNED_OUT: dict[str, Callable[..., Any]] = {"verify-batch": verify_batch, "verify-local-batch": verify_local_batch}


@flow(name="safepoint-verify-batches")
def verify_batches(name: str, calls: list[tuple[Any, ...]]) -> list[Any]:
    """One task per batch on this flow's task runner (set at call time by FanoutSteps)."""
    return PrefectSteps().map(name, FANNED_OUT[name], calls)


class FanoutSteps(PrefectSteps):
    """Prefect steps whose batch verification runs on the `[fanout]` task runner (threads or Dask)."""

    def __init__(self, config: Config):
        super().__init__()
        self.config = config

    def map(self, name: str, fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], /) -> list[Any]:
        if name not in FANNED_OUT or not calls:
            return super().map(name, fn, calls)
        return verify_batches.with_options(task_runner=fanout.task_runner(self.config))(name, list(calls))


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


@flow(name="safepoint-verify-fanout")
def verify_fanout(target: str, catalog_url: str | None = None) -> dict[str, Any]:
    """Verify one (very large) replica URL or local snapshot folder in full: safepoint.ops.verify.verify,
    its batches fanned out."""
    route_to_run_logs()
    config = load_config()
    return verify(catalog_url or config.catalog_url, target, config, runner=FanoutSteps(config)).to_dict()
