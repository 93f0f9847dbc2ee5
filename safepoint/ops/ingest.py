"""Ingest, written once: commit marker -> replicate -> verify -> validate -> catalog.

One composition for a whole snapshot and for one node's part of a multi-node checkpoint. The CLI,
the tests and the Prefect flow (safepoint.flows.ingest) all run `ingest` below; the flow passes a
step runner that makes each step a Prefect task, with retries. Every run ends with an
`ingest.done` catalog event (what event-driven watchers wait for), whatever the outcome.

The dry-run load (validation) reads the local bytes while the upload reads them, in a thread of its
own beside the steps (its reader is a sandboxed child), so the whole ingest costs about one upload;
its report is recorded, and the checkpoint validated, only once a replica is verified.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safepoint.catalog.store import Catalog
from safepoint.core.config import Config, load_config
from safepoint.core.errors import FormatError, SafepointError
from safepoint.core.format import Manifest, digest_bytes
from safepoint.core.redact import redact, redact_url
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.destinations.check import check_destinations
from safepoint.destinations.parts import check_part, is_part, part_key
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops import assemble, export, progress, reconcile, steps
from safepoint.ops.leases import HostLimit, ingest_leases
from safepoint.ops.metrics import MemorySampler
from safepoint.ops.replicate import ReplicaResult
from safepoint.ops.runner import INLINE, StepRunner
from safepoint.ops.steps import IngestOutcome
from safepoint.ops.validation import judge, validate_checkpoint

log = logging.getLogger("safepoint")

__all__ = ["IngestOutcome", "IngestReport", "ingest"]


@dataclass(frozen=True)
class IngestReport:
    """What one ingest did: the outcome, plus the `ingest.done` detail (also the flow's artifact)."""

    outcome: IngestOutcome
    checkpoint_id: int | None
    detail: dict[str, Any]


def ingest(folder: str | Path, destinations: list[str], catalog: Catalog, config: Config | None = None, *,
           model: str | None = None, event_id: str | None = None, skip_if_verified: bool = False,
           runner: StepRunner = INLINE) -> IngestOutcome:
    """Ingest one committed snapshot folder (or one node's part) into every destination."""
    return run_ingest(folder, destinations, catalog, config, model=model, event_id=event_id,
                      skip_if_verified=skip_if_verified, runner=runner).outcome


@dataclass(frozen=True)
class Prepared:
    """What a caller in this process already read and checked for one ingest (the CLI, before Prefect
    starts): the snapshot opened, the destinations resolved, with their credentials, and checked. The
    ingest flow takes it from `PREPARED` instead of reading and checking all of it again; it never
    becomes a flow parameter (it holds credentials)."""

    snap: LocalSnapshot
    to: list[str]
    config: Config

    def serves(self, snapshot: str | Path) -> bool:
        return Path(snapshot).resolve() == self.snap.root


PREPARED: ContextVar[Prepared | None] = ContextVar("safepoint_prepared_ingest", default=None)


def run_ingest(folder: str | Path, destinations: list[str], catalog: Catalog, config: Config | None = None, *,
               model: str | None = None, event_id: str | None = None, skip_if_verified: bool = False,
               runner: StepRunner = INLINE, prepared: Prepared | None = None) -> IngestReport:
    """`ingest`, returning the detail recorded with `ingest.done` as well. `prepared`: the snapshot and the
    destinations (resolved and checked) of a caller that has them already (`destinations` and `config` unused)."""
    if prepared is not None:
        config, to = prepared.config, list(prepared.to)
    else:
        config = config or load_config()
        to = list(destinations) or list(config.section("ingest").get("to", []))
    if not to:
        raise ValueError("no destination: pass `to` or set [ingest] to = [...] in config.toml")
    if prepared is None:
        check_destinations(to, config.storage_options)  # before any state changes: a bad one is one clear error
    t0 = time.perf_counter()
    snapshot = str(folder)
    try:
        snap = prepared.snap if prepared is not None else LocalSnapshot.open(folder)
        if is_part(snap.manifest):
            check_part(snap.manifest)  # a part that breaks the layout rules is refused like a broken folder
    except FormatError as e:
        log.error("not ingesting %s: %s", snapshot, e)
        row = steps.quarantine(catalog, folder, str(e))  # corrupt: watchers stop
        if row is not None:  # an event-driven watcher waits for this record, whatever the outcome
            record_done(catalog, row.id, {"event_id": event_id, "snapshot": snapshot, "run": row.run,
                                          "step": row.step, "state": str(row.state), "error": redact(str(e))})
        raise
    m = snap.manifest
    # A part restored from the whole (a fleet restart) is delivered already: replicating it again
    # could only collide with the part it was cut from.
    if (skip_if_verified or "part_of" in m.meta) and already_done(catalog, snap, to):
        row = catalog.get(m.run, m.step)
        log.info("%s/%s is already verified; nothing to do", row.run, row.step)
        out = steps.outcome(catalog, row.id, "already verified", part=_part(m))
        detail = done_detail(snap, snapshot, event_id, out, [], t0, None, skipped=True)
        record_done(catalog, row.id, detail)
        return IngestReport(out, row.id, detail)

    factory = model or config.run_setting(m.run, "model")
    # The dry-run load reads the local bytes while the upload does (one page-cache pass, overlapped);
    # its report is recorded only once the replicas are verified. Leaving this block waits for it.
    with MemorySampler() as mem, ThreadPoolExecutor(1, thread_name_prefix="safepoint-validate") as beside:
        # Repair what a crashed earlier attempt left at these destinations (scoped, cheap), then register.
        # Both run in the ingest itself: neither retries nor shows anything a task run would add.
        reconcile_scope(catalog, m.run, m.step, to, config)
        checkpoint_id = steps.register(catalog, snap).id
        judged = None if is_part(m) else beside.submit(judge, catalog, checkpoint_id, snap, model=factory,
                                                         config=config)
        limit = getattr(runner, "host_limit", None)  # Prefect's global concurrency limit, where there is one
        answers = runner.map(REPLICATE, replicate_one,
                             [(catalog, checkpoint_id, snap, url, config, limit) for url in to])
        results = [_as_result(url, a) for url, a in zip(to, answers)]
        end = Ending(snap, snapshot, event_id, factory, t0, mem)
        out, detail = runner.run(VALIDATE, settle_validate_record, catalog, checkpoint_id, results, to, config, end,
                                 judged)
    export.after_ingest(catalog, checkpoint_id, config)  # [export.*] trackers: verified ones only, never raises
    log.info("%s/%s ended %s", out.run, out.step, out.state)
    return IngestReport(out, checkpoint_id, detail)


#: The ingest's two steps a runner sees (Prefect: two task runs, about 3 events each; issue 35): the
#: copies, each read back (per destination, retried), then the verdict and its record.
REPLICATE = "replicate+verify"
VALIDATE = "validate+record"


@dataclass(frozen=True)
class Ending:
    """What the last step needs besides the catalog and the copies' results."""

    snap: LocalSnapshot
    snapshot: str
    event_id: str | None
    factory: str | None
    t0: float
    mem: MemorySampler


def settle_validate_record(catalog: Catalog, checkpoint_id: int, results: list[ReplicaResult], to: list[str],
                           config: Config, end: Ending, judged: Future | None = None
                           ) -> tuple[IngestOutcome, dict[str, Any]]:
    """Settle the copies (a part: assemble the set when it is complete), validate when due, and record
    `ingest.done`: one step, since none of these retries on its own and each says what it did in the log."""
    snap, m = end.snap, end.snap.manifest
    timings: dict[str, float] = {}
    t = time.perf_counter()
    if is_part(m):
        settled = assemble.settle_part(catalog, checkpoint_id, snap, results, to, config)
        timings["verify"] = time.perf_counter() - t
        log.info("%s/%s part %s: %s (%s)", m.run, m.step, part_key(m.held_ranks), settled.state, settled.message)
        if settled.won:
            t = time.perf_counter()
            assemble.validate_assembled(catalog, checkpoint_id, config, end.factory)
            timings["validate"] = time.perf_counter() - t
    elif steps.settle(catalog, checkpoint_id, results) is CS.REPLICATED:
        timings["verify"] = time.perf_counter() - t
        t = time.perf_counter()
        validate_checkpoint(catalog, checkpoint_id, snap, model=end.factory, config=config, judged=judged)
        timings["validate"] = time.perf_counter() - t
    elif judged is not None:
        judged.cancel()  # no verified copy: the dry-run load has nothing to decide
    out = steps.outcome(catalog, checkpoint_id, part=_part(m))
    detail = done_detail(snap, end.snapshot, end.event_id, out, results, end.t0, end.mem.min_ratio)
    record_done(catalog, checkpoint_id, detail)
    log.info("%s/%s%s: %s", m.run, m.step, f" part {_part(m)}" if is_part(m) else "",
             ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()) or "not replicated")
    return out, detail


