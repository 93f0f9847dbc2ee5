"""Cutting a checkpoint's files into batches for hashing fan-out: pure, deterministic.

A batch is the unit one verify step hashes (one Prefect task when a flow runs it). A task per tiny
file would cost more than it saves (~5 ms of Prefect overhead per task), hence the batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from safepoint.core.format import FileEntry

DEFAULT_BATCH_BYTES = 4 * 2**30
DEFAULT_BATCH_FILES = 256


def batches(files: Sequence[FileEntry], batch_bytes: int = DEFAULT_BATCH_BYTES,
            batch_files: int = DEFAULT_BATCH_FILES) -> list[list[FileEntry]]:
    """Cut files into batches of at most `batch_bytes` (a bigger file is alone) and `batch_files`.

    Largest files first into the lightest batch (LPT), so batches come out balanced; then each
    batch is sorted by path and batches are ordered by their first path: deterministic.
    """
    if batch_bytes < 1 or batch_files < 1:
        raise ValueError("batch_bytes and batch_files must be >= 1")
    total = sum(f.size for f in files)
    n = min(len(files), max(1, -(-total // batch_bytes), -(-len(files) // batch_files)))
    bins: list[list[FileEntry]] = [[] for _ in range(n)]
    loads = [0] * n
    for f in sorted(files, key=lambda f: (-f.size, f.path)):
        candidates = [i for i in range(n) if len(bins[i]) < batch_files] or list(range(n))
        i = min(candidates, key=lambda j: (loads[j], j))
        bins[i].append(f)
        loads[i] += f.size
    out = [sorted(b, key=lambda f: f.path) for b in bins if b]
    return sorted(out, key=lambda b: b[0].path)


def batch_limits(fanout: Mapping[str, Any]) -> tuple[int, int]:
    """`[fanout] batch_bytes` and `batch_files` (the settings of safepoint.core.config.fanout_settings)."""
    return (int(fanout.get("batch_bytes", DEFAULT_BATCH_BYTES)),
            int(fanout.get("batch_files", DEFAULT_BATCH_FILES)))
