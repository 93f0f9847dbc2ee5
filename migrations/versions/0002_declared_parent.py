"""Lineage as declared: the parent's run and step, even before (or without) the parent's row.

Revision ID: 0002_declared_parent
Revises: 0001_initial
Create Date: 2026-12-01

``parent_id`` only resolves when the parent is already cataloged. A fork from another run (or a
resume from a checkpoint ingested later, or by another catalog) used to lose its lineage. Now the
declaration is kept in ``parent_run``/``parent_step`` and ``parent_id`` is filled in as soon as the
parent appears (catalog.store adopts orphans on insert; the index makes that one indexed UPDATE).

Existing rows are back-filled from ``parent_id``. Plain ADD/DROP COLUMN work on SQLite >= 3.35 and
PostgreSQL alike, so no table rebuild is needed (a rebuild would fire ON DELETE CASCADE on SQLite).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_declared_parent"
down_revision: str | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("parent_run", sa.String(128), nullable=True))
    op.add_column("checkpoints", sa.Column("parent_step", sa.BigInteger(), nullable=True))
    op.create_index("ix_checkpoints_parent_run_parent_step", "checkpoints", ["parent_run", "parent_step"])
    op.execute(
        "UPDATE checkpoints SET "
        "parent_step = (SELECT p.step FROM checkpoints p WHERE p.id = checkpoints.parent_id), "
        "parent_run = (SELECT r.name FROM checkpoints p JOIN runs r ON r.id = p.run_id "
        "WHERE p.id = checkpoints.parent_id) "
        "WHERE parent_id IS NOT NULL"
    )


def downgrade() -> None:
    op.drop_index("ix_checkpoints_parent_run_parent_step", table_name="checkpoints")
    op.drop_column("checkpoints", "parent_step")
    op.drop_column("checkpoints", "parent_run")
