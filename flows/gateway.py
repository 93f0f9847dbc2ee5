"""The Prefect side of the event-driven watcher: emit, confirm, dispatch (safepoint.events.markers).

Prefect's client calls, each bounded in time; the watcher's logic (spool, retries, fallback to
`run_deployment`) is the library's and is tested with a fake gateway.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timezone
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter
from prefect.client.schemas.filters import FlowRunFilterExpectedStartTime as Start
from prefect.client.schemas.sorting import FlowRunSort
from prefect.deployments import run_deployment
from prefect.events import Event
from prefect.events.clients import get_events_client

from safepoint.events.markers import DEFAULT_DEPLOYMENT, EVENT, FLOW_NAME, Marker, resource


class PrefectGateway:
    """The few Prefect calls a watcher makes, each bounded in time and raising on failure."""

    def __init__(self, deployment: str = DEFAULT_DEPLOYMENT, timeout_s: float = 10.0):
        self.deployment = deployment
        self.timeout_s = timeout_s

    def _run(self, coro: Any) -> Any:
        return asyncio.run(asyncio.wait_for(coro, self.timeout_s))

    def warm(self) -> None:
        """Nothing left to do: the client modules are imported with this module, before the first marker."""

    def healthy(self) -> bool:
        async def check() -> bool:
            async with get_client() as c:
                return await c.api_healthcheck() is None

        try:
            return bool(self._run(check()))
        except Exception:  # noqa: BLE001 - any failure means "not reachable now"
            return False

    def emit(self, marker: Marker) -> None:
        """Send the event over a fresh connection; raises when the server does not take it."""
        event = Event(event=EVENT, resource=resource(marker.run, marker.step, marker.node),
                      payload=marker.payload(), id=uuid.UUID(marker.event_id))

        async def send() -> None:
            async with get_events_client(reconnection_attempts=1) as c:
                await c.emit(event)

        self._run(send())

    def runs_for(self, event_ids: set[str], since: float) -> dict[str, list[tuple[str, str]]]:
        """event_id -> [(flow run id, state type)] of ingest runs created since `since` (epoch)."""
        after = datetime.fromtimestamp(since - 120, tz=timezone.utc)

        async def read() -> list[Any]:
            async with get_client() as c:
                return await c.read_flow_runs(
                    flow_filter=FlowFilter(name=FlowFilterName(any_=[FLOW_NAME])),
                    flow_run_filter=FlowRunFilter(expected_start_time=Start(after_=after)),
                    sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=200)

        out: dict[str, list[tuple[str, str]]] = {}
        for r in self._run(read()):
            eid = (r.parameters or {}).get("event_id")
            if eid in event_ids:
                state = r.state_type.value if r.state_type else "UNKNOWN"
                out.setdefault(eid, []).append((str(r.id), state))
        return out

    def dispatch(self, marker: Marker, key: str) -> str:
        """run_deployment with an idempotency key: the same key never makes two runs."""
        async def go() -> str:
            run = await run_deployment(self.deployment, parameters=marker.parameters(), idempotency_key=key,
                                       timeout=0)
            return str(run.id)

        return self._run(go())


