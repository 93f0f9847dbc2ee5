"""The ingest flow: safepoint.ops.ingest, with each step a Prefect task, plus artifacts.

The composition is the library's (the CLI without a flow runs the very same code); this flow
adds what only Prefect has: tasks with retries in the UI, markdown/table artifacts, runs named
`ingest-RUN-STEP`, Safepoint's log lines in the run's logs, and a run state that tells the
outcome: Completed for a verified checkpoint (or a part delivered and waiting for the others),
Failed with the verdict as its message for corrupt/invalid/incomplete or a failed or corrupt copy
(the outcome rule, safepoint.rules.outcome).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.states import Failed, State

from safepoint.catalog.store import open_catalog
from safepoint.core.config import load_config
from safepoint.core.errors import FormatError
from safepoint.core.format import MARKER_NAME, parse_marker
from safepoint.core.redact import redact
from safepoint.core.states import CheckpointState as CS
from safepoint.flows.automations import emit_outcome
from safepoint.flows.credentials import resolve_destinations
from safepoint.flows.run_logs import route_to_run_logs
from safepoint.local.credentials import reveal_credentials
from safepoint.local.snapshot import read_small
from safepoint.ops import trend
from safepoint.ops.ingest import PREPARED, IngestOutcome, run_ingest
from safepoint.rules.outcome import decide
from safepoint.tasks.runner import PrefectSteps
from safepoint.validation import report as vr


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


def publish_report(catalog: Any, checkpoint_id: int, out: IngestOutcome, detail: dict[str, Any]) -> None:
    """One markdown artifact per ingest: the ingest report, preceded by the validation report when this
    ingest reached the verdict (key `validation-RUN-STEP`, else `ingest-RUN-STEP`); the per-tensor table
    only for an invalid checkpoint, where it says which tensors failed. Each keyed artifact is two
    Prefect events (created, collection): this keeps a part at most 12 (issue 35)."""
    row = catalog.get_by_id(checkpoint_id)
    ingest_md = _report_markdown(out, detail, catalog.ranks(checkpoint_id), row.world_size)
    where = f"Safepoint ingest of {out.run}/{out.step}" + (f" (part {detail['part']})" if detail["part"] else "")
    v = catalog.latest_validation(checkpoint_id) if out.state in (CS.VERIFIED, CS.INVALID) else None
    try:
        if v is None:
            create_markdown_artifact(key=vr.artifact_key("ingest", out.run, out.step), markdown=ingest_md,
                                     description=where)
            return
        stats = catalog.tensor_stats(v.id)
        create_markdown_artifact(key=vr.artifact_key("validation", row.run, row.step),
                                 markdown=vr.markdown(row.run, row.step, str(row.state), v.report, stats)
                                 + "\n" + ingest_md + "\n" + _trend_markdown(catalog, row.run),
                                 description=f"Safepoint validation of {row.run}/{row.step}: {row.state}; {where}")
        if out.state is CS.INVALID:
            create_table_artifact(key=vr.artifact_key("validation-tensors", row.run, row.step),
                                  table=vr.tensor_rows(v.report, stats),
                                  description=f"Tensors of {row.run}/{row.step}: verdict and stats (flagged first)")
    except Exception as e:  # noqa: BLE001 - artifacts are a view; the catalog holds the report
        logging.getLogger("safepoint").warning("artifacts for %s/%s not created: %s", out.run, out.step, e)


#: the newest steps the verdict's artifact shows the norm trend of
TREND_STEPS = 20


def _trend_markdown(catalog: Any, run: str) -> str:
    """The run's norm trend (what `safepoint plot` draws) in the verdict's artifact: no artifact, and so
    no Prefect events, of its own. Empty when it cannot be read: the catalog holds the stats."""
    try:
        return trend.markdown(trend.run_trend(catalog, run, last=TREND_STEPS), last=TREND_STEPS)
    except Exception as e:  # noqa: BLE001 - a view of the catalog
        logging.getLogger("safepoint").warning("norm trend of %s not shown: %s", run, e)
        return ""


def run_name(snapshot: str) -> str:
    """`ingest-RUN-STEP` from the commit marker (small, checked); the folder's name if it is unreadable."""
    try:
        data = read_small(Path(snapshot) / MARKER_NAME)
        if data is not None:
            marker = parse_marker(data)
            return f"ingest-{marker.run}-{marker.step}"
    except (OSError, FormatError):
        pass
    return f"ingest-{Path(snapshot).name or 'snapshot'}"


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    snapshot = str(flow_run.parameters.get("snapshot", ""))
    prepared = PREPARED.get()
    if prepared is not None and prepared.serves(snapshot):  # the marker is read already
        return f"ingest-{prepared.snap.manifest.run}-{prepared.snap.manifest.step}"
    return run_name(snapshot)


