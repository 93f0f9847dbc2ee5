"""Run untrusted-input work in a child process with memory, CPU-time and wall-clock limits.

Validation reads bytes someone else wrote; a bug or a hole in a loader must cost at most a bounded
amount of memory and time, and never the calling process (an ingest loop, a Prefect worker). So
`run_limited(fn, args, limits)` runs `fn(*args)` in a child and returns what it returned as plain
data (JSON: a compromised child cannot send back anything that runs), or the limit it hit:

- memory: `RLIMIT_AS` = the child's size at start + `memory_bytes` + the bytes of the files it may
  map (torch.save zip files are memory-mapped, which costs address space, not memory; validation
  streams, so `memory_bytes` does not grow with the checkpoint); the parent also watches the
  child's anonymous resident memory (RssAnon) against the same allowance, every 2 ms for the first
  half second and every 50 ms after: a forked child may reuse heap the caller had freed without
  mapping more, which `RLIMIT_AS` cannot see;
- CPU: `RLIMIT_CPU` = `cpu_seconds` + `cpu_seconds_per_gib` per GiB of input (SIGXCPU, then SIGKILL);
- wall clock: `wall_seconds` + `wall_seconds_per_gib` per GiB; past it the child is killed.

The work is named by its dotted path (`"package.module:function"`), so the caller need not import
what the child runs (the readers import torch). Where the children come from
(`sandbox_start_method = "auto"`):
- after `prestart()` (the CLI calls it first thing, before Prefect): from a fork server that imports
  the readers (`preload`) on another core while the caller imports Prefect and opens the catalog,
  so torch's import (seconds) is off the critical path of a small ingest;
- otherwise straight from the caller, which imports the work's module first, once, so every child
  inherits it (milliseconds per child, where a fresh interpreter or a fork server per process would
  import torch again). CPython re-creates its import and logging locks in a forked child, and the
  child turns logging off, so a lock another thread of the caller held (Prefect's log and event
  workers) is never waited for; the wall clock stays the backstop.
A caller whose main module a fork server cannot re-import (`python -`) is never given one.
"forkserver", "fork" and "spawn" can be chosen explicitly.
`note(text)` lets the child say what it is working on, so a limit names the file it stopped in.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from safepoint.core.errors import SafepointError, UsageError

GiB = 1 << 30
MiB = 1 << 20
_POLL_S = 0.05
# A child that allocates and frees within a few milliseconds is seen only by a fine watch; that
# costs the parent nothing measurable for the first moments, and the coarse one after.
_FINE_POLL_S, _FINE_FOR_S = 0.002, 0.5
_MAX_RESULT_BYTES = 1 << 30
_START_METHODS = ("auto", "forkserver", "spawn", "fork")


@dataclass(frozen=True)
class SandboxLimits:
    """`[validation]` keys `sandbox`, `sandbox_memory_bytes`, `sandbox_cpu_seconds`, ... (defaults below)."""

    enabled: bool = True
    memory_bytes: int = 2 * GiB          # memory the work may add to the child's start-up size
    cpu_seconds: int = 300
    cpu_seconds_per_gib: int = 60        # reading and auditing take about 1 CPU-second per GiB
    wall_seconds: int = 600
    wall_seconds_per_gib: int = 120      # i.e. slower than ~8 MiB/s is a stuck read, not a slow disk
    start_method: str = "auto"          # the fork server after prestart(), else fork from the caller
    preload: tuple[str, ...] = ("safepoint.validation.reading",)

    def cpu_limit(self, nbytes: int) -> int:
        return self.cpu_seconds + -(-self.cpu_seconds_per_gib * nbytes // GiB)

    def wall_limit(self, nbytes: int) -> int:
        return self.wall_seconds + -(-self.wall_seconds_per_gib * nbytes // GiB)


_INT_KEYS = {"sandbox_memory_bytes": "memory_bytes", "sandbox_cpu_seconds": "cpu_seconds",
             "sandbox_cpu_seconds_per_gib": "cpu_seconds_per_gib", "sandbox_wall_seconds": "wall_seconds",
             "sandbox_wall_seconds_per_gib": "wall_seconds_per_gib"}
SANDBOX_KEYS = frozenset({"sandbox", "sandbox_start_method", *_INT_KEYS})


def sandbox_limits_from(current: SandboxLimits, doc: dict[str, Any], *, where: str) -> SandboxLimits:
    """`current` with the sandbox keys of a `[validation]` table applied. Raises UsageError."""
    out = current
    if "sandbox" in doc:
        if not isinstance(doc["sandbox"], bool):
            raise UsageError(f"{where}: sandbox must be true or false, got {doc['sandbox']!r}")
        out = replace(out, enabled=doc["sandbox"])
    for key, attr in _INT_KEYS.items():
        if key in doc:
            v = doc[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UsageError(f"{where}: {key} must be a positive integer, got {v!r}")
            out = replace(out, **{attr: v})
    if "sandbox_start_method" in doc:
        v = doc["sandbox_start_method"]
        if v not in _START_METHODS:
            raise UsageError(f"{where}: sandbox_start_method must be one of {', '.join(_START_METHODS)}, got {v!r}")
        out = replace(out, start_method=v)
    return out


@dataclass
class Outcome:
    """What a limited run gave: `value` (plain data) when it finished, else `limit` or `error` says why."""

    value: Any = None
    limit: str | None = None        # "validation exceeded ..." when a limit stopped it
    error: str | None = None        # it crashed or failed without hitting a limit
    last_note: str | None = None    # what the child last said it was working on
    usage: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.limit is None and self.error is None


def human_bytes(n: int) -> str:
    return f"{n / GiB:g} GiB" if n >= GiB and n % (GiB // 4) == 0 else f"{n / MiB:.0f} MiB"


# ------------------------------------------------------------------------------------------ the child

_note_conn: Any = None


def note(text: str) -> None:
    """In a sandboxed child: report progress to the parent (no-op elsewhere)."""
    if _note_conn is not None:
        _note_conn.send_bytes(json.dumps({"note": text[:1000]}).encode())


def _vm(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


Work = Callable[..., Any] | str  # a module-level function, or its "package.module:function" path


def _resolve(work: Work) -> Callable[..., Any]:
    if callable(work):
        return work
    module, _, name = work.partition(":")
    return getattr(importlib.import_module(module), name)


def _child(conn: Any, work: Work, args: tuple, memory: int, cpu: int) -> None:
    global _note_conn
    _note_conn = conn
    logging.disable(logging.CRITICAL)  # no handler (and no lock a parent thread held at fork) is ever used here
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
    base = _vm("VmSize")
    conn.send_bytes(json.dumps({"start": _vm("RssAnon")}).encode())
    if base:
        resource.setrlimit(resource.RLIMIT_AS, (base + memory, base + memory))
    t0 = time.monotonic()
    try:
        value = _resolve(work)(*args)
        msg: dict[str, Any] = {"value": value}
    except MemoryError:
        value = None
        msg = {"memory": True}
    except BaseException as e:  # a bug is reported as data, never raised into the parent
        msg = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    ru = resource.getrusage(resource.RUSAGE_SELF)
    msg["usage"] = {"peak_rss_bytes": _vm("VmHWM"), "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
                    "wall_s": round(time.monotonic() - t0, 3), "address_space_limit": base + memory if base else None}
    try:
        conn.send_bytes(json.dumps(msg, allow_nan=True).encode())
    except MemoryError:
        conn.send_bytes(b'{"memory": true}')


# ------------------------------------------------------------------------------------------ the parent

class SandboxUnavailable(SafepointError):
    """The sandbox could not run at all: an infrastructure failure (exit 2), not a verdict."""


_contexts: dict[str, Any] = {}
_lock = threading.Lock()
_prestarted = False


def _main_importable() -> bool:
    """A fork server's children re-import the caller's main module by path: `python -` (stdin) has none."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return path is None or os.path.isfile(path)


