"""Replicas: copies of a checkpoint at a destination and their verification state."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from safepoint.catalog.base import C, CatalogBase
from safepoint.catalog.models import Checkpoint, Replica, utcnow
from safepoint.catalog.views import CheckpointRow, ReplicaRow
from safepoint.core.errors import CatalogError
from safepoint.core.redact import redact, redact_url
from safepoint.core.states import ReplicaState
from safepoint.core.transitions import replica_allowed


class Replicas(CatalogBase):
    """One row per (checkpoint, snapshot URL), credentials stripped."""

    def set_replica(self, checkpoint_id: int, url: str, destination: str, state: ReplicaState, *,
                    bytes: int = 0, error: str | None = None, proof: str | None = None) -> bool:  # noqa: A002
        """Upsert the replica at snapshot `url` (credentials stripped); logs an event on change.

        `proof` (with `verified`): what showed the bytes are the manifest's ("read-back", "s3-sha256");
        None keeps the one recorded. Any other state clears it: nothing vouches for those bytes now.

        Returns False, changing nothing, for a pruned checkpoint unless `state` is `deleted`: a
        scrub or upload that finishes after retention marked the checkpoint must not bring back
        a replica whose files are being deleted. The checkpoint row is share-locked for the
        transaction, so this check and retention's marking (catalog.mark_pruned) serialize.
        """
        state = ReplicaState(state)
        url, destination, error = redact_url(url), redact_url(destination), redact(error)
        now = utcnow()
        with self._write() as s:
            ck = s.execute(sa.select(Checkpoint.state, Checkpoint.run_id).where(Checkpoint.id == checkpoint_id)
                           .with_for_update(read=True)).first()
            if ck is None:
                raise CatalogError(f"no checkpoint with id {checkpoint_id}")
            if not replica_allowed(C(ck.state), state):
                return False
            prev = s.execute(sa.select(Replica.state, Replica.error)
                             .where(Replica.checkpoint_id == checkpoint_id, Replica.url == url)).first()
            ins = self._insert(Replica).values(
                checkpoint_id=checkpoint_id, url=url, destination=destination, state=state.value, bytes=int(bytes),
                error=error, verified_at=now if state == ReplicaState.VERIFIED else None,
                created_at=now, updated_at=now, proof=proof if state == ReplicaState.VERIFIED else None,
            )
            set_: dict[str, Any] = {"destination": ins.excluded.destination, "state": ins.excluded.state,
                                    "bytes": ins.excluded.bytes, "error": ins.excluded.error,
                                    "updated_at": ins.excluded.updated_at}
            if state == ReplicaState.VERIFIED:
                set_["verified_at"] = ins.excluded.verified_at
            if proof is not None or state != ReplicaState.VERIFIED:
                set_["proof"] = ins.excluded.proof
            try:
                s.execute(ins.on_conflict_do_update(index_elements=["checkpoint_id", "url"], set_=set_))
            except IntegrityError as e:
                raise CatalogError(f"no checkpoint with id {checkpoint_id}") from e
            if prev is None or prev.state != state.value or prev.error != error:
                self._event(s, "replica", checkpoint_id=checkpoint_id, run_id=ck.run_id,
                            detail={"url": url, "state": state.value, "bytes": int(bytes), "error": error,
                                    "from": prev.state if prev else None})
            return True

    @staticmethod
    def _replica_row(r: Replica) -> ReplicaRow:
        return ReplicaRow(id=r.id, checkpoint_id=r.checkpoint_id, url=r.url, destination=r.destination,
                          state=ReplicaState(r.state), bytes=r.bytes, verified_at=r.verified_at, error=r.error,
                          created_at=r.created_at, updated_at=r.updated_at, proof=r.proof)

    def replicas(self, checkpoint_id: int) -> list[ReplicaRow]:
        with self._read() as s:
            q = sa.select(Replica).where(Replica.checkpoint_id == checkpoint_id).order_by(Replica.id)
            return [self._replica_row(r) for r in s.execute(q).scalars()]

    def find_replica(self, url: str) -> tuple[CheckpointRow, ReplicaRow] | None:
        """The checkpoint and replica stored at snapshot `url` (trailing '/' and credentials ignored)."""
        u = redact_url(url)
        with self._read() as s:
            r = s.execute(sa.select(Replica).where(Replica.url.in_({u, u + "/"})).order_by(Replica.id.desc())
                          .limit(1)).scalar_one_or_none()
            if r is None:
                return None
            row = self._get(s, Checkpoint.id == r.checkpoint_id)
            assert row is not None
            return row, self._replica_row(r)
