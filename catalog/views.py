"""Plain, frozen records returned by the catalog.

Callers never hold ORM objects or sessions, and decision code (retention, resume selection) can
import these without SQLAlchemy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from safepoint.core.states import CheckpointState, ReplicaState


@dataclass(frozen=True)
class CheckpointRow:
    id: int
    run: str
    run_id: int
    step: int
    state: CheckpointState
    local_path: str | None
    node: str | None
    world_size: int
    total_bytes: int
    file_count: int
    manifest_blake3: str | None
    created_at: datetime
    updated_at: datetime
    state_changed_at: datetime
    parent_id: int | None
    pinned: bool
    tags: tuple[str, ...]
    metrics: dict[str, Any] = field(hash=False)
    error: str | None
    version: int
    delivered_ranks: tuple[int, ...] = ()
    parent: tuple[str, int] | None = None   # declared lineage (run, step), linked or not

    @property
    def complete(self) -> bool:
        """Every rank of 0..world_size-1 has delivered its files."""
        return set(self.delivered_ranks) >= set(range(self.world_size))


@dataclass(frozen=True)
class ReplicaRow:
    id: int
    checkpoint_id: int
    url: str
    destination: str
    state: ReplicaState
    bytes: int
    verified_at: datetime | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    proof: str | None = None  # what vouched for a verified replica: "read-back", "s3-sha256" (models.Replica)


@dataclass(frozen=True)
class ReplicaView:
    url: str
    destination: str
    state: ReplicaState
    verified_at: datetime | None


@dataclass(frozen=True)
class CheckpointView:
    id: int
    run: str
    step: int
    state: CheckpointState
    local_path: str | None
    created_at: datetime
    total_bytes: int
    pinned: bool
    tags: tuple[str, ...]
    metrics: dict[str, Any] = field(hash=False)
    parent: tuple[str, int] | None
    world_size: int
    replicas: tuple[ReplicaView, ...] = ()
    file_count: int = 0
    state_changed_at: datetime | None = None
    error: str | None = None
    version: int = 0      # bumped by every change: guards plan-then-act (retention, eviction)

    def verified_replicas(self) -> tuple[ReplicaView, ...]:
        return tuple(r for r in self.replicas if r.state == ReplicaState.VERIFIED)


@dataclass(frozen=True)
class ValidationRow:
    id: int
    checkpoint_id: int
    started_at: datetime
    finished_at: datetime | None
    ok: bool
    summary: str
    report: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class LineageLink:
    """One checkpoint in a lineage chain, newest first.

    `relation` says how this link relates to the next (older) one: "resumed" (same run),
    "forked" (another run), or None at the root. A parent that was declared but is not in the
    catalog appears with `state` None and `id` None.
    """

    run: str
    step: int
    id: int | None
    state: CheckpointState | None
    created_at: datetime | None
    relation: str | None = None


@dataclass(frozen=True)
class LocalCopy:
    """A checkpoint's (or one rank's) folder on node-local storage, as the catalog knows it."""

    checkpoint_id: int
    run: str
    step: int
    state: CheckpointState
    version: int
    created_at: datetime
    path: str
    verified_replicas: int
    rank: int | None = None    # None: the checkpoint's own local_path; else one rank's part
