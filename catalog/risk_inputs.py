"""What the corruption-risk rule reads about a run, in three queries."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from safepoint.catalog.base import C, CatalogBase
from safepoint.catalog.models import Checkpoint, Event, Replica, Run
from safepoint.core.states import ReplicaState


class RiskInputs(CatalogBase):
    """Read-only inputs of safepoint.rules.risk."""

    def risk_inputs(self, run: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
        """What safepoint.risk needs for `run`, in three queries.

        Checkpoints (step, state, total_bytes, created_at, copies: replicas not deleted), the
        run's replica and scrub/verify events (kind, at, detail, checkpoint_id) oldest first, and
        the current state of each of its replicas.
        """
        copies = (sa.select(sa.func.count()).select_from(Replica)
                  .where(Replica.checkpoint_id == Checkpoint.id, Replica.state != ReplicaState.DELETED.value)
                  .scalar_subquery())
        q = (sa.select(Checkpoint.id, Checkpoint.step, Checkpoint.state, Checkpoint.total_bytes,
                       Checkpoint.created_at, copies.label("copies"))
             .join(Run, Checkpoint.run_id == Run.id).where(Run.name == run).order_by(Checkpoint.step))
        eq = (sa.select(Event.kind, Event.at, Event.detail, Event.checkpoint_id)
              .join(Checkpoint, Event.checkpoint_id == Checkpoint.id).join(Run, Checkpoint.run_id == Run.id)
              .where(Run.name == run, sa.or_(Event.kind == "replica", Event.kind.startswith("scrub"),
                                             Event.kind.startswith("verify")))
              .order_by(Event.id))
        with self._read() as s:
            cks = [{"id": r.id, "step": r.step, "state": C(r.state), "total_bytes": int(r.total_bytes),
                    "created_at": r.created_at, "copies": int(r.copies)} for r in s.execute(q)]
            evs = [{"kind": r.kind, "at": r.at, "detail": dict(r.detail or {}), "checkpoint_id": r.checkpoint_id}
                   for r in s.execute(eq)]
            states = list(s.execute(sa.select(Replica.state).join(Checkpoint, Replica.checkpoint_id == Checkpoint.id)
                                    .join(Run, Checkpoint.run_id == Run.id).where(Run.name == run)).scalars())
        return cks, evs, states
