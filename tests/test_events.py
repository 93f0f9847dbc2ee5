"""Event emission and confirmation without a server: ids, spool, the dispatcher's state machine, the watcher.

A fake gateway stands in for Prefect (it can be down, lose events, and report runs); the catalog is
real. The same code against a real `prefect server start` is in tests/test_events_server.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from safepoint import commit
from safepoint.events.markers import (
    Dispatcher,
    Marker,
    Policy,
    Spool,
    Status,
    event_id,
    ingest_finished,
    trigger_parameters,
)
from safepoint.events.watch import ChangeWaiter, Emit, Watcher
from safepoint.local.snapshot import LocalSnapshot


class FakeGateway:
    """Prefect as the dispatcher sees it: can be down, can drop events, reports runs by event id."""

    def __init__(self):
        self.up = True
        self.deliver = True           # an emitted event becomes a run
        self.emitted: list[str] = []
        self.dispatched: list[tuple[str, str]] = []  # (event id, idempotency key)
        self.runs: dict[str, list[tuple[str, str]]] = {}

    def healthy(self) -> bool:
        return self.up

    def emit(self, m: Marker) -> None:
        if not self.up:
            raise ConnectionRefusedError("down")
        self.emitted.append(m.event_id)
        if self.deliver and m.event_id not in self.runs:  # same id: collapsed, as the server does
            self.runs[m.event_id] = [(f"run-{len(self.emitted)}", "SCHEDULED")]

    def runs_for(self, ids, since):
        if not self.up:
            raise ConnectionRefusedError("down")
        return {i: list(r) for i, r in self.runs.items() if i in ids}

    def dispatch(self, m: Marker, key: str) -> str:
        if not self.up:
            raise ConnectionRefusedError("down")
        self.dispatched.append((m.event_id, key))
        run = f"fallback-{len(self.dispatched)}"
        self.runs.setdefault(m.event_id, []).insert(0, (run, "SCHEDULED"))
        return run


def committed(root: Path, run: str = "r", step: int = 1, **kw) -> LocalSnapshot:
    folder = root / run / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "w.bin").write_bytes(b"x" * 100 + bytes([step % 256]))
    commit(folder, run, step, **kw)
    return LocalSnapshot.open(folder)


def finish(catalog, m: Marker, state: str = "verified") -> None:
    """What the ingest flow records at its end."""
    row = catalog.get(m.run, m.step)
    if row is None:
        from safepoint.ops.steps import register

        row = register(catalog, LocalSnapshot.open(m.snapshot))
    catalog.add_event("ingest.done", checkpoint_id=row.id, detail={
        "event_id": m.event_id, "snapshot": m.snapshot, "manifest_blake3": m.manifest_blake3, "state": state})


def test_event_ids_are_deterministic_per_commit_and_node(tmp_path):
    snap = committed(tmp_path)
    a = Marker.of(snap, ["file:///d"], "n0", now=1.0)
    b = Marker.of(LocalSnapshot.open(snap.root), ["file:///other"], "n0", now=2.0)
    assert a.event_id == b.event_id  # same marker, same id, whatever else differs
    assert Marker.of(snap, ["file:///d"], "n1").event_id != a.event_id
    assert event_id("r", 1, "n0", "0" * 64) != event_id("r", 1, "n0", "1" * 64)  # a re-commit is a new event
    # A part's node comes from its manifest, not from the watcher's default.
    part = committed(tmp_path, step=2, world_size=2, ranks=[1], node="gpu7")
    assert Marker.of(part, [], "n0").node == "gpu7"


def test_payload_carries_the_flow_parameters_with_their_native_types(tmp_path):
    m = Marker.of(committed(tmp_path), ["file:///a", "file:///b"], "n0")
    p = m.payload()
    assert isinstance(p["to"], list) and all(isinstance(u, str) for u in p["to"])
    assert isinstance(p["event_id"], str) and isinstance(p["step"], int)
    # Every templated parameter is rendered from a payload field of the right type.
    for name, template in trigger_parameters().items():
        if isinstance(template, str) and template.startswith("{{ event.payload."):
            field = template.removeprefix("{{ event.payload.").removesuffix(" }}")
            assert field in p, name
    from safepoint.flows.ingest import ingest

    params = set(ingest.parameters.properties)
    assert set(trigger_parameters()) <= params and set(m.parameters()) <= params


def test_spool_roundtrip_survives_a_new_process(tmp_path):
    m = Marker.of(committed(tmp_path), ["file:///d"], "n0")
    m.note("seen")
    Spool(tmp_path / "spool").put(m)
    again = Spool(tmp_path / "spool").all()
    assert again == [m]
    (tmp_path / "spool" / "junk.json").write_text("{not json")
    assert Spool(tmp_path / "spool").all() == [m]  # a bad entry is set aside, not fatal
    assert (tmp_path / "spool" / "junk.bad").exists()


def test_marker_is_kept_while_the_server_is_down_then_emitted(tmp_path, sqlite_catalog):
    gw = FakeGateway()
    gw.up = False
    d = Dispatcher(sqlite_catalog, Spool(tmp_path / "spool"), gw, Policy(retry_min_s=1, retry_max_s=4))
    m = Marker.of(committed(tmp_path), ["file:///d"], "n0", now=100.0)
    assert d.add(m) and not d.add(m)
    for t in (100, 101, 103, 107):
        assert d.tick(now=t) == []
    (kept,) = d.spool.all()
    assert kept.status is Status.PENDING and "unreachable" in kept.last_error and gw.emitted == []
    assert kept.next_try_at - 107 <= 4  # backoff is capped
    gw.up = True
    d.tick(now=200)
    (kept,) = d.spool.all()
    assert gw.emitted == [m.event_id] and kept.status is Status.EMITTED
    d.tick(now=202)
    assert d.spool.all()[0].status is Status.DISPATCHED
    finish(sqlite_catalog, m)
    (done,) = d.tick(now=203)
    assert done.event_id == m.event_id and d.spool.all() == []


def test_lost_event_falls_back_to_run_deployment_with_the_event_id_as_key(tmp_path, sqlite_catalog):
    gw = FakeGateway()
    gw.deliver = False  # the server took the event but no run came of it
    d = Dispatcher(sqlite_catalog, Spool(tmp_path / "spool"), gw, Policy(confirm_after_s=30))
    m = Marker.of(committed(tmp_path), ["file:///d"], "n0", now=0.0)
    d.add(m)
    d.tick(now=1)
    d.tick(now=20)
    assert gw.dispatched == []
    d.tick(now=40)
    assert gw.dispatched == [(m.event_id, m.event_id)]
    # The fallback run crashes: re-dispatched under a new key, never more than max_dispatches.
    gw.runs[m.event_id] = [("fallback-1", "CRASHED")]
    d.tick(now=50)
    assert gw.dispatched[-1] == (m.event_id, f"{m.event_id}#1")
    assert len(d.spool.all()) == 1
    finish(sqlite_catalog, m, "corrupt")  # any finished ingest confirms, whatever its outcome
    assert [x.event_id for x in d.tick(now=60)] == [m.event_id]


def test_run_in_progress_is_waited_for_not_duplicated(tmp_path, sqlite_catalog):
    gw = FakeGateway()
    d = Dispatcher(sqlite_catalog, Spool(tmp_path / "spool"), gw, Policy(confirm_after_s=5))
    m = Marker.of(committed(tmp_path), ["file:///d"], "n0", now=0.0)
    d.add(m)
    d.tick(now=1)
    gw.runs[m.event_id] = [("run-1", "RUNNING")]
    for t in range(2, 200, 7):
        d.tick(now=t)
    assert gw.dispatched == [] and gw.emitted == [m.event_id]


def test_emitted_before_an_outage_is_emitted_again_after(tmp_path, sqlite_catalog):
    """An event sent just before the server died may be lost: after the outage it is sent again."""
    gw = FakeGateway()
    gw.deliver = False
    d = Dispatcher(sqlite_catalog, Spool(tmp_path / "spool"), gw, Policy(confirm_after_s=10, retry_max_s=2))
    m = Marker.of(committed(tmp_path), ["file:///d"], "n0", now=0.0)
    d.add(m)
    d.tick(now=1)
    gw.up = False
    for t in (5, 9, 13, 17):
        d.tick(now=t)
    gw.up, gw.deliver = True, True
    d.tick(now=30)
    assert gw.emitted == [m.event_id, m.event_id]  # same id twice: the server collapses duplicates
    assert d.spool.all()[0].status is Status.EMITTED


def test_ingest_done_matches_by_snapshot_and_manifest_too(tmp_path, sqlite_catalog):
    """A marker ingested by hand (`safepoint ingest`, no event id) counts as done."""
    snap = committed(tmp_path)
    m = Marker.of(snap, ["file:///d"], "n0")
    assert ingest_finished(sqlite_catalog, m) is None
    from safepoint.ops.steps import register

    row = register(sqlite_catalog, snap)
    sqlite_catalog.add_event("ingest.done", checkpoint_id=row.id, detail={
        "event_id": None, "snapshot": str(snap.root), "manifest_blake3": m.manifest_blake3, "state": "verified"})
    assert ingest_finished(sqlite_catalog, m)["state"] == "verified"


def test_watcher_spools_committed_folders_only_once(tmp_path, sqlite_catalog):
    root = tmp_path / "root"
    root.mkdir()
    gw = FakeGateway()
    d = Dispatcher(sqlite_catalog, Spool(tmp_path / "spool"), gw)
    w = Watcher(root, sqlite_catalog, Emit(sqlite_catalog, d, ["file:///d"], "n0"), timeouts_every=None,
                use_inotify=False)
    (root / "r" / "partial").mkdir(parents=True)
    (root / "r" / "partial" / "w.bin").write_bytes(b"no marker")
    assert w.scan() == 0
    snap = committed(root, step=3)
    assert w.scan() == 1 and w.scan() == 0
    w.pass_once(now=time.time())
    assert gw.emitted == [Marker.of(snap, [], "n0").event_id]
    # A restarted watcher finds the spooled marker and does not emit a second event for it.
    w2 = Watcher(root, sqlite_catalog, Emit(sqlite_catalog, d, ["file:///d"], "n0"), timeouts_every=None,
                 use_inotify=False)
    assert w2.scan() == 0
    # A bad marker is reported, not emitted.
    bad = root / "r" / "bad"
    bad.mkdir()
    (bad / "COMMITTED").write_text("{}")
    said = []
    w2.say = said.append
    assert w2.scan() == 0 and any("not emitting" in s for s in said)


def test_inotify_wakes_the_watcher_on_a_marker(tmp_path):
    pytest.importorskip("watchfiles")
    root = tmp_path / "root"
    root.mkdir()
    waiter = ChangeWaiter(root)
    try:
        assert waiter.mode == "inotify"
        time.sleep(0.5)  # let the watch settle
        threading.Timer(0.3, lambda: committed(root, step=9)).start()
        t0 = time.monotonic()
        assert waiter.wait(20) is True
        assert time.monotonic() - t0 < 20
    finally:
        waiter.close()


def test_polling_waiter_just_sleeps(tmp_path):
    waiter = ChangeWaiter(tmp_path, use_inotify=False)
    assert waiter.mode == "polling"
    assert waiter.wait(0.05) is False


def test_served_deployments_match_prefect_yaml():
    """`safepoint serve` and prefect.yaml declare the same deployments, triggers and parameters."""
    import yaml

    from safepoint.flows.deployments import build

    served = {d.name: d for d in build(["file:///d"], scrub_every_s=3600, completeness_every_s=60)}
    assert set(served) == {"ingest", "scrub", "completeness"}
    (trigger,) = served["ingest"].triggers
    assert trigger.expect == {"safepoint.checkpoint.committed"}
    assert trigger.parameters == trigger_parameters()
    assert served["scrub"].schedules and served["completeness"].schedules
    per_node = {d.name: d for d in build([], node="n7")}
    assert set(per_node) == {"ingest-n7", "scrub-n7", "completeness-n7"}
    assert per_node["ingest-n7"].triggers[0].match.root["safepoint.node"] == "n7"

    doc = yaml.safe_load((Path(__file__).resolve().parents[1] / "prefect.yaml").read_text())
    deps = {d["name"]: d for d in doc["deployments"]}
    (yaml_trigger,) = deps["ingest"]["triggers"]
    assert yaml_trigger["parameters"] == trigger_parameters()
    assert yaml_trigger["expect"] == ["safepoint.checkpoint.committed"]
    assert deps["scrub"]["entrypoint"] == "flows/scrub.py:scrub_replicas"
    assert deps["completeness"]["entrypoint"] == "flows/completeness.py:check_completeness"
