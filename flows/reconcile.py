"""The reconcile flow: safepoint.ops.reconcile.reconcile as one Prefect task (`safepoint reconcile` runs it inline)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from safepoint.catalog.store import open_catalog
from safepoint.core.config import load_config
from safepoint.flows.run_logs import route_to_run_logs
from safepoint.ops.reconcile import GRACE_S
from safepoint.ops.reconcile import reconcile as reconcile_catalog
from safepoint.tasks.runner import PrefectSteps


@flow(name="safepoint-reconcile", validate_parameters=True)
def reconcile(destinations: list[str] | None = None, run: str | None = None, step: int | None = None,
              grace_s: float = GRACE_S, dry_run: bool = False, catalog_url: str | None = None) -> dict[str, Any]:
    """Repair the catalog from the destinations (default: every one it knows); scope: `run` and `step`."""
    route_to_run_logs()
    config = load_config()
    catalog = open_catalog(catalog_url or config.catalog_url)
    scope = (run, step) if run and step is not None else None
    return PrefectSteps().run("reconcile", reconcile_catalog, catalog, destinations, config, grace_s=grace_s,
                              dry_run=dry_run, scope=scope).to_dict()
