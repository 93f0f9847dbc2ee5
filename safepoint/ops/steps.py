"""The steps every operation is built from, each recording its outcome in the catalog.

`register`, `replicate_to`, `settle`, `settle_copies`, `quarantine` and `outcome` are what ingest
(safepoint.ops.ingest), multi-node assembly (safepoint.ops.assemble), verify, reconcile and scrub
compose; the validation step is safepoint.ops.validation (it alone pulls in torch). Each is
written once, here, and knows nothing of Prefect.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safepoint.catalog.store import Catalog
from safepoint.catalog.views import CheckpointRow
from safepoint.core.config import Config
from safepoint.core.errors import CatalogError, FormatError, SafepointError
from safepoint.core.format import MARKER_NAME, Manifest, digest_bytes, parse_marker
from safepoint.core.redact import redact, redact_url
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.core.transitions import path
from safepoint.core.verify import FileStatus
from safepoint.destinations import open_destination
from safepoint.destinations.parts import PartDestination, check_part, is_part, part_key
from safepoint.local.snapshot import LocalSnapshot, read_small
from safepoint.ops.replicate import Progress, ReplicaResult, replicate
from safepoint.rules.outcome import Decision, decide
from safepoint.rules.settle import settle_replication

log = logging.getLogger("safepoint")


@dataclass
class IngestOutcome:
    run: str
    step: int
    state: CS
    replicas: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""
    part: str | None = None  # this node's part of a multi-node checkpoint (its key), else None

    def result(self) -> dict[str, Any]:
        """The outcome as plain data: the ingest flow's return value and the CLI's `--json`."""
        return {"run": self.run, "step": self.step, "state": str(self.state), "replicas": self.replicas,
                "message": self.message, "part": self.part}

    @property
    def decision(self) -> Decision:
        """Verdict, final run state and exit code, by the one outcome rule (safepoint.rules.outcome)."""
        return decide(self.result())

    @property
    def exit_code(self) -> int:
        return self.decision.exit_code


def register(catalog: Catalog, snap: LocalSnapshot) -> CheckpointRow:
    """Record the commit (idempotent) and move the checkpoint to `replicating`."""
    row = catalog.record_commit(snap.manifest, digest_bytes(snap.manifest_bytes), str(snap.root))
    if row.state is CS.PRUNED:
        raise CatalogError(f"{row.run}/{row.step} was pruned; refusing to ingest it again")
    # From wherever it is (a validation a crash interrupted left `validating`: back through `replicated`).
    walk(catalog, row.id, CS.REPLICATING, detail={"why": "re-ingest"})
    row = catalog.get_by_id(row.id)
    if row.state is CS.PRUNED:  # retention marked it between record_commit and the transition
        raise CatalogError(f"{row.run}/{row.step} was pruned; refusing to ingest it again")
    return row


def walk(catalog: Catalog, checkpoint_id: int, to: CS, *, start: Iterable[CS] | None = None,
         error: str | None = None, detail: dict[str, Any] | None = None) -> bool:
    """Move a checkpoint to `to` along the rule's walk (safepoint.core.transitions.path), each hop a
    guarded transition; only from a state in `start` (default: any). True when this caller made the
    last hop; False when the state is not in `start`, there is no walk, or others keep moving it."""
    for _ in range(10):
        state = catalog.get_by_id(checkpoint_id).state
        hops = path(state, to) if start is None or state in start else ()
        if not hops:
            return False
        for i, nxt in enumerate(hops):
            last = i == len(hops) - 1
            if not catalog.transition(checkpoint_id, nxt, expect={state}, error=error if last else None,
                                      detail=detail):
                break  # another writer moved it: read it again
            state = nxt
        else:
            return True
    return False


def replicate_to(
    catalog: Catalog, checkpoint_id: int, snap: LocalSnapshot, url: str, config: Config | None = None,
    *, attempts: int = 2, progress: Progress | None = None,
) -> ReplicaResult:
    """Replicate to one destination and record the replica: the one recorded replicate, whole or part.

    A replica that reads back wrong is re-sent once. An upload that raises (disk full, EIO, a network
    that gave up) marks the replica `failed` and is raised: never left `pending`; the caller (a
    Prefect retry, the next ingest) sends it again, nothing is trusted. This node's part of a
    multi-node checkpoint goes under its own control folder (safepoint.destinations.parts); its
    replica row becomes verified only when the set is assembled (safepoint.ops.assemble).
    """
    config = config or Config()
    m = snap.manifest
    key = None
    if is_part(m):
        check_part(m)
        key = part_key(m.held_ranks)
    dest = open_destination(url, config.storage_options(url))
    try:
        snap_url = dest.snapshot_url(m.run, m.step)
        known = {r.url: r.state for r in catalog.replicas(checkpoint_id)} if key is not None else {}
        if known.get(snap_url) is not RS.VERIFIED:
            catalog.set_replica(checkpoint_id, snap_url, dest.url, RS.PENDING)
        target = dest if key is None else PartDestination(dest, key)
        why = "" if key is None else f"part {key} ({m.node or 'no node'}): "
        for _ in range(max(1, attempts)):
            try:
                result = replicate(snap, target, progress=progress)
            except (OSError, SafepointError) as e:
                catalog.set_replica(checkpoint_id, snap_url, dest.url, RS.FAILED, error=why + _why(e))
                raise
            if result.state is not RS.CORRUPT:
                break
            # Remove what read back wrong so the next attempt uploads it again.
            dest.delete_files(m.run, m.step, [p for p, s in result.remote.items() if s is not FileStatus.OK])
        if key is None:
            catalog.set_replica(checkpoint_id, result.url, result.destination, result.state,
                                bytes=m.total_bytes if result.state is RS.VERIFIED else 0, error=result.error,
                                proof=result.proof if result.state is RS.VERIFIED else None)
            return result
        catalog.add_event("part.replica", checkpoint_id=checkpoint_id, detail={
            "part": key, "node": m.node, "ranks": list(m.held_ranks), "url": result.url,
            "state": str(result.state), "error": result.error, "bytes_uploaded": result.bytes_uploaded,
            "bytes_reused": result.bytes_reused,
        })
        if result.state is not RS.VERIFIED:
            catalog.set_replica(checkpoint_id, snap_url, dest.url,
                                RS.CORRUPT if result.state is RS.CORRUPT else RS.FAILED, error=why + str(result.error))
        return result
    finally:
        dest.close()


def _why(e: BaseException) -> str:
    return redact(e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__


def settle(catalog: Catalog, checkpoint_id: int, results: list[ReplicaResult]) -> CS:
    """Apply the pure settlement rule (safepoint.rules.settle) in one guarded transition."""
    s = settle_replication(results)
    catalog.transition(checkpoint_id, s.state, expect={CS.REPLICATING}, error=s.error)
    return s.state


def failed_result(url: str, e: BaseException) -> ReplicaResult:
    return ReplicaResult(url=url, destination=redact_url(url), state=RS.FAILED,
                         error=f"{redact_url(url)}: {_why(e)}")


def outcome(catalog: Catalog, checkpoint_id: int, message: str = "", part: str | None = None) -> IngestOutcome:
    row = catalog.get_by_id(checkpoint_id)
    reps = [{"url": r.url, "state": str(r.state), "error": r.error} for r in catalog.replicas(checkpoint_id)]
    return IngestOutcome(row.run, row.step, row.state, reps, message or (row.error or ""), part)


def settle_copies(catalog: Catalog, checkpoint_id: int) -> CS:
    """A verified checkpoint with no verified copy left (no good replica, no good local copy) is corrupt."""
    row = catalog.get_by_id(checkpoint_id)
    if row.state is not CS.VERIFIED:
        return row.state
    if any(r.state is RS.VERIFIED for r in catalog.replicas(checkpoint_id)):
        return row.state
    local_ok = False
    if row.local_path and (Path(row.local_path) / MARKER_NAME).exists():
        try:
            local_ok = LocalSnapshot.open(row.local_path).verify().outcome is CS.VERIFIED
        except FormatError:
            local_ok = False
    if not local_ok:
        catalog.transition(checkpoint_id, CS.CORRUPT, expect={CS.VERIFIED}, error="no verified copy left")
        return CS.CORRUPT
    return row.state


def quarantine(catalog: Catalog, folder: str | os.PathLike, error: str) -> CheckpointRow | None:
    """Record a committed local folder whose control files are unusable as a corrupt checkpoint.

    A marker that binds no valid manifest (missing, hostile, rotten) makes the snapshot corrupt
    (docs/format.md); recording it stops watchers from retrying it forever and shows it in `ls`.
    The checkpoint is named by its marker; an unreadable marker names nothing and None is returned.
    A checkpoint the catalog already has from another folder or a replica keeps its state.
    """
    root = Path(folder).resolve()
    try:
        marker = parse_marker(read_small(root / MARKER_NAME, 64 * 1024) or b"")
    except (FormatError, OSError):
        return None
    row = catalog.get(marker.run, marker.step)
    why = f"local snapshot refused: {redact(error)}"
    if row is None:
        row = catalog.record_commit(Manifest(marker.run, marker.step, ()), marker.manifest_blake3, str(root))
    elif row.local_path not in (None, str(root)):
        catalog.add_event("quarantine", checkpoint_id=row.id, detail={"folder": str(root), "error": why})
        return row
    catalog.transition(row.id, CS.CORRUPT, expect={CS.COMMITTED, CS.REPLICATING}, error=why)
    return catalog.get_by_id(row.id)
