"""Pages of resume candidates, newest first, read in one snapshot.

The catalog only reads; the decision (and the paging loop that stops at a winner) is the pure rule
safepoint.rules.resume.resume_point_paged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from safepoint.catalog.base import CatalogBase
from safepoint.catalog.models import Checkpoint, Replica, Run
from safepoint.catalog.views import CheckpointView, ReplicaView
from safepoint.core.states import ReplicaState


class ResumePages(CatalogBase):
    """A run's checkpoints newest first, one bounded page at a time."""

    @staticmethod
    def _with_replicas(page: Any) -> Any:
        """The page of checkpoints (a LIMITed select of _VIEW_COLS) LEFT JOIN their replicas."""
        sub = page.subquery()
        return (sa.select(sub, Replica.url.label("r_url"), Replica.destination.label("r_dest"),
                          Replica.state.label("r_state"), Replica.verified_at.label("r_verified_at"))
                .outerjoin(Replica, Replica.checkpoint_id == sub.c.id)
                .order_by(sub.c.step.desc(), Replica.id))

    def _page_views(self, conn: Any, q: Any, params: dict[str, Any] | None = None) -> list[CheckpointView]:
        """One round trip for a page of checkpoints and their replicas (`q` from _with_replicas)."""
        views: list[CheckpointView] = []
        reps: list[ReplicaView] = []
        last = None
        for r in conn.execute(q, params or {}):
            if last is None or r.id != last.id:
                if last is not None:
                    views.append(self._view_of(last, tuple(reps)))
                last, reps = r, []
            if r.r_url is not None:
                reps.append(ReplicaView(r.r_url, r.r_dest, ReplicaState(r.r_state), r.r_verified_at))
        if last is not None:
            views.append(self._view_of(last, tuple(reps)))
        return views

    # Built once per combination of filters, executed with bound parameters: constructing the
    # SELECT costs more CPU than running it.
    _PAGE_CACHE: dict[tuple[bool, bool, bool, bool], Any] = {}

    @classmethod
    def _resume_page_statement(cls, has_max: bool, has_before: bool, has_below: bool, with_replicas: bool) -> Any:
        key = (has_max, has_before, has_below, with_replicas)
        q = cls._PAGE_CACHE.get(key)
        if q is None:
            where: list[Any] = [
                Checkpoint.run_id == sa.select(Run.id).where(Run.name == sa.bindparam("run")).scalar_subquery()]
            if has_max:
                where.append(Checkpoint.step <= sa.bindparam("max_step"))
            if has_below:
                where.append(Checkpoint.step < sa.bindparam("below_step"))
            if has_before:
                where.append(Checkpoint.created_at < sa.bindparam("before", type_=Checkpoint.created_at.type))
            q = (sa.select(*cls._VIEW_COLS).join(Run, Checkpoint.run_id == Run.id).where(*where)
                 .order_by(Checkpoint.step.desc()).limit(sa.bindparam("limit", type_=sa.Integer)))
            q = cls._PAGE_CACHE[key] = cls._with_replicas(q) if with_replicas else q
        return q

    def resume_page_query(self, run: str, *, max_step: int | None = None, before: datetime | None = None,
                          below_step: int | None = None, limit: int = 16,
                          with_replicas: bool = False) -> tuple[Any, dict[str, Any]]:
        """The SELECT behind candidates_for_resume and its parameters (also for EXPLAIN in bench/)."""
        q = self._resume_page_statement(max_step is not None, before is not None, below_step is not None,
                                        with_replicas)
        params = {"run": run, "max_step": max_step, "before": before, "below_step": below_step, "limit": int(limit)}
        return q, {k: v for k, v in params.items() if v is not None}

    def candidates_for_resume(self, run: str, *, max_step: int | None = None, before: datetime | None = None,
                              below_step: int | None = None, limit: int = 16,
                              _conn: Any = None) -> list[CheckpointView]:
        """One page of `run`'s checkpoints, newest first, that a resume decision may look at.

        Only rows within the rules' scope (step <= max_step, created before `before`) and below
        `below_step` (the previous page's last step). One statement: a backward range scan of
        uq_checkpoints_run_id_step (run_id, step) that stops after `limit` rows, joined to their
        replicas through uq_replicas_checkpoint_id_url, so its cost does not grow with the catalog.
        """
        q, params = self.resume_page_query(run, max_step=max_step, before=before, below_step=below_step,
                                           limit=limit, with_replicas=True)
        if _conn is not None:
            return self._page_views(_conn, q, params)
        with self._ro_engine.connect() as conn, conn.begin():
            return self._page_views(conn, q, params)

    @contextmanager
    def resume_pages(self, run: str, *, max_step: int | None = None,
                     before: datetime | None = None) -> Iterator[Callable[[int | None, int], list[CheckpointView]]]:
        """`fetch_page(below_step, limit)` over candidates_for_resume, all pages in one read transaction.

        Every page sees the same snapshot, so a paging decision (safepoint.rules.resume.resume_point_paged)
        gives the answer it would give on the whole run read at once. Usually one page, one statement.
        """
        with self._read() as s:
            conn = s.connection()

            def fetch_page(below_step: int | None, limit: int) -> list[CheckpointView]:
                return self.candidates_for_resume(run, max_step=max_step, before=before, below_step=below_step,
                                                  limit=limit, _conn=conn)

            yield fetch_page
