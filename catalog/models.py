"""ORM models of the catalog. The schema itself comes only from Alembic migrations.

Types are portable (SQLite by default, PostgreSQL first-class): JSON becomes JSONB on PostgreSQL
(comparable, indexable), surrogate keys are BIGINT on PostgreSQL and INTEGER on SQLite (where only
INTEGER PRIMARY KEY autoincrements), and datetimes are always timezone-aware UTC on the Python side.
Constraint names follow NAMING_CONVENTION so that autogenerate is stable on both backends.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# 64-bit ids where it matters (events, tensor_stats can pass 2**31 rows), INTEGER on SQLite.
BigID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
JSONType = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


class UTCDateTime(sa.TypeDecorator):
    """A DateTime that always stores UTC and always returns aware datetimes.

    SQLite has no time zone type and returns naive values; normalizing on both sides keeps
    comparisons (lease expiry, ordering) correct on every backend.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        value = value.astimezone(timezone.utc)
        if dialect.name == "sqlite":
            value = value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(BigID, primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    settings: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        sa.UniqueConstraint("run_id", "step"),
        # "newest checkpoint of a run in state X": equality on (run_id, state), then step desc.
        sa.Index("ix_checkpoints_run_id_state_step", "run_id", "state", "step"),
        # Work queues across runs ("everything still committed/replicating").
        sa.Index("ix_checkpoints_state", "state"),
        sa.Index("ix_checkpoints_local_path", "local_path"),
        sa.Index("ix_checkpoints_parent_id", "parent_id"),
        # Adopting orphans: "who declared (run, step) as parent and is not linked yet?" (0002).
        sa.Index("ix_checkpoints_parent_run_parent_step", "parent_run", "parent_step"),
    )

    id: Mapped[int] = mapped_column(BigID, primary_key=True)
    run_id: Mapped[int] = mapped_column(BigID, sa.ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(sa.BigInteger)
    state: Mapped[str] = mapped_column(sa.String(16))
    local_path: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    node: Mapped[str | None] = mapped_column(sa.String(255), nullable=True)
    world_size: Mapped[int] = mapped_column(sa.Integer, default=1, server_default=sa.text("1"))
    total_bytes: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default=sa.text("0"))
    file_count: Mapped[int] = mapped_column(sa.Integer, default=0, server_default=sa.text("0"))
    manifest_blake3: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    state_changed_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    parent_id: Mapped[int | None] = mapped_column(
        BigID, sa.ForeignKey("checkpoints.id", ondelete="SET NULL"), nullable=True
    )
    # Lineage as declared by the manifest or set_parent(); parent_id links it once cataloged.
    parent_run: Mapped[str | None] = mapped_column(sa.String(128), nullable=True)
    parent_step: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)
    pinned: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())
    tags: Mapped[list[str]] = mapped_column(JSONType, default=list, server_default=sa.text("'[]'"))
    metrics: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict, server_default=sa.text("'{}'"))
    error: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    version: Mapped[int] = mapped_column(sa.Integer, default=1, server_default=sa.text("1"))


class CheckpointFile(Base):
    __tablename__ = "checkpoint_files"
    __table_args__ = (sa.UniqueConstraint("checkpoint_id", "path"),)

    id: Mapped[int] = mapped_column(BigID, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(BigID, sa.ForeignKey("checkpoints.id", ondelete="CASCADE"))
    path: Mapped[str] = mapped_column(sa.Text)
    size: Mapped[int] = mapped_column(sa.BigInteger)
    blake3: Mapped[str] = mapped_column(sa.String(64))
    rank: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)


class CheckpointRank(Base):
    """A rank whose files were delivered (multi-node checkpoints arrive in parts)."""

    __tablename__ = "checkpoint_ranks"

    checkpoint_id: Mapped[int] = mapped_column(
        BigID, sa.ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=False)
    node: Mapped[str | None] = mapped_column(sa.String(255), nullable=True)
    local_path: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    # Digest of the (part) manifest that delivered this rank: makes re-ingesting a part idempotent.
    manifest_blake3: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)
    delivered_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Replica(Base):
    __tablename__ = "replicas"
    __table_args__ = (
        sa.UniqueConstraint("checkpoint_id", "url"),
        sa.Index("ix_replicas_url", "url"),
        sa.Index("ix_replicas_state", "state"),
    )

    id: Mapped[int] = mapped_column(BigID, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(BigID, sa.ForeignKey("checkpoints.id", ondelete="CASCADE"))
    url: Mapped[str] = mapped_column(sa.Text)  # snapshot URL, credentials stripped
    destination: Mapped[str] = mapped_column(sa.Text)  # base URL, credentials stripped
    state: Mapped[str] = mapped_column(sa.String(16))
    bytes: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default=sa.text("0"))
    verified_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    error: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    # how a verified replica was shown to hold the manifest's bytes: "read-back", "s3-sha256", ...
    proof: Mapped[str | None] = mapped_column(sa.String(32), nullable=True)


class Validation(Base):
    __tablename__ = "validations"
    __table_args__ = (sa.Index("ix_validations_checkpoint_id_id", "checkpoint_id", "id"),)

    id: Mapped[int] = mapped_column(BigID, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(BigID, sa.ForeignKey("checkpoints.id", ondelete="CASCADE"))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    ok: Mapped[bool] = mapped_column(sa.Boolean)
    summary: Mapped[str] = mapped_column(sa.Text, default="", server_default=sa.text("''"))
    report: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict, server_default=sa.text("'{}'"))


class TensorStat(Base):
    __tablename__ = "tensor_stats"
    __table_args__ = (sa.Index("ix_tensor_stats_validation_id", "validation_id"),)

    id: Mapped[int] = mapped_column(BigID, primary_key=True)
    validation_id: Mapped[int] = mapped_column(BigID, sa.ForeignKey("validations.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(sa.Text)
    dtype: Mapped[str] = mapped_column(sa.String(32))
    shape: Mapped[list[int]] = mapped_column(JSONType)
    numel: Mapped[int] = mapped_column(sa.BigInteger)
    norm: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    max_abs: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    nan_count: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default=sa.text("0"))
    inf_count: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default=sa.text("0"))
    # BLAKE3 of the first 64 KiB / of all bytes (where asked), and a one-element tensor's value: the
    # consistency rules (safepoint.rules.consistency) compare them with the previous checkpoint's.
    head: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)
    digest: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)
    value: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    # Where the tensor was read from and what it is (safepoint.validation.roles), for the tensor table.
    file: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    role: Mapped[str | None] = mapped_column(sa.String(32), nullable=True)


class Event(Base):
    """Append-only audit log; survives deletion of its checkpoint (FK set to NULL)."""

    __tablename__ = "events"
    __table_args__ = (
        sa.Index("ix_events_checkpoint_id_id", "checkpoint_id", "id"),
        sa.Index("ix_events_run_id_id", "run_id", "id"),
        sa.Index("ix_events_at", "at"),
    )

    id: Mapped[int] = mapped_column(BigID, primary_key=True)
    checkpoint_id: Mapped[int | None] = mapped_column(
        BigID, sa.ForeignKey("checkpoints.id", ondelete="SET NULL"), nullable=True
    )
    run_id: Mapped[int | None] = mapped_column(BigID, sa.ForeignKey("runs.id", ondelete="SET NULL"), nullable=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    kind: Mapped[str] = mapped_column(sa.String(64))
    detail: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict, server_default=sa.text("'{}'"))


class Lease(Base):
    """A named, expiring mutex ("one ingest at a time per checkpoint+destination")."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(sa.String(255), primary_key=True)
    holder: Mapped[str] = mapped_column(sa.String(255))
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
