"""Execute a retention plan: catalog first, then each replica's marker, then its files, then local."""

from __future__ import annotations

import shutil
from pathlib import Path

from catalog.store import Catalog
from safepoint.config import Config
from safepoint.decisions import RetentionPlan
from safepoint.destinations import open_destination
from safepoint.format import MARKER_NAME
from safepoint.layout import parse_snapshot_url
from safepoint.states import CheckpointState as CS
from safepoint.states import ReplicaState as RS


def execute(catalog: Catalog, plan: RetentionPlan, config: Config | None = None) -> list[tuple[str, int]]:
    """Delete what the plan says. A checkpoint whose state changed since planning is left alone."""
    config = config or Config()
    pruned = []
    for c in plan.delete:
        # Catalog first: once it says pruned, nothing resumes from it while files disappear.
        if not catalog.transition(c.id, CS.PRUNED, expect={c.state}):
            continue
        files = [f for f in catalog.file_paths(c.id)]
        for r in catalog.replicas(c.id):
            if r.state is RS.DELETED:
                continue
            base, run, step = parse_snapshot_url(r.url)
            dest = open_destination(base, config.storage_options(base))
            try:
                dest.delete_snapshot(run, step, files)
            finally:
                dest.close()
            catalog.set_replica(c.id, r.url, r.destination, RS.DELETED)
        if c.local_path and Path(c.local_path).is_dir():
            local = Path(c.local_path)
            (local / MARKER_NAME).unlink(missing_ok=True)
            shutil.rmtree(local, ignore_errors=True)
        pruned.append((c.run, c.step))
    return pruned