def _part(m: Manifest) -> str | None:
    return part_key(m.held_ranks) if is_part(m) else None


def replicate_one(catalog: Catalog, checkpoint_id: int, snap: LocalSnapshot, url: str,
                  config: Config, host_limit: HostLimit | None = None) -> ReplicaResult:
    """Replicate a whole snapshot, or this node's part of a multi-node one, under the ingest leases.

    I/O failures raise (a flow's runner retries them); the composition turns a final failure into
    a `failed` replica, so the other destinations still settle the checkpoint.
    """
    with ingest_leases(catalog, snap.manifest, url, config, host_limit):
        if is_part(snap.manifest):
            return assemble.replicate_part_to(catalog, checkpoint_id, snap, url, config, progress=progress.hook(url))
        return steps.replicate_to(catalog, checkpoint_id, snap, url, config, progress=progress.hook(url))


def _as_result(url: str, answer: ReplicaResult | BaseException) -> ReplicaResult:
    if isinstance(answer, (OSError, SafepointError)):
        return steps.failed_result(url, answer)
    if isinstance(answer, BaseException):
        raise answer
    return answer


def reconcile_scope(catalog: Catalog, run: str, step: int, to: list[str], config: Config) -> dict[str, Any]:
    """Reconcile one (run, step) at the destinations an ingest is about to write to.

    Scoped and cheap: one listing of `<dest>/<run>/<step>/` per destination. It adopts or confirms a
    replica a crashed ingest committed, marks vanished ones, and removes orphans older than the
    grace period (`[reconcile] grace_s`, default 3600). It never finishes or repairs here: the
    ingest that follows does that work. Never fails the ingest: problems are logged.
    """
    grace = float(config.section("reconcile").get("grace_s", reconcile.GRACE_S))
    try:
        report = reconcile.reconcile(catalog, to, config, grace_s=grace, scope=(run, step), finish=False,
                                     repair=False)
    except (OSError, SafepointError, ValueError) as e:
        log.warning("reconcile of %s/%s skipped: %s", run, step, redact(str(e)))
        return {"error": redact(str(e))}
    done = dict(report.actions())
    if any(s.done for s in report.steps) or report.errors:
        log.info("reconcile %s/%s: %s%s", run, step, done, f"; errors: {report.errors}" if report.errors else "")
    return done


