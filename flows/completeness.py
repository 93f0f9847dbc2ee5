"""The periodic completeness check of multi-node checkpoints (safepoint.ops.assemble.apply_timeouts).

Deployed on an interval (prefect.yaml `completeness`, `safepoint serve`). It never waits: it marks
sets that stayed partial past `[multinode] timeout_s` as `incomplete`, and assembles and validates
a complete set whose last ingest died before doing so.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from safepoint.catalog.store import open_catalog
from safepoint.core.config import load_config
from safepoint.flows.run_logs import route_to_run_logs
from safepoint.ops import assemble
from safepoint.ops.ingest import validate_assembled
from safepoint.tasks.artifacts import publish_validation_report
from safepoint.tasks.runner import PrefectSteps


@flow(name="safepoint-completeness")
def check_completeness(run: str | None = None, catalog_url: str | None = None) -> list[dict[str, Any]]:
    logger = get_run_logger()
    route_to_run_logs()
    config = load_config()
    catalog_url = catalog_url or config.catalog_url
    catalog = open_catalog(catalog_url)
    steps = PrefectSteps()
    actions = steps.run("apply-timeouts", assemble.apply_timeouts, catalog, config, run=run)
    out = []
    for a in actions:
        logger.info("%s/%s -> %s: %s", a.run, a.step, a.state, a.assessment.summary())
        state = a.state
        if a.validate:
            state = steps.run("validate", validate_assembled, catalog, a.checkpoint_id, config,
                              config.run_setting(a.run, "model"))
            publish_validation_report(catalog, a.checkpoint_id)
        out.append({"run": a.run, "step": a.step, "state": str(state), "missing_ranks": list(a.assessment.missing)})
    return out