def run_state(result: dict[str, Any]) -> dict[str, Any] | State:
    """The flow's return: the result itself (Completed), or Failed carrying it, with a one-line why;
    which one is the outcome rule's (safepoint.rules.outcome), the same the CLI's exit code reads."""
    decision = decide(result)
    return result if decision.completed else Failed(message=decision.message, data=result)


@flow(name="safepoint-ingest", flow_run_name=_flow_run_name, validate_parameters=True)
def ingest(snapshot: str, to: list[str], model: str | None = None, catalog_url: str | None = None,
           event_id: str | None = None, skip_if_verified: bool = False) -> dict | State:
    """Ingest one committed snapshot folder (or one node's part) into every destination in `to`.

    `event_id` ties an event-triggered run to the marker that caused it (safepoint.events);
    `skip_if_verified` turns a duplicate trigger for an already verified commit into a no-op.
    `to` and `catalog_url` carry no secrets: sealed URLs or `block:NAME/prefix` (flows/credentials.py).
    Called directly, a Failed run raises; `ingest_result` returns its result either way.
    """
    route_to_run_logs()
    prepared = PREPARED.get()  # read, resolved and checked by the CLI in this process: not again
    if prepared is not None and prepared.serves(snapshot):
        config = prepared.config
    else:
        prepared = None
        # Parameters name credentials by reference only (safepoint.local.credentials); resolved here, in memory.
        config = load_config()
        to, config = resolve_destinations(list(to) or list(config.section("ingest").get("to", [])), config)
    catalog = open_catalog(reveal_credentials(catalog_url) or config.catalog_url)
    try:
        done = run_ingest(snapshot, to, catalog, config, model=model, event_id=event_id,
                          skip_if_verified=skip_if_verified, runner=PrefectSteps(), prepared=prepared)
    except FormatError as e:  # quarantined as corrupt: the verdict event, then the run fails as before
        row = catalog.find_by_local_path(snapshot)
        if row is not None:
            emit_outcome(row.run, row.step, None, str(row.state), str(e))
        raise
    out, detail = done.outcome, done.detail
    if not detail.get("skipped"):
        emit_outcome(out.run, out.step, detail.get("node"), str(out.state), out.message)
    if done.checkpoint_id is not None and not detail.get("skipped"):
        publish_report(catalog, done.checkpoint_id, out, detail)
    return run_state(out.result())


def heartbeat_updates(flows_settings: Any) -> dict[Any, Any]:
    """Settings for a run in this process: Prefect's flow-run heartbeat off unless the user set it.

    The heartbeat thread sleeps in 1 s steps and the engine joins it when the run ends, which adds
    up to 1 s to every in-process ingest (measured: 1.00 s on a bare flow). Its only use is Prefect's
    crashed-run detection, which needs an automation of the user's; whoever set
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY (env or profile) keeps it.
    """
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY

    return {} if "heartbeat_frequency" in flows_settings.model_fields_set else {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}


@contextmanager
def without_heartbeat() -> Iterator[None]:
    """`heartbeat_updates` in force for the block. A no-op where they are already (a long-lived process
    enters it once, `safepoint serve --watch`): copying Prefect's settings costs 0.2-0.4 CPU s, more
    than the ingest of a small part."""
    from prefect.settings import get_current_settings, temporary_settings

    flows = get_current_settings().flows
    updates = heartbeat_updates(flows)
    if not updates or flows.heartbeat_frequency is None:
        yield
        return
    with temporary_settings(updates=updates):
        yield


@contextmanager
def warm_process() -> Iterator[None]:
    """For a process that runs many ingests (`safepoint serve --watch`): the heartbeat settings once,
    and one Prefect client for every flow and task run in it (Prefect's engine reuses the client of
    an entered SyncClientContext): no settings copy, no new HTTP client, TLS context (about 30 ms of
    CPU) or connection per ingest."""
    from prefect.context import SyncClientContext

    with without_heartbeat(), SyncClientContext.get_or_create():
        yield


def ingest_result(**params: Any) -> dict[str, Any]:
    """Run the ingest flow in this process and return its result dict whatever the run's state (the
    CLI turns the state into exit 0/1/2); an exception raised inside the flow is raised here, as a
    plain call would."""
    with without_heartbeat():
        state = ingest(**params, return_state=True)
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException):
        raise result
    return result
