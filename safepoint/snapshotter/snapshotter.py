"""Snapshotter: an async save for training loops that is isolated, bounded in host memory, and committed.

    snap = Snapshotter("/nvme/ckpt", "run-7", budget_bytes=16 << 30)
    for step in ...:
        train_step()
        if step % 500 == 0:
            handle = snap.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    snap.close()          # waits for the last save; raises if any save failed

`save()` returns once every tensor has been copied into the pool of staging buffers and the copies
have completed, so the next optimizer step can mutate the tensors. A background writer writes one
safetensors file per rank into `<root>/<run>/<step>/`, hashes the staged bytes, and commits the
folder with the same MANIFEST.json and COMMITTED as `safepoint commit` (docs/format.md), so the
ingest pipeline picks it up. A failed save raises on `handle.wait()` or, if nobody waited for it,
on the next `save()` / `wait()` / `close()`: never silently.

Host memory: the staging pool holds at most `budget_bytes`. A state larger than that is staged
chunk by chunk while the writer drains buffers to disk (save() then blocks about as long as the
disk needs for the excess). Allocating the pool never takes MemAvailable below `memory_floor` of
RAM: an up-front pool that would is refused (MemoryFloorError); a pool grown on demand
(`preallocate=False`) stops growing and staging waits for buffers instead, and the delays are
reported in the save's stats and logged.

Multi-rank: every rank writes its own shard into the shared folder; the committer rank commits
once all ranks have announced theirs through the filesystem (rendezvous.py), with a timeout and
no collective, so a dead rank cannot hang the others: the save fails and nothing is committed.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from safepoint.core.format import MARKER_NAME, FileEntry, Manifest, check_run, check_step
from safepoint.local.commit import commit
from safepoint.snapshotter.errors import SnapshotError
from safepoint.snapshotter.layout import META_FORMAT, META_VERSION, plan_file, shard_name
from safepoint.snapshotter.memory import MemoryGuard, read_meminfo
from safepoint.snapshotter.pool import BufferPool
from safepoint.snapshotter.rendezvous import remove_done, wait_for_marker, wait_for_ranks, write_done
from safepoint.snapshotter.staging import Stager
from safepoint.snapshotter.structure import STRUCTURE_VERSION, flatten
from safepoint.snapshotter.writer import Job, SaveStats, Writer

log = logging.getLogger("safepoint.snapshotter")

__all__ = ["SaveHandle", "SaveStats", "Snapshotter", "default_rank_world", "default_session"]


def default_rank_world() -> tuple[int, int]:
    """(rank, world_size) from an initialized process group, else $RANK/$WORLD_SIZE, else (0, 1)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - no distributed support at all
        pass
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def default_session() -> str:
    """Identifies one attempt of a job on every rank (torchrun sets these); '' outside torchrun."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return f"{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}" if run_id else ""


class SaveHandle:
    """The outcome of one save(): done(), wait(), and its stats."""

    def __init__(self, step: int, folder: Path, rank: int, world_size: int, stats: SaveStats) -> None:
        self.step, self.folder, self.rank, self.world_size = step, folder, rank, world_size
        self.stats = stats
        self.manifest: Manifest | None = None
        self.error: BaseException | None = None
        self.observed = False  # the error was raised to the caller at least once
        self._event = threading.Event()

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._event.is_set()

    @property
    def committed(self) -> bool:
        return self.done() and self.error is None

    def wait(self, timeout: float | None = None) -> Manifest | None:
        """Block until committed; return the manifest (None on a rank that does not wait for the commit).

        Raises SnapshotError (or a subclass: CommitTimeout, MemoryFloorError) when the save failed,
        and TimeoutError when `timeout` passes first.
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"snapshot of step {self.step} not committed within {timeout} s")
        if self.error is not None:
            self.observed = True
            raise _as_snapshot_error(self.error, self.step)
        return self.manifest

    def _resolve(self, manifest: Manifest | None, error: BaseException | None) -> None:
        if self._event.is_set():
            return
        self.manifest, self.error = manifest, error
        if error is not None:
            log.error("snapshot of step %s failed: %s", self.step, error)
        self._event.set()


def _as_snapshot_error(err: BaseException, step: int) -> SnapshotError:
    if isinstance(err, SnapshotError):
        return err
    out = SnapshotError(f"snapshot of step {step} failed, nothing was committed: {err}")
    out.__cause__ = err
    return out


