"""The ingest flow: safepoint.ops.ingest, with each step a Prefect task, plus artifacts.

The composition is the library's (the CLI without a flow runs the very same code); this flow
adds what only Prefect has: tasks with retries in the UI, and markdown/table artifacts.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from safepoint.catalog.store import open_catalog
from safepoint.core.config import load_config
from safepoint.core.errors import FormatError
from safepoint.core.redact import redact
from safepoint.core.states import CheckpointState as CS
from safepoint.flows.automations import emit_outcome
from safepoint.flows.credentials import resolve_destinations
from safepoint.local.credentials import unseal
from safepoint.ops.ingest import IngestOutcome, run_ingest
from safepoint.tasks.artifacts import publish_validation_report
from safepoint.tasks.runner import PrefectSteps


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _report_markdown(out: IngestOutcome, detail: dict[str, Any], ranks: list[dict[str, Any]],
                     world_size: int) -> str:
    lines = [f"# Checkpoint {out.run} step {out.step}: **{out.state}**", ""]
    if out.message:
        lines += [redact(out.message) or "", ""]
    lines += ["| | |", "|---|---|",
              f"| snapshot | `{detail['snapshot']}` |",
              f"| part | {detail['part']} (ranks {detail['ranks']}, node {detail['node'] or '-'}) |" if detail["part"]
              else f"| files | {detail['files']} ({_fmt_bytes(detail['bytes'])}) |",
              f"| uploaded / reused | {_fmt_bytes(detail['bytes_uploaded'])} / {_fmt_bytes(detail['bytes_reused'])} |",
              f"| wall time | {detail['seconds']:.2f} s |",
              f"| throughput | {_fmt_bytes(detail['throughput_bps'] or 0)}/s |",
              f"| memory available (min) | {detail['memory_available_min_ratio'] or 0:.0%} |",
              f"| event | {detail['event_id'] or '-'} |", ""]
    lines += ["| replica | state | error |", "|---|---|---|"]
    lines += [f"| {r['url']} | {r['state']} | {r['error'] or ''} |" for r in out.replicas]
    if world_size > 1:
        have = {r["rank"]: r for r in ranks}
        lines += ["", f"## Ranks ({len(have)} of {world_size} delivered)", "", "| rank | node | delivered |",
                  "|---|---|---|"]
        for rank in range(world_size):
            r = have.get(rank)
            lines.append(f"| {rank} | {r['node'] or '-'} | {r['delivered_at']:%H:%M:%S} |" if r
                         else f"| {rank} | - | **missing** |")
    return "\n".join(lines) + "\n"


@flow(name="safepoint-ingest", flow_run_name="ingest-{snapshot}", validate_parameters=True)
def ingest(snapshot: str, to: list[str], model: str | None = None, catalog_url: str | None = None,
           event_id: str | None = None, skip_if_verified: bool = False) -> dict:
    """Ingest one committed snapshot folder (or one node's part) into every destination in `to`.

    `event_id` ties an event-triggered run to the marker that caused it (safepoint.events);
    `skip_if_verified` turns a duplicate trigger for an already verified commit into a no-op.
    `to` and `catalog_url` carry no secrets: sealed URLs or `block:NAME/prefix` (flows/credentials.py).
    """
    # Parameters name credentials by reference only (safepoint.local.credentials); resolved here, in memory.
    config = load_config()
    to, config = resolve_destinations(list(to) or list(config.section("ingest").get("to", [])), config)
    catalog = open_catalog(unseal(catalog_url) or config.catalog_url)
    try:
        done = run_ingest(snapshot, to, catalog, config, model=model, event_id=event_id,
                          skip_if_verified=skip_if_verified, runner=PrefectSteps())
    except FormatError as e:  # quarantined as corrupt: the verdict event, then the run fails as before
        row = catalog.find_by_local_path(snapshot)
        if row is not None:
            emit_outcome(row.run, row.step, None, str(row.state), str(e))
        raise
    out, detail = done.outcome, done.detail
    if not detail.get("skipped"):
        emit_outcome(out.run, out.step, detail.get("node"), str(out.state), out.message)
    if done.checkpoint_id is not None and not detail.get("skipped"):
        row = catalog.get_by_id(done.checkpoint_id)
        if out.state in (CS.VERIFIED, CS.INVALID):
            publish_validation_report(catalog, done.checkpoint_id)
        create_markdown_artifact(
            key=f"ingest-{out.run}-{out.step}".lower().replace("_", "-").replace(".", "-"),
            markdown=_report_markdown(out, detail, catalog.ranks(done.checkpoint_id), row.world_size),
            description=f"Safepoint ingest of {out.run}/{out.step}" + (f" (part {detail['part']})"
                                                                      if detail["part"] else ""),
        )
    return {"run": out.run, "step": out.step, "state": str(out.state), "replicas": out.replicas,
            "message": out.message}
