"""Initial catalog schema.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-30

Written by hand to mirror catalog/models.py (tests/test_migrations.py checks they agree on SQLite
and PostgreSQL). Types are frozen here on purpose: a migration must not change when models do.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001_initial"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
JSONType = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", BigID, nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("settings", JSONType, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.UniqueConstraint("name", name=op.f("uq_runs_name")),
    )
    op.create_table(
        "checkpoints",
        sa.Column("id", BigID, nullable=False),
        sa.Column("run_id", BigID, nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("local_path", sa.Text(), nullable=True),
        sa.Column("node", sa.String(255), nullable=True),
        sa.Column("world_size", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("total_bytes", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("file_count", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("manifest_blake3", sa.String(64), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("state_changed_at", TS, nullable=False),
        sa.Column("parent_id", BigID, nullable=True),
        sa.Column("pinned", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("tags", JSONType, server_default=sa.text("'[]'"), nullable=False),
        sa.Column("metrics", JSONType, server_default=sa.text("'{}'"), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("version", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_checkpoints_run_id_runs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["parent_id"], ["checkpoints.id"], name=op.f("fk_checkpoints_parent_id_checkpoints"),
            ondelete="SET NULL",
        ),
        sa.UniqueConstraint("run_id", "step", name=op.f("uq_checkpoints_run_id_step")),
    )
    op.create_index("ix_checkpoints_run_id_state_step", "checkpoints", ["run_id", "state", "step"])
    op.create_index("ix_checkpoints_state", "checkpoints", ["state"])
    op.create_index("ix_checkpoints_local_path", "checkpoints", ["local_path"])
    op.create_index("ix_checkpoints_parent_id", "checkpoints", ["parent_id"])

    op.create_table(
        "checkpoint_files",
        sa.Column("id", BigID, nullable=False),
        sa.Column("checkpoint_id", BigID, nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("blake3", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoint_files")),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name=op.f("fk_checkpoint_files_checkpoint_id_checkpoints"),
            ondelete="CASCADE",
        ),
        sa.UniqueConstraint("checkpoint_id", "path", name=op.f("uq_checkpoint_files_checkpoint_id_path")),
    )
    op.create_table(
        "checkpoint_ranks",
        sa.Column("checkpoint_id", BigID, nullable=False),
        sa.Column("rank", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("node", sa.String(255), nullable=True),
        sa.Column("local_path", sa.Text(), nullable=True),
        sa.Column("manifest_blake3", sa.String(64), nullable=True),
        sa.Column("delivered_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("checkpoint_id", "rank", name=op.f("pk_checkpoint_ranks")),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name=op.f("fk_checkpoint_ranks_checkpoint_id_checkpoints"),
            ondelete="CASCADE",
        ),
    )
    op.create_table(
        "replicas",
        sa.Column("id", BigID, nullable=False),
        sa.Column("checkpoint_id", BigID, nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("destination", sa.Text(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("bytes", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("verified_at", TS, nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replicas")),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name=op.f("fk_replicas_checkpoint_id_checkpoints"),
            ondelete="CASCADE",
        ),
        sa.UniqueConstraint("checkpoint_id", "url", name=op.f("uq_replicas_checkpoint_id_url")),
    )
    op.create_index("ix_replicas_url", "replicas", ["url"])
    op.create_index("ix_replicas_state", "replicas", ["state"])

    op.create_table(
        "validations",
        sa.Column("id", BigID, nullable=False),
        sa.Column("checkpoint_id", BigID, nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("summary", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("report", JSONType, server_default=sa.text("'{}'"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_validations")),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name=op.f("fk_validations_checkpoint_id_checkpoints"),
            ondelete="CASCADE",
        ),
    )
    op.create_index("ix_validations_checkpoint_id_id", "validations", ["checkpoint_id", "id"])

    op.create_table(
        "tensor_stats",
        sa.Column("id", BigID, nullable=False),
        sa.Column("validation_id", BigID, nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("dtype", sa.String(32), nullable=False),
        sa.Column("shape", JSONType, nullable=False),
        sa.Column("numel", sa.BigInteger(), nullable=False),
        sa.Column("norm", sa.Float(), nullable=True),
        sa.Column("max_abs", sa.Float(), nullable=True),
        sa.Column("nan_count", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("inf_count", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tensor_stats")),
        sa.ForeignKeyConstraint(
            ["validation_id"], ["validations.id"], name=op.f("fk_tensor_stats_validation_id_validations"),
            ondelete="CASCADE",
        ),
    )
    op.create_index("ix_tensor_stats_validation_id", "tensor_stats", ["validation_id"])

    op.create_table(
        "events",
        sa.Column("id", BigID, nullable=False),
        sa.Column("checkpoint_id", BigID, nullable=True),
        sa.Column("run_id", BigID, nullable=True),
        sa.Column("at", TS, nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("detail", JSONType, server_default=sa.text("'{}'"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name=op.f("fk_events_checkpoint_id_checkpoints"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_events_run_id_runs"), ondelete="SET NULL"),
    )
    op.create_index("ix_events_checkpoint_id_id", "events", ["checkpoint_id", "id"])
    op.create_index("ix_events_run_id_id", "events", ["run_id", "id"])
    op.create_index("ix_events_at", "events", ["at"])

    op.create_table(
        "leases",
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("holder", sa.String(255), nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.Column("acquired_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_leases")),
    )


def downgrade() -> None:
    op.drop_table("leases")
    op.drop_index("ix_events_at", table_name="events")
    op.drop_index("ix_events_run_id_id", table_name="events")
    op.drop_index("ix_events_checkpoint_id_id", table_name="events")
    op.drop_table("events")
    op.drop_index("ix_tensor_stats_validation_id", table_name="tensor_stats")
    op.drop_table("tensor_stats")
    op.drop_index("ix_validations_checkpoint_id_id", table_name="validations")
    op.drop_table("validations")
    op.drop_index("ix_replicas_state", table_name="replicas")
    op.drop_index("ix_replicas_url", table_name="replicas")
    op.drop_table("replicas")
    op.drop_table("checkpoint_ranks")
    op.drop_table("checkpoint_files")
    op.drop_index("ix_checkpoints_parent_id", table_name="checkpoints")
    op.drop_index("ix_checkpoints_local_path", table_name="checkpoints")
    op.drop_index("ix_checkpoints_state", table_name="checkpoints")
    op.drop_index("ix_checkpoints_run_id_state_step", table_name="checkpoints")
    op.drop_table("checkpoints")
    op.drop_table("runs")
