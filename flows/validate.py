"""The validate flow: the dry-run load of a recorded checkpoint again, from its verified replica, as a Prefect task.

The step is safepoint.ops.assemble.validate_assembled, what an ingest and the completeness check run
(inline or as a task); the report is published as an artifact.
"""

from __future__ import annotations

from prefect import flow

from safepoint.catalog.store import open_catalog
from safepoint.core.config import load_config
from safepoint.core.errors import UsageError
from safepoint.flows.run_logs import route_to_run_logs
from safepoint.ops.assemble import validate_assembled
from safepoint.tasks.artifacts import publish_validation_report
from safepoint.tasks.runner import PrefectSteps


@flow(name="safepoint-validate", validate_parameters=True)
def validate(run: str, step: int, model: str | None = None, catalog_url: str | None = None) -> str:
    """Validate `run`/`step` again; returns its state."""
    route_to_run_logs()
    config = load_config()
    catalog = open_catalog(catalog_url or config.catalog_url)
    row = catalog.get(run, step)
    if row is None:
        raise UsageError(f"no checkpoint {run}/{step} in the catalog")
    state = PrefectSteps().run("validate", validate_assembled, catalog, row.id, config, model)
    publish_validation_report(catalog, row.id)
    return str(state)
