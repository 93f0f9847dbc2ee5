"""The catalog as restore and resume-point use it, through sqlite3 alone when it is a SQLite file at head.

Importing SQLAlchemy and the models costs 0.3-0.4 s, more than the gap between a restore and
`s5cmd cp` of the same bytes. A restore reads a checkpoint, its replicas or a run's resume
candidates, and writes one event at the end; `LiteCatalog` answers exactly those with the standard
library (the same rows and views the catalog proper returns: tests/test_catalog_lite.py compares
them), and opens the catalog proper, once, for anything else (a replica found bad, settling a
checkpoint). `open_fast(url)` gives a LiteCatalog for a SQLite catalog already at HEAD_REVISION,
and the catalog proper (migrated as usual) for PostgreSQL, a new file, another revision, or any
doubt. The listing's SQL is catalog.listing's, written once.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safepoint.catalog import listing
from safepoint.catalog.jsontext import json_dumps
from safepoint.catalog.probe import sqlite_file
from safepoint.catalog.revision import HEAD_REVISION
from safepoint.catalog.views import CheckpointRow, CheckpointView, ReplicaRow
from safepoint.core.states import CheckpointState, ReplicaState

if TYPE_CHECKING:
    from safepoint.catalog.store import Catalog

__all__ = ["LiteCatalog", "open_fast"]

BUSY_TIMEOUT_S = 30.0  # as catalog.db's SQLITE_BUSY_TIMEOUT_MS

_CHECKPOINT = (
    "SELECT c.id, r.name, c.run_id, c.step, c.state, c.local_path, c.node, c.world_size, c.total_bytes, "
    "c.file_count, c.manifest_blake3, c.created_at, c.updated_at, c.state_changed_at, c.parent_id, c.pinned, "
    "c.tags, c.metrics, c.error, c.version, c.parent_run, c.parent_step "
    "FROM checkpoints c JOIN runs r ON c.run_id = r.id WHERE r.name = ? AND c.step = ?")
_RANKS = "SELECT rank FROM checkpoint_ranks WHERE checkpoint_id = ? ORDER BY rank"
_RANK_ROWS = ("SELECT rank, node, local_path, manifest_blake3, delivered_at FROM checkpoint_ranks "
              "WHERE checkpoint_id = ? ORDER BY rank")
_REPLICAS = ("SELECT id, checkpoint_id, url, destination, state, bytes, verified_at, error, created_at, updated_at, "
             "proof FROM replicas WHERE checkpoint_id = ? ORDER BY id")
_EVENT = ("INSERT INTO events (checkpoint_id, run_id, at, kind, detail) VALUES "
          "(:checkpoint_id, CASE WHEN :run IS NOT NULL THEN (SELECT id FROM runs WHERE name = :run) "
          "ELSE (SELECT run_id FROM checkpoints WHERE id = :checkpoint_id) END, :at, :kind, :detail)")


def _stored_time(t: datetime) -> str:
    """A UTC time as SQLAlchemy's SQLite DateTime stores it (naive, microseconds), so both read it back alike."""
    return t.astimezone(timezone.utc).replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f")


def _at_head(con: sqlite3.Connection) -> bool:
    return [r for (r,) in con.execute("SELECT version_num FROM alembic_version")] == [HEAD_REVISION]