def start_method(limits: SandboxLimits) -> str:
    if limits.start_method != "auto":
        return limits.start_method
    if _prestarted:
        return "forkserver"
    return "fork" if sys.platform == "linux" or not _main_importable() else "forkserver"


def prestart(limits: SandboxLimits) -> bool:
    """Start the fork server now, so it imports `limits.preload` (the readers, torch) in parallel with
    whatever this process does next; later sandboxed work forks from it. For a process that has not
    imported torch (the CLI, before Prefect): where torch is already loaded, forking from the caller
    is cheaper. False (nothing started) then, with the sandbox off, or with another start method."""
    global _prestarted
    if not limits.enabled or limits.start_method not in ("auto", "forkserver") or "torch" in sys.modules \
            or not _main_importable() or "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    from multiprocessing import forkserver

    with _lock:
        _prestarted = True
    _context(replace(limits, start_method="forkserver"))
    forkserver.ensure_running()
    return True


def _context(limits: SandboxLimits) -> Any:
    key = start_method(limits)   # one fork server per process: the first preload list is the one it keeps
    with _lock:
        ctx = _contexts.get(key)
        if ctx is None:
            ctx = multiprocessing.get_context(key)
            if key == "forkserver":
                ctx.set_forkserver_preload(list(limits.preload))
            _contexts[key] = ctx
        return ctx


