"""Thin Prefect tasks over safepoint.prune and safepoint.eviction: retries live here, logic does not."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from prefect import task
from prefect.tasks import exponential_backoff

from safepoint.catalog.store import open_catalog
from safepoint.core.config import load_config
from safepoint.ops import evict as eviction
from safepoint.ops import prune
from safepoint.rules.retention import policy_from_spec
from safepoint.tasks.retry import retry_on_infrastructure


@task(name="prune-run", retries=2, retry_delay_seconds=exponential_backoff(backoff_factor=5),
      retry_condition_fn=retry_on_infrastructure)
def prune_run(catalog_url: str | None, run: str, spec: dict[str, Any], min_replicas: int, dry_run: bool,
              now: datetime) -> dict[str, Any]:
    """Plan and execute retention for one run (a re-run is safe: the catalog is marked first)."""
    res = prune.prune(open_catalog(catalog_url), [run], policy_from_spec(spec), now=now, min_replicas=min_replicas,
                      dry_run=dry_run, config=load_config())
    return {"run": run, "kept": len(res.plan.keep), "delete": len(res.plan.delete),
            "pruned": [s for _r, s in res.pruned], "skipped": [s for _r, s in res.skipped], "errors": res.errors,
            "plan": res.plan.to_rows()}


@task(name="evict-root", retries=2, retry_delay_seconds=10, retry_condition_fn=retry_on_infrastructure)
def evict_root(catalog_url: str | None, root: str, high_water: float, low_water: float | None,
               capacity_bytes: int | None, min_replicas: int, keep_newest: int, dry_run: bool) -> dict[str, Any]:
    res = eviction.evict(open_catalog(catalog_url), root, high_water=high_water, low_water=low_water,
                         capacity_bytes=capacity_bytes, min_replicas=min_replicas, keep_newest=keep_newest,
                         dry_run=dry_run)
    p = res.plan
    return {"root": root, "fill": p.usage.fill, "projected_fill": p.projected_fill,
            "planned": [d.copy.path for d in p.evict], "evicted": res.evicted, "skipped": res.skipped}
