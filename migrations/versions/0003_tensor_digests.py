"""Per-tensor digests and scalar values: what the consistency rules compare across two checkpoints.

Revision ID: 0003_tensor_digests
Revises: 0002_declared_parent
Create Date: 2026-12-01

``head`` is the BLAKE3 of a tensor's first 64 KiB (always recorded), ``digest`` the BLAKE3 of all its
bytes (recorded where the previous checkpoint's head was the same), ``value`` the value of a
one-element tensor (Adam ``step``). 32 hex characters each: 10^5 tensors per checkpoint stay ~7 MB.
Rows written before this revision have NULLs, which the rules read as "not known": a tensor
without a head is never called unchanged. Plain ADD/DROP COLUMN (SQLite >= 3.35, PostgreSQL).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_tensor_digests"
down_revision: str | None = "0002_declared_parent"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tensor_stats", sa.Column("head", sa.String(64), nullable=True))
    op.add_column("tensor_stats", sa.Column("digest", sa.String(64), nullable=True))
    op.add_column("tensor_stats", sa.Column("value", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("tensor_stats", "value")
    op.drop_column("tensor_stats", "digest")
    op.drop_column("tensor_stats", "head")
