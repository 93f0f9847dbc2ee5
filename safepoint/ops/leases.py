"""Exclusive work through catalog leases: one holder per name, renewed while held.

The catalog lease (Catalog.acquire_lease) is an atomic compare-and-set row with an expiry. A holder
renews it from a daemon thread while it works, so a lease outlives slow uploads but not a dead
process: when the holder dies, the lease expires after `ttl_s` and a waiter takes over. Nothing
waits forever: `wait_s` bounds every wait and the caller decides what a timeout means.

- `held(catalog, name)`: a mutex, e.g. "one ingest of this checkpoint part per destination";
- `slot(catalog, prefix, slots)`: a counting semaphore of `slots` leases, e.g. "at most N uploads
  in flight on this host", without a Prefect server (works with the embedded runner too).

With a Prefect server, the uploads per host are a Prefect global concurrency limit instead (a
`HostLimit` from the flow's step runner, safepoint.tasks.runner), which the UI shows and an operator
can change; the catalog slots serve only where Prefect cannot (no server, or a temporary one).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from safepoint.catalog.store import Catalog
from safepoint.core.config import Config
from safepoint.core.errors import SafepointError
from safepoint.core.format import Manifest
from safepoint.core.naming import ingest_lease, this_host, uploads_lease_prefix, uploads_limit_name
from safepoint.destinations.parts import is_part, part_key
from safepoint.local.processes import pid_running


class LeaseBusy(SafepointError):
    """The lease (or every slot) stayed held by others for the whole wait."""


#: (limit name, slots, wait_s) -> a context manager holding one slot, or None where the runner has none
HostLimit = Callable[[str, int, float], "AbstractContextManager[None] | None"]


def default_holder() -> str:
    """host:pid:random, unique per call so two holders in one process never share a lease."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class _Renewer(threading.Thread):
    def __init__(self, catalog: Catalog, name: str, holder: str, ttl_s: float):
        super().__init__(name=f"lease-{name}", daemon=True)
        self.catalog, self.lease, self.holder, self.ttl_s = catalog, name, holder, ttl_s
        self.stop = threading.Event()
        self.lost = False

    def run(self) -> None:
        while not self.stop.wait(self.ttl_s / 3):
            try:
                if not self.catalog.acquire_lease(self.lease, self.holder, self.ttl_s):
                    self.lost = True  # expired and taken over: the holder was too slow to renew
                    return
            except Exception:  # noqa: BLE001 - a transient catalog error: try again next period
                continue


def holder_is_dead(holder: str | None, host: str, alive: Callable[[int], bool] = pid_running) -> bool:
    """A lease of a process of this host that no longer exists (killed -9): it will never be renewed,
    so waiting out its TTL would only delay the restart. Holders elsewhere are never judged."""
    parts = (holder or "").split(":")  # default_holder(): host:pid:random
    if len(parts) < 3 or not parts[-2].isdigit():
        return False
    return ":".join(parts[:-2]) == host and not alive(int(parts[-2]))


def _try(catalog: Catalog, names: list[str], holder: str, ttl_s: float) -> str | None:
    for n in names:
        if catalog.acquire_lease(n, holder, ttl_s):
            return n
    for n in names:  # take over what a dead process of this host held (released by its exact holder only)
        dead = catalog.lease_holder(n)
        if holder_is_dead(dead, socket.gethostname()) and catalog.release_lease(n, dead) and \
                catalog.acquire_lease(n, holder, ttl_s):
            return n
    return None


@contextmanager
def _hold(catalog: Catalog, names: list[str], *, holder: str | None, ttl_s: float, wait_s: float,
          poll_s: float) -> Iterator[str]:
    holder = holder or default_holder()
    deadline = time.monotonic() + wait_s
    got = _try(catalog, names, holder, ttl_s)
    while got is None:
        if time.monotonic() >= deadline:
            raise LeaseBusy(f"{names[0] if len(names) == 1 else names[0].rsplit('/', 1)[0]} stayed busy "
                            f"for {wait_s:.0f}s")
        time.sleep(poll_s)
        got = _try(catalog, names, holder, ttl_s)
    renewer = _Renewer(catalog, got, holder, ttl_s)
    renewer.start()
    try:
        yield got
    finally:
        renewer.stop.set()
        renewer.join(timeout=5)
        catalog.release_lease(got, holder)


@contextmanager
def try_once(catalog: Catalog, name: str, *, ttl_s: float = 300.0) -> Iterator[bool]:
    """Try lease `name` once and yield whether we hold it (reconcile never waits for a live ingest)."""
    holder = default_holder()
    got = catalog.acquire_lease(name, holder, ttl_s)
    try:
        yield got
    finally:
        if got:
            catalog.release_lease(name, holder)


@contextmanager
def held(catalog: Catalog, name: str, *, holder: str | None = None, ttl_s: float = 60.0,
         wait_s: float = 3600.0, poll_s: float = 1.0) -> Iterator[str]:
    """Hold lease `name` for the block; wait up to `wait_s` for it (LeaseBusy after that)."""
    with _hold(catalog, [name], holder=holder, ttl_s=ttl_s, wait_s=wait_s, poll_s=poll_s) as got:
        yield got


@contextmanager
def slot(catalog: Catalog, prefix: str, slots: int, *, holder: str | None = None, ttl_s: float = 60.0,
         wait_s: float = 3600.0, poll_s: float = 0.5) -> Iterator[str]:
    """Hold one of `slots` leases `prefix/0..slots-1` for the block (a counting semaphore)."""
    if slots < 1:
        raise ValueError("slots must be >= 1")
    # Start at a random slot so waiters do not all hammer slot 0.
    start = uuid.uuid4().int % slots
    names = [f"{prefix}/{(start + i) % slots}" for i in range(slots)]
    with _hold(catalog, names, holder=holder, ttl_s=ttl_s, wait_s=wait_s, poll_s=poll_s) as got:
        yield got


def limits(config: Config) -> tuple[int, float, float]:
    """`[limits]`: uploads_per_host (4), lease_ttl_s (60), lease_wait_s (3600)."""
    sec = config.section("limits")
    return (int(sec.get("uploads_per_host", 4)), float(sec.get("lease_ttl_s", 60)),
            float(sec.get("lease_wait_s", 3600)))


@contextmanager
def ingest_leases(catalog: Catalog, manifest: Manifest, url: str, config: Config,
                  host_limit: HostLimit | None = None) -> Iterator[None]:
    """Never two ingests of one checkpoint (part) into one destination at once; at most N uploads per host.

    The first is a catalog lease; the second a slot of `host_limit` (Prefect's global concurrency
    limit) when the runner has one, else catalog slots. Both hold across processes and hosts and
    expire if a holder dies.
    """
    part = part_key(manifest.held_ranks) if is_part(manifest) else "all"
    slots, ttl, wait = limits(config)
    host = this_host()
    per_host = host_limit(uploads_limit_name(host), slots, wait) if host_limit is not None else None
    with held(catalog, ingest_lease(manifest.run, manifest.step, url, part), ttl_s=ttl, wait_s=wait), \
            (per_host or slot(catalog, uploads_lease_prefix(host), slots, ttl_s=ttl, wait_s=wait)):
        yield
