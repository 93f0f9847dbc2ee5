"""Is a multi-node checkpoint complete? A pure decision over ranks and delivery times.

A checkpoint written by many nodes is complete when every expected rank has delivered its part.
Nothing ever waits for the missing ranks: the last part to arrive finds the set complete, and a
periodic check calls `assess` to give up on a set that stayed partial past its timeout. A late
part after that re-opens the set (see `safepoint.ops.assemble`).

Once assembled, the checkpoint is one object: `copy_problem` says whether a copy's manifest is the
whole checkpoint the catalog recorded, so restore, verify and scrub refuse a partial or forged copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum


class Completeness(str, Enum):
    COMPLETE = "complete"        # every expected rank delivered
    WAITING = "waiting"          # some ranks missing, still within the timeout
    INCOMPLETE = "incomplete"    # some ranks missing and the timeout has passed

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Assessment:
    status: Completeness
    expected: tuple[int, ...]
    missing: tuple[int, ...]
    deadline: datetime | None     # when WAITING turns INCOMPLETE (None: nothing delivered yet)

    @property
    def complete(self) -> bool:
        return self.status is Completeness.COMPLETE

    def summary(self) -> str:
        if self.complete:
            return f"all {len(self.expected)} ranks delivered"
        shown = ", ".join(str(r) for r in self.missing[:16]) + (" ..." if len(self.missing) > 16 else "")
        n = len(self.expected)
        return f"{len(self.missing)} of {n} ranks missing ({shown}); {self.status}"


def assess(
    world_size: int,
    delivered: Mapping[int, datetime],
    now: datetime,
    timeout: timedelta,
    *,
    expected: Iterable[int] | None = None,
) -> Assessment:
    """Decide from `delivered` (rank -> delivery time) whether the set is complete.

    `expected` defaults to ranks 0..world_size-1. The timeout counts from the *first* delivery:
    a rank that is more than `timeout` behind the first one is considered lost. Deliveries of
    ranks outside `expected` are ignored. With nothing delivered there is no deadline (nothing
    to time out: the checkpoint does not exist yet).
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    exp = tuple(sorted(set(range(world_size) if expected is None else expected)))
    if any(r < 0 or r >= world_size for r in exp):
        raise ValueError("expected ranks must lie in [0, world_size)")
    got = {r: t for r, t in delivered.items() if r in exp}
    missing = tuple(r for r in exp if r not in got)
    if not missing:
        return Assessment(Completeness.COMPLETE, exp, (), None)
    if not got:
        return Assessment(Completeness.WAITING, exp, missing, None)
    deadline = min(got.values()) + timeout
    status = Completeness.INCOMPLETE if now >= deadline else Completeness.WAITING
    return Assessment(status, exp, missing, deadline)


FileRow = tuple[str, int, str]   # path, size, BLAKE3


def missing_ranks(held: Iterable[int], world_size: int) -> tuple[int, ...]:
    have = set(held)
    return tuple(r for r in range(world_size) if r not in have)


def copy_problem(world_size: int, held: Iterable[int], digest: str, files: Iterable[FileRow], *,
                 recorded: str | None, recorded_files: Iterable[FileRow] | None = None) -> str | None:
    """Why a copy's manifest is not the checkpoint the catalog recorded; None when it is.

    `recorded`: the BLAKE3 of the whole manifest (for a multi-node checkpoint, the merged one the
    last part assembled). Without it (a set assembled before the digest was recorded) the copy's
    files must be the catalog's per-file rows. Either way it must hold every rank: a copy that
    lacks one is never the checkpoint, whatever its marker binds.
    """
    if recorded is not None and digest != recorded:
        return "its MANIFEST.json is not the one the catalog recorded (a stale or forged copy)"
    if recorded is None and recorded_files is not None and set(files) != set(recorded_files):
        return "its manifest lists other files than the catalog recorded (a stale or forged copy)"
    missing = missing_ranks(held, world_size)
    if missing:
        shown = ", ".join(str(r) for r in missing[:16]) + (" ..." if len(missing) > 16 else "")
        return f"its manifest lacks rank(s) {shown} of {world_size}"
    return None