def record_done(catalog: Catalog, checkpoint_id: int, detail: dict[str, Any]) -> None:
    """The `ingest.done` catalog event: what watchers wait for to drop a marker from their spool."""
    catalog.add_event("ingest.done", checkpoint_id=checkpoint_id, detail=detail)


def already_done(catalog: Catalog, snap: LocalSnapshot, to: list[str]) -> bool:
    """This exact commit is verified everywhere asked: a duplicate trigger has nothing to do."""
    m = snap.manifest
    row = catalog.get(m.run, m.step)
    if row is None or row.state is not CS.VERIFIED:
        return False
    digest = digest_bytes(snap.manifest_bytes)
    if is_part(m):
        mine = {r["rank"]: r["manifest_blake3"] for r in catalog.ranks(row.id)}
        if any(mine.get(r) != digest for r in m.held_ranks) and not _cut_from(catalog, row, m):
            return False
    elif row.manifest_blake3 != digest:
        return False
    verified = {r.destination for r in catalog.replicas(row.id) if r.state is RS.VERIFIED}
    return all(redact_url(u) in verified for u in to)


def _cut_from(catalog: Catalog, row: Any, m: Manifest) -> bool:
    """A part that a restore cut from this checkpoint's bound whole: every rank delivered, every file the catalog's."""
    if row.manifest_blake3 is None or m.meta.get("part_of") != row.manifest_blake3:
        return False
    delivered = {r["rank"] for r in catalog.ranks(row.id)}
    files = {f.path: f for f in catalog.files(row.id)}
    return set(m.held_ranks) <= delivered and all(files.get(f.path) == f for f in m.files)


def done_detail(snap: LocalSnapshot, snapshot: str, event_id: str | None, out: IngestOutcome,
                results: list[ReplicaResult], t0: float, mem_min: float | None, *, skipped: bool = False
                ) -> dict[str, Any]:
    m = snap.manifest
    seconds = time.perf_counter() - t0
    uploaded = sum(r.bytes_uploaded for r in results)
    return {
        "event_id": event_id, "snapshot": snapshot, "run": m.run, "step": m.step, "node": m.node,
        "part": _part(m), "ranks": list(m.held_ranks),
        "manifest_blake3": digest_bytes(snap.manifest_bytes), "state": str(out.state),
        "files": len(m.files), "bytes": m.total_bytes, "bytes_uploaded": uploaded,
        "bytes_reused": sum(r.bytes_reused for r in results), "seconds": round(seconds, 4),
        "throughput_bps": round(uploaded / seconds, 1) if seconds > 0 and uploaded else None,
        "memory_available_min_ratio": round(mem_min, 4) if mem_min is not None else None,
        "error": redact(out.message) if out.state in (CS.CORRUPT, CS.INVALID) else None,
        "skipped": skipped,
    }
