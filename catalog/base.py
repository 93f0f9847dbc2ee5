"""Shared plumbing of the catalog aggregates: engines, one-transaction sessions, row and view builders.

Every public method of the aggregates is one short transaction and returns frozen dataclasses
(catalog.views), so callers never hold sessions or ORM objects across slow I/O. State changes are
guarded compare-and-set updates, safe with many processes on PostgreSQL without explicit locks; on
SQLite write transactions start with BEGIN IMMEDIATE (catalog.db) and so are serialized.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from safepoint.catalog import db
from safepoint.catalog.models import Checkpoint, CheckpointRank, Event, Replica, Run, utcnow
from safepoint.catalog.views import CheckpointRow, CheckpointView, ReplicaView
from safepoint.core.errors import CatalogError
from safepoint.core.states import CheckpointState, ReplicaState

C = CheckpointState


def norm_path(path: str | os.PathLike[str] | None) -> str | None:
    if path is None:
        return None
    return os.path.normpath(os.fspath(path))


class CatalogBase:
    """One catalog database. Cheap to construct; share the Engine (db.get_engine) per process."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._ro_engine = engine.execution_options(**{db.READONLY: True})
        self._held = threading.local()  # the session of a one_read() block, per thread

    @property
    def url(self) -> str:
        """The catalog URL, e.g. to hand to a subprocess (may contain a password: do not log)."""
        return self.engine.url.render_as_string(hide_password=False)

    # -- plumbing -----------------------------------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as s, s.begin():
            yield s

    @contextmanager
    def _read(self) -> Iterator[Session]:
        held = getattr(self._held, "session", None)
        if held is not None:  # inside one_read(): its session
            yield held
            return
        with Session(self._ro_engine) as s, s.begin():
            yield s

    @contextmanager
    def one_read(self) -> Iterator[None]:
        """Every read of this thread in the block shares one session and transaction: one snapshot,
        one connection checked out. A fleet restart's N nodes then read the catalog once each (the
        resume point, the checkpoint, its replicas and ranks), not once per question."""
        if getattr(self._held, "session", None) is not None:
            yield
            return
        with Session(self._ro_engine) as s, s.begin():
            self._held.session = s
            try:
                yield
            finally:
                self._held.session = None

    def _insert(self, model: Any) -> Any:
        """INSERT supporting ON CONFLICT on both backends."""
        name = self.engine.dialect.name
        if name == "postgresql":
            return postgresql.insert(model)
        if name == "sqlite":
            return sqlite.insert(model)
        raise CatalogError(f"unsupported catalog backend {name!r}")

    def _event(self, s: Session, kind: str, *, checkpoint_id: int | None = None, run_id: int | None = None,
               detail: dict[str, Any] | None = None) -> None:
        s.add(Event(checkpoint_id=checkpoint_id, run_id=run_id, at=utcnow(), kind=kind, detail=detail or {}))

    def _run_id(self, s: Session, name: str, settings: dict[str, Any] | None = None) -> int:
        ins = self._insert(Run).values(name=name, created_at=utcnow(), settings=settings)
        s.execute(ins.on_conflict_do_nothing(index_elements=["name"]))
        return s.execute(sa.select(Run.id).where(Run.name == name)).scalar_one()

    def _ranks(self, s: Session, checkpoint_id: int) -> tuple[int, ...]:
        q = sa.select(CheckpointRank.rank).where(CheckpointRank.checkpoint_id == checkpoint_id)
        return tuple(sorted(s.execute(q).scalars()))

    def _row(self, s: Session, ck: Checkpoint, run: str) -> CheckpointRow:
        return CheckpointRow(
            id=ck.id, run=run, run_id=ck.run_id, step=ck.step, state=C(ck.state), local_path=ck.local_path,
            node=ck.node, world_size=ck.world_size, total_bytes=ck.total_bytes, file_count=ck.file_count,
            manifest_blake3=ck.manifest_blake3, created_at=ck.created_at, updated_at=ck.updated_at,
            state_changed_at=ck.state_changed_at, parent_id=ck.parent_id, pinned=bool(ck.pinned),
            tags=tuple(ck.tags or ()), metrics=dict(ck.metrics or {}), error=ck.error, version=ck.version,
            delivered_ranks=self._ranks(s, ck.id),
            parent=(ck.parent_run, ck.parent_step) if ck.parent_run is not None else None,
        )

    def _get(self, s: Session, where: Any) -> CheckpointRow | None:
        r = s.execute(sa.select(Checkpoint, Run.name).join(Run, Checkpoint.run_id == Run.id).where(where)).first()
        return None if r is None else self._row(s, r[0], r[1])

    # Columns of a CheckpointView; plain column selects (no ORM identity map) keep pages cheap.
    _VIEW_COLS = (
        Checkpoint.id, Run.name.label("run"), Checkpoint.step, Checkpoint.state, Checkpoint.local_path,
        Checkpoint.created_at, Checkpoint.total_bytes, Checkpoint.pinned, Checkpoint.tags, Checkpoint.metrics,
        Checkpoint.parent_run, Checkpoint.parent_step, Checkpoint.world_size, Checkpoint.file_count,
        Checkpoint.state_changed_at, Checkpoint.error, Checkpoint.version,
    )

    @staticmethod
    def _replica_views(s: Session, q: Any) -> dict[int, list[ReplicaView]]:
        reps: dict[int, list[ReplicaView]] = {}
        for cid, url, dest, state, verified_at in s.execute(q):
            reps.setdefault(cid, []).append(ReplicaView(url, dest, ReplicaState(state), verified_at))
        return reps

    def _views(self, s: Session, q: Any, replicas_where: list[Any] | None = None) -> list[CheckpointView]:
        """Run `q` (selecting _VIEW_COLS) and attach replicas with one more query.

        Replicas are fetched by id list (small pages) or, for big listings, by `replicas_where`
        (the same filter joined through checkpoints) so no id list grows with the catalog.
        """
        rows = s.execute(q).all()
        rq = sa.select(Replica.checkpoint_id, Replica.url, Replica.destination, Replica.state, Replica.verified_at)
        if replicas_where is None:
            if not rows:
                return []
            rq = rq.where(Replica.checkpoint_id.in_([r.id for r in rows]))
        else:
            rq = (rq.join(Checkpoint, Replica.checkpoint_id == Checkpoint.id).join(Run, Checkpoint.run_id == Run.id)
                  .where(*replicas_where))
        reps = self._replica_views(s, rq.order_by(Replica.id))
        return [self._view_of(r, tuple(reps.get(r.id, ()))) for r in rows]

    @staticmethod
    def _view_of(r: Any, replicas: tuple[ReplicaView, ...]) -> CheckpointView:
        return CheckpointView(
            id=r.id, run=r.run, step=r.step, state=C(r.state), local_path=r.local_path, created_at=r.created_at,
            total_bytes=r.total_bytes, pinned=bool(r.pinned), tags=tuple(r.tags or ()), metrics=dict(r.metrics or {}),
            parent=(r.parent_run, r.parent_step) if r.parent_run is not None else None, world_size=r.world_size,
            replicas=replicas, file_count=r.file_count, state_changed_at=r.state_changed_at, error=r.error,
            version=r.version,
        )

