"""Each tensor stat's file and role, so the tensor table says where a row came from and what it is.

Revision ID: 0004_tensor_file_role
Revises: 0003_tensor_digests
Create Date: 2026-12-03

Without them a row named ``cpu`` of dtype uint8 is a mystery; with them it reads as the RNG state of
``rng_state.pth``. ``file`` is the snapshot-relative path the tensor was read from, ``role`` its role
(safepoint.validation.roles: parameter, buffer, optimizer_state, ...). Rows written before this
revision have NULLs, shown as "-". Plain ADD/DROP COLUMN (SQLite >= 3.35, PostgreSQL).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_tensor_file_role"
down_revision: str | None = "0003_tensor_digests"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tensor_stats", sa.Column("file", sa.Text(), nullable=True))
    op.add_column("tensor_stats", sa.Column("role", sa.String(32), nullable=True))


def downgrade() -> None:
    op.drop_column("tensor_stats", "role")
    op.drop_column("tensor_stats", "file")
