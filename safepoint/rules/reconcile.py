"""Reconcile's decisions, as pure functions: what a location at a destination needs, and a checkpoint.

The pipeline writes in an order that makes every crash leave something safe (docs/format.md):
objects, then the replica's manifest and marker, then the catalog row. A process killed between
two of those steps leaves the catalog and the storage disagreeing, in one of a few ways that this
module repairs, like `restic check` and `restic prune` do for a repository:

- a replica committed at a destination that the catalog does not know (the catalog commit never
  happened, or the catalog was rebuilt) is **adopted**: row added, every byte re-hashed, recorded;
- a committed replica the catalog still has as pending, failed or missing is **confirmed** by
  re-hashing every byte (never by trusting the marker) and recorded as verified or corrupt;
- a catalog replica marked verified whose marker or objects are gone is **marked missing**, and
  one whose control files are unreadable or bind another manifest is **marked corrupt**; a
  checkpoint left without any verified copy becomes corrupt (safepoint.ops.steps.settle_copies);
- a bad replica of a good checkpoint is **replicated again** from a copy that verifies (the local
  folder, or another replica): the objects that still hash right are reused, the rest re-sent;
- partial replicas (no marker) and Safepoint's temporary files (`.safepoint-tmp-*`) untouched for
  longer than a **grace period** are removed: younger ones may belong to an upload in flight; stale
  multipart uploads are aborted where the destination offers it;
- a checkpoint stuck in a pipeline state (replicating, replicated, validating) for longer than the
  grace period is **finished** (validated from a verified copy) when a verified replica exists, or
  **abandoned** back to `committed` (so the next ingest or `watch` pass starts it again);
- what retention already marked `pruned` but did not finish deleting is deleted (marker first).

A committed replica is never deleted unless retention marked its checkpoint pruned, and a copy is
never trusted without re-hashing it. `observe` turns a listing and the control files into a
`Remote`; `decide` and `plan_checkpoint` are the rules (tested with tables in
tests/faults/test_reconcile.py); safepoint.ops.reconcile observes, decides and acts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from safepoint.core.format import MARKER_NAME, PARTS_DIR, FileEntry
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS

# States the ingest pipeline passes through; a checkpoint left in one by a crash is "stale".
IN_FLIGHT = frozenset({CS.REPLICATING, CS.REPLICATED, CS.VALIDATING})
# Replica states that a repair re-replicates (for a checkpoint that has or had a good copy).
REPAIRABLE = frozenset({RS.CORRUPT, RS.MISSING, RS.FAILED})


# -- observations and pure decisions -----------------------------------------------------------

class Found(str, Enum):
    """What a destination holds at <base>/<run>/<step>/."""

    COMMITTED = "committed"   # a marker that binds a valid manifest
    BROKEN = "broken"         # a marker, but the control files do not load (missing, hostile, rotten)
    PARTIAL = "partial"       # objects but no marker
    PARTS = "parts"           # no marker yet, committed parts of a multi-node one (safepoint.destinations.parts)
    ABSENT = "absent"         # nothing

    def __str__(self) -> str:
        return self.value


class Action(str, Enum):
    NONE = "none"
    ADOPT = "adopt"                       # committed, unknown to the catalog: add the row, re-verify
    CONFIRM = "confirm"                   # committed, catalog not verified: re-verify every byte
    MARK_MISSING = "mark_missing"         # catalog verified; marker or objects gone
    MARK_CORRUPT = "mark_corrupt"         # catalog has the replica; control files bad or not ours
    CONFLICT = "conflict"                 # committed with another manifest than the catalog's: left alone
    UNREADABLE = "unreadable"             # a marker nobody can read, unknown to the catalog: left alone
    REMOVE_PARTIAL = "remove_partial"     # no marker, untouched for longer than the grace period
    KEEP_PARTIAL = "keep_partial"         # no marker, but recent: an upload may be in flight
    ABANDON_REPLICA = "abandon_replica"   # catalog pending, nothing there, for longer than the grace period
    FINISH_PRUNE = "finish_prune"         # retention marked the checkpoint pruned: delete what is left

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Remote:
    """One snapshot location at a destination, as observed."""

    found: Found
    manifest_blake3: str | None = None      # what the marker binds (COMMITTED)
    age_s: float | None = None              # since the newest object under it was written
    complete: bool | None = None            # COMMITTED: every manifest file listed with its size
    size_mismatch: bool = False             # COMMITTED: some file listed with another size


@dataclass(frozen=True)
class Known:
    """What the catalog says about the same location."""

    state: CS | None                        # checkpoint state (None: no row)
    manifest_blake3: str | None = None
    replica: RS | None = None               # replica row at this URL (None: no row)
    replica_age_s: float | None = None      # since that row last changed


def decide(remote: Remote, known: Known, grace_s: float) -> Action:
    """The repair for one location: pure, so it is tested with tables and properties."""
    if known.state is CS.PRUNED:
        done = known.replica in (None, RS.DELETED)
        if remote.found is Found.ABSENT and done:
            return Action.NONE
        if remote.found is not Found.PARTIAL or not done:
            return Action.FINISH_PRUNE  # retention decided: finish its deletion now
        # Leftovers of a finished deletion (empty folders, temporary files) are orphans like any other.
    if remote.found is Found.COMMITTED:
        if known.state is None:
            return Action.ADOPT
        if known.manifest_blake3 and remote.manifest_blake3 != known.manifest_blake3:
            # Someone else's commit sits where the catalog expects ours: never touch it.
            return Action.MARK_CORRUPT if known.replica is RS.VERIFIED else Action.CONFLICT
        if remote.complete is False:
            if known.replica is RS.VERIFIED:
                return Action.MARK_CORRUPT if remote.size_mismatch else Action.MARK_MISSING
            return Action.CONFIRM  # re-verifying records exactly what is wrong
        return Action.NONE if known.replica is RS.VERIFIED else Action.CONFIRM
    if remote.found is Found.BROKEN:
        if known.state is None:
            return Action.UNREADABLE
        return Action.NONE if known.replica is RS.CORRUPT else Action.MARK_CORRUPT
    if remote.found is Found.PARTS:
        # Delivered parts wait for the others: safepoint.ops.assemble (timeouts) and retention own them.
        return Action.NONE
    if remote.found is Found.PARTIAL:
        if known.replica is RS.VERIFIED and known.state is not CS.PRUNED:
            return Action.MARK_MISSING  # the marker vanished: its objects are kept for the repair to reuse
        ages = [a for a in (remote.age_s, known.replica_age_s if known.replica is RS.PENDING else None)
                if a is not None]
        return Action.REMOVE_PARTIAL if ages and min(ages) >= grace_s else Action.KEEP_PARTIAL
    # ABSENT
    if known.replica is RS.VERIFIED:
        return Action.MARK_MISSING
    if known.replica is RS.PENDING and known.replica_age_s is not None and known.replica_age_s >= grace_s:
        return Action.ABANDON_REPLICA
    return Action.NONE


class Settle(str, Enum):
    NONE = "none"
    FINISH = "finish"        # in flight (stale) or corrupt, with a verified replica: validate from it
    ABANDON = "abandon"      # in flight (stale), no verified replica: back to committed
    NO_COPY = "no_copy"      # verified, no verified replica: corrupt unless the local copy verifies

    def __str__(self) -> str:
        return self.value


def plan_checkpoint(state: CS, state_age_s: float, verified_replicas: int, grace_s: float,
                    world_size: int = 1) -> Settle:
    """What to do with a checkpoint's state once its replicas are reconciled (pure).

    Multi-node checkpoints in flight belong to safepoint.ops.assemble (its timeouts and assembly),
    not to us.
    """
    if state in IN_FLIGHT:
        if world_size > 1 or state_age_s < grace_s:
            return Settle.NONE
        return Settle.FINISH if verified_replicas else Settle.ABANDON
    if state in (CS.CORRUPT, CS.COMMITTED) and verified_replicas and world_size == 1:
        # Corrupt because its copies went bad, and a repair or a confirmed replica brought one back;
        # or committed with a replica adopted or confirmed from a destination: validate it.
        return Settle.FINISH
    if state is CS.VERIFIED and not verified_replicas:
        return Settle.NO_COPY
    return Settle.NONE


def needs_repair(state: CS, replicas: Iterable[RS]) -> bool:
    """A checkpoint that is (or was, until its copies went bad) good, with a bad replica."""
    return state in (CS.VERIFIED, CS.CORRUPT) and any(r in REPAIRABLE for r in replicas)



def observe(objects: Mapping[str, tuple[int, float | None]], folder_mtime: float | None, now: float, *,
            manifest_files: Sequence[FileEntry] | None = None, manifest_blake3: str | None = None,
            broken: bool = False) -> Remote:
    """What a listing of <run>/<step>/ (relpath -> (size, mtime)) and its control files add up to.

    `manifest_files`/`manifest_blake3`: the manifest the marker binds, when it loads; `broken`: a
    marker whose control files do not load.
    """
    if MARKER_NAME not in objects and not objects and folder_mtime is None:
        return Remote(Found.ABSENT)
    mtimes = [m for _s, m in objects.values() if m is not None]
    newest = max(mtimes) if mtimes else folder_mtime
    age = None if newest is None else max(0.0, now - newest)
    if MARKER_NAME not in objects:
        parts = any(p.startswith(PARTS_DIR + "/") and p.endswith("/" + MARKER_NAME) for p in objects)
        return Remote(Found.PARTS if parts else Found.PARTIAL, age_s=age)
    if broken or manifest_files is None:
        return Remote(Found.BROKEN, age_s=age)
    complete, mismatch = True, False
    for f in manifest_files:
        got = objects.get(f.path)
        if got is None:
            complete = False
        elif got[0] != f.size:
            complete, mismatch = False, True
    return Remote(Found.COMMITTED, manifest_blake3, age, complete, mismatch)
