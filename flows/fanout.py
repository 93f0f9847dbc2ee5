"""Spread hashing and validation of one very large checkpoint over a task runner.

The work is cut into batches of whole files (pure `batches`), each batch is one Prefect task, and
the runner decides where batches run: threads in the flow's process (the default, embedded), or a
Dask cluster through prefect-dask's DaskTaskRunner (`pip install 'safepoint[dask]'`), chosen in
config.toml:

    [fanout]
    runner = "dask"                  # "thread" (default) or "dask"
    address = "tcp://10.0.0.5:8786"  # an existing cluster; omitted: a local cluster of `workers`
    workers = 2
    batch_bytes = 4294967296         # ~4 GiB of files per task
    batch_files = 256

Dask workers must see the files they hash: a replica URL (s3://, a parallel file system), or a
local folder when the cluster is local. A task per tiny file would cost more than it saves
(~5 ms of Prefect overhead per task), hence the batches.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from safepoint.core.config import Config
from safepoint.core.errors import UsageError
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


def settings(config: Config | None) -> dict[str, Any]:
    sec = dict((config or Config()).section("fanout"))
    if os.environ.get("SAFEPOINT_FANOUT_RUNNER"):
        sec["runner"] = os.environ["SAFEPOINT_FANOUT_RUNNER"]
    if os.environ.get("SAFEPOINT_FANOUT_ADDRESS"):
        sec["address"] = os.environ["SAFEPOINT_FANOUT_ADDRESS"]
    return sec


def batch_limits(config: Config | None) -> tuple[int, int]:
    sec = settings(config)
    return int(sec.get("batch_bytes", DEFAULT_BATCH_BYTES)), int(sec.get("batch_files", DEFAULT_BATCH_FILES))


def task_runner(config: Config | None = None) -> Any:
    """The Prefect task runner named by `[fanout] runner`: threads (default) or Dask."""
    sec = settings(config)
    kind = str(sec.get("runner", "thread")).lower()
    if kind == "thread":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=int(sec.get("workers", 4)))
    if kind == "dask":
        try:
            from prefect_dask import DaskTaskRunner
        except ImportError:
            raise UsageError("[fanout] runner = 'dask' needs prefect-dask: pip install 'safepoint[dask]'") from None
        if sec.get("address"):
            return DaskTaskRunner(address=str(sec["address"]))
        return DaskTaskRunner(cluster_kwargs={
            "n_workers": int(sec.get("workers", 2)), "threads_per_worker": int(sec.get("threads_per_worker", 1)),
            "processes": True, "dashboard_address": None,
        })
    raise UsageError(f"[fanout] runner must be 'thread' or 'dask', not {kind!r}")
