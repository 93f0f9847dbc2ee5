"""Alembic environment for the Safepoint catalog.

Normally run through catalog.db.upgrade(), which passes an open connection in
``config.attributes["connection"]``. From the alembic CLI the URL comes from ``sqlalchemy.url`` or
$SAFEPOINT_CATALOG_URL. SQLite uses batch mode so that later ALTERs work there too.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from safepoint.catalog.db import MIGRATION_LOCK_KEY, default_catalog_url, make_engine
from safepoint.catalog.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def run_migrations_offline() -> None:
    url = config.get_main_option("sqlalchemy.url") or default_catalog_url()
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: sa.Connection) -> None:
    if connection.dialect.name == "postgresql":
        # Re-entrant within the transaction: harmless when catalog.db already holds it.
        connection.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
    _configure(connection)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(config.get_main_option("sqlalchemy.url") or default_catalog_url())
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
