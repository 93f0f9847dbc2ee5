"""Validation reports as Prefect artifacts (markdown and a per-tensor table), readable in the UI."""

from __future__ import annotations

import logging

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from safepoint.catalog.store import Catalog
from safepoint.validation import report as vr


def publish_validation_report(catalog: Catalog, checkpoint_id: int) -> None:
    """The stored report as a markdown artifact and a per-tensor table artifact.

    An artifact that cannot be created (no API reachable) is logged, never fatal: the report is
    already in the catalog (`safepoint show RUN STEP`).
    """
    row = catalog.get_by_id(checkpoint_id)
    v = catalog.latest_validation(checkpoint_id)
    if row is None or v is None:
        return
    stats = catalog.tensor_stats(v.id)
    try:
        create_markdown_artifact(key=vr.artifact_key("validation", row.run, row.step),
                                 markdown=vr.markdown(row.run, row.step, str(row.state), v.report, stats),
                                 description=f"Safepoint validation of {row.run}/{row.step}: {row.state}")
        create_table_artifact(key=vr.artifact_key("validation-tensors", row.run, row.step),
                              table=vr.tensor_rows(v.report, stats),
                              description=f"Tensors of {row.run}/{row.step}: verdict and stats (flagged first)")
    except Exception as e:  # noqa: BLE001 - artifacts are a view; the catalog holds the report
        logging.getLogger("safepoint").warning("validation artifacts for %s/%s not created: %s", row.run, row.step, e)
