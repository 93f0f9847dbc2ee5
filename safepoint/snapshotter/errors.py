"""The Snapshotter's exceptions: all are SafepointErrors, so callers can catch one base class."""

from __future__ import annotations

from safepoint.core.errors import SafepointError


class SnapshotError(SafepointError):
    """A snapshot could not be taken, written or committed; nothing was committed for it."""


class UnsupportedState(SnapshotError, TypeError):
    """The state holds something that cannot be saved without pickle (an arbitrary object)."""


class MemoryFloorError(SnapshotError):
    """Staging would push free host memory below the configured floor, and it did not recover in time."""


class CommitTimeout(SnapshotError):
    """Not every rank wrote its shard (or the committer did not commit) within the timeout."""
