"""Leases: named, expiring, compare-and-set locks shared by every process on the catalog."""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa

from safepoint.catalog.base import CatalogBase
from safepoint.catalog.models import Lease, utcnow


class Leases(CatalogBase):
    """Take, renew, release and read leases."""

    def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take (or renew, for the same holder) lease `name` until now + ttl_s; False if held.

        One INSERT ... ON CONFLICT DO UPDATE ... WHERE expired-or-mine: atomic on both backends.
        """
        now = utcnow()
        ins = self._insert(Lease).values(name=name, holder=holder, expires_at=now + timedelta(seconds=ttl_s),
                                         acquired_at=now)
        ins = ins.on_conflict_do_update(
            index_elements=["name"],
            set_={"holder": ins.excluded.holder, "expires_at": ins.excluded.expires_at,
                  "acquired_at": sa.case((Lease.holder == holder, Lease.acquired_at),
                                         else_=ins.excluded.acquired_at)},
            where=sa.or_(Lease.expires_at < now, Lease.holder == holder),
        ).returning(Lease.name)
        with self._write() as s:
            return s.execute(ins).first() is not None

    def release_lease(self, name: str, holder: str) -> bool:
        """Release a lease if `holder` holds it; True if it did."""
        with self._write() as s:
            res = s.execute(sa.delete(Lease).where(Lease.name == name, Lease.holder == holder)
                            .execution_options(synchronize_session=False))
            return res.rowcount == 1

    def lease_holder(self, name: str) -> str | None:
        """The current (unexpired) holder of lease `name`, if any."""
        with self._read() as s:
            return s.execute(sa.select(Lease.holder).where(Lease.name == name, Lease.expires_at >= utcnow())
                             ).scalar_one_or_none()