def _rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_limited(work: Work, args: tuple, limits: SandboxLimits, *, input_bytes: int = 0,
                mapped_bytes: int = 0) -> Outcome:
    """Run `work(*args)` (a module-level function returning JSON-able data, or its dotted path) in a
    limited child process."""
    memory = limits.memory_bytes + mapped_bytes
    cpu, wall = limits.cpu_limit(input_bytes), limits.wall_limit(input_bytes)
    ctx = _context(limits)
    if start_method(limits) == "fork":
        _resolve(work)  # imported here, once: every forked child inherits it
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(send, work, args, memory, cpu))   # joined or killed below, always
    p.start()
    send.close()
    deadline = time.monotonic() + wall
    out = Outcome()
    msg: dict[str, Any] | None = None
    rss0 = 0
    started = False
    killed: str | None = None
    t0 = time.monotonic()
    try:
        while True:
            if recv.poll(_FINE_POLL_S if time.monotonic() - t0 < _FINE_FOR_S else _POLL_S):
                try:
                    data = recv.recv_bytes(_MAX_RESULT_BYTES)
                except (EOFError, OSError):
                    break
                doc = json.loads(data)
                if isinstance(doc, dict) and set(doc) == {"note"}:
                    out.last_note = str(doc["note"])
                    continue
                if isinstance(doc, dict) and set(doc) == {"start"}:
                    rss0, started = int(doc["start"] or 0), True
                    continue
                msg = doc if isinstance(doc, dict) else {"error": "the sandbox sent a malformed result"}
                break
            if not p.is_alive():
                if not recv.poll(0):
                    break
                continue
            if rss0 and _rss_anon(p.pid) - rss0 > limits.memory_bytes:
                killed = f"validation exceeded {human_bytes(limits.memory_bytes)} of memory"
                break
            if time.monotonic() > deadline:
                killed = f"validation exceeded its wall clock of {wall} s"
                break
    finally:
        if killed or msg is None:
            if p.is_alive():
                p.kill()
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
        recv.close()
    if not started and not killed and msg is None:
        # The child never reached the checkpoint: a failure of this machine (no fork, the main module
        # not importable by a fork server, ...), never a verdict on the bytes.
        raise SandboxUnavailable(f"the validation sandbox could not start ({_exit_text(p.exitcode)}); "
                                 "[validation] sandbox_start_method = \"fork\" or \"spawn\" may help")
    if killed:
        out.limit = killed
    elif msg is None:
        code = p.exitcode
        if code == -signal.SIGXCPU:
            out.limit = f"validation exceeded {cpu} s of CPU time"
        elif code == -signal.SIGKILL:
            out.limit = f"validation was killed (over {cpu} s of CPU time, or out of memory)"
        else:
            out.error = f"the validation process died ({_exit_text(code)})"
    elif msg.get("memory"):
        out.limit = f"validation exceeded {human_bytes(limits.memory_bytes)} of memory"
    elif "error" in msg:
        out.error = str(msg["error"])
    else:
        out.value = msg.get("value")
    out.usage = msg.get("usage") if msg else None
    return out


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


__all__ = ["SANDBOX_KEYS", "Outcome", "SandboxLimits", "Work", "note", "prestart", "run_limited",
           "sandbox_limits_from"]
