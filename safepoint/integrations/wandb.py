"""Weights & Biases, from Python: export a Safepoint run's verified checkpoints as reference artifacts.

    from safepoint.integrations import wandb as sp_wandb

    sp_wandb.export("my-run", project="my-project")   # what `safepoint export wandb my-run` does

The references go to the W&B run `safepoint-RUN` (group RUN); a training run started with
`wandb.init(group="my-run")` shows beside them. The catalog and the exporter (safepoint.ops.export) are
imported only when `export` is called.
"""

from __future__ import annotations

from typing import Any

__all__ = ["export"]


def export(run: str, *, catalog_url: str | None = None, steps: list[int] | None = None,
           **options: Any) -> list[dict[str, Any]]:
    """Record `run`'s verified checkpoints in W&B. `options`: project, entity, mode, dir (over
    `[export.wandb]` of config.toml)."""
    from safepoint.catalog.store import open_catalog
    from safepoint.core.config import load_config
    from safepoint.ops.export import export_run, options_for

    config = load_config()
    catalog = open_catalog(catalog_url or config.catalog_url)
    return export_run(catalog, run, "wandb", options_for("wandb", config, **options), steps=steps)
