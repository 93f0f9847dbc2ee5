"""The watch flow: one pass of the watch loop (safepoint.events.watch) with each ingest an ingest flow run.

`safepoint watch` runs the same loop and sink (`IngestHere`); here each folder's ingest is the
ingest flow (safepoint.flows.ingest), its steps Prefect tasks.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect import flow

from safepoint.catalog.store import open_catalog
from safepoint.core.config import load_config
from safepoint.events.watch import IngestHere, Watcher
from safepoint.flows.ingest import ingest_result
from safepoint.flows.run_logs import route_to_run_logs
from safepoint.rules.outcome import decide


@flow(name="safepoint-watch", validate_parameters=True)
def watch(root: str, to: list[str], model: str | None = None, catalog_url: str | None = None) -> int:
    """Ingest every committed folder under `root` not ingested yet, once; returns the worst exit code."""
    route_to_run_logs()
    config = load_config()
    catalog = open_catalog(catalog_url or config.catalog_url)

    def ingest(folder: Path, _snap: object) -> int:
        result = ingest_result(snapshot=str(folder), to=to, model=model, catalog_url=catalog_url)
        return decide(result).exit_code  # the one outcome rule, as the CLI's watch

    here = IngestHere(catalog, ingest)
    Watcher(Path(root), catalog, here, config=config, use_inotify=False).run(once=True)
    return here.worst


def crash_orphaned_runs(root: str | Path) -> int:
    """Mark Crashed the ingest flow runs a killed warm executor left Running or Pending on this node
    (their snapshot is under `root`, which only this node's executor ingests); returns how many.

    Called as `safepoint serve --watch` starts, before its watcher offers those folders again, so the
    UI tells the dead run from the one that replaces it. The warm lane has no heartbeat to do it.
    """
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    base = str(Path(root).resolve())
    crashed = 0
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["safepoint-ingest"])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING]))), limit=200)
        for run in runs:
            snapshot = str((run.parameters or {}).get("snapshot", ""))
            if snapshot == base or snapshot.startswith(base + os.sep):
                client.set_flow_run_state(run.id, Crashed(
                    message="the node's warm executor stopped during this ingest; it runs again"), force=True)
                crashed += 1
    return crashed
