"""Retries as one layer over any destination (as restic wraps every backend).

`open_destination` returns every backend inside a `RetryingDestination`: each call that fails with
what the backend calls transient (`Destination.transient`) is tried again under its
`retry_policy` (capped exponential backoff, full jitter); a final failure surfaces at once, and
one that keeps failing ends as a DestinationError. Every call is safe to repeat: uploads and
fetches rewrite their whole target, deletes tolerate what is gone, and an exclusive write that
finds its own bytes in place counts as done (safepoint.destinations.replica_commit).

A backend may still retry inside one call where only it can (S3 retries a part of a multipart
upload, not the whole file); what it gives up on is a DestinationError, which this layer does not
retry again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from safepoint.core.format import FileEntry
from safepoint.core.redact import redact
from safepoint.destinations import retry
from safepoint.destinations.base import Destination, SnapshotListing

__all__ = ["RetryingDestination"]

T = TypeVar("T")


class RetryingDestination(Destination):
    """`inner`, each call retried while it fails transiently."""

    def __init__(self, inner: Destination, *, sleep: Callable[[float], None] = time.sleep):
        self.inner = inner
        self.url = inner.url
        self.capabilities = inner.capabilities
        self._sleep = sleep

    def __getattr__(self, name: str) -> Any:  # the backend's own attributes (bucket, root, fs, ...)
        if name == "inner" or name.startswith("__"):
            raise AttributeError(name)  # not set yet (unpickling): no recursion
        return getattr(self.inner, name)

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        return retry.call(fn, self.inner.retry_policy, redact(f"{what} {self.url}") or what, sleep=self._sleep,
                          transient=self.inner.transient)

    def snapshot_url(self, run: str, step: int) -> str:
        return self.inner.snapshot_url(run, step)

    def size(self, run: str, step: int, relpath: str) -> int | None:
        return self._retry(f"size of {run}/{step}/{relpath} at", lambda: self.inner.size(run, step, relpath))

    def upload(self, run: str, step: int, entry: FileEntry, source: Path) -> str:
        return self._retry(f"upload {run}/{step}/{entry.path} to", lambda: self.inner.upload(run, step, entry, source))

    def digest(self, run: str, step: int, relpath: str) -> str:
        return self._retry(f"read back {run}/{step}/{relpath} at", lambda: self.inner.digest(run, step, relpath))

    def attest(self, run: str, step: int, relpath: str, size: int) -> str | None:
        return self._retry(f"attest {run}/{step}/{relpath} at", lambda: self.inner.attest(run, step, relpath, size))

    def fetch(self, run: str, step: int, relpath: str, target: Path,
              on_bytes: Callable[[int], None] | None = None, *, size: int | None = None) -> str:
        return self._retry(f"fetch {run}/{step}/{relpath} from",
                           lambda: self.inner.fetch(run, step, relpath, target, on_bytes, size=size))

    def listing(self, run: str | None = None, step: int | None = None) -> dict[tuple[str, int], SnapshotListing]:
        return self._retry("list", lambda: self.inner.listing(run, step))

    def read_control(self, run: str, step: int, name: str) -> bytes | None:
        return self._retry(f"read {run}/{step}/{name} at", lambda: self.inner.read_control(run, step, name))

    def write_control(self, run: str, step: int, name: str, data: bytes, *, exclusive: bool = False) -> bool:
        return self._retry(f"write {run}/{step}/{name} to",
                           lambda: self.inner.write_control(run, step, name, data, exclusive=exclusive))

    def delete_files(self, run: str, step: int, relpaths: list[str]) -> None:
        self._retry(f"delete files of {run}/{step} at", lambda: self.inner.delete_files(run, step, relpaths))

    def delete_control(self, run: str, step: int, name: str) -> None:
        self._retry(f"delete {run}/{step}/{name} at", lambda: self.inner.delete_control(run, step, name))

    def committed_snapshots(self) -> list[tuple[str, int]]:
        return self._retry("list committed snapshots at", self.inner.committed_snapshots)

    def delete_snapshot(self, run: str, step: int, relpaths: list[str]) -> None:
        self._retry(f"delete {run}/{step} at", lambda: self.inner.delete_snapshot(run, step, relpaths))

    def abort_stale_uploads(self, older_than_s: float) -> int:
        return self._retry("abort stale uploads at", lambda: self.inner.abort_stale_uploads(older_than_s))

    def remove_empty_folders(self, run: str, step: int) -> None:
        self._retry(f"remove empty folders of {run}/{step} at", lambda: self.inner.remove_empty_folders(run, step))

    def close(self) -> None:
        self.inner.close()
