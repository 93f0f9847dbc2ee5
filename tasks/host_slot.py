"""One slot of a Prefect global concurrency limit, held with a lease, without the 2 s wait of a busy SQLite server.

Prefect's `concurrency()` takes the slot through `POST /v2/concurrency_limits/increment-with-lease`. On
a SQLite server that endpoint reads the limit and then updates it in a DEFERRED transaction, so when any
other writer (the server's own event persister, a task-run state) commits in between, SQLite refuses
the upgrade at once (SQLITE_BUSY, no busy timeout) and the server answers 503. Prefect's client then
sleeps 2**1 s before it asks again. On the embedded server that cost 1.8-2.4 s of nearly every ingest
(docs/prefect-server.md). The same lease is taken here through Prefect's client, whose transport asks
again after tens of milliseconds; past `BUSY_RETRY_S` the 503 goes back to Prefect's own retry.

The slot, its holder (the task run) and its release are Prefect's, so the UI shows them as for
`concurrency()`. The lease is renewed in a thread; a renewal that fails is logged and the upload goes
on (the catalog lease still guards the checkpoint), as `concurrency(raise_on_lease_renewal_failure=False)`.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from uuid import UUID

import httpx

from safepoint.ops.leases import LeaseBusy

log = logging.getLogger(__name__)

#: How long the transport keeps asking again after a 503, before the answer goes to Prefect's retry
BUSY_RETRY_S = 2.0
#: The pause before the first new ask; it doubles up to BUSY_PAUSE_MAX_S, with jitter
BUSY_PAUSE_S = 0.02
BUSY_PAUSE_MAX_S = 0.25
#: Prefect's default lease (`concurrency(lease_duration=300)`), renewed at three quarters of it
LEASE_S = 300.0
RENEW_FRACTION = 0.75
#: The shortest wait after a 423 (every slot taken), whatever Retry-After says
LOCKED_PAUSE_MIN_S = 0.1


class BusyRetry(httpx.BaseTransport):
    """An httpx transport that asks again soon after a 503 (a busy server), for up to `budget_s`."""

    def __init__(self, inner: httpx.BaseTransport, budget_s: float = BUSY_RETRY_S,
                 pause_s: float = BUSY_PAUSE_S, pause_max_s: float = BUSY_PAUSE_MAX_S):
        self.inner, self.budget_s, self.pause_s, self.pause_max_s = inner, budget_s, pause_s, pause_max_s

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        deadline = time.monotonic() + self.budget_s
        pause = self.pause_s
        while True:
            response = self.inner.handle_request(request)
            if response.status_code != httpx.codes.SERVICE_UNAVAILABLE:
                return response
            wait = random.uniform(pause / 2, pause)
            if time.monotonic() + wait > deadline:
                return response
            response.close()
            log.debug("%s %s: 503, asking again in %.3fs", request.method, request.url.path, wait)
            time.sleep(wait)
            pause = min(pause * 2, self.pause_max_s)

    def close(self) -> None:
        self.inner.close()


#: Clients kept open for the process, by API URL and credentials: a new one per ingest cost two TLS contexts (about
#: 50 ms of CPU, a fifth of a warm executor's Prefect cost per part; bench/fleet.py)
_MAX_CLIENTS = 4
_clients: dict[tuple[str, str | None, str | None], Any] = {}
_clients_lock = threading.Lock()


def _client() -> Any:
    """Prefect's sync client for this process's API (URL and credentials), started once and shared by every slot taken
    in it (httpx's client is thread-safe); on plain HTTP (a local server) with the BusyRetry
    transport. Over HTTPS it keeps its own transport, which carries Prefect's TLS settings."""
    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    api = get_current_settings().api
    url = api.url or ""
    key = (url, api.key.get_secret_value() if api.key else None,
           api.auth_string.get_secret_value() if api.auth_string else None)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            if url.startswith("http://"):
                client = get_client(sync_client=True,
                                    httpx_settings={"transport": BusyRetry(httpx.HTTPTransport(retries=3))})
            else:
                client = get_client(sync_client=True)
            client.__enter__()
            if len(_clients) >= _MAX_CLIENTS:  # a process that met many servers (tests): the oldest goes
                _clients.pop(next(iter(_clients))).__exit__(None, None, None)
            _clients[key] = client
        return client


@atexit.register
def _close_clients() -> None:
    with _clients_lock:
        while _clients:
            _clients.popitem()[1].__exit__(None, None, None)


def _holder() -> Any:
    """The task run that holds the slot, as Prefect's `concurrency()` names it; None outside a task."""
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.context import TaskRunContext

    ctx = TaskRunContext.get()
    return ConcurrencyLeaseHolder(type="task_run", id=ctx.task_run.id) if ctx and ctx.task_run else None


def _acquire(client: Any, name: str, slots: int, wait_s: float, lease_s: float) -> UUID:
    from prefect.exceptions import ObjectAlreadyExists, PrefectHTTPStatusError

    try:
        client.upsert_global_concurrency_limit_by_name(name, slots)
    except ObjectAlreadyExists:  # another node created it between Prefect's read and its create
        client.upsert_global_concurrency_limit_by_name(name, slots)
    deadline = time.monotonic() + wait_s
    holder = _holder()
    while True:
        try:
            response = client.increment_concurrency_slots_with_lease(
                names=[name], slots=1, mode="concurrency", lease_duration=lease_s, holder=holder)
            return UUID(response.json()["lease_id"])
        except PrefectHTTPStatusError as e:
            if e.response.status_code != httpx.codes.LOCKED:  # every slot taken: wait as the server says
                raise
            retry_after = max(float(e.response.headers.get("Retry-After", 1.0)), LOCKED_PAUSE_MIN_S)
        left = deadline - time.monotonic()
        if left <= 0:
            raise LeaseBusy(f"{name}: all {slots} slots stayed busy for {wait_s:.0f}s")
        time.sleep(min(random.uniform(retry_after, retry_after * 1.2), left))


def _renew(client: Any, lease_id: UUID, lease_s: float, stop: threading.Event) -> None:
    while not stop.wait(lease_s * RENEW_FRACTION):
        try:
            client.renew_concurrency_lease(lease_id=lease_id, lease_duration=lease_s)
        except Exception as e:  # noqa: BLE001 - logged; the upload goes on
            log.warning("renewing the upload slot's lease %s failed: %s", lease_id, e)


@contextmanager
def host_slot(name: str, slots: int, wait_s: float, lease_s: float = LEASE_S) -> Iterator[None]:
    """Hold one slot of global concurrency limit `name` (created or resized to `slots`) for the block.

    LeaseBusy when every slot stays taken for `wait_s`."""
    client = _client()
    lease_id = _acquire(client, name, slots, wait_s, lease_s)
    stop = threading.Event()
    renewer = threading.Thread(target=contextvars.copy_context().run,
                               args=(_renew, client, lease_id, lease_s, stop), daemon=True, name=f"lease-{name}")
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        client.release_concurrency_slots_with_lease(lease_id)
