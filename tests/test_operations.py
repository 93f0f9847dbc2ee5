"""Each operation is written once: run inline (CLI, tests) and as a Prefect flow, it leaves the same
catalog events and states and comes to the same outcome and exit code (docs/architecture.md).

Each test builds two worlds alike (local folders, a file:// destination, a SQLite catalog) under
`inline/` and `flow/`, runs the operation inline in one and as its flow in the other (one Prefect
server for the session: `prefect_api`), and compares what they left, paths made relative to each world.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from safepoint import commit
from safepoint.catalog.store import Catalog, open_catalog
from safepoint.core.config import Config
from safepoint.core.exits import EXIT_BAD, EXIT_ERROR, EXIT_OK
from safepoint.core.states import BAD_END_STATES
from safepoint.core.states import CheckpointState as CS
from safepoint.ops.ingest import ingest
from safepoint.ops.retention import retention_pass
from safepoint.ops.scrub import scrub_pass

#: event details that differ between two runs by nature (time, sizes of a run, ids, paths)
VOLATILE = {"seconds", "throughput_bps", "memory_available_min_ratio", "snapshot", "event_id", "url", "at",
            "bytes_uploaded", "bytes_reused", "started_at", "destination", "folder", "holder", "manifest_blake3"}


def _folder(root: Path, step: int, run: str = "ops") -> Path:
    folder = root / f"s{step}"
    folder.mkdir(parents=True)
    torch.save({"w": torch.full((8, 8), float(step)), "b": torch.zeros(8)}, folder / "model.pt")
    commit(folder, run, step)
    return folder


def _shape(value: Any, root: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _shape(v, root) for k, v in sorted(value.items()) if k not in VOLATILE}
    if isinstance(value, list):
        return [_shape(v, root) for v in value]
    if isinstance(value, str) and root:
        return value.replace(Path(root).as_uri(), "WORLD").replace(root, "WORLD")
    return value


def journal(catalog: Catalog, root: Path | None = None) -> list[tuple[str, Any]]:
    """The catalog's events, in order, without what differs between two runs by nature."""
    return [(e["kind"], _shape(e["detail"], str(root or ""))) for e in catalog.events()]


def states(catalog: Catalog, run: str = "ops") -> list[tuple[int, str]]:
    return sorted((v.step, str(v.state)) for v in catalog.list_checkpoints(run))


def rows(catalog: Catalog, root: Path) -> list[tuple[Any, ...]]:
    """The catalog's checkpoints and replicas (state, error), paths relative to their world."""
    return [(v.run, v.step, str(v.state), sorted((_shape(r.url, str(root)), str(r.state)) for r in v.replicas))
            for v in sorted(catalog.list_checkpoints(), key=lambda v: (v.run, v.step))]


@dataclass
class World:
    root: Path
    catalog: Catalog
    catalog_url: str

    @property
    def dest(self) -> str:
        return (self.root / "durable").as_uri()

    def same_as(self, other: World) -> None:
        assert rows(self.catalog, self.root) == rows(other.catalog, other.root)
        assert journal(self.catalog, self.root) == journal(other.catalog, other.root)


def worlds(tmp_path: Path, steps: tuple[int, ...] = (1,)) -> tuple[World, World]:
    """Two alike worlds, each with `steps` of run `ops` committed locally and ingested (inline)."""
    out = []
    for name in ("inline", "flow"):
        root = tmp_path / name
        url = f"sqlite:///{root / 'catalog.db'}"
        root.mkdir()
        w = World(root, open_catalog(url), url)
        for s in steps:
            assert ingest(_folder(root / "local", s), [w.dest], w.catalog).state is CS.VERIFIED
        out.append(w)
    return out[0], out[1]


def ingest_exit(state: str) -> int:
    return EXIT_OK if state == "verified" else EXIT_BAD if state in {str(s) for s in BAD_END_STATES} else EXIT_ERROR


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
        inline_out = ingest(folder, [inline_dest], inline_cat)
        flow_out = ingest_flow(snapshot=str(folder), to=[flow_dest], catalog_url=flow_url)
        assert (str(inline_out.state), ingest_exit(str(inline_out.state))) == \
            (flow_out["state"], ingest_exit(flow_out["state"])) == ("verified", EXIT_OK)
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


