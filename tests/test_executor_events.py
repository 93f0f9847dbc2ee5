"""How many events Prefect stores for one ingested part (issue 35: at most 12, about 34 before).

One node's part of a two-node checkpoint is ingested in this process as the ingest flow, against
the session's Prefect server; every event related to that flow run (its own states, its tasks',
the verdict) is counted from the server's event store.
"""

from __future__ import annotations

import time

import httpx
import torch

from safepoint import commit

MAX_EVENTS_PER_PART = 12


def write_part(root, node: str, ranks: list[int], world: int):
    folder = root / node / "run" / "step-1"
    folder.mkdir(parents=True)
    for r in ranks:
        torch.save({"model": {f"w{r}": torch.ones(8, 8) * r}, "step": 1}, folder / f"rank{r}.pt")
    commit(folder, "run", 1, world_size=world, ranks=ranks, node=node)
    return folder


def related_events(api: str, flow_run_id: str) -> list[dict]:
    flt = {"related": {"id": [f"prefect.flow-run.{flow_run_id}"]}}
    r = httpx.post(f"{api}/events/filter", json={"filter": flt, "limit": 50}, timeout=10)
    r.raise_for_status()
    ev = r.json()["events"]
    flt = {"resource": {"id": [f"prefect.flow-run.{flow_run_id}"]}}
    r = httpx.post(f"{api}/events/filter", json={"filter": flt, "limit": 50}, timeout=10)
    r.raise_for_status()
    return ev + r.json()["events"]


#: the steps a part's flow run shows in the UI, each a task run
STEPS = {"replicate+verify", "validate+record"}


def events_of(api: str, flow_run_id: str, settle_s: float = 1.5) -> list[dict]:
    """Every event of one flow run, once the server has stored them all and the count holds still.

    The server stores events in batches, asynchronously, and the flow run's own states (set through
    the API) can be stored before its task runs' (sent by this process over the events socket): the
    run's Completed event alone does not mean the rest are in."""
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()
    deadline = time.monotonic() + 60
    last, since, events = -1, time.monotonic(), []
    while time.monotonic() < deadline:
        events = related_events(api, flow_run_id)
        names = [e["event"] for e in events]
        if len(events) != last:
            last, since = len(events), time.monotonic()
        elif ("prefect.flow-run.Completed" in names and names.count("prefect.task-run.Completed") >= len(STEPS)
              and time.monotonic() - since >= settle_s):
            return events
        time.sleep(0.25)
    raise AssertionError(f"the events of flow run {flow_run_id} did not settle: {sorted(e['event'] for e in events)}")


def test_a_part_costs_at_most_12_events_and_the_steps_still_show(prefect_api, sqlite_catalog_url, tmp_path):
    """Both parts of a two-node checkpoint, as the warm lane runs them (an in-process flow run, no
    heartbeat): the first part delivered, the second assembling, validating and judging the set."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from safepoint.flows.ingest import ingest

    to = [(tmp_path / "durable").as_uri()]
    for node, ranks, verdict in (("n0", [0], "replicating"), ("n1", [1], "verified")):
        folder = write_part(tmp_path / "nodes", node, ranks, 2)
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            state = ingest(snapshot=str(folder), to=to, catalog_url=sqlite_catalog_url, return_state=True)
        assert state.is_completed(), state
        assert state.result()["state"] == verdict
        events = events_of(prefect_api, str(state.state_details.flow_run_id))
        names = sorted(e["event"] for e in events)
        assert len(names) <= MAX_EVENTS_PER_PART, (node, names)
        tasks = {e["resource"]["prefect.resource.name"].rsplit("-", 1)[0] for e in events
                 if e["event"].startswith("prefect.task-run")}  # run names: TASK-abc
        assert tasks == STEPS, tasks  # the UI still shows each step
        if verdict == "verified":
            assert "safepoint.checkpoint.verified" in names, names
