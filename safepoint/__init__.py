"""Safepoint: verified, cataloged checkpoints for large-model training.

`safepoint.commit(folder, run, step)` seals a folder written by any tool (docs/format.md).
"""

from __future__ import annotations

import importlib
from typing import Any

from safepoint.core.errors import CommitError, FormatError, SafepointError

__all__ = ["commit", "restore", "CommitError", "FormatError", "SafepointError", "Snapshotter"]

# Loaded on first use (PEP 562), so `import safepoint`, which every command and `python -m
# safepoint.cli` pays, costs nothing: commit pulls in the format and durable writes, restore the
# catalog (SQLAlchemy), the Snapshotter torch.
_LAZY = {"commit": "safepoint.local.commit", "restore": "safepoint.ops.restore", "Snapshotter": "safepoint.snapshotter"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'safepoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
