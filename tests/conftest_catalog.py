"""Catalog fixtures shared by every test module (loaded from tests/conftest.py).

- ``catalog_url``: a catalog URL, exported as $SAFEPOINT_CATALOG_URL for subprocesses: ``sqlite`` (a
  file in tmp_path), and for catalog-level tests (marked ``catalog_backends``: catalog/ queries,
  migrations, concurrency) also ``postgres`` (a fresh, uniquely named schema in the ``test``
  database, selected through ``search_path`` in the URL, so tests are isolated and parallel-safe).
  Everything above the catalog (ops, flows, CLI) talks to it through the same Catalog API, so it
  runs once, on SQLite.
- ``catalog``: an open, migrated ``Catalog`` on ``catalog_url``.
- ``sqlite_catalog_url`` / ``sqlite_catalog``: SQLite only, for tests that need no server.

PostgreSQL unreachable: the postgres cases skip, unless SAFEPOINT_REQUIRE_POSTGRES=1 (then fail).
Override the server with SAFEPOINT_TEST_PG_URL (default postgresql+psycopg://postgres@127.0.0.1:5432/test).
"""

from __future__ import annotations

import os
import uuid

import pytest

PG_URL = os.environ.get("SAFEPOINT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def _pg_admin():
    """An AUTOCOMMIT engine on the test database, or None when the server is unreachable."""
    import sqlalchemy as sa
    from sqlalchemy.pool import NullPool

    from safepoint.catalog.db import normalize_url

    eng = sa.create_engine(normalize_url(PG_URL), poolclass=NullPool, isolation_level="AUTOCOMMIT",
                           connect_args={"connect_timeout": 5})
    try:
        with eng.connect() as c:
            c.exec_driver_sql("SELECT 1")
    except Exception as e:  # noqa: BLE001 - any failure means "no server"
        eng.dispose()
        yield None, f"PostgreSQL unreachable at {PG_URL}: {e.__class__.__name__}: {e}"
        return
    yield eng, None
    eng.dispose()


def _need_pg(admin):
    eng, why = admin
    if eng is None:
        if os.environ.get("SAFEPOINT_REQUIRE_POSTGRES") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return eng


def pg_schema_url(schema: str) -> str:
    """The test server's URL with `schema` as the only schema on the search_path."""
    from safepoint.catalog.db import normalize_url

    u = normalize_url(PG_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    return u.render_as_string(hide_password=False)


@pytest.fixture
def postgres_catalog_url(_pg_admin, monkeypatch):
    """A fresh PostgreSQL schema (dropped afterwards) as a catalog URL."""
    from safepoint.catalog import db

    eng = _need_pg(_pg_admin)
    schema = f"sp_test_{uuid.uuid4().hex[:12]}"
    with eng.connect() as c:
        c.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    url = pg_schema_url(schema)
    monkeypatch.setenv("SAFEPOINT_CATALOG_URL", url)
    try:
        yield url
    finally:
        db.dispose(url)
        with eng.connect() as c:
            c.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def sqlite_catalog_url(tmp_path, monkeypatch):
    from safepoint.catalog import db

    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    monkeypatch.setenv("SAFEPOINT_CATALOG_URL", url)
    yield url
    db.dispose(url)


def pytest_generate_tests(metafunc):
    """Catalog-level tests (marked ``catalog_backends``) run on SQLite and on PostgreSQL."""
    if "catalog_url" in metafunc.fixturenames and metafunc.definition.get_closest_marker("catalog_backends"):
        metafunc.parametrize("catalog_backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
                             indirect=True)


@pytest.fixture
def catalog_backend(request) -> str:
    """``sqlite``, or the backend a ``catalog_backends`` test is parametrized with."""
    return getattr(request, "param", "sqlite")


@pytest.fixture
def catalog_url(request, catalog_backend):
    """A catalog URL on SQLite, or on each backend for catalog-level tests (see module docstring)."""
    name = "sqlite_catalog_url" if catalog_backend == "sqlite" else "postgres_catalog_url"
    return request.getfixturevalue(name)


@pytest.fixture
def catalog(catalog_url):
    """An open, migrated Catalog on `catalog_url`."""
    from safepoint.catalog import open_catalog

    return open_catalog(catalog_url)


@pytest.fixture
def sqlite_catalog(sqlite_catalog_url):
    from safepoint.catalog import open_catalog

    return open_catalog(sqlite_catalog_url)
