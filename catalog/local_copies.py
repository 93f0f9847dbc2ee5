"""Local copies (the burst buffer): what is still on local disk, and the guard before evicting it."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa

from safepoint.catalog.base import C, CatalogBase, norm_path
from safepoint.catalog.models import Checkpoint, CheckpointRank, Replica, Run, utcnow
from safepoint.catalog.views import LocalCopy
from safepoint.core.states import CheckpointState, ReplicaState


class LocalCopies(CatalogBase):
    """Local folders the catalog points at, eviction claims and removals."""

    def _verified_count(self) -> Any:
        return (sa.select(sa.func.count()).select_from(Replica)
                .where(Replica.checkpoint_id == Checkpoint.id, Replica.state == ReplicaState.VERIFIED.value)
                .scalar_subquery())

    def local_copies(self, root: str | os.PathLike[str]) -> list[LocalCopy]:
        """Local folders under `root` that the catalog still points at (checkpoints and rank parts)."""
        prefix = norm_path(root)
        assert prefix is not None
        under = prefix.rstrip(os.sep) + os.sep

        def inside(col: Any) -> Any:
            return sa.or_(col == prefix, col.startswith(under, autoescape=True))

        base = (Checkpoint.id, Run.name.label("run"), Checkpoint.step, Checkpoint.state, Checkpoint.version,
                Checkpoint.created_at, self._verified_count().label("nver"))
        q1 = (sa.select(*base, Checkpoint.local_path.label("path"), sa.null().label("rank"))
              .join(Run, Checkpoint.run_id == Run.id).where(inside(Checkpoint.local_path)))
        q2 = (sa.select(*base, CheckpointRank.local_path.label("path"), CheckpointRank.rank)
              .join(Checkpoint, CheckpointRank.checkpoint_id == Checkpoint.id).join(Run, Checkpoint.run_id == Run.id)
              .where(inside(CheckpointRank.local_path),
                     sa.or_(Checkpoint.local_path.is_(None), CheckpointRank.local_path != Checkpoint.local_path)))
        out: dict[tuple[int, str], LocalCopy] = {}
        with self._read() as s:
            for q in (q1, q2):
                for r in s.execute(q):
                    out.setdefault((r.id, r.path), LocalCopy(
                        checkpoint_id=r.id, run=r.run, step=r.step, state=C(r.state), version=r.version,
                        created_at=r.created_at, path=r.path, verified_replicas=int(r.nver), rank=r.rank))
        return sorted(out.values(), key=lambda c: (c.created_at, c.run, c.step, c.path))

    def claim_local_eviction(self, copy: LocalCopy, *, states: Iterable[CheckpointState],
                             min_replicas: int = 1) -> bool:
        """Guard before deleting a local copy: True only if, right now, the checkpoint is unchanged
        since planning (same version), in one of `states`, and has >= `min_replicas` verified
        replicas. Bumps the version (a stale plan elsewhere then fails) and logs an event."""
        allowed = {C(x).value for x in states}
        with self._write() as s:
            cur = s.execute(sa.select(Checkpoint.state, Checkpoint.version, Checkpoint.run_id)
                            .where(Checkpoint.id == copy.checkpoint_id).with_for_update()).first()
            if cur is None or cur.version != copy.version or cur.state not in allowed:
                return False
            n = s.execute(sa.select(sa.func.count()).select_from(Replica).where(
                Replica.checkpoint_id == copy.checkpoint_id, Replica.state == ReplicaState.VERIFIED.value)).scalar_one()
            if n < max(1, min_replicas):
                return False
            s.execute(sa.update(Checkpoint).where(Checkpoint.id == copy.checkpoint_id)
                      .values(version=Checkpoint.version + 1, updated_at=utcnow())
                      .execution_options(synchronize_session=False))
            self._event(s, "evict", checkpoint_id=copy.checkpoint_id, run_id=cur.run_id,
                        detail={"path": copy.path, "rank": copy.rank, "verified_replicas": int(n)})
            return True

    def local_copy_removed(self, checkpoint_id: int, path: str | os.PathLike[str]) -> None:
        """Forget a deleted local folder (the checkpoint's own path and/or ranks' paths)."""
        p = norm_path(path)
        with self._write() as s:
            s.execute(sa.update(Checkpoint).where(Checkpoint.id == checkpoint_id, Checkpoint.local_path == p)
                      .values(local_path=None, updated_at=utcnow(), version=Checkpoint.version + 1)
                      .execution_options(synchronize_session=False))
            s.execute(sa.update(CheckpointRank)
                      .where(CheckpointRank.checkpoint_id == checkpoint_id, CheckpointRank.local_path == p)
                      .values(local_path=None).execution_options(synchronize_session=False))
            run_id = s.execute(sa.select(Checkpoint.run_id).where(Checkpoint.id == checkpoint_id)).scalar_one_or_none()
            self._event(s, "evicted", checkpoint_id=checkpoint_id, run_id=run_id, detail={"path": p})
