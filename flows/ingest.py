"""The ingest flow: commit marker -> replicate -> verify -> validate -> catalog."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from catalog.store import open_catalog
from safepoint import pipeline
from safepoint.config import load_config
from safepoint.errors import FormatError
from safepoint.states import CheckpointState as CS
from tasks import ingest as t


def _report_markdown(out: pipeline.IngestOutcome) -> str:
    rows = "\n".join(f"| {r['url']} | {r['state']} | {r['error'] or ''} |" for r in out.replicas)
    return (
        f"# Checkpoint {out.run} step {out.step}: **{out.state}**\n\n{out.message}\n\n"
        f"| replica | state | error |\n|---|---|---|\n{rows}\n"
    )


@flow(name="safepoint-ingest", flow_run_name="ingest-{snapshot}", validate_parameters=True)
def ingest(snapshot: str, to: list[str], model: str | None = None, catalog_url: str | None = None) -> dict:
    """Ingest one committed snapshot folder into every destination in `to`."""
    logger = get_run_logger()
    config = load_config()
    catalog_url = catalog_url or config.catalog_url
    try:
        snap = t.open_snapshot(snapshot)
    except FormatError as e:
        logger.error("not ingesting %s: %s", snapshot, e)
        raise
    checkpoint_id = t.register(catalog_url, snap)
    futures = [t.replicate.submit(catalog_url, checkpoint_id, snap, url, config) for url in to]
    results = [f.result() for f in futures]
    state = t.settle(catalog_url, checkpoint_id, results)
    if state is CS.REPLICATED:
        t.validate(catalog_url, checkpoint_id, snap, model or config.run_setting(snap.manifest.run, "model"))
    out = pipeline.outcome(open_catalog(catalog_url), checkpoint_id)
    create_markdown_artifact(
        key=f"ingest-{out.run}-{out.step}".lower().replace("_", "-").replace(".", "-"),
        markdown=_report_markdown(out), description=f"Safepoint ingest of {out.run}/{out.step}",
    )
    logger.info("%s/%s ended %s", out.run, out.step, out.state)
    return {"run": out.run, "step": out.step, "state": str(out.state), "replicas": out.replicas,
            "message": out.message}
