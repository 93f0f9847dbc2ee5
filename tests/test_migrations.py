"""Migrations are the only source of the schema: they must round-trip and match the models."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from safepoint.catalog import db
from safepoint.catalog.models import Base

pytestmark = pytest.mark.catalog_backends  # catalog-level: on SQLite and PostgreSQL

HEAD = "0005_replica_proof"
TABLES = {"runs", "checkpoints", "checkpoint_files", "checkpoint_ranks", "replicas", "validations",
          "tensor_stats", "events", "leases"}


def _tables(engine) -> set[str]:
    with engine.connect() as c:
        return set(sa.inspect(c).get_table_names())


def _revision(engine) -> str | None:
    with engine.connect() as c:
        return MigrationContext.configure(c).get_current_revision()


def test_single_head():
    script = ScriptDirectory.from_config(db.alembic_config())
    assert script.get_heads() == [HEAD]
    assert db.HEAD_REVISION == HEAD  # ensure_schema skips Alembic for catalogs at this revision


def test_a_catalog_at_head_is_opened_without_alembic(catalog_url, tmp_path):
    """The start-up shortcut: at HEAD_REVISION, ensure_schema neither imports Alembic nor migrates;
    below it (here: one revision down), it migrates as before."""
    import subprocess
    import sys

    eng = db.make_engine(catalog_url)
    try:
        assert not db.at_head(eng)  # no alembic_version table yet
        db.upgrade(eng)
        assert db.at_head(eng)
        db.downgrade(eng, "0002_declared_parent")
        assert not db.at_head(eng)
    finally:
        eng.dispose()
    code = ("import sys; from safepoint.catalog import db; db.ensure_schema(sys.argv[1]); "
            "print('alembic' in sys.modules)")
    runs = [subprocess.run([sys.executable, "-c", code, catalog_url], capture_output=True, text=True, check=True)
            for _ in range(2)]
    assert [r.stdout.split() for r in runs] == [["True"], ["False"]]  # migrated once, then skipped
    eng = db.make_engine(catalog_url)
    try:
        assert _revision(eng) == HEAD
    finally:
        eng.dispose()


def test_upgrade_downgrade_upgrade(catalog_url):
    eng = db.make_engine(catalog_url)
    try:
        assert _tables(eng) == set()
        db.upgrade(eng)
        assert TABLES <= _tables(eng)
        assert _revision(eng) == HEAD
        db.upgrade(eng)  # idempotent
        db.downgrade(eng, "base")
        assert _tables(eng) - {"alembic_version"} == set()
        assert _revision(eng) is None
        db.upgrade(eng)
        assert TABLES <= _tables(eng)
    finally:
        eng.dispose()


def test_models_match_migrations(catalog_url):
    eng = db.make_engine(catalog_url)
    try:
        db.upgrade(eng)
        with eng.connect() as c:
            mc = MigrationContext.configure(c, opts={"compare_type": True, "compare_server_default": False})
            diff = compare_metadata(mc, Base.metadata)
        assert diff == []
    finally:
        eng.dispose()


def test_compare_metadata_detects_drift(catalog_url):
    """Guard the guard: a model change must show up as a diff."""
    eng = db.make_engine(catalog_url)
    try:
        db.upgrade(eng)
        md = sa.MetaData(naming_convention=Base.metadata.naming_convention)
        for t in Base.metadata.tables.values():
            t.to_metadata(md)
        sa.Table("runs", md, sa.Column("extra", sa.Integer), extend_existing=True)
        with eng.connect() as c:
            diff = compare_metadata(MigrationContext.configure(c, opts={"compare_type": True}), md)
        assert any(d[0] == "add_column" and d[3].name == "extra" for d in diff)
    finally:
        eng.dispose()


def test_sqlite_pragmas(sqlite_catalog_url):
    eng = db.make_engine(sqlite_catalog_url)
    try:
        with eng.connect() as c:
            assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert c.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert c.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 30_000
    finally:
        eng.dispose()


def test_postgres_url_uses_psycopg():
    assert db.normalize_url("postgresql://u@h/d").drivername == "postgresql+psycopg"
    assert db.normalize_url("postgres://u@h/d").drivername == "postgresql+psycopg"
    assert db.normalize_url("postgresql+psycopg://u@h/d").drivername == "postgresql+psycopg"


def test_default_url(monkeypatch, tmp_path):
    monkeypatch.delenv("SAFEPOINT_CATALOG_URL", raising=False)
    monkeypatch.setenv("SAFEPOINT_HOME", str(tmp_path / "home"))
    assert db.default_catalog_url() == f"sqlite:///{tmp_path / 'home' / 'catalog.db'}"
    assert (tmp_path / "home").is_dir()
    monkeypatch.setenv("SAFEPOINT_CATALOG_URL", "postgresql://x@y/z")
    assert db.default_catalog_url() == "postgresql://x@y/z"


def _upgrade_worker(url: str, barrier) -> None:
    eng = db.make_engine(url)
    barrier.wait(timeout=60)
    db.upgrade(eng)
    eng.dispose()


def test_concurrent_upgrade(catalog_url):
    """Several processes migrating an empty catalog at once: all succeed, schema created once."""
    ctx = mp.get_context("spawn")
    n = 4
    barrier = ctx.Barrier(n)
    procs = [ctx.Process(target=_upgrade_worker, args=(catalog_url, barrier)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * n
    eng = db.make_engine(catalog_url)
    try:
        assert _revision(eng) == HEAD
        assert TABLES <= _tables(eng)
    finally:
        eng.dispose()


@pytest.mark.parametrize("rev", ["head"])
def test_open_catalog_upgrades_once(catalog_url, rev, monkeypatch):
    from safepoint.catalog import open_catalog

    calls = []
    real = db.upgrade
    monkeypatch.setattr(db, "upgrade", lambda eng, r=rev: (calls.append(r), real(eng, r)))
    open_catalog(catalog_url)
    open_catalog(catalog_url)
    assert calls == [rev]


def _columns(engine, table: str) -> set[str]:
    with engine.connect() as c:
        return {col["name"] for col in sa.inspect(c).get_columns(table)}


def test_0002_backfills_declared_parent_and_downgrades(catalog_url):
    """Rows written under 0001 (lineage only as parent_id) get parent_run/parent_step on upgrade."""
    eng = db.make_engine(catalog_url)
    try:
        db.upgrade(eng, "0001_initial")
        assert "parent_run" not in _columns(eng, "checkpoints")
        with eng.begin() as c:
            c.execute(sa.text("INSERT INTO runs (id, name, created_at) VALUES (1, 'base', :t), (2, 'ft', :t)"),
                      {"t": "2026-01-01 00:00:00"})
            ins = sa.text("INSERT INTO checkpoints (id, run_id, step, state, created_at, updated_at, "
                          "state_changed_at, parent_id, tags, metrics) VALUES "
                          "(:id, :run, :step, 'verified', :t, :t, :t, :parent, '[]', '{}')")
            for row in ({"id": 1, "run": 1, "step": 100, "parent": None}, {"id": 2, "run": 2, "step": 5, "parent": 1},
                        {"id": 3, "run": 2, "step": 10, "parent": 2}):
                c.execute(ins, {**row, "t": "2026-01-01 00:00:00"})
        db.upgrade(eng)
        with eng.connect() as c:
            got = c.execute(sa.text("SELECT id, parent_run, parent_step FROM checkpoints ORDER BY id")).all()
        assert [tuple(r) for r in got] == [(1, None, None), (2, "base", 100), (3, "ft", 5)]
        db.downgrade(eng, "0001_initial")
        assert "parent_run" not in _columns(eng, "checkpoints")
        with eng.connect() as c:  # the downgrade dropped columns, not rows
            assert c.execute(sa.text("SELECT count(*) FROM checkpoints")).scalar() == 3
    finally:
        eng.dispose()
