"""The checkpoint listing, written once as SQL: SQLAlchemy runs it on any backend, sqlite3 on a SQLite file.

`safepoint ls` is a read of two tables, and importing SQLAlchemy alone costs more than the 0.3 s the
whole command may take. So the listing's SQL lives here, in the standard library's terms (named
``:params``, which both sqlite3 and ``sqlalchemy.text`` accept), with the one function that turns
its rows into CheckpointViews. `Catalog.list_checkpoints` runs these statements through SQLAlchemy
(PostgreSQL, SQLite, migrations done); `read_sqlite` runs the same ones with sqlite3 on a catalog
already at HEAD_REVISION, and answers None (the caller opens the catalog proper) on any doubt.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from safepoint.catalog.revision import HEAD_REVISION
from safepoint.catalog.views import CheckpointView, ReplicaView
from safepoint.core.states import CheckpointState, ReplicaState

__all__ = ["CHECKPOINTS", "REPLICAS", "parse_json", "parse_time", "statements", "views", "read_sqlite"]

CHECKPOINTS = (
    "SELECT c.id, r.name AS run, c.step, c.state, c.local_path, c.created_at, c.total_bytes, c.pinned, c.tags, "
    "c.metrics, c.parent_run, c.parent_step, c.world_size, c.file_count, c.state_changed_at, c.error, c.version "
    "FROM checkpoints c JOIN runs r ON c.run_id = r.id{where} ORDER BY r.name, c.step")
REPLICAS = (
    "SELECT p.checkpoint_id, p.url, p.destination, p.state, p.verified_at "
    "FROM replicas p JOIN checkpoints c ON p.checkpoint_id = c.id JOIN runs r ON c.run_id = r.id{where} "
    "ORDER BY p.id")


def statements(run: str | None = None, states: Iterable[CheckpointState] | None = None
               ) -> tuple[str, str, dict[str, Any]]:
    """The two SELECTs (checkpoints, their replicas) of a listing filtered by run and states, and their params."""
    where, params = [], {}
    if run is not None:
        where.append("r.name = :run")
        params["run"] = run
    if states is not None:
        names = []
        for i, s in enumerate(dict.fromkeys(CheckpointState(x).value for x in states)):
            params[f"state{i}"] = s
            names.append(f":state{i}")
        where.append(f"c.state IN ({', '.join(names)})" if names else "1 = 0")
    clause = (" WHERE " + " AND ".join(where)) if where else ""
    return CHECKPOINTS.format(where=clause), REPLICAS.format(where=clause), params


def parse_time(value: Any) -> datetime | None:
    """A stored time as an aware UTC datetime (as models.UTCDateTime returns it): SQLite keeps naive text."""
    if value is None:
        return None
    t = datetime.fromisoformat(value) if isinstance(value, str) else value
    return t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t.astimezone(timezone.utc)


def parse_json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, (str, bytes)) else value  # SQLite: text; PostgreSQL: decoded


def views(rows: Iterable[Sequence[Any]], replica_rows: Iterable[Sequence[Any]]) -> list[CheckpointView]:
    """CheckpointViews from the rows of CHECKPOINTS and REPLICAS, on any backend and any driver."""
    reps: dict[int, list[ReplicaView]] = {}
    for cid, url, dest, state, verified_at in replica_rows:
        reps.setdefault(cid, []).append(ReplicaView(url, dest, ReplicaState(state), parse_time(verified_at)))
    out = []
    for (cid, run, step, state, local_path, created_at, total_bytes, pinned, tags, metrics, parent_run, parent_step,
         world_size, file_count, state_changed_at, error, version) in rows:
        out.append(CheckpointView(
            id=cid, run=run, step=step, state=CheckpointState(state), local_path=local_path,
            created_at=parse_time(created_at), total_bytes=total_bytes, pinned=bool(pinned),
            tags=tuple(parse_json(tags) or ()), metrics=dict(parse_json(metrics) or {}),
            parent=(parent_run, parent_step) if parent_run is not None else None, world_size=world_size,
            replicas=tuple(reps.get(cid, ())), file_count=file_count, state_changed_at=parse_time(state_changed_at),
            error=error, version=version))
    return out


def read_sqlite(db: Path, run: str | None = None, states: Iterable[CheckpointState] | None = None
                ) -> list[CheckpointView] | None:
    """The listing of the SQLite catalog file `db` with sqlite3 alone; None: cannot tell here.

    No file yet is an empty catalog. A catalog at another revision than HEAD_REVISION (older: it
    needs migrating; newer: this Safepoint does not know its schema), a locked or unreadable one,
    answers None, and the caller opens it with SQLAlchemy and Alembic as every other command does.
    """
    if not db.exists():
        return []
    checkpoints, replicas, params = statements(run, states)
    try:
        con = sqlite3.connect(db, timeout=30, isolation_level=None)
    except sqlite3.Error:
        return None
    try:
        con.execute("BEGIN")  # one snapshot for both SELECTs (WAL: readers never block)
        revs = [r for (r,) in con.execute("SELECT version_num FROM alembic_version")]
        if revs != [HEAD_REVISION]:
            return None
        return views(con.execute(checkpoints, params).fetchall(), con.execute(replicas, params).fetchall())
    except (sqlite3.Error, ValueError):
        return None
    finally:
        con.close()

