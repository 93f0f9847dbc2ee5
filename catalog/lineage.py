"""Lineage: which checkpoint each one was resumed or forked from, and back."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from safepoint.catalog.base import C, CatalogBase
from safepoint.catalog.models import Checkpoint, Run, utcnow
from safepoint.catalog.views import CheckpointRow, LineageLink
from safepoint.core.errors import CatalogError
from safepoint.core.format import check_run, check_step


class Lineage(CatalogBase):
    """Parent links across runs: chains, children and corrections."""

    _LINK_COLS = (Checkpoint.id, Run.name.label("run"), Checkpoint.step, Checkpoint.state, Checkpoint.created_at,
                  Checkpoint.parent_id, Checkpoint.parent_run, Checkpoint.parent_step)

    def _link_row(self, s: Session, where: Any) -> Any:
        return s.execute(sa.select(*self._LINK_COLS).join(Run, Checkpoint.run_id == Run.id).where(where)).first()

    def _parent_link_row(self, s: Session, cur: Any) -> Any:
        if cur.parent_id is not None:
            return self._link_row(s, Checkpoint.id == cur.parent_id)
        if cur.parent_run is None:
            return None
        return self._link_row(s, sa.and_(Run.name == cur.parent_run, Checkpoint.step == cur.parent_step))

    def lineage(self, run: str, step: int, *, max_depth: int = 10_000) -> list[LineageLink]:
        """The chain from (run, step) back to its root, newest first, across runs.

        Each hop is one primary-key (or (run, step)) lookup. A declared parent missing from the
        catalog ends the chain as a link with state None. Stops on a cycle (only a hand-made
        manifest can declare one; set_parent refuses them).
        """
        chain: list[LineageLink] = []
        with self._read() as s:
            cur = self._link_row(s, sa.and_(Run.name == run, Checkpoint.step == step))
            seen: set[int] = set()
            while cur is not None and cur.id not in seen and len(chain) < max_depth:
                seen.add(cur.id)
                relation = None
                if cur.parent_run is not None:
                    relation = "resumed" if cur.parent_run == cur.run else "forked"
                chain.append(LineageLink(cur.run, cur.step, cur.id, C(cur.state), cur.created_at, relation))
                if cur.parent_run is None:
                    break
                nxt = self._parent_link_row(s, cur)
                if nxt is None:
                    chain.append(LineageLink(cur.parent_run, int(cur.parent_step), None, None, None, None))
                    break
                cur = nxt
        return chain

    def children(self, run: str, step: int) -> list[LineageLink]:
        """Checkpoints that name (run, step) as their parent: later resumes and forks, by run and step."""
        with self._read() as s:
            me = self._link_row(s, sa.and_(Run.name == run, Checkpoint.step == step))
            if me is None:
                return []
            q = (sa.select(*self._LINK_COLS).join(Run, Checkpoint.run_id == Run.id)
                 .where(Checkpoint.parent_id == me.id).order_by(Run.name, Checkpoint.step))
            return [LineageLink(r.run, r.step, r.id, C(r.state), r.created_at,
                                "resumed" if r.run == run else "forked") for r in s.execute(q)]

    def set_parent(self, run: str, step: int, parent: tuple[str, int] | None) -> CheckpointRow:
        """Record (or clear) the checkpoint (run, step) was resumed or forked from; refuses cycles.

        The Python API counterpart of `safepoint commit --parent` for checkpoints already
        cataloged. The parent need not be cataloged yet: it is linked when it appears.
        """
        with self._write() as s:
            me = self._link_row(s, sa.and_(Run.name == run, Checkpoint.step == step))
            if me is None:
                raise CatalogError(f"no checkpoint {run}/{step} in the catalog")
            pid = None
            if parent is not None:
                prun, pstep = check_run(parent[0]), check_step(parent[1])
                if (prun, pstep) == (run, step):
                    raise CatalogError(f"{run}/{step} cannot be its own parent")
                p = self._link_row(s, sa.and_(Run.name == prun, Checkpoint.step == pstep))
                hops = 0
                while p is not None and hops < 100_000:
                    if p.id == me.id:
                        raise CatalogError(f"{prun}/{pstep} descends from {run}/{step}: that parent makes a cycle")
                    pid = p.id if pid is None else pid
                    p, hops = self._parent_link_row(s, p), hops + 1
            values = {"parent_run": parent[0] if parent else None, "parent_step": parent[1] if parent else None,
                      "parent_id": pid}
            s.execute(sa.update(Checkpoint).where(Checkpoint.id == me.id)
                      .values(**values, version=Checkpoint.version + 1, updated_at=utcnow())
                      .execution_options(synchronize_session=False))
            run_id = s.execute(sa.select(Checkpoint.run_id).where(Checkpoint.id == me.id)).scalar_one()
            self._event(s, "lineage", checkpoint_id=me.id, run_id=run_id,
                        detail={"parent": {"run": parent[0], "step": parent[1]} if parent else None,
                                "from": {"run": me.parent_run, "step": me.parent_step} if me.parent_run else None,
                                "linked": pid is not None})
        with self._read() as s:
            row = self._get(s, sa.and_(Run.name == run, Checkpoint.step == step))
        assert row is not None
        return row
