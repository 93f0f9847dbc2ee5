"""The retention flow: prune every run by its policy, then evict burst-buffer copies.

Runs on a schedule (the `retention` deployment in prefect.yaml) and does what `safepoint prune`
and `safepoint evict` do from the command line. Safe to run while ingests and scrubs run, and
twice at once: every deletion is decided again inside the catalog transaction that marks it
(catalog.mark_pruned), and local copies go only after catalog.claim_local_eviction agrees.

Policy per run: `[runs.<run>] retention = {...}` in config.toml, else the `policy` parameter (the
deployment's default), else the `[retention]` table; runs with none are skipped. Eviction roots: `evict_roots`, else
`[eviction] roots = [...]`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from safepoint.catalog.store import open_catalog
from safepoint.core.config import load_config
from safepoint.flows.run_logs import route_to_run_logs
from safepoint.ops.retention import retention_pass
from safepoint.tasks.runner import PrefectSteps


def _markdown(pruned: list[dict[str, Any]], evicted: list[dict[str, Any]], skipped: list[str], dry_run: bool) -> str:
    lines = [f"# Safepoint retention{' (dry run)' if dry_run else ''}", "",
             "| run | kept | planned deletions | pruned | kept on re-check | errors |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['kept']} | {r['delete']} | {len(r['pruned'])} | {len(r['skipped'])} | "
              f"{len(r['errors'])} |" for r in pruned]
    if skipped:
        lines += ["", f"Runs without a retention policy (skipped): {', '.join(skipped)}"]
    if evicted:
        lines += ["", "| local root | fill | evicted | projected fill |", "|---|---|---|---|"]
        lines += [f"| `{e['root']}` | {e['fill']:.0%} | {len(e['evicted'] or e['planned'])} | "
                  f"{e['projected_fill']:.0%} |" for e in evicted]
    return "\n".join(lines) + "\n"


@flow(name="safepoint-retention", validate_parameters=True)
def retention(
    runs: list[str] | None = None,
    policy: dict[str, Any] | None = None,
    min_replicas: int = 1,
    dry_run: bool = False,
    evict_roots: list[str] | None = None,
    high_water: float | None = None,
    low_water: float | None = None,
    capacity_bytes: int | None = None,
    keep_newest_local: int | None = None,
    catalog_url: str | None = None,
) -> dict[str, Any]:
    """Prune `runs` (default: every run in the catalog), then evict local copies under `evict_roots`."""
    route_to_run_logs()
    config = load_config()
    catalog = open_catalog(catalog_url or config.catalog_url)
    result = retention_pass(catalog, config, runs=runs, policy=policy, min_replicas=min_replicas, dry_run=dry_run,
                            evict_roots=evict_roots, high_water=high_water, low_water=low_water,
                            capacity_bytes=capacity_bytes, keep_newest_local=keep_newest_local,
                            runner=PrefectSteps())
    pruned, evicted = result["runs"], result["eviction"]
    create_markdown_artifact(key="safepoint-retention",
                             markdown=_markdown(pruned, evicted, result["skipped_runs"], dry_run),
                             description="Safepoint retention and eviction")
    get_run_logger().info("retention: %d checkpoint(s) pruned over %d run(s); %d local copies evicted",
                          sum(len(r["pruned"]) for r in pruned), len(pruned), sum(len(e["evicted"]) for e in evicted))
    return result
