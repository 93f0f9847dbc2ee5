"""Commit a replica at a destination: its MANIFEST.json, then COMMITTED, with one winner per race.

The marker binds the manifest by digest, so the manifest must never change under a marker. Two
writers committing the same (run, step) at once (two ingests, two assemblers) each see no marker,
and the old order "write the manifest, then create the marker exclusively" let the loser replace
the winner's manifest after the winner's marker was in place: a committed replica whose marker no
longer binds its manifest. Here the manifest is created exclusively too (If-None-Match on S3,
link on file://). A manifest already there with other bytes belongs to another writer (in flight,
or killed before its marker): this writer stops without touching it; reconcile removes a partial
that nobody finished once it is older than the grace period. The same bytes are someone's
identical commit (or our own earlier attempt), and the marker race decides as before.
"""

from __future__ import annotations

from safepoint.core.format import MANIFEST_NAME, MARKER_NAME
from safepoint.destinations.base import Destination

__all__ = ["commit_replica", "read_committed"]


def commit_replica(dest: Destination, run: str, step: int, manifest: bytes, marker: bytes) -> str | None:
    """Write `manifest` and `marker` for (run, step) at `dest`; None when our marker stands, else why not."""
    existing = dest.read_control(run, step, MARKER_NAME)
    if existing is not None:
        return None if existing == marker else "already committed with a different manifest; refusing to overwrite"
    if not dest.write_control(run, step, MANIFEST_NAME, manifest, exclusive=True):
        if dest.read_control(run, step, MANIFEST_NAME) != manifest:
            if dest.read_control(run, step, MARKER_NAME) is not None:
                return "committed concurrently with a different manifest"
            return ("another writer holds the commit (a different MANIFEST.json is in place, no marker yet); "
                    "left alone: reconcile removes it after the grace period if nobody commits it")
    if not dest.write_control(run, step, MARKER_NAME, marker, exclusive=True):
        if dest.read_control(run, step, MARKER_NAME) != marker:
            return "committed concurrently with a different manifest"
    return None


def read_committed(dest: Destination, run: str, step: int) -> tuple[bytes | None, bytes | None]:
    """The replica's (MANIFEST.json, COMMITTED) bytes, None for one that is absent (`load_committed`
    holds the marker to the manifest it binds)."""
    return dest.read_control(run, step, MANIFEST_NAME), dest.read_control(run, step, MARKER_NAME)
