"""Burst-buffer eviction: node-local copies go only after a durable replica is verified.

Training writes checkpoints to fast node-local storage (NVMe); Safepoint replicates them to
durable storage. The local copy is what a restart on the same node reads fastest, so it stays
until space is needed: when the local root passes a fill level (high water), the oldest local
copies whose checkpoint has a verified durable replica are deleted, oldest first, until the fill
is back under the low-water mark. A copy the pipeline may still read (pending states), one with
no verified replica, or the newest one of each run (fast restart) is never evicted.

`plan_eviction` is pure (safepoint.rules.eviction). `evict` measures, plans and deletes: for
each copy it first asks the catalog to confirm the plan still holds (claim_local_eviction: same
version, still evictable, replica still verified) and re-reads the replicas it relies on (a
replica verified at ingest may have rotted since: one that no longer matches its manifest is marked corrupt, and without
`min_replicas` whole ones the local copy, perhaps the last good one, stays), then deletes the
marker first (the folder stops being a committed snapshot for every reader), then the data files,
then the manifest, then records the removal.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from safepoint.catalog.views import LocalCopy
from safepoint.core.config import Config, load_config
from safepoint.core.errors import SafepointError
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.destinations import open_destination
from safepoint.local.safe_delete import remove_snapshot_folder
from safepoint.ops.verify import verify_replica
from safepoint.rules.eviction import EVICTABLE, EvictionPlan, Usage, plan_eviction, plan_keep_local

log = logging.getLogger("safepoint.ops.evict")

# -- I/O ----------------------------------------------------------------------------------------

def folder_bytes(path: str | os.PathLike[str]) -> int:
    """Apparent size of every regular file under `path` (0 when absent)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except FileNotFoundError:
                continue
            total += st.st_size
    return total


def measure(root: str | os.PathLike[str], capacity_bytes: int | None = None) -> Usage:
    """The root's fill: its filesystem's, or the bytes under root against a `capacity_bytes` quota."""
    if capacity_bytes is not None:
        return Usage(folder_bytes(root), int(capacity_bytes))
    du = shutil.disk_usage(root)
    return Usage(du.total - du.free, du.total)


def remove_local_snapshot(folder: str | os.PathLike[str], run: str, step: int,
                          files: Iterable[str] = (), *, expect_digest: str | None = None) -> bool:
    """Delete a local snapshot folder that provably holds (run, step): marker, data, manifest.

    Proof is a MANIFEST.json bound by the folder's marker (or, the marker gone, by `expect_digest`,
    the catalog's record) that names run and step: a folder reused for a newer checkpoint, being
    written by training (no manifest yet), or whose manifest was rewritten is left alone. Only
    files that manifest or the catalog lists are deleted, never through a symlink
    (safepoint.local.safe_delete), then empty folders; anything else stays. False if nothing was done.
    """
    out = remove_snapshot_folder(folder, run, step, expect_digest=expect_digest, files=sorted(set(files)))
    if out.refused:
        log.warning("%s: %d path(s) not deleted (a symlink or a folder on the way): %s", folder, len(out.refused),
                    ", ".join(out.refused[:3]))
    return out.done


def manifest_digests(catalog, checkpoint_id: int) -> dict[str, str | None]:
    """Local folder -> the digest of the manifest the catalog recorded for it (rank parts included)."""
    row = catalog.get_by_id(checkpoint_id)
    out: dict[str, str | None] = {}
    if row is not None and row.local_path:
        out[row.local_path] = row.manifest_blake3 or None
    for r in catalog.ranks(checkpoint_id) if row is not None and row.world_size > 1 else ():
        if r["local_path"]:
            out[r["local_path"]] = r["manifest_blake3"] or None
    return out


@dataclass
class EvictionResult:
    plan: EvictionPlan
    evicted: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)    # the catalog no longer allowed it, or not ours


def whole_replicas(catalog, copy: LocalCopy, needed: int, config: Config) -> int:
    """Re-hash the copy's verified replicas until `needed` of them still match their manifest; how many did.

    A replica that no longer does (rotted, deleted behind our back) is marked corrupt on the way."""
    whole = 0
    for r in catalog.replicas(copy.checkpoint_id):
        if whole >= needed:
            break
        if r.state is not RS.VERIFIED:
            continue
        try:
            dest = open_destination(r.destination, config.storage_options(r.destination))
            try:
                report = verify_replica(dest, copy.run, copy.step)
            finally:
                dest.close()
        except (OSError, SafepointError) as e:
            log.warning("%s: could not be re-read before eviction (%s); counted as not whole", r.url, e)
            continue
        if report.outcome is CS.VERIFIED:
            whole += 1
            continue
        log.error("%s: no longer matches its manifest (%s): marked corrupt; the local copy stays", r.url,
                  report.summary())
        catalog.set_replica(copy.checkpoint_id, r.url, r.destination, RS.CORRUPT,
                            error=f"re-verified before eviction: {report.summary()}")
    return whole


def evict(catalog, root: str | os.PathLike[str], *, high_water: float = 0.85, low_water: float | None = None,
          capacity_bytes: int | None = None, min_replicas: int = 1, keep_newest: int = 1,
          dry_run: bool = False, config: Config | None = None, keep_local: int | None = None) -> EvictionResult:
    """Measure `root`, plan, and (unless `dry_run`) delete the chosen local copies.

    `keep_local=N`: the trainer's count-based rule (rules.eviction.plan_keep_local) instead of the fill."""
    root = Path(root).resolve()  # the catalog holds resolved paths (safepoint commit resolves them)
    copies = [c for c in catalog.local_copies(root) if Path(c.path).is_dir()]
    sizes = {c.path: folder_bytes(c.path) for c in copies}
    if keep_local is not None:
        p = plan_keep_local(copies, sizes, measure(root, capacity_bytes), keep_local, min_replicas=min_replicas)
    else:
        p = plan_eviction(copies, sizes, measure(root, capacity_bytes), high_water=high_water, low_water=low_water,
                          min_replicas=min_replicas, keep_newest=keep_newest)
    result = EvictionResult(p)
    if dry_run:
        return result
    config = config or load_config()
    for d in p.evict:
        c = d.copy
        if whole_replicas(catalog, c, max(1, min_replicas), config) < max(1, min_replicas):
            result.skipped.append(c.path)  # what the plan relied on is gone: this copy may be the last good one
            continue
        if not catalog.claim_local_eviction(c, states=EVICTABLE, min_replicas=min_replicas):
            result.skipped.append(c.path)
            continue
        digest = manifest_digests(catalog, c.checkpoint_id).get(c.path)
        if remove_local_snapshot(c.path, c.run, c.step, catalog.file_paths(c.checkpoint_id), expect_digest=digest):
            catalog.local_copy_removed(c.checkpoint_id, c.path)
            result.evicted.append(c.path)
        else:
            result.skipped.append(c.path)
    return result
