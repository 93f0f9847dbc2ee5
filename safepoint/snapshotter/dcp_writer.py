"""A torch.distributed.checkpoint StorageWriter whose checkpoints come out Safepoint-committed.

    writer = SafepointWriter("/nvme/ckpt/run-7/500", run="run-7", step=500)
    dcp.save(state, storage_writer=writer)            # or dcp.async_save(state, storage_writer=writer)

It is DCP's own FileSystemWriter (same files, same staging for async_save) with one addition: on
the coordinator, after DCP has written `.metadata` (that is, after every rank's data files, since
DCP gathers the write results first), `finish()` commits the folder with `safepoint.commit`: hash,
fsync, MANIFEST.json, then COMMITTED, with `world_size` set to the number of ranks that wrote. A
folder that is already committed is refused, never overwritten. `step=None` takes the step from the
folder's name (`.../<run>/<step>`), so one writer can serve many `dcp.save(checkpoint_id=...)`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from safepoint.core.errors import CommitError, UsageError
from safepoint.core.format import MARKER_NAME, Manifest, check_run, check_step
from safepoint.local.commit import commit

__all__ = ["SafepointWriter"]


class SafepointWriter(FileSystemWriter):
    """FileSystemWriter + a Safepoint commit by the coordinator once `.metadata` is written."""

    def __init__(
        self, path: str | os.PathLike, *, run: str, step: int | None = None,
        parent: tuple[str, int] | None = None, meta: dict[str, Any] | None = None, **kwargs: Any,
    ) -> None:
        """kwargs go to FileSystemWriter (thread_count, sync_files, cache_staged_state_dict, ...)."""
        super().__init__(path, **kwargs)
        self.run = check_run(run)
        self.fixed_step = None if step is None else check_step(step)
        self.parent = parent
        self.meta = {"writer": "torch.distributed.checkpoint", **(meta or {})}
        self.manifest: Manifest | None = None   # set on the coordinator once committed

    def step_for(self, path: str | os.PathLike) -> int:
        if self.fixed_step is not None:
            return self.fixed_step
        name = Path(path).name
        if not name.isdigit():
            raise UsageError(f"{os.fspath(path)}: pass step=, or name the folder after the step (.../<run>/<step>)")
        return check_step(int(name))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not self.use_collectives:
            raise UsageError("SafepointWriter needs use_collectives=True: one coordinator commits the folder")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if (Path(self.path) / MARKER_NAME).exists():
            raise CommitError(f"{self.path} is already committed; refusing to overwrite a committed snapshot")
        self.step_for(self.path)  # fail before writing anything, not after
        return super().prepare_local_plan(plan)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)  # every rank's files are written; now .metadata is too
        self.manifest = commit(self.path, self.run, self.step_for(self.path), parent=self.parent,
                               world_size=max(1, len(results)), meta=self.meta)
