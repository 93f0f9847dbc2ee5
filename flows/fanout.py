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

from typing import Any

from safepoint.core.config import Config, fanout_settings
from safepoint.core.errors import UsageError


def task_runner(config: Config | None = None) -> Any:
    """The Prefect task runner named by `[fanout] runner`: threads (default) or Dask."""
    sec = fanout_settings(config)
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
