"""The restore flow: safepoint.ops.restore.restore, each step a Prefect task (`safepoint restore` runs it inline)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from safepoint.catalog.store import open_catalog
from safepoint.core.config import load_config
from safepoint.flows.run_logs import route_to_run_logs
from safepoint.ops.restore import restore as restore_checkpoint
from safepoint.tasks.runner import PrefectSteps


@flow(name="safepoint-restore", validate_parameters=True)
def restore(run: str, into: str, step: int | None = None, sources: list[str] | None = None, min_replicas: int = 1,
            force: bool = False, catalog_url: str | None = None, node: str | None = None,
            ranks: list[int] | None = None) -> dict[str, Any]:
    """Restore `run`'s resume point (or `step`) into the folder `into`, verified (`node`/`ranks`: one part)."""
    route_to_run_logs()
    config = load_config()
    catalog = open_catalog(catalog_url or config.catalog_url)
    return restore_checkpoint(run, into, step, sources=sources or (), min_replicas=min_replicas, force=force,
                              catalog=catalog, config=config, runner=PrefectSteps(), node=node,
                              ranks=ranks).to_dict()
