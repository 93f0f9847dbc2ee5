"""The schema revision this Safepoint writes: the newest migration in migrations/versions.

Apart from catalog.db so that readers that skip SQLAlchemy (catalog.listing) can check a catalog's
revision too. tests/test_migrations.py checks it is Alembic's only head.
"""

HEAD_REVISION = "0005_replica_proof"
