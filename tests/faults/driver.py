"""A fork server that runs pipeline operations in child processes the tests SIGKILL at random points.

Importing Safepoint, torch and SQLAlchemy takes seconds; forking takes milliseconds. The server
(`python -m tests.faults.driver CATALOG_URL`) imports everything once, then reads one JSON command
per line on stdin, forks a child per command, prints `{"pid": ...}` at once (so the test can
`kill -9` the child whenever it likes) and `{"pid": ..., "exit": ...}` when the child ends (exit
-9: killed). The child runs the plain pipeline functions (no Prefect), exactly what a worker runs.

A child can also kill itself at the N-th traced I/O event (`kill_at`): fsync, rename, link,
unlink, rmdir, and the begin and commit of every catalog transaction. Counting events instead of
time makes the kill land on every kind of step with the same odds, and makes a failure
reproducible from its number. Phases (commit, replicate, validate, prune) are
appended to `phase_file` as they start, so the test knows where the kill landed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from safepoint.ops.ingest import REPLICATE, VALIDATE
from safepoint.ops.runner import Inline

TRACED_OS = ("fsync", "replace", "rename", "link", "unlink", "rmdir")


class Tracer:
    """Counts I/O events; SIGKILLs its own process at event number `kill_at` (before or after it)."""

    def __init__(self, kill_at: int | None, after: bool = False):
        self.kill_at, self.after = kill_at, after
        self.count = 0
        self.lock = threading.Lock()
        self.last = ""

    def tick(self, name: str) -> None:
        with self.lock:
            self.count += 1
            self.last = name
            if self.kill_at is not None and self.count >= self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        import sqlalchemy as sa
        from sqlalchemy.orm import Session

        for name in TRACED_OS:
            real = getattr(os, name)
            setattr(os, name, self._wrap(name, real))
        sa.event.listen(Session, "after_begin", lambda *a: self.tick("db.begin"))
        sa.event.listen(Session, "before_commit", lambda *a: self.tick("db.commit"))

    def _wrap(self, name: str, real: Any) -> Any:
        def traced(*args: Any, **kwargs: Any) -> Any:
            if not self.after:
                self.tick(name)
            out = real(*args, **kwargs)
            if self.after:
                self.tick(name)
            return out

        traced.__wrapped__ = real  # type: ignore[attr-defined]
        return traced


class Phases:
    def __init__(self, path: str | None):
        self.path = path

    def __call__(self, name: str) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(name + "\n")


class Traced(Inline):
    """The inline step runner, announcing each ingest step before it runs (what the kill points key on)."""

    # the ingest's two steps (safepoint.ops.ingest); registering runs inside the ingest, before them
    LABELS = {REPLICATE: "replicate", VALIDATE: "validate"}

    def __init__(self, phase: Phases):
        self.phase = phase

    def run(self, name: str, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        if name in self.LABELS:
            self.phase(self.LABELS[name])
        return super().run(name, fn, *args, **kwargs)

    def map(self, name: str, fn: Any, calls: Any, /) -> list[Any]:
        if name in self.LABELS:
            self.phase(self.LABELS[name])
        return super().map(name, fn, calls)


# -- operations ----------------------------------------------------------------------------------

def op_lifecycle(*, folder: str, run: str, step: int, dest: str, catalog_url: str, keep_last: int,
                 phase: Phases) -> dict[str, Any]:
    """What a training node's Safepoint does for one checkpoint: commit, ingest, then retention."""
    from safepoint.catalog.store import open_catalog
    from safepoint.local.commit import commit
    from safepoint.ops import ingest as pipeline
    from safepoint.ops.prune import prune
    from safepoint.rules.retention import KeepLastN

    phase("commit")
    commit(folder, run, step)
    catalog = open_catalog(catalog_url)
    out = pipeline.ingest(folder, [dest], catalog, runner=Traced(phase))
    phase("prune")
    res = prune(catalog, [run], KeepLastN(keep_last), now=datetime.now(timezone.utc))
    phase("done")
    return {"state": str(out.state), "message": out.message, "pruned": [s for _r, s in res.pruned],
            "prune_errors": res.errors}


def op_ingest(*, folder: str, dest: list[str] | str, catalog_url: str, phase: Phases) -> dict[str, Any]:
    from safepoint.catalog.store import open_catalog
    from safepoint.ops import ingest as pipeline

    out = pipeline.ingest(folder, [dest] if isinstance(dest, str) else dest, open_catalog(catalog_url),
                          runner=Traced(phase))
    return {"state": str(out.state), "message": out.message, "replicas": out.replicas}


