"""Execute a retention plan: catalog marked first, then each replica's control files, then its data.

The plan (safepoint.rules.retention.plan) is pure and was made from a read of the catalog that may be
stale by now. `execute` therefore marks checkpoints `pruned` through catalog.mark_pruned, which
re-runs the planner on a fresh read inside the marking transaction and marks only what both
plans delete. Only then are files touched, in the order of docs/format.md (COMMITTED, then
MANIFEST.json, then, for a multi-node replica, every part's COMMITTED and MANIFEST.json, then data:
safepoint.rules.deletion), so a crash part-way leaves a partial replica or loose parts that
reconcile finishes deleting, never a committed one with missing files. Deletions that failed or
were interrupted are finished on the next run (`finish_pruned`) or by reconcile: the catalog
already says `pruned`, so nothing resumes from them meanwhile.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from safepoint.catalog.store import Catalog
from safepoint.catalog.views import CheckpointView
from safepoint.core.config import Config
from safepoint.core.errors import SafepointError
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME
from safepoint.core.naming import parse_snapshot_url
from safepoint.core.redact import redact
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.destinations import open_destination
from safepoint.destinations.parts import part_control
from safepoint.ops.assemble import part_digests
from safepoint.ops.evict import manifest_digests, remove_local_snapshot
from safepoint.rules.retention import Policy, RetentionPlan, plan, still_deletable

log = logging.getLogger("safepoint.ops.prune")


@dataclass
class PruneResult:
    plan: RetentionPlan
    pruned: list[tuple[str, int]] = field(default_factory=list)      # marked pruned by this execution
    skipped: list[tuple[str, int]] = field(default_factory=list)     # planned, but the re-check kept them
    errors: list[str] = field(default_factory=list)                  # deletions to retry next time


def delete_copies(catalog: Catalog, c: CheckpointView, config: Config) -> list[str]:
    """Delete every replica and local copy of a checkpoint the catalog already marked pruned."""
    if c.state is not CS.PRUNED:
        raise SafepointError(f"{c.run}/{c.step} is {c.state}, not pruned: refusing to delete its files")
    errors: list[str] = []
    files: list[str] | None = None
    for r in c.replicas:
        if r.state is RS.DELETED:
            continue
        files = files if files is not None else catalog.file_paths(c.id)
        try:
            base, run, step = parse_snapshot_url(r.url)
            dest = open_destination(base, config.storage_options(base))
            try:
                # COMMITTED, MANIFEST.json, every part's COMMITTED and MANIFEST.json, then data.
                dest.delete_snapshot(run, step, files + part_controls(catalog, c))
                dest.remove_empty_folders(run, step)
            finally:
                dest.close()
        except (OSError, SafepointError, ValueError) as e:
            errors.append(f"{r.url}: {redact(str(e))}")
            continue
        catalog.set_replica(c.id, r.url, r.destination, RS.DELETED)
    paths = {c.local_path}
    if c.world_size > 1:  # parts of a multi-node checkpoint may sit in other folders on this host
        paths |= {x["local_path"] for x in catalog.ranks(c.id)}
    digests = manifest_digests(catalog, c.id) if paths else {}
    for path in sorted(p for p in paths if p and Path(p).is_dir()):
        files = files if files is not None else catalog.file_paths(c.id)
        try:
            remove_local_snapshot(path, c.run, c.step, files, expect_digest=digests.get(path))
        except OSError as e:
            errors.append(f"{path}: {e}")
    return errors


def part_controls(catalog: Catalog, c: CheckpointView) -> list[str]:
    """The control files of every part of a multi-node checkpoint at a replica (none for a whole one)."""
    if c.world_size <= 1:
        return []
    return [part_control(key, name) for key in sorted(part_digests(catalog, c.id), key=int)
            for name in (MARKER_NAME, MANIFEST_NAME)]


def finish_pruned(catalog: Catalog, runs: list[str], config: Config) -> list[str]:
    """Delete what pruned checkpoints of `runs` still have (this execution's, or a crashed one's)."""
    errors: list[str] = []
    for run in runs:
        for c in catalog.list_checkpoints(run, states=[CS.PRUNED]):
            errors += delete_copies(catalog, c, config)
    return errors


def execute(catalog: Catalog, plan_: RetentionPlan, config: Config | None = None) -> list[tuple[str, int]]:
    """Delete what the plan says (see the module docstring); returns (run, step) marked pruned."""
    return execute_plan(catalog, plan_, config).pruned


def execute_plan(catalog: Catalog, plan_: RetentionPlan, config: Config | None = None) -> PruneResult:
    config = config or Config()
    result = PruneResult(plan_)
    recheck = still_deletable(plan_)
    by_run: dict[str, list[int]] = {}
    for c in plan_.delete:
        by_run.setdefault(c.run, []).append(c.id)
    for run, ids in sorted(by_run.items()):
        marked = catalog.mark_pruned(run, ids, recheck, detail={"by": "retention"})
        got = {c.id for c in marked}
        result.pruned += [(c.run, c.step) for c in marked]
        result.skipped += [(c.run, c.step) for c in plan_.delete if c.run == run and c.id not in got]
    result.errors = finish_pruned(catalog, sorted(set(plan_.runs()) | set(by_run)), config)
    for e in result.errors:
        log.warning("prune: could not delete %s (will retry on the next run)", e)
    return result


def prune(catalog: Catalog, runs: list[str], policy: Policy, *, now: datetime, min_replicas: int = 1,
          dry_run: bool = False, config: Config | None = None) -> PruneResult:
    """Plan retention for `runs` and, unless `dry_run`, execute it."""
    views = [v for run in runs for v in catalog.list_checkpoints(run)]
    p = plan(views, policy, now, min_replicas=min_replicas)
    if dry_run:
        return PruneResult(p)
    return execute_plan(catalog, p, config)
