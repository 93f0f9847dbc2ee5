"""Where this process resumed from: the lineage parent the integrations give the next checkpoint.

`safepoint.restore(...)` and the trainer integrations (a Trainer or Lightning resuming from a
sealed folder) note the checkpoint a process resumed from; each checkpoint an integration seals
afterwards names the point before it as its parent (the restored one first, then the one it sealed
last), so a resume from an older step shows as a branch in `safepoint lineage` and the consistency
rules compare each checkpoint with the one it really follows. A process that never resumed records
no parent, as before.
"""

from __future__ import annotations

import threading

__all__ = ["forget", "note_resumed", "note_sealed", "parent_for", "resumed_point"]

_lock = threading.Lock()
_point: tuple[str, int] | None = None


def note_resumed(run: str, step: int) -> None:
    """This process (re)starts from checkpoint (run, step)."""
    global _point
    with _lock:
        _point = (run, int(step))


def resumed_point() -> tuple[str, int] | None:
    with _lock:
        return _point


def parent_for(run: str, step: int) -> tuple[str, int] | None:
    """The parent of checkpoint (run, step) about to be sealed: the point this process went on from.

    None when it never resumed, and for a step that does not come after that point in the same run
    (a checkpoint cannot follow itself or a later one)."""
    with _lock:
        point = _point
    if point is None or (point[0] == run and step <= point[1]):
        return None
    return point


def note_sealed(run: str, step: int) -> None:
    """(run, step) was sealed: once a process resumed, the next checkpoint follows this one."""
    global _point
    with _lock:
        if _point is not None and (_point[0] != run or step > _point[1]):
            _point = (run, int(step))


def forget() -> None:
    """Back to a process that never resumed (tests; a new, unrelated run in the same process)."""
    global _point
    with _lock:
        _point = None
