"""Safepoint: verified, cataloged checkpoints for large-model training.

`safepoint.commit(folder, run, step)` seals a folder written by any tool (docs/format.md).
"""

from safepoint.commit import commit
from safepoint.errors import CommitError, FormatError, SafepointError

__all__ = ["commit", "CommitError", "FormatError", "SafepointError"]
