"""The Safepoint catalog: an SQL database (SQLite by default, PostgreSQL for fleets).

Names are imported lazily so that ``from catalog.views import ...`` (pure dataclasses, used by
decision code) does not pull in SQLAlchemy.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "Catalog", "open_catalog", "default_catalog_url",
    "CheckpointRow", "CheckpointView", "ReplicaRow", "ReplicaView", "ValidationRow", "LineageLink", "LocalCopy",
]

_WHERE = {
    "Catalog": "catalog.store", "open_catalog": "catalog.store", "default_catalog_url": "catalog.db",
    "CheckpointRow": "catalog.views", "CheckpointView": "catalog.views", "ReplicaRow": "catalog.views",
    "ReplicaView": "catalog.views", "ValidationRow": "catalog.views", "LineageLink": "catalog.views",
    "LocalCopy": "catalog.views",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'catalog' has no attribute {name!r}")