def op_prune(*, run: str, catalog_url: str, keep_last: int, phase: Phases) -> dict[str, Any]:
    from safepoint.catalog.store import open_catalog
    from safepoint.ops.prune import prune
    from safepoint.rules.retention import KeepLastN

    phase("prune")
    res = prune(open_catalog(catalog_url), [run], KeepLastN(keep_last), now=datetime.now(timezone.utc))
    return {"pruned": [s for _r, s in res.pruned], "skipped": [s for _r, s in res.skipped], "errors": res.errors}


def op_crash_before_catalog(*, folder: str, dest: str, catalog_url: str, phase: Phases) -> dict[str, Any]:
    """Ingest, but die (SIGKILL) the moment the replica is committed at the destination and the
    catalog is about to record it verified: the "crash between upload and catalog commit"."""
    from safepoint.catalog.store import Catalog
    from safepoint.core.states import ReplicaState

    real = Catalog.set_replica

    def set_replica(self: Catalog, checkpoint_id: int, url: str, destination: str, state: Any, **kw: Any) -> bool:
        if ReplicaState(state) is ReplicaState.VERIFIED:
            phase("crash")
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, checkpoint_id, url, destination, state, **kw)

    Catalog.set_replica = set_replica  # type: ignore[method-assign]
    return op_ingest(folder=folder, dest=dest, catalog_url=catalog_url, phase=phase)


def op_ingest_hostile(*, folder: str, dest: str, catalog_url: str, phase: Phases) -> dict[str, Any]:
    """Ingest a checkpoint someone handed us: a refusal is a result, not a crash."""
    from safepoint.core.errors import SafepointError

    try:
        return op_ingest(folder=folder, dest=dest, catalog_url=catalog_url, phase=phase)
    except SafepointError as e:
        return {"state": None, "error": f"{type(e).__name__}: {e}"}


def op_commit_ingest(*, folder: str, run: str, step: int, dest: str, catalog_url: str, phase: Phases
                     ) -> dict[str, Any]:
    """Commit then ingest, timing each (the 100,000-file case)."""
    from safepoint.catalog.store import open_catalog
    from safepoint.local.commit import commit
    from safepoint.ops import ingest as pipeline

    t0 = time.perf_counter()
    phase("commit")
    m = commit(folder, run, step)
    t1 = time.perf_counter()
    out = pipeline.ingest(folder, [dest], open_catalog(catalog_url))
    t2 = time.perf_counter()
    return {"files": len(m.files), "bytes": m.total_bytes, "commit_s": round(t1 - t0, 2),
            "ingest_s": round(t2 - t1, 2), "state": str(out.state), "message": out.message}


OPS = {"lifecycle": op_lifecycle, "commit_ingest": op_commit_ingest, "ingest_hostile": op_ingest_hostile,
       "ingest": op_ingest, "prune": op_prune, "crash_before_catalog": op_crash_before_catalog}


def _child(cmd: dict[str, Any]) -> int:
    os.dup2(2, 1)  # stdout is the protocol channel: the child's prints go to the log
    tracer = Tracer(cmd.get("kill_at"), bool(cmd.get("after")))
    if cmd.get("trace") or cmd.get("kill_at") is not None:
        tracer.install()
    phase = Phases(cmd.get("phase_file"))
    args = dict(cmd.get("args", {}))
    start_at = args.pop("start_at", None)  # a wall-clock barrier, so that racing children start together
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))
    import resource

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = OPS[cmd["op"]](**args, phase=phase)
    result["events"] = tracer.count
    # Peak resident memory this operation added (KiB; ru_maxrss starts at the parent's at fork).
    result["peak_rss_growth_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    if cmd.get("result"):  # whole or absent: a kill between the create and the write left it empty
        out = Path(cmd["result"])
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(result, default=str))
        os.replace(tmp, out)
    return 0


def serve(catalog_url: str | None) -> None:
    # Import everything a child needs, once (the point of the fork server).
    import torch  # noqa: F401

    import safepoint.ops.ingest  # noqa: F401
    import safepoint.ops.prune  # noqa: F401
    import safepoint.ops.reconcile  # noqa: F401
    import safepoint.rules.retention  # noqa: F401
    import safepoint.validation.validate  # noqa: F401
    from safepoint.catalog.store import open_catalog

    if catalog_url:
        open_catalog(catalog_url)  # migrate once; forked children reuse the knowledge, not the connection
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "exit":
            break
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                code = _child(cmd)
            except BaseException:  # noqa: BLE001 - report anything, then exit without cleanup
                traceback.print_exc(file=sys.stderr)
                code = 3
            finally:
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1] if len(sys.argv) > 1 else None)
