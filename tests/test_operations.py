"""Each operation is written once: run inline (CLI, tests) and as a Prefect flow, it leaves the same
catalog events and states (docs/architecture.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from safepoint import commit
from safepoint.catalog.store import Catalog, open_catalog
from safepoint.core.config import Config
from safepoint.core.states import CheckpointState as CS
from safepoint.ops.ingest import ingest
from safepoint.ops.retention import retention_pass
from safepoint.ops.scrub import scrub_pass

#: event details that differ between two runs by nature (time, sizes of a run, ids, paths)
VOLATILE = {"seconds", "throughput_bps", "memory_available_min_ratio", "snapshot", "event_id", "url", "at",
            "bytes_uploaded", "bytes_reused", "started_at", "destination", "folder", "holder"}


def _folder(root: Path, step: int) -> Path:
    folder = root / f"s{step}"
    folder.mkdir(parents=True)
    torch.save({"w": torch.full((8, 8), float(step)), "b": torch.zeros(8)}, folder / "model.pt")
    commit(folder, "ops", step)
    return folder


def _shape(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in sorted(value.items()) if k not in VOLATILE}
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return value


def journal(catalog: Catalog) -> list[tuple[str, Any]]:
    """The catalog's events, in order, without what differs between two runs by nature."""
    return [(e["kind"], _shape(e["detail"])) for e in catalog.events()]


def states(catalog: Catalog) -> list[tuple[int, str]]:
    return sorted((v.step, str(v.state)) for v in catalog.list_checkpoints("ops"))


def test_ingest_scrub_and_retention_leave_the_same_events_inline_and_as_flows(tmp_path, prefect_api):
    from safepoint.flows.ingest import ingest as ingest_flow
    from safepoint.flows.retention import retention as retention_flow
    from safepoint.flows.scrub import scrub_replicas

    folders = [_folder(tmp_path / "local", s) for s in (1, 2, 3)]
    inline_cat = open_catalog(f"sqlite:///{tmp_path / 'inline.db'}")
    flow_url = f"sqlite:///{tmp_path / 'flow.db'}"
    flow_cat = open_catalog(flow_url)
    inline_dest, flow_dest = (tmp_path / "inline").as_uri(), (tmp_path / "flow").as_uri()

    for folder in folders:
        assert ingest(folder, [inline_dest], inline_cat).state is CS.VERIFIED
        assert ingest_flow(snapshot=str(folder), to=[flow_dest], catalog_url=flow_url)["state"] == "verified"
    assert states(inline_cat) == states(flow_cat) == [(1, "verified"), (2, "verified"), (3, "verified")]
    kinds = [k for k, _ in journal(inline_cat)]
    assert kinds.count("ingest.done") == 3, kinds
    assert journal(inline_cat) == journal(flow_cat)

    inline_scrub = scrub_pass(inline_cat, Config(), subset="1/1")
    flow_scrub = scrub_replicas(subset="1/1", catalog_url=flow_url)
    assert inline_scrub["problems"] == flow_scrub["problems"] == 0
    assert inline_scrub["replicas"] == flow_scrub["replicas"] == 3
    assert journal(inline_cat) == journal(flow_cat)

    policy = {"keep_last": 2}
    inline_ret = retention_pass(inline_cat, Config(), policy=policy)
    flow_ret = retention_flow(policy=policy, catalog_url=flow_url)
    assert [len(r["pruned"]) for r in inline_ret["runs"]] == [len(r["pruned"]) for r in flow_ret["runs"]] == [1]
    assert states(inline_cat) == states(flow_cat) == [(1, "pruned"), (2, "verified"), (3, "verified")]
    assert journal(inline_cat) == journal(flow_cat)
