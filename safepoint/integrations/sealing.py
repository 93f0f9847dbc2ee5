"""What every integration does once a trainer has written a checkpoint folder: seal it, then
optionally announce it (the `safepoint.checkpoint.committed` event, exactly as `safepoint watch --emit`
sends it, with the same deterministic id, so a watcher that also sees the marker creates no
second run).

An event that cannot be sent never stops training: it is logged, and the marker on disk still lets
`safepoint watch` pick the checkpoint up. A failed seal does stop it (`CommitError`), because
training on without a resume point is what Safepoint exists to prevent; `strict=False` logs instead.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from safepoint.core.errors import CommitError
from safepoint.core.format import Manifest
from safepoint.events.markers import Marker
from safepoint.local.commit import commit
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.leases import this_host

__all__ = ["SealOptions", "emit_committed", "seal", "step_of_folder"]

log = logging.getLogger("safepoint.integrations")
_STEP_FOLDER = re.compile(r"^(?:step|checkpoint)[-_=]?(\d+)$")


@dataclass(frozen=True)
class SealOptions:
    """How an integration seals: `emit_to` destinations turn on the committed event (the ingest
    deployment replicates there); `strict` raises when sealing fails."""

    run: str
    emit_to: Sequence[str] = ()
    node: str | None = None
    workers: int = 2
    strict: bool = True
    event_timeout_s: float = 10.0


def step_of_folder(folder: str | os.PathLike) -> int | None:
    """The step in a folder name trainers use: `step-100` (torchtitan), `checkpoint-100` (HF)."""
    m = _STEP_FOLDER.match(Path(folder).name)
    return int(m.group(1)) if m else None


def emit_committed(folder: str | os.PathLike, to: Sequence[str], *, node: str | None = None,
                   timeout_s: float = 10.0) -> str | None:
    """Send the committed event of a sealed folder; its event id, or None when it could not be sent."""
    try:
        # Prefect is imported only by a job that asks for events: training scripts stay light without it.
        from safepoint.flows.gateway import PrefectGateway

        marker = Marker.of(LocalSnapshot.open(folder), list(to), node or this_host())
        PrefectGateway(timeout_s=timeout_s).emit(marker)
    except Exception as e:  # noqa: BLE001 - never stop training for an event; the marker stays on disk
        log.warning("safepoint: could not send the committed event for %s (safepoint watch will find it): %s",
                    folder, e)
        return None
    return marker.event_id


def seal(folder: str | os.PathLike, step: int, options: SealOptions) -> Manifest | None:
    """commit(folder, run, step), then the event if asked. None when sealing failed and not strict."""
    try:
        manifest = commit(folder, options.run, step, node=options.node, workers=options.workers)
    except CommitError as e:
        if options.strict:
            raise
        log.error("safepoint: %s", e)
        return None
    log.info("safepoint: sealed %s as %s/%s (%d files)", folder, options.run, step, len(manifest.files))
    if options.emit_to:
        emit_committed(folder, options.emit_to, node=options.node, timeout_s=options.event_timeout_s)
    return manifest
