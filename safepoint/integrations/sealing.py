"""What every integration does once a trainer has written a checkpoint folder: seal it, then
optionally announce it (the `safepoint.checkpoint.committed` event, exactly as `safepoint watch --emit`
sends it, with the same deterministic id, so a watcher that also sees the marker creates no
second run).

A trainer that re-saves a step it had sealed (a resume into its own output folder) gets a new seal:
`unseal` takes the old marker away before the trainer writes, and `seal_and_announce` re-seals what it wrote
(`commit(reseal=True)`), recording the manifest it supersedes. After a resume (`safepoint.restore`,
or a trainer resuming from a sealed folder), each sealed checkpoint names its lineage parent
(safepoint.core.resumed).

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

from safepoint.core import resumed
from safepoint.core.errors import CommitError, FormatError
from safepoint.core.format import Manifest
from safepoint.core.naming import this_host
from safepoint.local.commit import commit, unseal
from safepoint.local.snapshot import LocalSnapshot, is_committed

__all__ = ["SealOptions", "emit_committed", "note_resumed_from", "seal_and_announce", "step_of_folder",
           "unseal_before_write"]

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
        # Prefect (and the events layer) only for a job that asks for events: training scripts stay light.
        from safepoint.events.markers import Marker
        from safepoint.flows.gateway import PrefectGateway

        marker = Marker.of(LocalSnapshot.open(folder), list(to), node or this_host())
        PrefectGateway(timeout_s=timeout_s).emit(marker)
    except Exception as e:  # noqa: BLE001 - never stop training for an event; the marker stays on disk
        log.warning("safepoint: could not send the committed event for %s (safepoint watch will find it): %s",
                    folder, e)
        return None
    return marker.event_id


def unseal_before_write(folder: str | os.PathLike) -> bool:
    """A trainer is about to write into `folder`: if it is sealed, take the seal away first (True)."""
    if not is_committed(folder):
        return False
    unseal(folder)
    log.info("safepoint: %s is being re-saved: its old seal was removed; it is sealed again once written", folder)
    return True


def note_resumed_from(folder: str | os.PathLike) -> tuple[str, int] | None:
    """A trainer resumes from `folder`: when it is sealed, its (run, step) parents the next checkpoint."""
    try:
        m = LocalSnapshot.open(folder).manifest
    except (FormatError, OSError):
        return None
    resumed.note_resumed(m.run, m.step)
    return m.run, m.step


def seal_and_announce(folder: str | os.PathLike, step: int, options: SealOptions) -> Manifest | None:
    """commit(folder, run, step) (re-sealing a re-saved folder), then the event if asked.

    None when sealing failed and not strict."""
    try:
        manifest = commit(folder, options.run, step, node=options.node, workers=options.workers, reseal=True,
                          parent=resumed.parent_for(options.run, step))
    except CommitError as e:
        if options.strict:
            raise
        log.error("safepoint: %s", e)
        return None
    resumed.note_sealed(options.run, step)
    what = "re-sealed" if "supersedes" in manifest.meta else "sealed"
    log.info("safepoint: %s %s as %s/%s (%d files)", what, folder, options.run, step, len(manifest.files))
    if options.emit_to:
        emit_committed(folder, options.emit_to, node=options.node, timeout_s=options.event_timeout_s)
    return manifest