def test_verify_is_the_same_inline_and_as_a_flow(tmp_path, prefect_api):
    from safepoint.flows.scrub import verify_fanout
    from safepoint.ops.verify import verify

    inline, flow = worlds(tmp_path)

    def both(target: str) -> list[tuple[dict[str, Any], int]]:
        a = verify(inline.catalog, target.format(w=inline.root, d=inline.dest), Config())
        b = verify_fanout(target.format(w=flow.root, d=flow.dest), catalog_url=flow.catalog_url)
        a_doc = {k: _shape(v, str(inline.root)) for k, v in a.to_dict().items()}
        b_doc = {k: _shape(v, str(flow.root)) for k, v in b.items()}
        return [(a_doc, EXIT_OK if a.good else EXIT_BAD),
                (b_doc, EXIT_OK if b["outcome"] == "verified" else EXIT_BAD)]

    good, same = both("{d}/ops/1")
    assert good == same and good[0]["outcome"] == "verified" and good[1] == EXIT_OK
    inline.same_as(flow)
    local, same = both("{w}/local/s1")
    assert local == same and local[0]["outcome"] == "verified"
    inline.same_as(flow)
    for w in (inline, flow):  # rot in each replica
        victim = w.root / "durable" / "ops" / "1" / "model.pt"
        data = bytearray(victim.read_bytes())
        data[-1] ^= 1
        victim.write_bytes(bytes(data))
    bad, same = both("{d}/ops/1")
    assert bad == same and (bad[0]["outcome"], bad[1]) == ("corrupt", EXIT_BAD)
    inline.same_as(flow)
    assert rows(inline.catalog, inline.root)[0][3] == [("WORLD/durable/ops/1", "corrupt")]


def test_validate_is_the_same_inline_and_as_a_flow(tmp_path, prefect_api):
    from safepoint.flows.validate import validate
    from safepoint.ops.assemble import validate_assembled

    inline, flow = worlds(tmp_path)
    before = [w.catalog.latest_validation(w.catalog.get("ops", 1).id).id for w in (inline, flow)]
    a = validate_assembled(inline.catalog, inline.catalog.get("ops", 1).id, Config(), None)
    b = validate(run="ops", step=1, catalog_url=flow.catalog_url)
    assert str(a) == b == "verified"
    inline.same_as(flow)
    after = [w.catalog.latest_validation(w.catalog.get("ops", 1).id) for w in (inline, flow)]
    assert [v.id for v in after] != before  # validated again, both ways
    assert (after[0].ok, after[0].summary) == (after[1].ok, after[1].summary) == (True, after[0].summary)


def test_restore_is_the_same_inline_and_as_a_flow(tmp_path, prefect_api):
    from safepoint.flows.restore import restore as restore_flow
    from safepoint.ops.restore import NothingToRestore, restore

    inline, flow = worlds(tmp_path, (1, 2))
    a = restore("ops", inline.root / "back", catalog=inline.catalog, config=Config()).to_dict()
    b = restore_flow(run="ops", into=str(flow.root / "back"), catalog_url=flow.catalog_url)
    shape = {"seconds", "path", "sources"}
    assert {k: v for k, v in a.items() if k not in shape} == {k: v for k, v in b.items() if k not in shape}
    assert (a["step"], b["step"]) == (2, 2)
    assert (inline.root / "back" / "model.pt").read_bytes() == (flow.root / "back" / "model.pt").read_bytes()
    inline.same_as(flow)
    # Nothing to restore: the same error (exit 1) both ways, and nothing recorded.
    with pytest.raises(NothingToRestore):
        restore("nope", inline.root / "none", catalog=inline.catalog, config=Config())
    with pytest.raises(NothingToRestore):
        restore_flow(run="nope", into=str(flow.root / "none"), catalog_url=flow.catalog_url)
    inline.same_as(flow)


def test_reconcile_is_the_same_inline_and_as_a_flow(tmp_path, prefect_api):
    from safepoint.cli.repair_cmds import _exit
    from safepoint.flows.reconcile import reconcile as reconcile_flow
    from safepoint.ops.reconcile import reconcile

    inline, flow = worlds(tmp_path, (1, 2))
    for w in (inline, flow):  # one replica lost at its destination
        shutil.rmtree(w.root / "durable" / "ops" / "2")
    a = reconcile(inline.catalog, None, Config()).to_dict()
    b = reconcile_flow(catalog_url=flow.catalog_url)
    assert _shape(a, str(inline.root)) == _shape(b, str(flow.root))
    assert a["steps"], a  # it found the loss and acted on it
    as_report = SimpleNamespace(errors=b["errors"], steps=[SimpleNamespace(**s) for s in b["steps"]])
    assert _exit(SimpleNamespace(errors=a["errors"], steps=[SimpleNamespace(**s) for s in a["steps"]]), set()) \
        == _exit(as_report, set())
    inline.same_as(flow)


