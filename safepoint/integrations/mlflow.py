"""MLflow, from a training script: link the active MLflow run to a Safepoint run, export its checkpoints.

    import mlflow
    from safepoint.integrations import mlflow as sp_mlflow

    with mlflow.start_run():
        sp_mlflow.link("my-run")   # references to my-run's verified checkpoints land in this MLflow run
        ...                        # train; each ingest records what it verified ([export.mlflow])

`export` records what the catalog holds now (what `safepoint export mlflow RUN` does). The catalog and
the exporter (safepoint.ops.export) are imported only when it is called: a training process that only
links pays for nothing but MLflow.
"""

from __future__ import annotations

from typing import Any

__all__ = ["export", "link"]


def link(run: str) -> None:
    """Tag MLflow's active run (started if none) as Safepoint run `run`: the exporter finds it by that tag."""
    from safepoint.ops.trackers import require
    from safepoint.ops.trackers.mlflow import RUN_TAG

    require("mlflow").set_tag(RUN_TAG, run)


def export(run: str, *, catalog_url: str | None = None, steps: list[int] | None = None,
           **options: Any) -> list[dict[str, Any]]:
    """Record `run`'s verified checkpoints in MLflow. `options`: tracking_uri, registry_uri, experiment,
    model (over `[export.mlflow]` of config.toml)."""
    from safepoint.catalog.store import open_catalog
    from safepoint.core.config import load_config
    from safepoint.ops.export import export_run, options_for

    config = load_config()
    catalog = open_catalog(catalog_url or config.catalog_url)
    return export_run(catalog, run, "mlflow", options_for("mlflow", config, **options), steps=steps)
