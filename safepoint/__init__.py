"""Safepoint: verified, cataloged checkpoints for large-model training.

`safepoint.commit(folder, run, step)` seals a folder written by any tool (docs/format.md).
"""

from safepoint.core.errors import CommitError, FormatError, SafepointError
from safepoint.local.commit import commit

__all__ = ["commit", "restore", "CommitError", "FormatError", "SafepointError", "Snapshotter"]


def __getattr__(name: str):
    # Lazy, so `import safepoint` stays cheap (the Snapshotter pulls in torch).
    if name == "Snapshotter":
        from safepoint.snapshotter import Snapshotter

        return Snapshotter
    if name == "restore":  # pulls in the catalog (SQLAlchemy), not torch or Prefect
        from safepoint.ops.restore import restore

        return restore
    raise AttributeError(f"module 'safepoint' has no attribute {name!r}")
