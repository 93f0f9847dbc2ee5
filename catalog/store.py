"""The catalog API: what Safepoint knows about runs, checkpoints, replicas and validations.

Every method is one short transaction and returns frozen dataclasses (catalog.views), so callers
never hold sessions or ORM objects across slow I/O. State changes are guarded compare-and-set
updates, safe with many processes on PostgreSQL without explicit locks; on SQLite write
transactions start with BEGIN IMMEDIATE (catalog.db) and so are serialized.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from safepoint.catalog import db
from safepoint.catalog.models import (
    Checkpoint,
    CheckpointFile,
    CheckpointRank,
    Event,
    Lease,
    Replica,
    Run,
    TensorStat,
    Validation,
    utcnow,
)
from safepoint.catalog.views import (
    CheckpointRow,
    CheckpointView,
    LineageLink,
    LocalCopy,
    ReplicaRow,
    ReplicaView,
    ValidationRow,
)
from safepoint.core.errors import CatalogError
from safepoint.core.format import FileEntry, Manifest, check_run, check_step
from safepoint.core.redact import redact, redact_url
from safepoint.core.states import CheckpointState, ReplicaState, can_transition

if TYPE_CHECKING:
    from collections.abc import Callable

    from safepoint.rules.resume import ResumeDecision

__all__ = ["Catalog", "open_catalog", "redact", "redact_url"]

C = CheckpointState
# A re-commit with a different manifest may replace the files only while nothing downstream
# (replication, validation) relies on them.
REPLACEABLE = frozenset({C.COMMITTED, C.CORRUPT, C.INVALID, C.INCOMPLETE})
_STAT_KEYS = ("name", "dtype", "shape", "numel", "norm", "max_abs", "nan_count", "inf_count")


def open_catalog(url: str | None = None) -> Catalog:
    """A Catalog on `url` (default: db.default_catalog_url()), migrated to head once per process."""
    return Catalog(db.ensure_schema(url))


def _norm_path(path: str | os.PathLike[str] | None) -> str | None:
    if path is None:
        return None
    return os.path.normpath(os.fspath(path))


def _parse_time(text: str) -> datetime:
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return utcnow()
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _finite_or_none(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) else x


def _is_part(m: Manifest) -> bool:
    return m.ranks is not None and set(m.ranks) != set(range(m.world_size))


class Catalog:
    """One catalog database. Cheap to construct; share the Engine (db.get_engine) per process."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._ro_engine = engine.execution_options(**{db.READONLY: True})

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
        with Session(self._ro_engine) as s, s.begin():
            yield s

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

    # -- runs ---------------------------------------------------------------------------------

    def ensure_run(self, name: str, settings: dict[str, Any] | None = None) -> int:
        """Create the run if absent (settings are only used on creation); return its id."""
        with self._write() as s:
            return self._run_id(s, name, settings)

    def get_run_id(self, name: str) -> int | None:
        with self._read() as s:
            return s.execute(sa.select(Run.id).where(Run.name == name)).scalar_one_or_none()

    def runs(self) -> list[str]:
        with self._read() as s:
            return list(s.execute(sa.select(Run.name).order_by(Run.name)).scalars())

    def run_settings(self, name: str) -> dict[str, Any] | None:
        with self._read() as s:
            return s.execute(sa.select(Run.settings).where(Run.name == name)).scalar_one_or_none()

    def set_run_settings(self, name: str, settings: dict[str, Any] | None) -> None:
        with self._write() as s:
            rid = self._run_id(s, name)
            s.execute(sa.update(Run).where(Run.id == rid).values(settings=settings))

    # -- commits ------------------------------------------------------------------------------

    def record_commit(self, manifest: Manifest, manifest_blake3: str,
                      local_path: str | os.PathLike[str] | None = None) -> CheckpointRow:
        """Record a committed snapshot (or one part of a multi-node one); idempotent.

        Same run/step and same manifest digest: returns the existing row unchanged. A different
        manifest replaces files only in a state where nothing downstream used them (REPLACEABLE),
        else CatalogError. A part (ranks a strict subset of the world) merges into the checkpoint.
        ``manifest.meta["tags"]`` (list of str) and ``meta["metrics"]`` (object) seed tags/metrics.
        """
        for attempt in range(5):
            try:
                with self._write() as s:
                    return self._record_commit(s, manifest, manifest_blake3, _norm_path(local_path))
            except IntegrityError:
                # A concurrent ingest of the same checkpoint inserted first; retry sees its row.
                if attempt == 4:
                    raise
        raise AssertionError("unreachable")

    def _parent_id(self, s: Session, m: Manifest, checkpoint_id: int, run_id: int) -> int | None:
        """Resolve the manifest's declared parent; a missing one is logged and linked when it appears."""
        if m.parent is None:
            return None
        prun, pstep = m.parent
        pid = s.execute(
            sa.select(Checkpoint.id).join(Run, Checkpoint.run_id == Run.id).where(Run.name == prun,
                                                                                  Checkpoint.step == pstep)
        ).scalar_one_or_none()
        if pid is None:
            self._event(s, "parent_missing", checkpoint_id=checkpoint_id, run_id=run_id,
                        detail={"run": prun, "step": pstep})
        return pid

    def _adopt_children(self, s: Session, checkpoint_id: int, run: str, step: int) -> None:
        """Link checkpoints that declared (run, step) as parent before it was cataloged."""
        s.execute(
            sa.update(Checkpoint)
            .where(Checkpoint.parent_run == run, Checkpoint.parent_step == step, Checkpoint.parent_id.is_(None),
                   Checkpoint.id != checkpoint_id)
            .values(parent_id=checkpoint_id).execution_options(synchronize_session=False)
        )

    def _add_files_and_ranks(self, s: Session, ck_id: int, m: Manifest, blake: str, local_path: str | None,
                             files: Iterable[FileEntry]) -> None:
        held = m.held_ranks
        file_rank = held[0] if len(held) == 1 and m.world_size > 1 else None
        rows = [{"checkpoint_id": ck_id, "path": f.path, "size": f.size, "blake3": f.blake3, "rank": file_rank}
                for f in files]
        if rows:
            s.execute(sa.insert(CheckpointFile), rows)
        have = set(self._ranks(s, ck_id))
        now = utcnow()
        ranks = [{"checkpoint_id": ck_id, "rank": r, "node": m.node, "local_path": local_path,
                  "manifest_blake3": blake, "delivered_at": now} for r in held if r not in have]
        if ranks:
            s.execute(sa.insert(CheckpointRank), ranks)

    def _refresh_totals(self, s: Session, ck: Checkpoint) -> None:
        count, total = s.execute(
            sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(CheckpointFile.size), 0))
            .where(CheckpointFile.checkpoint_id == ck.id)
        ).one()
        ck.file_count, ck.total_bytes = int(count), int(total)

    def _record_commit(self, s: Session, m: Manifest, blake: str, local_path: str | None) -> CheckpointRow:
        run_id = self._run_id(s, m.run)
        part = _is_part(m)
        ck = s.execute(
            sa.select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.step == m.step).with_for_update()
        ).scalar_one_or_none()
        now = utcnow()
        tags = m.meta.get("tags")
        tags = [str(t) for t in tags] if isinstance(tags, list) else []
        metrics = m.meta.get("metrics")
        metrics = dict(metrics) if isinstance(metrics, dict) else {}

        if ck is None:
            ck = Checkpoint(
                run_id=run_id, step=m.step, state=C.COMMITTED.value, local_path=local_path, node=m.node,
                world_size=m.world_size, manifest_blake3=None if part else blake, created_at=_parse_time(m.created),
                updated_at=now, state_changed_at=now, tags=tags, metrics=metrics, version=1,
            )
            s.add(ck)
            s.flush()
            ck.parent_id = self._parent_id(s, m, ck.id, run_id)
            ck.parent_run, ck.parent_step = m.parent if m.parent else (None, None)
            self._adopt_children(s, ck.id, m.run, m.step)
            self._add_files_and_ranks(s, ck.id, m, blake, local_path, m.files)
            self._refresh_totals(s, ck)
            self._event(s, "commit", checkpoint_id=ck.id, run_id=run_id,
                        detail={"manifest_blake3": blake, "ranks": list(m.held_ranks), "node": m.node,
                                "part": part, "files": len(m.files)})
            s.flush()
            return self._row(s, ck, m.run)

        state = C(ck.state)
        if part:
            return self._merge_part(s, ck, m, blake, local_path)
        if ck.manifest_blake3 == blake:
            return self._row(s, ck, m.run)
        if state not in REPLACEABLE:
            raise CatalogError(
                f"{m.run}/{m.step} is already cataloged with another manifest and is {state}; "
                "refusing to replace its files"
            )
        old = ck.manifest_blake3
        s.execute(sa.delete(CheckpointFile).where(CheckpointFile.checkpoint_id == ck.id))
        s.execute(sa.delete(CheckpointRank).where(CheckpointRank.checkpoint_id == ck.id))
        ck.state, ck.version, ck.error = C.COMMITTED.value, ck.version + 1, None
        ck.state_changed_at = ck.updated_at = now
        ck.local_path, ck.node, ck.world_size, ck.manifest_blake3 = local_path, m.node, m.world_size, blake
        ck.created_at = _parse_time(m.created)
        ck.parent_id = self._parent_id(s, m, ck.id, run_id)
        ck.parent_run, ck.parent_step = m.parent if m.parent else (None, None)
        if tags:
            ck.tags = tags
        if metrics:
            ck.metrics = metrics
        s.flush()
        self._add_files_and_ranks(s, ck.id, m, blake, local_path, m.files)
        self._refresh_totals(s, ck)
        self._event(s, "recommit", checkpoint_id=ck.id, run_id=run_id,
                    detail={"from": state.value, "to": C.COMMITTED.value, "old_manifest_blake3": old,
                            "manifest_blake3": blake})
        s.flush()
        return self._row(s, ck, m.run)

    def _merge_part(self, s: Session, ck: Checkpoint, m: Manifest, blake: str, local_path: str | None) -> CheckpointRow:
        """Add one node's part: new files and ranks; the same path with other bytes is an error."""
        if ck.world_size != m.world_size:
            raise CatalogError(f"{m.run}/{m.step}: part has world_size {m.world_size}, catalog has {ck.world_size}")
        if C(ck.state) == C.PRUNED:
            raise CatalogError(f"{m.run}/{m.step} was pruned; refusing a late part")
        existing = {
            p: (size, digest) for p, size, digest in s.execute(
                sa.select(CheckpointFile.path, CheckpointFile.size, CheckpointFile.blake3)
                .where(CheckpointFile.checkpoint_id == ck.id)
            )
        }
        new: list[FileEntry] = []
        for f in m.files:
            old = existing.get(f.path)
            if old is None:
                new.append(f)
            elif old != (f.size, f.blake3):
                raise CatalogError(f"{m.run}/{m.step}: parts disagree on {f.path!r}")
        have = set(self._ranks(s, ck.id))
        if not new and set(m.held_ranks) <= have:
            return self._row(s, ck, m.run)  # this part was already merged
        self._add_files_and_ranks(s, ck.id, m, blake, local_path, new)
        if ck.local_path is None:
            ck.local_path = local_path
        self._refresh_totals(s, ck)
        ck.updated_at, ck.version = utcnow(), ck.version + 1
        self._event(s, "part", checkpoint_id=ck.id, run_id=ck.run_id,
                    detail={"manifest_blake3": blake, "ranks": list(m.held_ranks), "node": m.node,
                            "files": len(new)})
        s.flush()
        return self._row(s, ck, m.run)

    # -- lookups ------------------------------------------------------------------------------

    def get(self, run: str, step: int) -> CheckpointRow | None:
        with self._read() as s:
            return self._get(s, sa.and_(Run.name == run, Checkpoint.step == step))

    def get_by_id(self, checkpoint_id: int) -> CheckpointRow | None:
        with self._read() as s:
            return self._get(s, Checkpoint.id == checkpoint_id)

    def latest(self, run: str, states: Iterable[CheckpointState] = (C.VERIFIED,)) -> CheckpointRow | None:
        """The highest-step checkpoint of `run` in one of `states` (uses ix_checkpoints_run_id_state_step)."""
        with self._read() as s:
            q = (sa.select(Checkpoint, Run.name).join(Run, Checkpoint.run_id == Run.id)
                 .where(Run.name == run, Checkpoint.state.in_([C(x).value for x in states]))
                 .order_by(Checkpoint.step.desc()).limit(1))
            r = s.execute(q).first()
            return None if r is None else self._row(s, r[0], r[1])

    def find_by_local_path(self, path: str | os.PathLike[str]) -> CheckpointRow | None:
        """The checkpoint stored at local `path` (a whole snapshot, or one node's part)."""
        p = _norm_path(path)
        with self._read() as s:
            row = self._get(s, Checkpoint.id == sa.select(Checkpoint.id).where(Checkpoint.local_path == p)
                            .order_by(Checkpoint.id.desc()).limit(1).scalar_subquery())
            if row is None:
                sub = (sa.select(CheckpointRank.checkpoint_id).where(CheckpointRank.local_path == p)
                       .order_by(CheckpointRank.checkpoint_id.desc()).limit(1).scalar_subquery())
                row = self._get(s, Checkpoint.id == sub)
            return row

    def files(self, checkpoint_id: int) -> list[FileEntry]:
        with self._read() as s:
            q = (sa.select(CheckpointFile.path, CheckpointFile.size, CheckpointFile.blake3)
                 .where(CheckpointFile.checkpoint_id == checkpoint_id).order_by(CheckpointFile.path))
            return [FileEntry(p, size, b) for p, size, b in s.execute(q)]

    def file_paths(self, checkpoint_id: int) -> list[str]:
        """Relative paths of the checkpoint's data files, sorted."""
        return [f.path for f in self.files(checkpoint_id)]

    def ranks(self, checkpoint_id: int) -> list[dict[str, Any]]:
        """Delivered ranks: rank, node, local_path, manifest_blake3, delivered_at."""
        with self._read() as s:
            q = (sa.select(CheckpointRank).where(CheckpointRank.checkpoint_id == checkpoint_id)
                 .order_by(CheckpointRank.rank))
            return [{"rank": r.rank, "node": r.node, "local_path": r.local_path,
                     "manifest_blake3": r.manifest_blake3, "delivered_at": r.delivered_at}
                    for r in s.execute(q).scalars()]

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

    def list_checkpoints(self, run: str | None = None,
                         states: Iterable[CheckpointState] | None = None) -> list[CheckpointView]:
        """Checkpoints with lineage and replicas, ordered by run then step (two queries, no N+1)."""
        where: list[Any] = []
        if run is not None:
            where.append(Run.name == run)
        if states is not None:
            where.append(Checkpoint.state.in_([C(x).value for x in states]))
        q = (sa.select(*self._VIEW_COLS).join(Run, Checkpoint.run_id == Run.id).where(*where)
             .order_by(Run.name, Checkpoint.step))
        with self._read() as s:
            return self._views(s, q, replicas_where=where)

    # -- resume point -------------------------------------------------------------------------

    @staticmethod
    def _with_replicas(page: Any) -> Any:
        """The page of checkpoints (a LIMITed select of _VIEW_COLS) LEFT JOIN their replicas."""
        sub = page.subquery()
        return (sa.select(sub, Replica.url.label("r_url"), Replica.destination.label("r_dest"),
                          Replica.state.label("r_state"), Replica.verified_at.label("r_verified_at"))
                .outerjoin(Replica, Replica.checkpoint_id == sub.c.id)
                .order_by(sub.c.step.desc(), Replica.id))

    def _page_views(self, conn: Any, q: Any, params: dict[str, Any] | None = None) -> list[CheckpointView]:
        """One round trip for a page of checkpoints and their replicas (`q` from _with_replicas)."""
        views: list[CheckpointView] = []
        reps: list[ReplicaView] = []
        last = None
        for r in conn.execute(q, params or {}):
            if last is None or r.id != last.id:
                if last is not None:
                    views.append(self._view_of(last, tuple(reps)))
                last, reps = r, []
            if r.r_url is not None:
                reps.append(ReplicaView(r.r_url, r.r_dest, ReplicaState(r.r_state), r.r_verified_at))
        if last is not None:
            views.append(self._view_of(last, tuple(reps)))
        return views

    @staticmethod
    def _view_of(r: Any, replicas: tuple[ReplicaView, ...]) -> CheckpointView:
        return CheckpointView(
            id=r.id, run=r.run, step=r.step, state=C(r.state), local_path=r.local_path, created_at=r.created_at,
            total_bytes=r.total_bytes, pinned=bool(r.pinned), tags=tuple(r.tags or ()), metrics=dict(r.metrics or {}),
            parent=(r.parent_run, r.parent_step) if r.parent_run is not None else None, world_size=r.world_size,
            replicas=replicas, file_count=r.file_count, state_changed_at=r.state_changed_at, error=r.error,
            version=r.version,
        )

    # Built once per combination of filters, executed with bound parameters: constructing the
    # SELECT costs more CPU than running it.
    _PAGE_CACHE: dict[tuple[bool, bool, bool, bool], Any] = {}

    @classmethod
    def _resume_page_statement(cls, has_max: bool, has_before: bool, has_below: bool, with_replicas: bool) -> Any:
        key = (has_max, has_before, has_below, with_replicas)
        q = cls._PAGE_CACHE.get(key)
        if q is None:
            where: list[Any] = [
                Checkpoint.run_id == sa.select(Run.id).where(Run.name == sa.bindparam("run")).scalar_subquery()]
            if has_max:
                where.append(Checkpoint.step <= sa.bindparam("max_step"))
            if has_below:
                where.append(Checkpoint.step < sa.bindparam("below_step"))
            if has_before:
                where.append(Checkpoint.created_at < sa.bindparam("before", type_=Checkpoint.created_at.type))
            q = (sa.select(*cls._VIEW_COLS).join(Run, Checkpoint.run_id == Run.id).where(*where)
                 .order_by(Checkpoint.step.desc()).limit(sa.bindparam("limit", type_=sa.Integer)))
            q = cls._PAGE_CACHE[key] = cls._with_replicas(q) if with_replicas else q
        return q

    def resume_page_query(self, run: str, *, max_step: int | None = None, before: datetime | None = None,
                          below_step: int | None = None, limit: int = 16,
                          with_replicas: bool = False) -> tuple[Any, dict[str, Any]]:
        """The SELECT behind candidates_for_resume and its parameters (also for EXPLAIN in bench/)."""
        q = self._resume_page_statement(max_step is not None, before is not None, below_step is not None,
                                        with_replicas)
        params = {"run": run, "max_step": max_step, "before": before, "below_step": below_step, "limit": int(limit)}
        return q, {k: v for k, v in params.items() if v is not None}

    def candidates_for_resume(self, run: str, *, max_step: int | None = None, before: datetime | None = None,
                              below_step: int | None = None, limit: int = 16,
                              _conn: Any = None) -> list[CheckpointView]:
        """One page of `run`'s checkpoints, newest first, that a resume decision may look at.

        Only rows within the rules' scope (step <= max_step, created before `before`) and below
        `below_step` (the previous page's last step). One statement: a backward range scan of
        uq_checkpoints_run_id_step (run_id, step) that stops after `limit` rows, joined to their
        replicas through uq_replicas_checkpoint_id_url, so its cost does not grow with the catalog.
        """
        q, params = self.resume_page_query(run, max_step=max_step, before=before, below_step=below_step,
                                           limit=limit, with_replicas=True)
        if _conn is not None:
            return self._page_views(_conn, q, params)
        with self._ro_engine.connect() as conn, conn.begin():
            return self._page_views(conn, q, params)

    def resume_point(self, run: str, *, min_replicas: int = 1, max_step: int | None = None,
                     before: datetime | None = None, tag: str | None = None, page: int = 8) -> ResumeDecision:
        """Where `run` resumes from: safepoint.decisions.resume_point over only the rows it needs.

        Pages newest-first (8, 32, 128, ... rows) until the pure decision has a winner: the rows
        seen are then exactly the winner and every newer candidate, so the decision (and its
        explanation) is the one the pure function gives on the whole run. One read transaction,
        so every page sees the same snapshot; usually one page, one statement.
        """
        from safepoint.rules.resume import resume_point as decide

        seen: list[CheckpointView] = []
        below: int | None = None
        with self._ro_engine.connect() as conn, conn.begin():
            while True:
                batch = self.candidates_for_resume(run, max_step=max_step, before=before, below_step=below,
                                                   limit=page, _conn=conn)
                seen.extend(batch)
                decision = decide(seen, min_replicas=min_replicas, max_step=max_step, before=before, tag=tag)
                if decision.chosen is not None or len(batch) < page:
                    return decision
                below, page = batch[-1].step, min(page * 4, 4096)

    # -- lineage ------------------------------------------------------------------------------

    _LINK_COLS = (Checkpoint.id, Run.name.label("run"), Checkpoint.step, Checkpoint.state, Checkpoint.created_at,
                  Checkpoint.parent_id, Checkpoint.parent_run, Checkpoint.parent_step)

    def _link_row(self, s: Session, where: Any) -> Any:
        return s.execute(sa.select(*self._LINK_COLS).join(Run, Checkpoint.run_id == Run.id).where(where)).first()

    def _parent_link_row(self, s: Session, cur: Any) -> Any:
        if cur.parent_id is not None:
            return self._link_row(s, Checkpoint.id == cur.parent_id)
        if cur.parent_run is None:
            return None
        return self._link_row(s, sa.and_(Run.name == cur.parent_run, Checkpoint.step == cur.parent_step))

    def lineage(self, run: str, step: int, *, max_depth: int = 10_000) -> list[LineageLink]:
        """The chain from (run, step) back to its root, newest first, across runs.

        Each hop is one primary-key (or (run, step)) lookup. A declared parent missing from the
        catalog ends the chain as a link with state None. Stops on a cycle (only a hand-made
        manifest can declare one; set_parent refuses them).
        """
        chain: list[LineageLink] = []
        with self._read() as s:
            cur = self._link_row(s, sa.and_(Run.name == run, Checkpoint.step == step))
            seen: set[int] = set()
            while cur is not None and cur.id not in seen and len(chain) < max_depth:
                seen.add(cur.id)
                relation = None
                if cur.parent_run is not None:
                    relation = "resumed" if cur.parent_run == cur.run else "forked"
                chain.append(LineageLink(cur.run, cur.step, cur.id, C(cur.state), cur.created_at, relation))
                if cur.parent_run is None:
                    break
                nxt = self._parent_link_row(s, cur)
                if nxt is None:
                    chain.append(LineageLink(cur.parent_run, int(cur.parent_step), None, None, None, None))
                    break
                cur = nxt
        return chain

    def children(self, run: str, step: int) -> list[LineageLink]:
        """Checkpoints that name (run, step) as their parent: later resumes and forks, by run and step."""
        with self._read() as s:
            me = self._link_row(s, sa.and_(Run.name == run, Checkpoint.step == step))
            if me is None:
                return []
            q = (sa.select(*self._LINK_COLS).join(Run, Checkpoint.run_id == Run.id)
                 .where(Checkpoint.parent_id == me.id).order_by(Run.name, Checkpoint.step))
            return [LineageLink(r.run, r.step, r.id, C(r.state), r.created_at,
                                "resumed" if r.run == run else "forked") for r in s.execute(q)]

    def set_parent(self, run: str, step: int, parent: tuple[str, int] | None) -> CheckpointRow:
        """Record (or clear) the checkpoint (run, step) was resumed or forked from; refuses cycles.

        The Python API counterpart of `safepoint commit --parent` for checkpoints already
        cataloged. The parent need not be cataloged yet: it is linked when it appears.
        """
        with self._write() as s:
            me = self._link_row(s, sa.and_(Run.name == run, Checkpoint.step == step))
            if me is None:
                raise CatalogError(f"no checkpoint {run}/{step} in the catalog")
            pid = None
            if parent is not None:
                prun, pstep = check_run(parent[0]), check_step(parent[1])
                if (prun, pstep) == (run, step):
                    raise CatalogError(f"{run}/{step} cannot be its own parent")
                p = self._link_row(s, sa.and_(Run.name == prun, Checkpoint.step == pstep))
                hops = 0
                while p is not None and hops < 100_000:
                    if p.id == me.id:
                        raise CatalogError(f"{prun}/{pstep} descends from {run}/{step}: that parent makes a cycle")
                    pid = p.id if pid is None else pid
                    p, hops = self._parent_link_row(s, p), hops + 1
            values = {"parent_run": parent[0] if parent else None, "parent_step": parent[1] if parent else None,
                      "parent_id": pid}
            s.execute(sa.update(Checkpoint).where(Checkpoint.id == me.id)
                      .values(**values, version=Checkpoint.version + 1, updated_at=utcnow())
                      .execution_options(synchronize_session=False))
            run_id = s.execute(sa.select(Checkpoint.run_id).where(Checkpoint.id == me.id)).scalar_one()
            self._event(s, "lineage", checkpoint_id=me.id, run_id=run_id,
                        detail={"parent": {"run": parent[0], "step": parent[1]} if parent else None,
                                "from": {"run": me.parent_run, "step": me.parent_step} if me.parent_run else None,
                                "linked": pid is not None})
        row = self.get(run, step)
        assert row is not None
        return row

    # -- state --------------------------------------------------------------------------------

    def transition(self, checkpoint_id: int, to: CheckpointState, *, expect: set[CheckpointState] | None = None,
                   error: str | None = None, detail: dict[str, Any] | None = None) -> bool:
        """Move a checkpoint to `to` if its state allows it; False (nothing changed) otherwise.

        The UPDATE is guarded by the allowed source states *and* the version read just before, so
        the `from` recorded in the event is exact and concurrent callers cannot both win.
        A lost race re-reads and retries while the new state is still an allowed source.
        """
        to = C(to)
        sources = {x for x in C if can_transition(x, to)}
        if expect is not None:
            sources &= {C(x) for x in expect}
        if not sources:
            return False
        allowed = sorted(x.value for x in sources)
        for _ in range(50):
            with self._write() as s:
                cur = s.execute(sa.select(Checkpoint.state, Checkpoint.version, Checkpoint.run_id)
                                .where(Checkpoint.id == checkpoint_id)).first()
                if cur is None or C(cur.state) not in sources:
                    return False
                now = utcnow()
                values: dict[str, Any] = {"state": to.value, "version": Checkpoint.version + 1,
                                          "state_changed_at": now, "updated_at": now}
                if error is not None:
                    values["error"] = redact(error)
                res = s.execute(
                    sa.update(Checkpoint)
                    .where(Checkpoint.id == checkpoint_id, Checkpoint.state.in_(allowed),
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
            allowed = wanted & set(recheck(views))
            now = utcnow()
            marked: list[CheckpointView] = []
            for v in views:
                if v.id not in allowed or not can_transition(v.state, C.PRUNED):
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

    # -- local copies (burst buffer) ----------------------------------------------------------

    def _verified_count(self) -> Any:
        return (sa.select(sa.func.count()).select_from(Replica)
                .where(Replica.checkpoint_id == Checkpoint.id, Replica.state == ReplicaState.VERIFIED.value)
                .scalar_subquery())

    def local_copies(self, root: str | os.PathLike[str]) -> list[LocalCopy]:
        """Local folders under `root` that the catalog still points at (checkpoints and rank parts)."""
        prefix = _norm_path(root)
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
        p = _norm_path(path)
        with self._write() as s:
            s.execute(sa.update(Checkpoint).where(Checkpoint.id == checkpoint_id, Checkpoint.local_path == p)
                      .values(local_path=None, updated_at=utcnow(), version=Checkpoint.version + 1)
                      .execution_options(synchronize_session=False))
            s.execute(sa.update(CheckpointRank)
                      .where(CheckpointRank.checkpoint_id == checkpoint_id, CheckpointRank.local_path == p)
                      .values(local_path=None).execution_options(synchronize_session=False))
            run_id = s.execute(sa.select(Checkpoint.run_id).where(Checkpoint.id == checkpoint_id)).scalar_one_or_none()
            self._event(s, "evicted", checkpoint_id=checkpoint_id, run_id=run_id, detail={"path": p})

    # -- corruption risk ----------------------------------------------------------------------

    def risk_inputs(self, run: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
        """What safepoint.risk needs for `run`, in three queries.

        Checkpoints (step, state, total_bytes, created_at, copies: replicas not deleted), the
        run's replica and scrub/verify events (kind, at, detail, checkpoint_id) oldest first, and
        the current state of each of its replicas.
        """
        copies = (sa.select(sa.func.count()).select_from(Replica)
                  .where(Replica.checkpoint_id == Checkpoint.id, Replica.state != ReplicaState.DELETED.value)
                  .scalar_subquery())
        q = (sa.select(Checkpoint.id, Checkpoint.step, Checkpoint.state, Checkpoint.total_bytes,
                       Checkpoint.created_at, copies.label("copies"))
             .join(Run, Checkpoint.run_id == Run.id).where(Run.name == run).order_by(Checkpoint.step))
        eq = (sa.select(Event.kind, Event.at, Event.detail, Event.checkpoint_id)
              .join(Checkpoint, Event.checkpoint_id == Checkpoint.id).join(Run, Checkpoint.run_id == Run.id)
              .where(Run.name == run, sa.or_(Event.kind == "replica", Event.kind.startswith("scrub"),
                                             Event.kind.startswith("verify")))
              .order_by(Event.id))
        with self._read() as s:
            cks = [{"id": r.id, "step": r.step, "state": C(r.state), "total_bytes": int(r.total_bytes),
                    "created_at": r.created_at, "copies": int(r.copies)} for r in s.execute(q)]
            evs = [{"kind": r.kind, "at": r.at, "detail": dict(r.detail or {}), "checkpoint_id": r.checkpoint_id}
                   for r in s.execute(eq)]
            states = list(s.execute(sa.select(Replica.state).join(Checkpoint, Replica.checkpoint_id == Checkpoint.id)
                                    .join(Run, Checkpoint.run_id == Run.id).where(Run.name == run)).scalars())
        return cks, evs, states

    # -- replicas -----------------------------------------------------------------------------

    def set_replica(self, checkpoint_id: int, url: str, destination: str, state: ReplicaState, *,
                    bytes: int = 0, error: str | None = None) -> bool:  # noqa: A002 - API name
        """Upsert the replica at snapshot `url` (credentials stripped); logs an event on change.

        Returns False, changing nothing, for a pruned checkpoint unless `state` is `deleted`: a
        scrub or upload that finishes after retention marked the checkpoint must not bring back
        a replica whose files are being deleted. The checkpoint row is share-locked for the
        transaction, so this check and retention's marking (catalog.mark_pruned) serialize.
        """
        state = ReplicaState(state)
        url, destination, error = redact_url(url), redact_url(destination), redact(error)
        now = utcnow()
        with self._write() as s:
            ck = s.execute(sa.select(Checkpoint.state, Checkpoint.run_id).where(Checkpoint.id == checkpoint_id)
                           .with_for_update(read=True)).first()
            if ck is None:
                raise CatalogError(f"no checkpoint with id {checkpoint_id}")
            if ck.state == C.PRUNED.value and state is not ReplicaState.DELETED:
                return False
            prev = s.execute(sa.select(Replica.state, Replica.error)
                             .where(Replica.checkpoint_id == checkpoint_id, Replica.url == url)).first()
            ins = self._insert(Replica).values(
                checkpoint_id=checkpoint_id, url=url, destination=destination, state=state.value, bytes=int(bytes),
                error=error, verified_at=now if state == ReplicaState.VERIFIED else None,
                created_at=now, updated_at=now,
            )
            set_: dict[str, Any] = {"destination": ins.excluded.destination, "state": ins.excluded.state,
                                    "bytes": ins.excluded.bytes, "error": ins.excluded.error,
                                    "updated_at": ins.excluded.updated_at}
            if state == ReplicaState.VERIFIED:
                set_["verified_at"] = ins.excluded.verified_at
            try:
                s.execute(ins.on_conflict_do_update(index_elements=["checkpoint_id", "url"], set_=set_))
            except IntegrityError as e:
                raise CatalogError(f"no checkpoint with id {checkpoint_id}") from e
            if prev is None or prev.state != state.value or prev.error != error:
                self._event(s, "replica", checkpoint_id=checkpoint_id, run_id=ck.run_id,
                            detail={"url": url, "state": state.value, "bytes": int(bytes), "error": error,
                                    "from": prev.state if prev else None})
            return True

    @staticmethod
    def _replica_row(r: Replica) -> ReplicaRow:
        return ReplicaRow(id=r.id, checkpoint_id=r.checkpoint_id, url=r.url, destination=r.destination,
                          state=ReplicaState(r.state), bytes=r.bytes, verified_at=r.verified_at, error=r.error,
                          created_at=r.created_at, updated_at=r.updated_at)

    def replicas(self, checkpoint_id: int) -> list[ReplicaRow]:
        with self._read() as s:
            q = sa.select(Replica).where(Replica.checkpoint_id == checkpoint_id).order_by(Replica.id)
            return [self._replica_row(r) for r in s.execute(q).scalars()]

    def find_replica(self, url: str) -> tuple[CheckpointRow, ReplicaRow] | None:
        """The checkpoint and replica stored at snapshot `url` (trailing '/' and credentials ignored)."""
        u = redact_url(url)
        with self._read() as s:
            r = s.execute(sa.select(Replica).where(Replica.url.in_({u, u + "/"})).order_by(Replica.id.desc())
                          .limit(1)).scalar_one_or_none()
            if r is None:
                return None
            row = self._get(s, Checkpoint.id == r.checkpoint_id)
            assert row is not None
            return row, self._replica_row(r)

    # -- validations --------------------------------------------------------------------------

    def record_validation(self, checkpoint_id: int, ok: bool, summary: str, report: dict[str, Any],
                          tensor_stats: list[dict[str, Any]], *, started_at: datetime | None = None,
                          finished_at: datetime | None = None) -> int:
        """Store one validation and its per-tensor stats (one executemany; 10k rows is fine)."""
        finished = finished_at or utcnow()
        with self._write() as s:
            v = Validation(checkpoint_id=checkpoint_id, ok=bool(ok), summary=redact(summary or "") or "",
                           report=report or {}, started_at=started_at or finished, finished_at=finished)
            s.add(v)
            try:
                s.flush()
            except IntegrityError as e:
                raise CatalogError(f"no checkpoint with id {checkpoint_id}") from e
            rows = [{
                "validation_id": v.id, "name": str(t["name"]), "dtype": str(t.get("dtype", "")),
                "shape": [int(x) for x in (t.get("shape") or ())], "numel": int(t.get("numel") or 0),
                "norm": _finite_or_none(t.get("norm")), "max_abs": _finite_or_none(t.get("max_abs")),
                "nan_count": int(t.get("nan_count") or 0), "inf_count": int(t.get("inf_count") or 0),
            } for t in tensor_stats]
            if rows:
                s.execute(sa.insert(TensorStat.__table__), rows)
            self._event(s, "validation", checkpoint_id=checkpoint_id,
                        detail={"validation_id": v.id, "ok": bool(ok), "summary": v.summary, "tensors": len(rows)})
            return v.id

    def latest_validation(self, checkpoint_id: int) -> ValidationRow | None:
        with self._read() as s:
            v = s.execute(sa.select(Validation).where(Validation.checkpoint_id == checkpoint_id)
                          .order_by(Validation.id.desc()).limit(1)).scalar_one_or_none()
            if v is None:
                return None
            return ValidationRow(id=v.id, checkpoint_id=v.checkpoint_id, started_at=v.started_at,
                                 finished_at=v.finished_at, ok=bool(v.ok), summary=v.summary, report=dict(v.report))

    def tensor_stats(self, validation_id: int) -> list[dict[str, Any]]:
        t = TensorStat.__table__
        with self._read() as s:
            q = sa.select(*(t.c[k] for k in _STAT_KEYS)).where(t.c.validation_id == validation_id).order_by(t.c.id)
            return [dict(r._mapping) for r in s.execute(q)]

    # -- events -------------------------------------------------------------------------------

    def add_event(self, kind: str, *, checkpoint_id: int | None = None, run: str | None = None,
                  detail: dict[str, Any] | None = None) -> None:
        """Append an audit event (detail is stored as-is: redact secrets before passing them)."""
        with self._write() as s:
            run_id = None
            if run is not None:
                run_id = s.execute(sa.select(Run.id).where(Run.name == run)).scalar_one_or_none()
            elif checkpoint_id is not None:
                run_id = s.execute(sa.select(Checkpoint.run_id).where(Checkpoint.id == checkpoint_id)
                                   ).scalar_one_or_none()
            self._event(s, kind, checkpoint_id=checkpoint_id, run_id=run_id, detail=detail)

    def events(self, checkpoint_id: int | None = None, *, run: str | None = None,
               kind: str | None = None) -> list[dict[str, Any]]:
        """Events oldest first: dicts with id, at, kind, detail, checkpoint_id, run_id."""
        q = sa.select(Event).order_by(Event.id)
        if checkpoint_id is not None:
            q = q.where(Event.checkpoint_id == checkpoint_id)
        if run is not None:
            q = q.join(Run, Event.run_id == Run.id).where(Run.name == run)
        if kind is not None:
            q = q.where(Event.kind == kind)
        with self._read() as s:
            return [{"id": e.id, "at": e.at, "kind": e.kind, "detail": dict(e.detail or {}),
                     "checkpoint_id": e.checkpoint_id, "run_id": e.run_id} for e in s.execute(q).scalars()]

    # -- leases -------------------------------------------------------------------------------

    def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take (or renew, for the same holder) lease `name` until now + ttl_s; False if held.

        One INSERT ... ON CONFLICT DO UPDATE ... WHERE expired-or-mine: atomic on both backends.
        """
        now = utcnow()
        ins = self._insert(Lease).values(name=name, holder=holder, expires_at=now + timedelta(seconds=ttl_s),
                                         acquired_at=now)
        ins = ins.on_conflict_do_update(
            index_elements=["name"],
            set_={"holder": ins.excluded.holder, "expires_at": ins.excluded.expires_at,
                  "acquired_at": sa.case((Lease.holder == holder, Lease.acquired_at),
                                         else_=ins.excluded.acquired_at)},
            where=sa.or_(Lease.expires_at < now, Lease.holder == holder),
        ).returning(Lease.name)
        with self._write() as s:
            return s.execute(ins).first() is not None

    def release_lease(self, name: str, holder: str) -> bool:
        """Release a lease if `holder` holds it; True if it did."""
        with self._write() as s:
            res = s.execute(sa.delete(Lease).where(Lease.name == name, Lease.holder == holder)
                            .execution_options(synchronize_session=False))
            return res.rowcount == 1

    def lease_holder(self, name: str) -> str | None:
        """The current (unexpired) holder of lease `name`, if any."""
        with self._read() as s:
            return s.execute(sa.select(Lease.holder).where(Lease.name == name, Lease.expires_at >= utcnow())
                             ).scalar_one_or_none()