def test_completeness_is_the_same_inline_and_as_a_flow(tmp_path, prefect_api, monkeypatch):
    from safepoint.flows.completeness import check_completeness
    from safepoint.ops.assemble import check_completeness as check_inline

    inline, flow = worlds(tmp_path, ())
    for w in (inline, flow):  # rank 0 of 2 delivered; rank 1 never comes
        folder = w.root / "n0" / "mn" / "s1"
        folder.mkdir(parents=True)
        torch.save({"shard": torch.ones(4)}, folder / "rank00.pt")
        commit(folder, "mn", 1, world_size=2, ranks=[0], node="n0")
        out = ingest(folder, [w.dest], w.catalog)
        assert out.state is CS.REPLICATING, out
    monkeypatch.setenv("SAFEPOINT_MULTINODE_TIMEOUT_S", "0")
    a = [{"run": x.run, "step": x.step, "state": str(x.state), "missing_ranks": list(x.assessment.missing)}
         for x in check_inline(inline.catalog, Config())]
    b = check_completeness(catalog_url=flow.catalog_url)
    assert a == b == [{"run": "mn", "step": 1, "state": "incomplete", "missing_ranks": [1]}]
    assert states(inline.catalog, "mn") == states(flow.catalog, "mn") == [(1, "incomplete")]
    inline.same_as(flow)


def test_watch_is_the_same_inline_and_as_a_flow(tmp_path, prefect_api):
    from safepoint.events.watch import IngestHere, Watcher
    from safepoint.flows.watch import watch

    inline, flow = worlds(tmp_path, ())
    for w in (inline, flow):
        _folder(w.root / "local", 1)
        _folder(w.root / "local", 2)
        (w.root / "local" / "s3").mkdir()
        (w.root / "local" / "s3" / "COMMITTED").write_text("{}")  # hostile: set aside, a verdict

    def here(folder: Path, _snap: object) -> int:
        return ingest_exit(str(ingest(folder, [inline.dest], inline.catalog).state))

    sink = IngestHere(inline.catalog, here)
    Watcher(inline.root / "local", inline.catalog, sink, use_inotify=False).run(once=True)
    code = watch(root=str(flow.root / "local"), to=[flow.dest], catalog_url=flow.catalog_url)
    assert sink.worst == code == EXIT_BAD
    assert states(inline.catalog) == states(flow.catalog) == [(1, "verified"), (2, "verified")]
    inline.same_as(flow)


def test_one_cli_ingest_reads_loads_and_checks_once(tmp_path, prefect_api, monkeypatch):
    """`safepoint ingest` reads the snapshot's control files, loads the config and resolves and checks the
    destinations once: the flow it runs in this process takes them as they are (ops.ingest.Prepared)."""
    import safepoint.cli.main as cli
    import safepoint.core.config as config_mod
    import safepoint.destinations.check as check_mod
    import safepoint.flows.credentials as cred_mod
    import safepoint.flows.ingest as flow_mod
    import safepoint.local.snapshot as snap_mod
    import safepoint.ops.ingest as ingest_mod

    folder = _folder(tmp_path / "local", 1)
    calls: list[str] = []

    def counted(module: Any, name: str, key: Callable[..., str | None]) -> None:
        real = getattr(module, name)

        def spy(*args: Any, **kwargs: Any) -> Any:
            if (k := key(*args)) is not None:
                calls.append(k)
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, spy)

    for module in (config_mod, flow_mod):
        counted(module, "load_config", lambda *a: "config")
    counted(snap_mod, "read_small", lambda path, *a: "control" if Path(path).parent == folder.resolve() else None)
    counted(cred_mod, "resolve_destinations", lambda *a: "resolve")
    monkeypatch.setattr(flow_mod, "resolve_destinations", cred_mod.resolve_destinations)
    counted(check_mod, "check_destinations", lambda *a: "check")
    monkeypatch.setattr(ingest_mod, "check_destinations", check_mod.check_destinations)
    monkeypatch.setattr(cli, "_prestart_sandbox", lambda: None)  # a head start for the sandbox, not the ingest's
    code = cli.main(["--catalog", f"sqlite:///{tmp_path / 'c.db'}", "ingest", str(folder), "--to",
                     (tmp_path / "durable").as_uri()])
    assert code == 0
    assert sorted(calls) == ["check", "config", "control", "control", "resolve"]  # MANIFEST.json, COMMITTED once


def test_evict_is_the_same_inline_and_as_a_flow(tmp_path, prefect_api):
    from safepoint.flows.retention import retention as retention_flow

    inline, flow = worlds(tmp_path, (1, 2, 3))
    size = sum(f.stat().st_size for f in (inline.root / "local" / "s1").iterdir())
    knobs = {"high_water": 0.5, "low_water": 0.4, "capacity_bytes": 3 * size, "keep_newest_local": 1}
    a = retention_pass(inline.catalog, Config(), runs=[], evict_roots=[str(inline.root / "local")], **knobs)
    b = retention_flow(runs=[], evict_roots=[str(flow.root / "local")], catalog_url=flow.catalog_url, **knobs)
    assert _shape(a, str(inline.root)) == _shape(b, str(flow.root))
    kept = [(w.root / "local" / f"s{s}").exists() for w in (inline, flow) for s in (1, 2, 3)]
    assert kept == [False, False, True] * 2  # the oldest local copies evicted, the newest kept, both ways
    inline.same_as(flow)
