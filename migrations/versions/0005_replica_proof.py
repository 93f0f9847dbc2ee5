"""Which proof vouches for each verified replica: a full read-back, or the store's own checksum.

Revision ID: 0005_replica_proof
Revises: 0003_tensor_digests (written before 0004 existed; the chain is put right where they meet)
Create Date: 2026-12-03

``proof`` says how the bytes at the destination were shown to be the manifest's: ``read-back`` (every
byte downloaded again and BLAKE3-hashed), ``s3-sha256`` (every object's SHA-256, full or composite,
sent with each request, checked by the store on arrival and read back from it with HeadObject,
while the upload BLAKE3-hashed the same bytes), or both joined by ``+`` when files differ. NULL: a
row written before this revision, or a replica not verified. Plain ADD/DROP COLUMN.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_replica_proof"
down_revision: str | None = "0004_tensor_file_role"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("replicas", sa.Column("proof", sa.String(32), nullable=True))


def downgrade() -> None:
    op.drop_column("replicas", "proof")
