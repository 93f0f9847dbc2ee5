"""Engines, URLs and schema upgrades for the catalog.

SQLite is the zero-setup default (one file under $SAFEPOINT_HOME); PostgreSQL is for many
processes and nodes. The schema comes only from Alembic migrations (never ``create_all``) so that
every catalog, old or new, has exactly the schema some revision describes.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.pool import StaticPool

from safepoint.catalog.jsontext import json_dumps
from safepoint.catalog.revision import HEAD_REVISION
from safepoint.core.naming import catalog_db

if TYPE_CHECKING:
    from alembic.config import Config

__all__ = [
    "default_catalog_url", "normalize_url", "make_engine", "get_engine", "upgrade", "downgrade",
    "ensure_schema", "dispose", "alembic_config", "MIGRATION_LOCK_KEY", "HEAD_REVISION",
]

# HEAD_REVISION (catalog.revision): a catalog already there is used without importing Alembic or
# scanning its scripts (~0.4 s of every CLI command's start).

# pg_advisory_xact_lock key serializing concurrent upgrades (any constant; "safepoint" in hex-ish).
MIGRATION_LOCK_KEY = 0x5AFE_9017_0001
SQLITE_BUSY_TIMEOUT_MS = 30_000
# Execution option: a transaction that only reads. On SQLite it starts with a plain BEGIN (WAL
# readers never block); all others use BEGIN IMMEDIATE (see _sqlite_events).
READONLY = "safepoint_readonly"

_lock = threading.RLock()
_engines: dict[str, Engine] = {}
_upgraded: set[str] = set()


def default_catalog_url() -> str:
    """$SAFEPOINT_CATALOG_URL, else a SQLite file in $SAFEPOINT_HOME (default ~/.safepoint)."""
    url = os.environ.get("SAFEPOINT_CATALOG_URL")
    if url:
        return url
    path = catalog_db()
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def normalize_url(url: str | URL) -> URL:
    """Parse `url`; plain ``postgresql://``/``postgres://`` select the psycopg 3 driver."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    return u


def _key(url: str | URL) -> str:
    return normalize_url(url).render_as_string(hide_password=False)


def _sqlite_events(engine: Engine) -> None:
    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
        # Take transaction control away from the sqlite3 module so that "begin" below decides.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA foreign_keys = ON")
            cur.execute("PRAGMA journal_mode = WAL")
            cur.execute("PRAGMA synchronous = NORMAL")  # durable enough with WAL, much faster
        finally:
            cur.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        # Writers take the write lock up front: a deferred transaction that reads then writes can
        # fail with SQLITE_BUSY at once (no busy wait) when another writer got there first.
        if conn.get_execution_options().get(READONLY):
            conn.exec_driver_sql("BEGIN")
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")


def make_engine(url: str | URL, **kw: Any) -> Engine:
    """A new Engine configured for the catalog (not cached; see get_engine)."""
    u = normalize_url(url)
    kw.setdefault("json_serializer", json_dumps)
    if u.get_backend_name() == "sqlite":
        if u.database in (None, "", ":memory:"):
            kw.setdefault("poolclass", StaticPool)
            kw.setdefault("connect_args", {"check_same_thread": False})
        elif not u.query.get("uri"):  # a `file:` URI (?uri=true) is sqlite3's to open, not a path here
            Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(u, **kw)
        _sqlite_events(engine)
        return engine
    if u.get_backend_name() == "postgresql":
        kw.setdefault("pool_pre_ping", True)
    return sa.create_engine(u, **kw)


def get_engine(url: str | URL | None = None) -> Engine:
    """The process-wide Engine for `url` (default_catalog_url() when None)."""
    key = _key(url or default_catalog_url())
    with _lock:
        eng = _engines.get(key)
        if eng is None:
            eng = _engines[key] = make_engine(key)
        return eng


def dispose(url: str | URL | None = None) -> None:
    """Close pooled connections and forget cached engines (all of them when `url` is None)."""
    with _lock:
        keys = list(_engines) if url is None else [_key(url)]
        for k in keys:
            eng = _engines.pop(k, None)
            if eng is not None:
                eng.dispose()
            _upgraded.discard(k)


def _after_fork_in_child() -> None:
    # Pooled connections belong to the parent; the child must open its own.
    with _lock:
        for eng in _engines.values():
            eng.dispose(close=False)
        _engines.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def alembic_config(connection: sa.Connection | None = None) -> Config:
    """An Alembic Config for the bundled migrations; `connection` is used by migrations/env.py."""
    from alembic.config import Config

    from safepoint import migrations

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).resolve().parent))
    cfg.set_main_option("path_separator", "os")
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def _retryable(exc: Exception, dialect: str) -> bool:
    msg = str(exc).lower()
    if dialect == "sqlite":
        return "database is locked" in msg or "already exists" in msg or "busy" in msg
    # Without the advisory lock (e.g. a foreign tool migrating) a racing CREATE may collide.
    return "already exists" in msg or "duplicate key" in msg or "deadlock" in msg


def _run_alembic(engine: Engine, fn: Any, *args: Any, attempts: int = 5) -> None:
    for attempt in range(attempts):
        try:
            with engine.begin() as conn:
                if conn.dialect.name == "postgresql":
                    # Serialize concurrent upgrades; released at commit. env.py takes it too when
                    # alembic runs from the command line.
                    conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
                fn(alembic_config(conn), *args)
            return
        except (OperationalError, IntegrityError, ProgrammingError) as e:
            if attempt == attempts - 1 or not _retryable(e, engine.dialect.name):
                raise
            time.sleep(0.2 * (attempt + 1))


def upgrade(engine: Engine, rev: str = "head") -> None:
    """Migrate the catalog to `rev`; safe to call from several processes at once."""
    from alembic import command

    _run_alembic(engine, command.upgrade, rev)


def downgrade(engine: Engine, rev: str) -> None:
    """Migrate down to `rev` ("base" removes every table)."""
    from alembic import command

    _run_alembic(engine, command.downgrade, rev)


def at_head(engine: Engine) -> bool:
    """Whether the catalog's recorded revision is HEAD_REVISION (no table yet, or another one: False)."""
    try:
        with engine.connect().execution_options(**{READONLY: True}) as conn:
            return conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all() == [HEAD_REVISION]
    except (OperationalError, ProgrammingError):
        return False


def ensure_schema(url: str | URL | None = None) -> Engine:
    """The cached Engine for `url`, upgraded to head at most once per process."""
    key = _key(url or default_catalog_url())
    eng = get_engine(key)
    with _lock:
        if key not in _upgraded:
            if not at_head(eng):
                upgrade(eng)
            _upgraded.add(key)
    return eng
