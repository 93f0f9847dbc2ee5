"""Retention, written once: prune every run by its policy, then evict burst-buffer copies.

`safepoint prune` / `safepoint evict` and the scheduled retention flow (flows/retention.py) run
this code; the flow passes a runner that makes `prune-run` and `evict-root` Prefect tasks with
retries. Safe to run while ingests and scrubs run, and twice at once: every deletion is decided
again inside the catalog transaction that marks it, and local copies go only after the catalog
agrees (safepoint.ops.prune, safepoint.ops.evict).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from safepoint.catalog.store import Catalog
from safepoint.core.config import Config
from safepoint.core.errors import UsageError
from safepoint.ops import evict, prune
from safepoint.ops.runner import INLINE, StepRunner, all_or_raise
from safepoint.rules.retention import SPEC_KEYS, policy_from_spec


def spec_for(run: str, config: Config, *, override: Mapping[str, Any] | None = None,
             fallback: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """A run's retention policy spec, first found: `override` (command-line flags), the run's own
    `[runs.<run>] retention`, `fallback` (a flow's `policy` parameter), then the `[retention]` table."""
    if override:
        return dict(override)
    per_run = config.run_setting(run, "retention")
    if isinstance(per_run, dict) and per_run:
        return dict(per_run)
    if fallback:
        return dict(fallback)
    return {k: v for k, v in config.section("retention").items() if k in SPEC_KEYS} or None


def require_spec(run: str, config: Config, override: Mapping[str, Any] | None = None) -> dict[str, Any]:
    spec = spec_for(run, config, override=override)
    if spec is None:
        raise UsageError(_NO_POLICY.format(run=run))
    return spec


_NO_POLICY = ("no retention policy for run {run!r}: give --keep-last/--keep-every/--keep-within/--keep-tagged/"
              "--keep-best, or set [retention] or [runs.<run>] retention in config.toml")


def prune_run(catalog: Catalog, run: str, spec: dict[str, Any], min_replicas: int, dry_run: bool,
              now: datetime, config: Config) -> dict[str, Any]:
    """Plan and execute retention for one run (a re-run is safe: the catalog is marked first)."""
    policy = policy_from_spec(spec)
    res = prune.prune(catalog, [run], policy, now=now, min_replicas=min_replicas, dry_run=dry_run, config=config)
    return {"run": run, "policy": repr(policy), "dry_run": dry_run, "kept": len(res.plan.keep),
            "delete": len(res.plan.delete), "pruned": [s for _r, s in res.pruned],
            "skipped": [s for _r, s in res.skipped], "errors": res.errors, "plan": res.plan.to_rows(),
            "decisions": res.plan.decisions}


def evict_root(catalog: Catalog, root: str, high_water: float, low_water: float | None,
               capacity_bytes: int | None, min_replicas: int, keep_newest: int, dry_run: bool) -> dict[str, Any]:
    res = evict.evict(catalog, root, high_water=high_water, low_water=low_water, capacity_bytes=capacity_bytes,
                      min_replicas=min_replicas, keep_newest=keep_newest, dry_run=dry_run)
    p = res.plan
    return {"root": root, "fill": p.usage.fill, "projected_fill": p.projected_fill,
            "planned": [d.copy.path for d in p.evict], "evicted": res.evicted, "skipped": res.skipped}


def prune_runs(catalog: Catalog, config: Config, runs: list[str], *, override: Mapping[str, Any] | None = None,
               fallback: Mapping[str, Any] | None = None, require: bool = False, min_replicas: int = 1,
               dry_run: bool = False, runner: StepRunner = INLINE) -> tuple[list[dict[str, Any]], list[str]]:
    """The prune loop, written once: each run by its own policy (`spec_for`), one `prune-run` step each.

    Returns (one `prune_run` report per run pruned, the runs skipped for having no policy). A bad
    policy, and with `require` (the CLI) a run without one, is refused before anything is deleted.
    """
    now = datetime.now(timezone.utc)
    specs = {run: spec_for(run, config, override=override, fallback=fallback) for run in dict.fromkeys(runs)}
    skipped = sorted(r for r, s in specs.items() if not s)
    if require and skipped:
        raise UsageError(_NO_POLICY.format(run=skipped[0]))
    for spec in filter(None, specs.values()):
        policy_from_spec(spec)  # a bad policy is refused before any run is pruned
    answers = runner.map("prune-run", prune_run, [(catalog, run, spec, min_replicas, dry_run, now, config)
                                                  for run, spec in specs.items() if spec])
    return all_or_raise(answers), skipped


def retention_pass(catalog: Catalog, config: Config, *, runs: list[str] | None = None,
                   policy: dict[str, Any] | None = None, min_replicas: int = 1, dry_run: bool = False,
                   evict_roots: list[str] | None = None, high_water: float | None = None,
                   low_water: float | None = None, capacity_bytes: int | None = None,
                   keep_newest_local: int | None = None, runner: StepRunner = INLINE) -> dict[str, Any]:
    """Prune `runs` (default: every run in the catalog), then evict local copies under `evict_roots`
    (default: `[eviction] roots`). Runs with no policy are skipped."""
    answers, skipped = prune_runs(catalog, config, runs if runs is not None else catalog.runs(), fallback=policy,
                                  min_replicas=min_replicas, dry_run=dry_run, runner=runner)
    pruned = [{k: v for k, v in a.items() if k != "decisions"} for a in answers]
    ev = config.section("eviction")
    roots = evict_roots if evict_roots is not None else list(ev.get("roots", []))
    hw = high_water if high_water is not None else float(ev.get("high_water", 0.85))
    lw = low_water if low_water is not None else ev.get("low_water")
    cap = capacity_bytes if capacity_bytes is not None else ev.get("capacity_bytes")
    keep = keep_newest_local if keep_newest_local is not None else int(ev.get("keep_newest", 1))
    # After pruning, so copies retention deleted anyway are not counted against the fill.
    evicted = [runner.run("evict-root", evict_root, catalog, root, hw, lw, cap, min_replicas, keep, dry_run)
               for root in roots]
    return {"runs": pruned, "skipped_runs": skipped, "eviction": evicted, "dry_run": dry_run}