class _StopStaging(Exception):
    """The save already failed in the writer: stop copying, its handle carries the error."""


class Snapshotter:
    """Async, isolated, budgeted snapshots of a training state into `<root>/<run>/<step>/`."""

    def __init__(
        self,
        root: str | os.PathLike,
        run: str,
        *,
        budget_bytes: int,
        buffer_bytes: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        preallocate: bool = True,
        pin_memory: bool | None = None,
        memory_floor: float = 0.25,
        floor_timeout_s: float = 60.0,
        commit_timeout_s: float = 600.0,
        wait_for_commit: bool = True,
        committer_rank: int = 0,
        session: str | None = None,
        write_threads: int = 2,
        meminfo: Any = read_meminfo,
    ) -> None:
        """
        budget_bytes: hard cap on host staging memory (pinned or not). With budget >= the state size
            every save copies at full speed and returns; smaller budgets stage with backpressure.
        buffer_bytes: staging buffer size (a power of two; default about budget/8, 1-64 MiB).
        rank, world_size: default from torch.distributed, else $RANK/$WORLD_SIZE, else 0 and 1.
        preallocate: allocate (and pin) the whole pool now, so no save pays for it.
        pin_memory: pinned buffers (default: when CUDA is available).
        memory_floor: fraction of RAM that MemAvailable must keep when the pool is allocated.
        floor_timeout_s: how long staging waits for memory before MemoryFloorError (on-demand pools).
        commit_timeout_s: how long the committer waits for the other ranks (and they for the commit).
        wait_for_commit: ranks other than the committer wait for the marker before their save is done.
        session: the same string on every rank of one attempt (default from torchrun's environment).
        meminfo: a callable returning MemInfo (tests inject memory pressure here).
        """
        self.root = Path(root)
        self.run = check_run(run)
        dr, dw = default_rank_world()
        self.rank = dr if rank is None else rank
        self.world_size = dw if world_size is None else world_size
        if not (self.world_size >= 1 and 0 <= self.rank < self.world_size and 0 <= committer_rank < self.world_size):
            raise ValueError(f"bad rank {self.rank} / committer {committer_rank} for world_size {self.world_size}")
        self.committer_rank = committer_rank
        self.commit_timeout_s = commit_timeout_s
        self.wait_for_commit = wait_for_commit
        self.session = default_session() if session is None else session
        self.guard = MemoryGuard(memory_floor, meminfo)
        self.pool = BufferPool(budget_bytes, buffer_bytes, pin=pin_memory, preallocate=preallocate, guard=self.guard,
                               floor_timeout_s=floor_timeout_s)
        self._stager = Stager(self.pool)
        self._writer = Writer(self.pool, write_threads=write_threads)
        self._lock = threading.Lock()
        self._handles: list[SaveHandle] = []
        self._closed = False

    # -- paths --------------------------------------------------------------------------------

    def folder(self, step: int) -> Path:
        return self.root / self.run / str(check_step(step))

    @property
    def shard_name(self) -> str:
        return shard_name(self.rank, self.world_size)

    # -- errors -------------------------------------------------------------------------------

    def _raise_unobserved(self) -> None:
        """Raise the first failure nobody has seen yet (a failed save never goes unnoticed)."""
        keep = []
        failed: SaveHandle | None = None
        for h in self._handles:
            if not h.done():
                keep.append(h)
            elif h.error is not None and not h.observed and failed is None:
                failed = h
        self._handles = keep
        if failed is not None:
            failed.observed = True
            raise _as_snapshot_error(failed.error, failed.step)  # type: ignore[arg-type]

    # -- save ---------------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, parent: tuple[str, int] | None = None,
             meta: dict[str, Any] | None = None) -> SaveHandle:
        """Stage `state` and return a handle; the tensors may be mutated as soon as this returns."""
        t0 = time.perf_counter()
        with self._lock:
            if self._closed:
                raise SnapshotError("this Snapshotter is closed")
            self._raise_unobserved()
            self._writer.check_alive()
            folder = self.folder(step)
            if (folder / MARKER_NAME).exists():
                raise SnapshotError(f"{folder} is already committed; refusing to overwrite a committed snapshot")
            if any(h.step == step and not h.done() for h in self._handles):
                raise SnapshotError(f"step {step} is already being saved; wait for it first")
            if parent is not None:
                check_run(parent[0])
                check_step(parent[1])
            try:
                json.dumps(meta or {}, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise SnapshotError(f"meta must be plain JSON: {e}") from None
            flat = flatten(state)
            header_meta = {
                "format": META_FORMAT, "format_version": META_VERSION, "structure_version": str(STRUCTURE_VERSION),
                "structure": json.dumps(flat.tree, separators=(",", ":"), allow_nan=False),
                "run": self.run, "step": str(step), "rank": str(self.rank), "world_size": str(self.world_size),
            }
            layout = plan_file([(n, t.dtype, tuple(t.shape)) for n, t in flat.tensors], header_meta)
            folder.mkdir(parents=True, exist_ok=True)
            if self.world_size > 1:
                remove_done(folder, self.rank)  # a stale announcement from a crashed attempt
            stats = SaveStats(step=step, tensors=len(flat.tensors), bytes=layout.total_bytes)
            handle = SaveHandle(step, folder, self.rank, self.world_size, stats)
            job = Job(folder=folder, name=self.shard_name, layout=layout, handle=handle, stats=stats, t0=t0,
                      on_written=lambda j, e: self._commit(j, e, parent=parent, meta=meta))
            stats.deferred = layout.data_bytes <= self.pool.available_bytes()
            if not stats.deferred:
                job.release.set()  # the writer drains while we stage: backpressure
            wait0, guard0 = self.pool.wait_s, self.pool.guard_wait_s
            refusals0 = self.guard.refusals
            self._writer.begin(job)

            def check() -> None:
                self._writer.check_alive()
                if job.failed:
                    raise _StopStaging()
                if not job.release.is_set():  # never wait for buffers a deferred writer would not return
                    job.release.set()

            try:
                self._stager.stage([flat.tensors[s.index][1] for s in layout.slots],
                                   lambda c: self._writer.chunk(job, c), check)
            except _StopStaging:
                pass
            except BaseException as e:
                self._writer.abort(job, e)
                raise
            self._writer.end(job)
            stats.stall_s = time.perf_counter() - t0
            stats.backpressure_s = self.pool.wait_s - wait0
            stats.guard_wait_s = self.pool.guard_wait_s - guard0
            stats.pool_high_water = self.pool.high_water_in_use
            if self.guard.refusals > refusals0 and self.guard.last_refusal is not None:
                log.warning("snapshot of step %s: the memory floor delayed staging by %.2f s (%s)", step,
                            stats.guard_wait_s, self.guard.last_refusal.message())
            self._handles.append(handle)
            return handle

    def _commit(self, job: Job, entry: FileEntry, *, parent: tuple[str, int] | None,
                meta: dict[str, Any] | None) -> Manifest | None:
        """Runs on the commit thread once this rank's file is durable."""
        step = job.stats.step
        meta = {"writer": "safepoint.Snapshotter", **(meta or {})}
        if self.world_size == 1:
            entries = [entry]
        else:
            write_done(job.folder, self.rank, self.world_size, self.session, [entry])
            if self.rank != self.committer_rank:
                return wait_for_marker(job.folder, self.commit_timeout_s, entry) if self.wait_for_commit else None
            entries = wait_for_ranks(job.folder, self.world_size, self.session, self.commit_timeout_s)
        manifest = commit(job.folder, self.run, step, parent=parent, world_size=self.world_size, meta=meta,
                          files=entries)
        if not set(entries) <= set(manifest.files):  # someone else committed this folder meanwhile
            raise SnapshotError(f"{job.folder} was committed by another writer with other bytes; "
                                "this save is not part of it")
        for r in range(self.world_size if self.world_size > 1 else 0):
            remove_done(job.folder, r)
        return manifest

    # -- lifecycle ----------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every save so far; raise the first failure not yet seen."""
        with self._lock:
            pending = list(self._handles)
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h._event.wait(left):
                raise TimeoutError(f"snapshot of step {h.step} still running")
        with self._lock:
            self._raise_unobserved()

    def close(self, timeout: float | None = None) -> None:
        """Wait for pending saves, stop the writer and free the pool; raise a failure nobody saw."""
        if self._closed:
            return
        try:
            self.wait(timeout)
        finally:
            self._closed = True
            self._writer.stop(timeout)
            self.pool.close()

    def __enter__(self) -> Snapshotter:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - the body's exception matters more
                log.exception("closing the Snapshotter after an error")

