"""The Safepoint catalog: an SQL database (SQLite by default, PostgreSQL for fleets).

Names are imported lazily so that ``from safepoint.catalog.views import ...`` (pure dataclasses, used by
decision code) does not pull in SQLAlchemy.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "Catalog", "open_catalog", "default_catalog_url",
    "CheckpointRow", "CheckpointView", "ReplicaRow", "ReplicaView", "ValidationRow", "LineageLink", "LocalCopy",
]

_WHERE = {
    **dict.fromkeys(["Catalog", "open_catalog"], "safepoint.catalog.store"),
    "default_catalog_url": "safepoint.catalog.db",
    **dict.fromkeys(["CheckpointRow", "CheckpointView", "ReplicaRow", "ReplicaView", "ValidationRow", "LineageLink",
                     "LocalCopy"], "safepoint.catalog.views"),
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'safepoint.catalog' has no attribute {name!r}")
