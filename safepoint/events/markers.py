"""Commit markers as Prefect events, emitted once, confirmed, and never lost.

Prefect has no file sensor, and an event sent while the server is unreachable is gone. So a
watcher (safepoint.events.watch) does not trust an emission: it keeps every marker it has seen in a small
on-disk spool until the *catalog* shows that an ingest of exactly that commit finished (an
`ingest.done` event, written by the flow), and drives each spooled marker through this loop:

1. emit `safepoint.checkpoint.committed` with a deterministic id (uuid5 of run, step, node and the
   manifest digest). Prefect collapses events with the same id, so re-emitting a marker whose
   first event did arrive creates no second run;
2. while a flow run for it exists (found by its `event_id` parameter) and is not finished, wait;
3. if no run showed up within `confirm_after_s`, or its run failed without finishing the ingest,
   fall back to `run_deployment(..., idempotency_key=...)`, which also collapses duplicates;
4. while the server is down, nothing is dropped: the marker stays spooled and is retried with
   backoff. Entries survive a restart of the watcher.

The flow parameters are templated from the event payload (prefect.yaml, `safepoint serve`); they
arrive as native types, so the payload carries exactly the flow's types: `to` a list of str,
`event_id` a str. A mismatch would create no run at all, and only a server warning would say so.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from safepoint.core.format import TMP_PREFIX, digest_bytes
from safepoint.local.atomic import publish, write_replace
from safepoint.local.snapshot import LocalSnapshot

if TYPE_CHECKING:
    from safepoint.catalog.store import Catalog

log = logging.getLogger("safepoint.events.markers")

EVENT = "safepoint.checkpoint.committed"
#: what the ingest flow emits when a checkpoint reaches a verdict (flows/automations.py), same resource
OUTCOME_EVENTS = {"verified": "safepoint.checkpoint.verified", "corrupt": "safepoint.checkpoint.corrupt",
                  "invalid": "safepoint.checkpoint.invalid"}
RESOURCE_PREFIX = "safepoint.checkpoint."
NODE_LABEL = "safepoint.node"
FLOW_NAME = "safepoint-ingest"
DEFAULT_DEPLOYMENT = f"{FLOW_NAME}/ingest"
# A fixed namespace: the same marker gives the same event id on every host and every restart.
NAMESPACE = uuid.UUID("5f1c2d4e-8b7a-5c3e-9d1f-0a2b3c4d5e6f")


def event_id(run: str, step: int, node: str, manifest_blake3: str) -> str:
    """Deterministic id of the commit event of one marker (one node's part, or a whole snapshot)."""
    return str(uuid.uuid5(NAMESPACE, f"{EVENT}/{run}/{step}/{node}/{manifest_blake3}"))


def resource(run: str, step: int, node: str) -> dict[str, str]:
    return {"prefect.resource.id": f"{RESOURCE_PREFIX}{run}.{step}", "prefect.resource.name": f"{run}/{step}",
            NODE_LABEL: node, "safepoint.run": run}


def trigger_parameters() -> dict[str, Any]:
    """The ingest flow's parameters, templated from the event payload (native types)."""
    return {"snapshot": "{{ event.payload.snapshot }}", "to": "{{ event.payload.to }}",
            "event_id": "{{ event.payload.event_id }}", "skip_if_verified": True}


def trigger_match(node: str | None = None) -> dict[str, str]:
    match = {"prefect.resource.id": f"{RESOURCE_PREFIX}*"}
    if node:
        match[NODE_LABEL] = node
    return match


class Status(str, Enum):
    PENDING = "pending"          # seen, not yet emitted (or the emission failed)
    EMITTED = "emitted"          # event sent; waiting for a run
    DISPATCHED = "dispatched"    # a flow run exists (from the trigger or from run_deployment)
    DONE = "done"                # the catalog holds an `ingest.done` for this commit

    def __str__(self) -> str:
        return self.value


@dataclass
class Marker:
    """One commit marker a watcher has seen, as stored in the spool (JSON)."""

    event_id: str
    snapshot: str
    run: str
    step: int
    node: str
    manifest_blake3: str
    to: list[str]
    seen_at: float
    status: Status = Status.PENDING
    emitted_at: float | None = None
    dispatches: int = 0              # run_deployment fallbacks so far
    attempts: int = 0                # emission attempts (including failed ones)
    next_try_at: float = 0.0         # backoff while the server is unreachable
    flow_run_id: str | None = None
    last_error: str | None = None
    history: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, snap: LocalSnapshot, to: list[str], node: str, now: float | None = None) -> Marker:
        m = snap.manifest
        node = m.node or node
        digest = digest_bytes(snap.manifest_bytes)
        return cls(event_id(m.run, m.step, node, digest), str(snap.root), m.run, m.step, node, digest,
                   list(to), now if now is not None else time.time())

    def payload(self) -> dict[str, Any]:
        return {"snapshot": self.snapshot, "to": list(self.to), "event_id": self.event_id, "run": self.run,
                "step": self.step, "node": self.node, "manifest_blake3": self.manifest_blake3}

    def parameters(self) -> dict[str, Any]:
        """The same parameters the trigger renders, for the run_deployment fallback."""
        return {"snapshot": self.snapshot, "to": list(self.to), "event_id": self.event_id,
                "skip_if_verified": True}

    def note(self, text: str) -> None:
        self.history = [*self.history[-19:], f"{time.strftime('%H:%M:%S')} {text}"]

    def to_json(self) -> bytes:
        d = asdict(self)
        d["status"] = self.status.value
        return json.dumps(d, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Marker:
        d = json.loads(data)
        d["status"] = Status(d["status"])
        return cls(**d)


class Spool:
    """Markers not yet confirmed, one JSON file each (written atomically), so none is lost on a crash."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, eid: str) -> Path:
        return self.folder / f"{eid}.json"

    def put(self, marker: Marker) -> None:
        write_replace(self._path(marker.event_id), marker.to_json())  # temp, fsync, rename, fsync the folder

    def has(self, eid: str) -> bool:
        return self._path(eid).exists()

    def remove(self, eid: str) -> None:
        self._path(eid).unlink(missing_ok=True)

    def all(self) -> list[Marker]:
        out = []
        for p in sorted(self.folder.glob("*.json")):
            if p.name.startswith(TMP_PREFIX):
                continue
            try:
                out.append(Marker.from_json(p.read_bytes()))
            except (ValueError, TypeError, KeyError) as e:
                log.warning("unreadable spool entry %s (%s); keeping it aside", p.name, e)
                publish(p, p.with_suffix(".bad"), sync=False)
        return out


# -- the catalog side of confirmation -------------------------------------------------------------

def ingest_finished(catalog: Catalog, marker: Marker) -> dict[str, Any] | None:
    """The `ingest.done` event of this exact commit (by event id, or by snapshot and manifest)."""
    row = catalog.get(marker.run, marker.step)
    if row is None:
        return None
    for e in reversed(catalog.events(row.id, kind="ingest.done")):
        d = e["detail"]
        if d.get("event_id") == marker.event_id or (
                d.get("snapshot") == marker.snapshot and d.get("manifest_blake3") == marker.manifest_blake3):
            return d
    return None


class Gateway(Protocol):
    """The few orchestrator calls a watcher makes (safepoint.flows.gateway.PrefectGateway), each bounded
    in time and raising on failure; tests pass a fake."""

    def warm(self) -> None: ...
    def healthy(self) -> bool: ...
    def emit(self, marker: Marker) -> None: ...
    def runs_for(self, event_ids: set[str], since: float) -> dict[str, list[tuple[str, str]]]: ...
    def dispatch(self, marker: Marker, key: str) -> str: ...


FINISHED_BAD = frozenset({"FAILED", "CRASHED", "CANCELLED", "CANCELLING"})


@dataclass
class Policy:
    confirm_after_s: float = 30.0    # no run this long after emitting: fall back to run_deployment
    retry_min_s: float = 1.0         # backoff while the server is down
    retry_max_s: float = 30.0
    max_dispatches: int = 5          # failed runs re-dispatched at most this often (then keep, report)


class Dispatcher:
    """Drives spooled markers to DONE. `tick()` never blocks for long and never drops a marker."""

    def __init__(self, catalog: Catalog, spool: Spool, gateway: Gateway, policy: Policy | None = None):
        self.catalog, self.spool, self.gateway = catalog, spool, gateway
        self.policy = policy or Policy()

    def add(self, marker: Marker) -> bool:
        """Spool a newly seen marker (False if it is already spooled)."""
        if self.spool.has(marker.event_id):
            return False
        marker.note("seen")
        self.spool.put(marker)
        return True

    def tick(self, now: float | None = None) -> list[Marker]:
        """One pass over the spool; returns the markers confirmed (and removed) in this pass."""
        now = now if now is not None else time.time()
        pending = self.spool.all()
        done: list[Marker] = []
        waiting: list[Marker] = []
        for m in pending:
            finished = ingest_finished(self.catalog, m)
            if finished is not None:
                m.status = Status.DONE
                m.note(f"ingest finished: {finished.get('state')}")
                self.spool.remove(m.event_id)
                done.append(m)
            else:
                waiting.append(m)
        if not waiting:
            return done
        due = [m for m in waiting if m.next_try_at <= now]
        if not due:
            return done
        if not self.gateway.healthy():
            for m in due:
                self._backoff(m, now, "Prefect server unreachable")
            return done
        # Fresh markers are emitted at once: if an earlier event for one did arrive, the server
        # collapses the duplicate (same id), and the flow skips a commit already verified.
        for m in [m for m in due if m.status is Status.PENDING]:
            self._emit(m, now)
        due = [m for m in due if m.status is not Status.PENDING and m.next_try_at <= now]
        if not due:
            return done
        try:
            runs = self.gateway.runs_for({m.event_id for m in due}, min(m.seen_at for m in due))
        except Exception as e:  # noqa: BLE001 - the server went away mid-pass
            for m in due:
                self._backoff(m, now, f"listing flow runs failed: {e.__class__.__name__}: {e}"[:300])
            return done
        for m in due:
            self._advance(m, runs.get(m.event_id, []), now)
        return done

    def _backoff(self, m: Marker, now: float, why: str) -> None:
        m.attempts += 1
        delay = min(self.policy.retry_max_s, self.policy.retry_min_s * 2 ** min(m.attempts, 10))
        m.next_try_at = now + delay
        if m.last_error != why:
            m.note(why)
        m.last_error = why
        if m.status is Status.EMITTED and m.emitted_at is not None and now - m.emitted_at > self.policy.confirm_after_s:
            m.status = Status.PENDING  # whatever was sent before the outage may be lost: send again
        self.spool.put(m)

    def _advance(self, m: Marker, runs: list[tuple[str, str]], now: float) -> None:
        active = [r for r in runs if r[1] not in FINISHED_BAD and r[1] != "COMPLETED"]
        if active:
            if m.status is not Status.DISPATCHED or m.flow_run_id != active[0][0]:
                m.status, m.flow_run_id = Status.DISPATCHED, active[0][0]
                m.note(f"flow run {active[0][0]} {active[0][1].lower()}")
                self.spool.put(m)
            return
        if runs:
            if ingest_finished(self.catalog, m) is not None:
                m.next_try_at = now  # it finished while we looked: confirmed on the next pass
                return
            # Every run for this marker ended without recording the ingest: run it again.
            self._dispatch(m, now, f"previous run {runs[0][0]} ended {runs[0][1].lower()}")
            return
        if m.status is Status.PENDING:
            self._emit(m, now)
            return
        since = now - (m.emitted_at or m.seen_at)
        if since >= self.policy.confirm_after_s:
            self._dispatch(m, now, f"no flow run {since:.0f}s after the event")
        else:
            m.next_try_at = now + 1.0

    def _emit(self, m: Marker, now: float) -> None:
        try:
            self.gateway.emit(m)
        except Exception as e:  # noqa: BLE001 - not taken: keep it and retry later
            self._backoff(m, now, f"emit failed: {e.__class__.__name__}")
            return
        m.status, m.emitted_at, m.last_error = Status.EMITTED, now, None
        m.attempts += 1
        m.next_try_at = now + 1.0
        m.note(f"event {m.event_id} emitted")
        self.spool.put(m)

    def _dispatch(self, m: Marker, now: float, why: str) -> None:
        if m.dispatches >= self.policy.max_dispatches:
            self._backoff(m, now, f"{why}; gave up re-dispatching after {m.dispatches} runs (kept in spool)")
            m.next_try_at = now + self.policy.retry_max_s
            self.spool.put(m)
            return
        key = m.event_id if m.dispatches == 0 else f"{m.event_id}#{m.dispatches}"
        try:
            run_id = self.gateway.dispatch(m, key)
        except Exception as e:  # noqa: BLE001
            self._backoff(m, now, f"run_deployment failed: {e.__class__.__name__}: {e}"[:300])
            return
        m.dispatches += 1
        m.status, m.flow_run_id, m.last_error = Status.DISPATCHED, run_id, None
        m.next_try_at = now + 1.0
        m.note(f"{why}: run_deployment -> {run_id}")
        self.spool.put(m)
