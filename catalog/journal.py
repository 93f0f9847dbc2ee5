"""The audit journal: append-only events about runs and checkpoints."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from safepoint.catalog.base import CatalogBase
from safepoint.catalog.models import Checkpoint, Event, Run


class Journal(CatalogBase):
    """Events, oldest first."""

    def add_event(self, kind: str, *, checkpoint_id: int | None = None, run: str | None = None,
                  detail: dict[str, Any] | None = None) -> None:
        """Append an audit event (detail is stored as-is: redact secrets before passing them)."""
        with self._write() as s:
            run_id = None
            if run is not None:
                run_id = s.execute(sa.select(Run.id).where(Run.name == run)).scalar_one_or_none()
            elif checkpoint_id is not None:
                run_id = s.execute(sa.select(Checkpoint.run_id).where(Checkpoint.id == checkpoint_id)
                                   ).scalar_one_or_none()
            self._event(s, kind, checkpoint_id=checkpoint_id, run_id=run_id, detail=detail)

    def events(self, checkpoint_id: int | None = None, *, run: str | None = None,
               kind: str | None = None) -> list[dict[str, Any]]:
        """Events oldest first: dicts with id, at, kind, detail, checkpoint_id, run_id."""
        q = sa.select(Event).order_by(Event.id)
        if checkpoint_id is not None:
            q = q.where(Event.checkpoint_id == checkpoint_id)
        if run is not None:
            q = q.join(Run, Event.run_id == Run.id).where(Run.name == run)
        if kind is not None:
            q = q.where(Event.kind == kind)
        with self._read() as s:
            return [{"id": e.id, "at": e.at, "kind": e.kind, "detail": dict(e.detail or {}),
                     "checkpoint_id": e.checkpoint_id, "run_id": e.run_id} for e in s.execute(q).scalars()]