class LiteCatalog:
    """The reads of a restore and its closing event, with sqlite3; every other method is the catalog proper's."""

    def __init__(self, db: Path, url: str):
        self.db, self._url = db, url
        self._proper: Catalog | None = None
        self._held = threading.local()  # the connection of a one_read() block, per thread

    # -- the catalog proper, for anything not answered here --------------------------------------
    def proper(self) -> Catalog:
        """The SQLAlchemy catalog on the same file, opened on first need."""
        if self._proper is None:
            from safepoint.catalog.store import open_catalog

            self._proper = open_catalog(self._url)
        return self._proper

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.proper(), name)

    @property
    def url(self) -> str:
        return self._url

    @contextmanager
    def one_read(self) -> Iterator[None]:
        """Catalog.one_read: every read of this thread in the block on one connection, in one transaction."""
        if getattr(self._held, "con", None) is not None:
            yield
            return
        with self._connect() as con:
            self._held.con = con
            try:
                yield
            finally:
                self._held.con = None

    @contextmanager
    def _connect(self, *, write: bool = False) -> Iterator[sqlite3.Connection]:
        held = None if write else getattr(self._held, "con", None)
        if held is not None:
            yield held
            return
        con = sqlite3.connect(self.db, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            con.execute("PRAGMA foreign_keys = ON")
            con.execute("PRAGMA synchronous = NORMAL")  # as catalog.db: durable enough with WAL
            con.execute("BEGIN IMMEDIATE" if write else "BEGIN")  # writers lock up front (as catalog.db)
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")
        finally:
            con.close()

    # -- reads ---------------------------------------------------------------------------------
    def get(self, run: str, step: int) -> CheckpointRow | None:
        with self._connect() as con:
            r = con.execute(_CHECKPOINT, (run, step)).fetchone()
            if r is None:
                return None
            ranks = tuple(x for (x,) in con.execute(_RANKS, (r[0],)))
        (cid, name, run_id, st, state, local_path, node, world_size, total_bytes, file_count, manifest_blake3,
         created_at, updated_at, state_changed_at, parent_id, pinned, tags, metrics, error, version, parent_run,
         parent_step) = r
        t = listing.parse_time
        return CheckpointRow(
            id=cid, run=name, run_id=run_id, step=st, state=CheckpointState(state), local_path=local_path, node=node,
            world_size=world_size, total_bytes=total_bytes, file_count=file_count, manifest_blake3=manifest_blake3,
            created_at=t(created_at), updated_at=t(updated_at), state_changed_at=t(state_changed_at),
            parent_id=parent_id, pinned=bool(pinned), tags=tuple(listing.parse_json(tags) or ()),
            metrics=dict(listing.parse_json(metrics) or {}), error=error, version=version, delivered_ranks=ranks,
            parent=(parent_run, parent_step) if parent_run is not None else None)

    def replicas(self, checkpoint_id: int) -> list[ReplicaRow]:
        with self._connect() as con:
            rows = con.execute(_REPLICAS, (checkpoint_id,)).fetchall()
        t = listing.parse_time
        return [ReplicaRow(id=i, checkpoint_id=c, url=u, destination=d, state=ReplicaState(s), bytes=b,
                           verified_at=t(v), error=e, created_at=t(ca), updated_at=t(ua), proof=p)
                for i, c, u, d, s, b, v, e, ca, ua, p in rows]

    def ranks(self, checkpoint_id: int) -> list[dict[str, Any]]:
        """Catalog.ranks: each delivered rank's node, folder and part digest (a fleet restore scopes by them)."""
        with self._connect() as con:
            rows = con.execute(_RANK_ROWS, (checkpoint_id,)).fetchall()
        return [{"rank": r, "node": n, "local_path": p, "manifest_blake3": d, "delivered_at": listing.parse_time(t)}
                for r, n, p, d, t in rows]

    def get_run_id(self, name: str) -> int | None:
        with self._connect() as con:
            r = con.execute("SELECT id FROM runs WHERE name = ?", (name,)).fetchone()
        return None if r is None else r[0]

    def runs(self) -> list[str]:
        with self._connect() as con:
            return [n for (n,) in con.execute("SELECT name FROM runs ORDER BY name")]

    def list_checkpoints(self, run: str | None = None,
                         states: Any = None) -> list[CheckpointView]:
        checkpoints, replicas, params = listing.statements(run, states)
        with self._connect() as con:
            return listing.views(con.execute(checkpoints, params).fetchall(), con.execute(replicas, params).fetchall())

    @contextmanager
    def resume_pages(self, run: str, *, max_step: int | None = None, before: datetime | None = None
                     ) -> Iterator[Callable[[int | None, int], list[CheckpointView]]]:
        """Catalog.resume_pages over one read of the run (catalog.listing's SELECTs, one snapshot)."""
        rows = [c for c in self.list_checkpoints(run)
                if (max_step is None or c.step <= max_step)
                and (before is None or c.created_at is None or c.created_at < before)]
        rows.sort(key=lambda c: c.step, reverse=True)

        def fetch_page(below_step: int | None, limit: int) -> list[CheckpointView]:
            return [c for c in rows if below_step is None or c.step < below_step][:limit]

        yield fetch_page

    # -- the one write -------------------------------------------------------------------------
    def add_event(self, kind: str, *, checkpoint_id: int | None = None, run: str | None = None,
                  detail: dict[str, Any] | None = None) -> None:
        """Journal.add_event's row (run from `run`, else from the checkpoint), in one short write transaction."""
        with self._connect(write=True) as con:
            con.execute(_EVENT, {"checkpoint_id": checkpoint_id, "run": run, "kind": kind,
                                 "at": _stored_time(datetime.now(timezone.utc)), "detail": json_dumps(detail or {})})


def open_fast(url: str | None = None) -> LiteCatalog | Catalog:
    """A LiteCatalog when `url` (None: the default) is a SQLite file already at head; else the catalog proper."""
    db = sqlite_file(url)
    if db is not None and db.is_file():
        try:
            con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S)
            try:
                ok = _at_head(con)
            finally:
                con.close()
        except sqlite3.Error:
            ok = False
        if ok:
            return LiteCatalog(db, url or f"sqlite:///{db}")
    from safepoint.catalog.store import open_catalog

    return open_catalog(url)
