"""The watch flow: one pass of the watch loop (safepoint.events.watch) with each ingest an ingest flow run.

`safepoint watch` runs the same loop and sink (`IngestHere`); here each folder's ingest is the
ingest flow (safepoint.flows.ingest), its steps Prefect tasks.
"""

from __future__ import annotations

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
