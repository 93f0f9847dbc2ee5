"""Checkpoint state: guarded transitions, pins, tags and metrics, and marking for retention."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import sqlalchemy as sa

from safepoint.catalog.base import C, CatalogBase
from safepoint.catalog.models import Checkpoint, Run, utcnow
from safepoint.catalog.views import CheckpointView
from safepoint.core.redact import redact
from safepoint.core.states import CheckpointState
from safepoint.core.transitions import allowed, sources


class Transitions(CatalogBase):
    """Compare-and-set changes of one checkpoint row (and a run, for retention)."""

    def transition(self, checkpoint_id: int, to: CheckpointState, *, expect: set[CheckpointState] | None = None,
                   error: str | None = None, detail: dict[str, Any] | None = None) -> bool:
        """Move a checkpoint to `to` if its state allows it; False (nothing changed) otherwise.

        The UPDATE is guarded by the allowed source states *and* the version read just before, so
        the `from` recorded in the event is exact and concurrent callers cannot both win.
        A lost race re-reads and retries while the new state is still an allowed source.
        """
        to = C(to)
        froms = sources(to, expect)
        if not froms:
            return False
        allowed_from = sorted(x.value for x in froms)
        for _ in range(50):
            with self._write() as s:
                cur = s.execute(sa.select(Checkpoint.state, Checkpoint.version, Checkpoint.run_id)
                                .where(Checkpoint.id == checkpoint_id)).first()
                if cur is None or C(cur.state) not in froms:
                    return False
                now = utcnow()
                values: dict[str, Any] = {"state": to.value, "version": Checkpoint.version + 1,
                                          "state_changed_at": now, "updated_at": now}
                if error is not None:
                    values["error"] = redact(error)
                res = s.execute(
                    sa.update(Checkpoint)
                    .where(Checkpoint.id == checkpoint_id, Checkpoint.state.in_(allowed_from),
                           Checkpoint.version == cur.version)
                    .values(**values).execution_options(synchronize_session=False)
                )
                if res.rowcount == 1:
                    ev = {"from": cur.state, "to": to.value, **(detail or {})}
                    if error is not None:
                        ev["error"] = redact(error)
                    self._event(s, "state", checkpoint_id=checkpoint_id, run_id=cur.run_id, detail=ev)
                    return True
        return False

    def _update_checkpoint(self, checkpoint_id: int, **values: Any) -> bool:
        with self._write() as s:
            res = s.execute(
                sa.update(Checkpoint).where(Checkpoint.id == checkpoint_id)
                .values(updated_at=utcnow(), version=Checkpoint.version + 1, **values)
                .execution_options(synchronize_session=False)
            )
            return res.rowcount == 1

    def set_pinned(self, checkpoint_id: int, pinned: bool = True) -> bool:
        """Pinned checkpoints are never pruned by retention."""
        return self._update_checkpoint(checkpoint_id, pinned=bool(pinned))

    def set_tags(self, checkpoint_id: int, tags: Iterable[str]) -> bool:
        return self._update_checkpoint(checkpoint_id, tags=sorted({str(t) for t in tags}))

    def set_metrics(self, checkpoint_id: int, metrics: dict[str, Any]) -> bool:
        return self._update_checkpoint(checkpoint_id, metrics=dict(metrics))

    # -- retention ----------------------------------------------------------------------------

    def mark_pruned(self, run: str, checkpoint_ids: Iterable[int],
                    recheck: Callable[[list[CheckpointView]], Iterable[int]], *,
                    detail: dict[str, Any] | None = None) -> list[CheckpointView]:
        """Mark planned checkpoints `pruned`, but only those `recheck` still allows right now.

        One transaction: lock the run's checkpoint rows (FOR UPDATE on PostgreSQL; SQLite write
        transactions are already exclusive), read the run again, call `recheck` (the pure planner
        re-run on this fresh view) and mark the intersection. A transition, a replica change
        (set_replica share-locks its checkpoint) or a new verified checkpoint that lands between
        planning and now is therefore seen before anything is marked, and nothing can change the
        run while marking. Files are deleted afterwards, outside the transaction (catalog first).
        """
        wanted = set(checkpoint_ids)
        if not wanted:
            return []
        with self._write() as s:
            run_id = s.execute(sa.select(Run.id).where(Run.name == run)).scalar_one_or_none()
            if run_id is None:
                return []
            if s.get_bind().dialect.name == "postgresql":
                s.execute(sa.select(Checkpoint.id).where(Checkpoint.run_id == run_id).order_by(Checkpoint.id)
                          .with_for_update())
            where = [Checkpoint.run_id == run_id]
            q = (sa.select(*self._VIEW_COLS).join(Run, Checkpoint.run_id == Run.id).where(*where)
                 .order_by(Checkpoint.step))
            views = self._views(s, q, replicas_where=where)
            chosen = wanted & set(recheck(views))
            now = utcnow()
            marked: list[CheckpointView] = []
            for v in views:
                if v.id not in chosen or not allowed(v.state, C.PRUNED):
                    continue
                res = s.execute(
                    sa.update(Checkpoint).where(Checkpoint.id == v.id, Checkpoint.version == v.version)
                    .values(state=C.PRUNED.value, version=Checkpoint.version + 1, state_changed_at=now,
                            updated_at=now).execution_options(synchronize_session=False)
                )
                if res.rowcount == 1:
                    self._event(s, "state", checkpoint_id=v.id, run_id=run_id,
                                detail={"from": v.state.value, "to": C.PRUNED.value, **(detail or {})})
                    marked.append(v)
            return marked
