"""The catalog API: what Safepoint knows about runs, checkpoints, replicas and validations.

`Catalog` is a facade over one aggregate per module (commits and parts, state transitions,
lineage, replicas, validations and stats, local copies, the event journal, leases, risk inputs,
resume pages), all sharing the engines and session helpers of catalog.base. Every method is one
short transaction and returns frozen dataclasses (catalog.views). The catalog reads and writes;
it makes no domain decisions (those are in safepoint.rules).
"""

from __future__ import annotations

from safepoint.catalog import db
from safepoint.catalog.commits import Commits
from safepoint.catalog.journal import Journal
from safepoint.catalog.leases import Leases
from safepoint.catalog.lineage import Lineage
from safepoint.catalog.local_copies import LocalCopies
from safepoint.catalog.replicas import Replicas
from safepoint.catalog.resume_pages import ResumePages
from safepoint.catalog.risk_inputs import RiskInputs
from safepoint.catalog.transitions import Transitions
from safepoint.catalog.validations import Validations
from safepoint.core.redact import redact, redact_url

__all__ = ["Catalog", "open_catalog", "redact", "redact_url"]


class Catalog(Commits, Transitions, Lineage, Replicas, Validations, LocalCopies, Journal, Leases, RiskInputs,
              ResumePages):
    """One catalog database. Cheap to construct; share the Engine (db.get_engine) per process."""


def open_catalog(url: str | None = None) -> Catalog:
    """A Catalog on `url` (default: db.default_catalog_url()), migrated to head once per process."""
    return Catalog(db.ensure_schema(url))
