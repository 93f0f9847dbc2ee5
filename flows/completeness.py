"""The periodic completeness check of multi-node checkpoints (safepoint.ops.assemble.check_completeness).

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
from safepoint.tasks.artifacts import publish_validation_report
from safepoint.tasks.runner import PrefectSteps


@flow(name="safepoint-completeness")
def check_completeness(run: str | None = None, catalog_url: str | None = None) -> list[dict[str, Any]]:
    logger = get_run_logger()
    route_to_run_logs()
    config = load_config()
    catalog_url = catalog_url or config.catalog_url
    catalog = open_catalog(catalog_url)
    out = []
    for a in assemble.check_completeness(catalog, config, run=run, runner=PrefectSteps()):
        logger.info("%s/%s -> %s: %s", a.run, a.step, a.state, a.assessment.summary())
        if a.validate:
            publish_validation_report(catalog, a.checkpoint_id)
        out.append({"run": a.run, "step": a.step, "state": str(a.state), "missing_ranks": list(a.assessment.missing)})
    return out
