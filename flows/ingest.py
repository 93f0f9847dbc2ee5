"""The ingest flow: commit marker -> replicate -> verify -> validate -> catalog.

One flow for a whole snapshot and for one node's part of a multi-node checkpoint. A part is
replicated into the shared snapshot folder and committed as a part; the ingest whose part completes
the set assembles the checkpoint and validates it (safepoint.assemble). No run ever waits for
another node. Every run ends with an `ingest.done` catalog event (what watchers wait for) and a
markdown artifact.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from safepoint.catalog.store import Catalog, open_catalog
from safepoint.core.config import Config, load_config
from safepoint.core.errors import FormatError
from safepoint.core.format import digest_bytes
from safepoint.core.redact import redact, redact_url
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.destinations.parts import check_part, is_part, part_key
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops import assemble
from safepoint.ops import ingest as pipeline
from safepoint.ops.metrics import MemorySampler
from safepoint.ops.replicate import ReplicaResult
from safepoint.tasks import ingest as t
from safepoint.tasks.repair import reconcile_snapshot


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _report_markdown(out: pipeline.IngestOutcome, detail: dict[str, Any], ranks: list[dict[str, Any]],
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


def _already_done(catalog: Catalog, snap: LocalSnapshot, to: list[str]) -> bool:
    """This exact commit is verified everywhere asked: a duplicate trigger has nothing to do."""
    m = snap.manifest
    row = catalog.get(m.run, m.step)
    if row is None or row.state is not CS.VERIFIED:
        return False
    digest = digest_bytes(snap.manifest_bytes)
    if is_part(m):
        mine = {r["rank"]: r["manifest_blake3"] for r in catalog.ranks(row.id)}
        if any(mine.get(r) != digest for r in m.held_ranks):
            return False
    elif row.manifest_blake3 != digest:
        return False
    verified = {r.destination for r in catalog.replicas(row.id) if r.state is RS.VERIFIED}
    return all(redact_url(u) in verified for u in to)


@flow(name="safepoint-ingest", flow_run_name="ingest-{snapshot}", validate_parameters=True)
def ingest(snapshot: str, to: list[str], model: str | None = None, catalog_url: str | None = None,
           event_id: str | None = None, skip_if_verified: bool = False) -> dict:
    """Ingest one committed snapshot folder (or one node's part) into every destination in `to`.

    `event_id` ties an event-triggered run to the marker that caused it (safepoint.events);
    `skip_if_verified` turns a duplicate trigger for an already verified commit into a no-op.
    """
    logger = get_run_logger()
    config = load_config()
    catalog_url = catalog_url or config.catalog_url
    to = list(to) or list(config.section("ingest").get("to", []))
    if not to:
        raise ValueError("no destination: pass `to` or set [ingest] to = [...] in config.toml")
    t0 = time.perf_counter()
    try:
        snap = t.open_snapshot(snapshot)
        if is_part(snap.manifest):
            check_part(snap.manifest)
    except FormatError as e:
        logger.error("not ingesting %s: %s", snapshot, e)
        from safepoint.ops.reconcile import quarantine

        row = quarantine(open_catalog(catalog_url), snapshot, str(e))  # corrupt in the catalog
        if row is not None:  # an event-driven watcher waits for this record, whatever the outcome
            t.record_done(catalog_url, row.id, {"event_id": event_id, "snapshot": snapshot, "run": row.run,
                                                "step": row.step, "state": str(row.state), "error": redact(str(e))})
        raise
    catalog = open_catalog(catalog_url)
    part = is_part(snap.manifest)
    if skip_if_verified and _already_done(catalog, snap, to):
        row = catalog.get(snap.manifest.run, snap.manifest.step)
        logger.info("%s/%s is already verified; nothing to do", row.run, row.step)
        out = pipeline.outcome(catalog, row.id, "already verified")
        t.record_done(catalog_url, row.id, _done_detail(snap, snapshot, event_id, out, [], t0, None, skipped=True))
        return _result(out)

    with MemorySampler() as mem:
        # Repair what a crashed earlier attempt left at these destinations (scoped, cheap).
        reconcile_snapshot(catalog_url, snap.manifest.run, snap.manifest.step, to, config)
        checkpoint_id = t.register(catalog_url, snap)
        futures = [t.replicate.submit(catalog_url, checkpoint_id, snap, url, config) for url in to]
        results = [f.result() for f in futures]
        if part:
            settled = t.settle_part(catalog_url, checkpoint_id, snap, results, to, config)
            logger.info("%s/%s part %s: %s (%s)", snap.manifest.run, snap.manifest.step,
                        part_key(snap.manifest.held_ranks), settled.state, settled.message)
            if settled.won:
                _validate_assembled(catalog_url, checkpoint_id, config, model, snap.manifest.run)
        else:
            state = t.settle(catalog_url, checkpoint_id, results)
            if state is CS.REPLICATED:
                t.validate(catalog_url, checkpoint_id, snap, model or config.run_setting(snap.manifest.run, "model"))
    out = pipeline.outcome(catalog, checkpoint_id)
    detail = _done_detail(snap, snapshot, event_id, out, results, t0, mem.min_ratio)
    t.record_done(catalog_url, checkpoint_id, detail)
    row = catalog.get_by_id(checkpoint_id)
    create_markdown_artifact(
        key=f"ingest-{out.run}-{out.step}".lower().replace("_", "-").replace(".", "-"),
        markdown=_report_markdown(out, detail, catalog.ranks(checkpoint_id), row.world_size),
        description=f"Safepoint ingest of {out.run}/{out.step}" + (f" (part {detail['part']})" if part else ""),
    )
    logger.info("%s/%s ended %s", out.run, out.step, out.state)
    return _result(out)


def _validate_assembled(catalog_url: str | None, checkpoint_id: int, config: Config, model: str | None,
                        run: str) -> None:
    """Validate the assembled checkpoint from its replica: no single node holds every shard."""
    with assemble.assembled_snapshot(open_catalog(catalog_url), checkpoint_id, config) as merged:
        t.validate(catalog_url, checkpoint_id, merged, model or config.run_setting(run, "model"))


def _done_detail(snap: LocalSnapshot, snapshot: str, event_id: str | None, out: pipeline.IngestOutcome,
                 results: list[ReplicaResult], t0: float, mem_min: float | None, *, skipped: bool = False
                 ) -> dict[str, Any]:
    m = snap.manifest
    seconds = time.perf_counter() - t0
    uploaded = sum(r.bytes_uploaded for r in results)
    return {
        "event_id": event_id, "snapshot": snapshot, "run": m.run, "step": m.step, "node": m.node,
        "part": part_key(m.held_ranks) if is_part(m) else None, "ranks": list(m.held_ranks),
        "manifest_blake3": digest_bytes(snap.manifest_bytes), "state": str(out.state),
        "files": len(m.files), "bytes": m.total_bytes, "bytes_uploaded": uploaded,
        "bytes_reused": sum(r.bytes_reused for r in results), "seconds": round(seconds, 4),
        "throughput_bps": round(uploaded / seconds, 1) if seconds > 0 and uploaded else None,
        "memory_available_min_ratio": round(mem_min, 4) if mem_min is not None else None,
        "error": redact(out.message) if out.state in (CS.CORRUPT, CS.INVALID) else None,
        "skipped": skipped,
    }


def _result(out: pipeline.IngestOutcome) -> dict:
    return {"run": out.run, "step": out.step, "state": str(out.state), "replicas": out.replicas,
            "message": out.message}
