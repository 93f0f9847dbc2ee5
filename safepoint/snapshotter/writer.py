"""The background writer: staged chunks to a durable safetensors file, hashed on the way, then committed.

One writer thread takes messages in the order save() sent them (begin, chunk..., end or abort).
For each chunk it waits for the copy's CUDA events, hands the bytes to an I/O thread (pwrite at the
chunk's offset) and hashes the same bytes itself with BLAKE3, in file order, while the write runs
(both release the GIL); the buffer goes back to the pool when both are done. So the digest
describes exactly the bytes that were frozen, and nothing is read back from disk.

At the end the file is fsynced and renamed from its temporary name, and a commit thread commits
(see Snapshotter._commit), so writing the next save can start while this one commits. Failures are
recorded on the save's handle, never dropped: a failed job discards its remaining chunks, removes
its temporary file and commits nothing. If the writer thread itself dies, every pending save fails
and staging stops waiting for buffers.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safepoint.core.format import TMP_PREFIX, FileEntry, Manifest
from safepoint.core.hashing import new_hasher
from safepoint.local.atomic import publish
from safepoint.snapshotter.errors import SnapshotError
from safepoint.snapshotter.layout import FileLayout
from safepoint.snapshotter.pool import BufferPool
from safepoint.snapshotter.staging import Chunk

BEGIN, CHUNK, END, ABORT = "begin", "chunk", "end", "abort"


@dataclass
class SaveStats:
    """What one save cost. Times in seconds; `stall_s` is what training waited for."""

    step: int
    tensors: int = 0
    bytes: int = 0                 # size of this rank's file
    stall_s: float = 0.0           # save() call to return
    backpressure_s: float = 0.0    # of the stall, waiting for the writer to return a buffer
    guard_wait_s: float = 0.0      # of that, waiting because the memory floor refused to grow the pool
    deferred: bool = False         # the whole state fit in free buffers: the writer started after staging
    drain_s: float = 0.0           # writer: first chunk to every buffer written and hashed (drain rate = bytes/drain_s)
    write_s: float = 0.0           # writer: first chunk to file durable (fsync and rename included)
    commit_s: float = 0.0          # rendezvous and commit
    to_committed_s: float = 0.0    # save() call to committed (or, on other ranks, to the marker seen)
    pool_high_water: int = 0       # bytes of buffers in use at most, since the pool was created


@dataclass
class Job:
    """One save on its way to disk."""

    folder: Path
    name: str                      # the rank's file name in the folder
    layout: FileLayout
    on_written: Callable[[Job, FileEntry], Manifest | None]
    handle: Any                    # SaveHandle
    stats: SaveStats
    t0: float                      # perf_counter() at the save() call
    release: threading.Event = field(default_factory=threading.Event)  # the writer may drain chunks
    error: BaseException | None = None
    fd: int | None = None
    hasher: Any = None
    offset: int = 0
    started: float | None = None
    futures: list[Future] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def tmp_path(self) -> Path:
        return self.folder / f"{TMP_PREFIX}{self.name}"

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = exc
        self.release.set()

    @property
    def failed(self) -> bool:
        return self.error is not None


class _BothDone:
    """Releases a buffer when the hash and the write of its chunk have both finished."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._left, self._fn, self._lock = 2, fn, threading.Lock()

    def done(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._fn()


class Writer:
    def __init__(self, pool: BufferPool, *, write_threads: int = 2) -> None:
        self.pool = pool
        self.dead: BaseException | None = None
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: set[int] = set()
        self._open: dict[int, Job] = {}
        self._jobs_lock = threading.Lock()
        self._io = ThreadPoolExecutor(max(1, write_threads), thread_name_prefix="safepoint-io")
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="safepoint-commit")
        self._thread = threading.Thread(target=self._run, name="safepoint-writer", daemon=True)
        self._thread.start()

    # -- the staging side ---------------------------------------------------------------------

    def check_alive(self) -> None:
        if self.dead is not None or not self._thread.is_alive():
            raise SnapshotError(f"the snapshot writer thread died: {self.dead!r}") from self.dead

    def begin(self, job: Job) -> None:
        self.check_alive()
        with self._jobs_lock:
            self._open[id(job)] = job
        self._q.put((BEGIN, job, None))

    def chunk(self, job: Job, chunk: Chunk) -> None:
        if self.dead is not None:
            self._discard(chunk)
            self.check_alive()
        self._q.put((CHUNK, job, chunk))

    def end(self, job: Job) -> None:
        job.release.set()
        self._q.put((END, job, None))

    def abort(self, job: Job, exc: BaseException) -> None:
        job.fail(SnapshotError(f"staging failed: {exc!r}"))
        self._q.put((ABORT, job, None))

    def stop(self, timeout: float | None = None) -> None:
        self._q.put(None)
        self._thread.join(timeout)
        self._io.shutdown(wait=True)
        self._committer.shutdown(wait=True)

    # -- the writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                msg = self._q.get()
                if msg is None:
                    return
                self._dispatch(msg)
        except BaseException as e:  # the thread itself failed: fail everything, never hang
            self._die(e)

    def _dispatch(self, msg: tuple[str, Job, Chunk | None]) -> None:
        kind, job, chunk = msg
        if kind == CHUNK:
            assert chunk is not None
            self._chunk(job, chunk)
        elif kind == BEGIN:
            try:
                self._begin(job)
            except Exception as e:
                job.fail(e)
        else:
            self._end(job)

    def _begin(self, job: Job) -> None:
        job.fd = os.open(job.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        job.hasher = new_hasher(job.layout.total_bytes)
        self._write_chunk(job.fd, memoryview(job.layout.header), 0)
        job.hasher.update(job.layout.header)
        job.offset = len(job.layout.header)

    def _write_chunk(self, fd: int, data: memoryview, offset: int) -> None:
        """pwrite all of `data` at `offset` (a seam for failure-injection tests)."""
        while data:
            n = os.pwrite(fd, data, offset)
            data, offset = data[n:], offset + n

    def _discard(self, chunk: Chunk) -> None:
        chunk.wait_ready()  # a DMA may still target the buffer
        self.pool.release(chunk.buffer)

    def _chunk(self, job: Job, chunk: Chunk) -> None:
        """Write and hash one chunk. A failure fails this save only; the writer goes on with the next."""
        if not job.release.is_set():
            job.release.wait()  # deferred: the state fits in the pool; let staging have the machine
        if job.failed:
            self._discard(chunk)
            return
        if job.started is None:
            job.started = time.perf_counter()
        try:
            chunk.wait_ready()
            data = chunk.buffer.view(chunk.nbytes)
            offset, job.offset = job.offset, job.offset + chunk.nbytes
            both = _BothDone(lambda: self.pool.release(chunk.buffer))

            def wrote(f: Future) -> None:
                if f.exception() is not None:
                    job.fail(f.exception())
                both.done()

            fut = self._io.submit(self._write_chunk, job.fd, data, offset)
        except Exception as e:
            job.fail(e)
            self.pool.release(chunk.buffer)
            return
        fut.add_done_callback(wrote)
        job.futures.append(fut)
        try:
            job.hasher.update(data)
        except Exception as e:
            job.fail(e)
        finally:
            both.done()

    def _cleanup(self, job: Job) -> None:
        wait_futures(job.futures)
        if job.fd is not None:
            try:
                os.close(job.fd)
            except OSError:
                pass
            job.fd = None
        try:
            job.tmp_path.unlink(missing_ok=True)
        except OSError:
            pass

    def _end(self, job: Job) -> None:
        try:
            if not job.failed:
                wait_futures(job.futures)
                job.stats.drain_s = time.perf_counter() - (job.started or time.perf_counter())
            if not job.failed and job.offset != job.layout.total_bytes:
                job.fail(SnapshotError(f"staged {job.offset} bytes, expected {job.layout.total_bytes}"))
            if job.failed:
                raise job.error  # type: ignore[misc]
            assert job.fd is not None
            os.fsync(job.fd)  # a failed fsync is final: the file is removed, nothing is committed
            os.close(job.fd)
            job.fd = None
            publish(job.tmp_path, job.folder / job.name, sync=False)  # fsynced above; rename, fsync the folder
            job.stats.write_s = time.perf_counter() - (job.started or time.perf_counter())
            entry = FileEntry(job.name, job.layout.total_bytes, job.hasher.hexdigest())
        except BaseException as e:
            job.fail(e)
            self._cleanup(job)
            self._finish(job, None, job.error)
            return
        with self._jobs_lock:  # from here the commit thread owns the job; a dying writer leaves it alone
            self._open.pop(id(job), None)
        self._committer.submit(self._commit, job, entry)

    def _commit(self, job: Job, entry: FileEntry) -> None:
        t = time.perf_counter()
        try:
            manifest = job.on_written(job, entry)
        except BaseException as e:
            job.stats.commit_s = time.perf_counter() - t
            self._finish(job, None, e)
            return
        job.stats.commit_s = time.perf_counter() - t
        job.stats.to_committed_s = time.perf_counter() - job.t0
        self._finish(job, manifest, None)

    def _finish(self, job: Job, manifest: Manifest | None, error: BaseException | None) -> None:
        with self._jobs_lock:
            self._open.pop(id(job), None)
        job.handle._resolve(manifest, error)

    def _drain_queue(self) -> None:
        """Return every queued buffer, so staging never waits for one that cannot come back."""
        while True:
            try:
                msg = self._q.get_nowait()
            except queue.Empty:
                return
            if msg is not None and msg[0] == CHUNK:
                self._discard(msg[2])

    def _die(self, exc: BaseException) -> None:
        err = SnapshotError(f"the snapshot writer thread died: {exc!r}; nothing was committed")
        err.__cause__ = exc
        self._drain_queue()
        with self._jobs_lock:
            jobs = list(self._open.values())
        for job in jobs:  # clean up first, so whoever sees the writer dead also sees nothing left behind
            job.fail(err)
            self._cleanup(job)
            self._finish(job, None, err)
        self.dead = exc
        self._drain_queue()
