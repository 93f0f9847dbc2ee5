"""A run's norm trend as a Prefect artifact: what `safepoint plot` draws, in a form Prefect's UI shows."""

from __future__ import annotations

import logging
import re

from prefect.artifacts import create_markdown_artifact

from safepoint.catalog.store import Catalog
from safepoint.ops import trend

#: the steps the artifact shows (and reads the stats of): the newest ones
LAST = 20


def publish_norm_trend(catalog: Catalog, run: str) -> None:
    """The markdown of safepoint.ops.trend (a sparkline per series, a row per step, marked steps in bold),
    under one key per run, so the UI keeps its history. Never fatal: it is a view of the catalog."""
    try:
        t = trend.run_trend(catalog, run, last=LAST)
        create_markdown_artifact(key=re.sub(r"[^a-z0-9-]+", "-", f"norms-{run}".lower()).strip("-"),
                                 markdown=trend.markdown(t, last=LAST),
                                 description=f"Parameter and optimizer-moment norms of {run}, per step")
    except Exception as e:  # noqa: BLE001 - artifacts are a view; `safepoint plot` reads the same catalog
        logging.getLogger("safepoint").warning("norm trend artifact for %s not created: %s", run, e)
