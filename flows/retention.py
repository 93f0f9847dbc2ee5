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

from datetime import datetime, timezone
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from safepoint.catalog.store import open_catalog
from safepoint.core.config import load_config
from safepoint.rules.retention import SPEC_KEYS
from safepoint.tasks import retention as t


def _spec_for(run: str, policy: dict[str, Any] | None, config: Any) -> dict[str, Any] | None:
    """The run's own [runs.<run>] retention, else the flow's `policy`, else the [retention] table."""
    per_run = config.run_setting(run, "retention")
    if isinstance(per_run, dict) and per_run:
        return dict(per_run)
    if policy:
        return dict(policy)
    default = {k: v for k, v in config.section("retention").items() if k in SPEC_KEYS}
    return default or None


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
    logger = get_run_logger()
    config = load_config()
    catalog_url = catalog_url or config.catalog_url
    now = datetime.now(timezone.utc)
    names = runs if runs is not None else open_catalog(catalog_url).runs()
    specs = {run: _spec_for(run, policy, config) for run in names}
    skipped = sorted(r for r, s in specs.items() if not s)
    futures = [t.prune_run.submit(catalog_url, run, spec, min_replicas, dry_run, now)
               for run, spec in specs.items() if spec]
    pruned = [f.result() for f in futures]
    ev = config.section("eviction")
    roots = evict_roots if evict_roots is not None else list(ev.get("roots", []))
    hw = high_water if high_water is not None else float(ev.get("high_water", 0.85))
    lw = low_water if low_water is not None else ev.get("low_water")
    cap = capacity_bytes if capacity_bytes is not None else ev.get("capacity_bytes")
    keep = keep_newest_local if keep_newest_local is not None else int(ev.get("keep_newest", 1))
    # After pruning, so copies retention deleted anyway are not counted against the fill.
    evicted = [t.evict_root(catalog_url, root, hw, lw, cap, min_replicas, keep, dry_run) for root in roots]
    create_markdown_artifact(key="safepoint-retention", markdown=_markdown(pruned, evicted, skipped, dry_run),
                             description="Safepoint retention and eviction")
    total = sum(len(r["pruned"]) for r in pruned)
    logger.info("retention: %d checkpoint(s) pruned over %d run(s); %d local copies evicted", total, len(pruned),
                sum(len(e["evicted"]) for e in evicted))
    return {"runs": pruned, "skipped_runs": skipped, "eviction": evicted, "dry_run": dry_run}
