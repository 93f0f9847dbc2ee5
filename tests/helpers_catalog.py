"""Seed a catalog directly (no Prefect, no validation) with real local folders and real replicas.

`seed(catalog, root, run, step, state=..., replicas=[...])` commits a tiny real snapshot under
`root/nvme`, records it, replicates it for real to `root/durable<i>` (file://), then drives the
catalog through legal transitions to `state` and sets each replica's recorded state. Tests of
prune/resume/eviction then see exactly what an ingest would have left, in milliseconds.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import sqlalchemy as sa

from safepoint.catalog.models import Checkpoint
from safepoint.catalog.store import Catalog
from safepoint.catalog.views import CheckpointRow, CheckpointView, ReplicaView
from safepoint.core.format import digest_bytes
from safepoint.core.states import CheckpointState as C
from safepoint.core.states import ReplicaState as R
from safepoint.destinations import open_destination
from safepoint.local.commit import commit
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.replicate import replicate

PATHS: dict[C, tuple[C, ...]] = {
    C.COMMITTED: (),
    C.REPLICATING: (C.REPLICATING,),
    C.REPLICATED: (C.REPLICATING, C.REPLICATED),
    C.VALIDATING: (C.REPLICATING, C.REPLICATED, C.VALIDATING),
    C.VERIFIED: (C.REPLICATING, C.REPLICATED, C.VALIDATING, C.VERIFIED),
    C.INVALID: (C.REPLICATING, C.REPLICATED, C.VALIDATING, C.INVALID),
    C.CORRUPT: (C.REPLICATING, C.CORRUPT),
    C.INCOMPLETE: (C.REPLICATING, C.INCOMPLETE),
    C.PRUNED: (C.REPLICATING, C.REPLICATED, C.VALIDATING, C.VERIFIED, C.PRUNED),
}


def local_folder(root: Path, run: str, step: int) -> Path:
    return root / "nvme" / run / f"step-{step}"


def durable(root: Path, i: int = 0) -> str:
    return (root / f"durable{i}").as_uri()


def seed(catalog: Catalog, root: Path, run: str, step: int, *, state: C | str = C.VERIFIED,
         replicas: tuple[R | str, ...] = (R.VERIFIED,), created: datetime | None = None,
         parent: tuple[str, int] | None = None, tags: tuple[str, ...] = (), metrics: dict | None = None,
         pinned: bool = False, size: int = 64, loadable: bool = False) -> CheckpointRow:
    """`loadable`: a real safetensors file (passes validation on re-ingest) instead of raw bytes."""
    state = C(state)
    folder = local_folder(root, run, step)
    folder.mkdir(parents=True, exist_ok=True)
    if loadable:
        import numpy as np
        from safetensors.numpy import save_file

        save_file({"w": np.full(max(1, size // 4), step, np.float32)}, str(folder / "model.safetensors"))
    else:
        (folder / "weights.bin").write_bytes(bytes([step % 251]) * size)
    meta = {"tags": list(tags)} if tags else {}
    if metrics:
        meta["metrics"] = metrics
    commit(folder, run, step, parent=parent, meta=meta or None)
    snap = LocalSnapshot.open(folder)
    row = catalog.record_commit(snap.manifest, digest_bytes(snap.manifest_bytes), str(snap.root))
    for i, rstate in enumerate(replicas):
        rstate = R(rstate)
        dest = open_destination(durable(root, i))
        if rstate in (R.VERIFIED, R.CORRUPT, R.DELETED):
            res = replicate(snap, dest)
            assert res.state is R.VERIFIED, res
        catalog.set_replica(row.id, dest.snapshot_url(run, step), dest.url, rstate)
    for to in PATHS[state]:
        assert catalog.transition(row.id, to), (run, step, to)
    if created is not None:
        with catalog.engine.begin() as c:
            c.execute(sa.update(Checkpoint).where(Checkpoint.id == row.id).values(created_at=created))
    if pinned:
        catalog.set_pinned(row.id)
    return catalog.get_by_id(row.id)


def view(step: int, state: C | str = C.VERIFIED, replicas: tuple[R | str, ...] = (R.VERIFIED,), *,
         run: str = "r", created: datetime | None = None, pinned: bool = False, tags: tuple[str, ...] = (),
         metrics: dict | None = None, id: int | None = None) -> CheckpointView:  # noqa: A002
    """A CheckpointView for the pure functions (id defaults to step)."""
    from datetime import timezone

    return CheckpointView(
        id=step if id is None else id, run=run, step=step, state=C(state), local_path=f"/nvme/{run}/{step}",
        created_at=created or datetime(2026, 1, 1, tzinfo=timezone.utc), total_bytes=100, pinned=pinned,
        tags=tags, metrics=metrics or {}, parent=None, world_size=1,
        replicas=tuple(ReplicaView(f"file:///d{i}/{run}/{step}", f"file:///d{i}", R(s), None)
                       for i, s in enumerate(replicas)),
    )
