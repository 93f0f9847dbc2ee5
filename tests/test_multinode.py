"""Multi-node checkpoints without Prefect: completeness (tables), merge, assembly, timeouts, late parts.

Each "node" is a separate folder holding its ranks' shards (real torch.save files), committed as a
part (`world_size`, `ranks`, `node`). The end-to-end run through real watchers, a real Prefect
server and `safepoint serve` is in tests/test_events_server.py.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch

from safepoint import commit
from safepoint.core.config import Config
from safepoint.core.errors import FormatError
from safepoint.core.format import MARKER_NAME, build_manifest, digest_bytes
from safepoint.core.states import CheckpointState as CS
from safepoint.destinations import open_destination
from safepoint.destinations.parts import PARTS_DIR, Assembly, merge_manifests
from safepoint.destinations.parts import assemble as assemble_parts
from safepoint.ops import assemble
from safepoint.ops.ingest import ingest
from safepoint.rules.completeness import Completeness, assess
from safepoint.rules.resume import resume_point
from tests.helpers_ckpt import seal_node_part

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
S = timedelta(seconds=1)
NODES = {"n0": (0, 1), "n1": (2, 3), "n2": (4, 5)}


# -- completeness: a pure decision, tested by tables ---------------------------------------------

@pytest.mark.parametrize(("world", "delivered", "now", "timeout", "expected", "status", "missing"), [
    (1, {0: 0}, 0, 10, None, Completeness.COMPLETE, ()),
    (6, {r: 0 for r in range(6)}, 100, 10, None, Completeness.COMPLETE, ()),
    (6, {0: 0, 1: 0}, 5, 10, None, Completeness.WAITING, (2, 3, 4, 5)),
    (6, {0: 0, 1: 0}, 10, 10, None, Completeness.INCOMPLETE, (2, 3, 4, 5)),      # deadline reached
    (6, {0: 0, 1: 0, 2: 9, 3: 9}, 11, 10, None, Completeness.INCOMPLETE, (4, 5)),  # counted from the first
    (6, {}, 1000, 10, None, Completeness.WAITING, (0, 1, 2, 3, 4, 5)),            # nothing to time out
    (4, {0: 0, 2: 0}, 1, 10, (0, 2), Completeness.COMPLETE, ()),                  # only ranks 0 and 2 expected
    (4, {0: 0, 1: 0, 3: 0}, 1, 10, (0, 2), Completeness.WAITING, (2,)),           # extra ranks are ignored
    (2, {0: 0, 1: 50}, 60, 10, None, Completeness.COMPLETE, ()),                  # late but arrived: complete
])
def test_assess_table(world, delivered, now, timeout, expected, status, missing):
    a = assess(world, {r: T0 + t * S for r, t in delivered.items()}, T0 + now * S, timeout * S, expected=expected)
    assert a.status is status
    assert a.missing == missing
    if status is Completeness.COMPLETE:
        assert a.complete and a.deadline is None and "all" in a.summary()
    elif delivered and set(delivered) & set(a.expected):
        assert a.deadline == T0 + min(t for r, t in delivered.items() if r in a.expected) * S + timeout * S
        assert str(len(missing)) in a.summary()


@pytest.mark.parametrize(("world", "expected"), [(0, None), (2, (0, 2)), (2, (-1,))])
def test_assess_rejects_bad_input(world, expected):
    with pytest.raises(ValueError):
        assess(world, {}, T0, S, expected=expected)


# -- a copy is the whole checkpoint the catalog recorded, or it is bad: a pure decision, by table -----

F = [("rank0.pt", 10, "a" * 64), ("rank1.pt", 10, "b" * 64)]
D = "d" * 64


@pytest.mark.parametrize(("world", "held", "digest", "files", "recorded", "recorded_files", "problem"), [
    (2, (0, 1), D, F, D, None, None),                                     # the recorded whole manifest
    (2, (0, 1), "e" * 64, F, D, None, "not the one the catalog recorded"),  # forged: other bytes, rebound
    (2, (0,), D, F[:1], D, None, "lacks rank(s) 1 of 2"),                 # a part posing as the whole
    (2, (0, 1), "e" * 64, F, None, F, None),                              # no digest yet: the per-file rows
    (2, (0, 1), "e" * 64, [F[0], ("rank1.pt", 10, "c" * 64)], None, F, "other files than the catalog"),
    (2, (0,), "e" * 64, F[:1], None, F[:1], "lacks rank(s) 1 of 2"),      # rows that lack a rank too
    (1, (0,), "e" * 64, F[:1], None, None, None),                         # single node, nothing recorded
    (1, (0,), "e" * 64, F[:1], D, None, "not the one the catalog recorded"),
])
def test_copy_problem(world, held, digest, files, recorded, recorded_files, problem):
    from safepoint.rules.completeness import copy_problem

    got = copy_problem(world, held, digest, files, recorded=recorded, recorded_files=recorded_files)
    assert got is None if problem is None else problem in got


# -- merge: pure and deterministic ---------------------------------------------------------------

def _part(ranks, node, files, world=6, created="2026-01-01T00:00:00.000000Z", parent=None, meta=None):
    from safepoint.core.format import FileEntry

    m = build_manifest("r", 7, [FileEntry(p, len(p), (c * 64)[:64]) for p, c in files], world_size=world,
                       ranks=tuple(ranks), node=node, created=created, parent=parent, meta=meta or {})
    return m, digest_bytes(m.to_json_bytes())


def test_merge_is_deterministic_and_records_parts():
    a = _part((0, 1), "n0", [("rank0.pt", "a"), ("rank1.pt", "b"), ("common.json", "c")], meta={"tags": ["x"]})
    b = _part((2, 3), "n1", [("rank2.pt", "d"), ("common.json", "c")], created="2026-01-01T00:00:05.000000Z")
    c = _part((4, 5), "n2", [("rank4.pt", "e"), ("rank5.pt", "f")])
    one = merge_manifests([a, b, c])
    two = merge_manifests([c, a, b])
    assert one.to_json_bytes() == two.to_json_bytes()
    assert one.held_ranks == tuple(range(6)) and one.node is None
    assert [f.path for f in one.files] == ["common.json", "rank0.pt", "rank1.pt", "rank2.pt", "rank4.pt", "rank5.pt"]
    assert one.created == "2026-01-01T00:00:05.000000Z"
    assert one.meta["tags"] == ["x"]
    assert [p["node"] for p in one.meta["parts"]] == ["n0", "n1", "n2"]
    assert one.meta["parts"][1] == {"node": "n1", "ranks": [2, 3], "manifest_blake3": b[1]}


@pytest.mark.parametrize("bad", [
    _part((2, 3), "n1", [("rank0.pt", "9")]),                       # same path, other bytes
    _part((1, 2), "n1", [("rank2.pt", "d")]),                       # rank 1 held twice
    _part((2, 3), "n1", [("rank2.pt", "d")], world=8),              # another world size
    _part((2, 3), "n1", [("rank2.pt", "d")], parent=("q", 1)),      # another parent
])
def test_merge_refuses_disagreeing_parts(bad):
    a = _part((0, 1), "n0", [("rank0.pt", "a"), ("rank1.pt", "b")])
    with pytest.raises(FormatError):
        merge_manifests([a, bad])


# -- the whole thing on real folders and a file:// destination -----------------------------------

def make_part(root: Path, run: str, step: int, node: str, ranks, *, world: int = 6, scale: float = 1.0,
              nan: bool = False) -> Path:
    """A node's folder with one real torch.save shard per rank it holds, committed as a part."""
    folder = root / node / run / f"step-{step}"
    folder.mkdir(parents=True)
    for r in ranks:
        w = torch.full((4, 4), float(r) * scale + step)
        if nan and r == ranks[0]:
            w[0, 0] = float("nan")
        torch.save({"shard": w, "rank": torch.tensor(r)}, folder / f"rank{r:02d}.pt")
    return seal_node_part(folder, run, step, node, ranks, world)


@pytest.fixture
def cfg(monkeypatch):
    monkeypatch.setenv("SAFEPOINT_MULTINODE_TIMEOUT_S", "30")
    return Config()


def test_three_nodes_become_verified_when_all_deliver(tmp_path, catalog, cfg):
    durable = (tmp_path / "durable").as_uri()
    parts = {n: make_part(tmp_path, "mn", 10, n, r) for n, r in NODES.items()}
    states = []
    for node in ("n1", "n0", "n2"):  # any order: the last one assembles
        out = ingest(parts[node], [durable], catalog, cfg)
        states.append(out.state)
    assert states == [CS.REPLICATING, CS.REPLICATING, CS.VERIFIED]
    row = catalog.get("mn", 10)
    assert row.state is CS.VERIFIED and row.complete and row.delivered_ranks == tuple(range(6))
    assert row.file_count == 7  # six shards and rank 0's config.json
    base = Path(durable[len("file://"):]) / "mn" / "10"
    assert (base / MARKER_NAME).is_file()
    assert sorted(p.name for p in (base / PARTS_DIR).iterdir()) == ["0", "2", "4"]
    merged = json.loads((base / "MANIFEST.json").read_text())
    assert merged["ranks"] == list(range(6)) and merged["node"] is None
    assert [p["node"] for p in merged["meta"]["parts"]] == ["n0", "n1", "n2"]
    # The assembled replica verifies as a whole, like any snapshot.
    from safepoint.ops.verify import verify

    report = verify(catalog, f"{durable}/mn/10", cfg).report
    assert report.outcome is CS.VERIFIED and len(report.files) == 7
    kinds = [e["detail"].get("to") for e in catalog.events(row.id, kind="state")]
    assert kinds[-3:] == ["replicated", "validating", "verified"]
    # A duplicate delivery changes nothing.
    assert ingest(parts["n2"], [durable], catalog, cfg).state is CS.VERIFIED


def test_lost_node_times_out_incomplete_and_a_late_part_completes_the_set(tmp_path, catalog, cfg):
    durable = (tmp_path / "durable").as_uri()
    # Step 5 is fully delivered: the resume point.
    for n, r in NODES.items():
        ingest(make_part(tmp_path, "mn", 5, n, r), [durable], catalog, cfg)
    assert catalog.get("mn", 5).state is CS.VERIFIED
    # Step 10: n2 dies before delivering.
    p0 = make_part(tmp_path, "mn", 10, "n0", NODES["n0"])
    p1 = make_part(tmp_path, "mn", 10, "n1", NODES["n1"])
    ingest(p0, [durable], catalog, cfg)
    ingest(p1, [durable], catalog, cfg)
    row = catalog.get("mn", 10)
    assert row.state is CS.REPLICATING and not row.complete
    # Before the timeout the periodic check changes nothing; after it, the set is incomplete.
    first = min(r["delivered_at"] for r in catalog.ranks(row.id))
    assert assemble.apply_timeouts(catalog, cfg, now=first + timedelta(seconds=29)) == []
    acts = assemble.apply_timeouts(catalog, cfg, now=first + timedelta(seconds=31))
    assert [(a.step, a.state, a.assessment.missing) for a in acts] == [(10, CS.INCOMPLETE, (4, 5))]
    row = catalog.get("mn", 10)
    assert row.state is CS.INCOMPLETE and "4, 5" in row.error
    assert not (Path(durable[len("file://"):]) / "mn" / "10" / MARKER_NAME).exists()
    decision = resume_point(catalog.list_checkpoints("mn"))
    assert decision.chosen.step == 5
    # The node comes back and delivers late: the set completes, is assembled and validated.
    p2 = make_part(tmp_path, "mn", 10, "n2", NODES["n2"])
    assert ingest(p2, [durable], catalog, cfg).state is CS.VERIFIED
    assert resume_point(catalog.list_checkpoints("mn")).chosen.step == 10


def test_all_ranks_registered_but_a_part_never_replicated(tmp_path, catalog, cfg):
    """The last node registered but died before its part committed: the timeout still fires."""
    from safepoint.local.snapshot import LocalSnapshot
    from safepoint.ops.steps import register

    durable = (tmp_path / "durable").as_uri()
    ingest(make_part(tmp_path, "mn", 3, "n0", (0, 1, 2)), [durable], catalog, cfg)
    dead = LocalSnapshot.open(make_part(tmp_path, "mn", 3, "n1", (3, 4, 5)))
    row = register(catalog, dead)  # registered, then killed before replicating
    assert catalog.get_by_id(row.id).complete
    last = max(r["delivered_at"] for r in catalog.ranks(row.id))
    assert assemble.apply_timeouts(catalog, cfg, now=last + timedelta(seconds=5)) == []
    acts = assemble.apply_timeouts(catalog, cfg, now=last + timedelta(seconds=31))
    assert [a.state for a in acts] == [CS.INCOMPLETE]
    assert "not assembled" in catalog.get_by_id(row.id).error


def test_periodic_check_assembles_a_set_nobody_finished(tmp_path, catalog, cfg):
    """Every part committed at the destination but the last ingest died before assembling."""
    from safepoint.local.snapshot import LocalSnapshot
    from safepoint.ops.steps import register

    durable = (tmp_path / "durable").as_uri()
    ingest(make_part(tmp_path, "mn", 4, "n0", (0, 1, 2)), [durable], catalog, cfg)
    snap = LocalSnapshot.open(make_part(tmp_path, "mn", 4, "n1", (3, 4, 5)))
    row = register(catalog, snap)
    assemble.replicate_part_to(catalog, row.id, snap, durable, cfg)  # ... and died here
    assert catalog.get_by_id(row.id).state is CS.REPLICATING
    acts = assemble.apply_timeouts(catalog, cfg)
    assert [(a.state, a.validate) for a in acts] == [(CS.REPLICATED, True)]


def test_bad_shard_on_one_node_spoils_the_checkpoint(tmp_path, catalog, cfg):
    durable = (tmp_path / "durable").as_uri()
    ingest(make_part(tmp_path, "mn", 8, "n0", (0, 1, 2)), [durable], catalog, cfg)
    out = ingest(make_part(tmp_path, "mn", 8, "n1", (3, 4, 5), nan=True), [durable], catalog, cfg)
    assert out.state is CS.INVALID
    assert "nan" in (catalog.get("mn", 8).error or "").lower()


def test_corrupt_local_part_is_corrupt(tmp_path, catalog, cfg):
    durable = (tmp_path / "durable").as_uri()
    folder = make_part(tmp_path, "mn", 9, "n0", (0, 1, 2))
    (folder / "rank01.pt").write_bytes(b"rot" + (folder / "rank01.pt").read_bytes()[3:])
    assert ingest(folder, [durable], catalog, cfg).state is CS.CORRUPT


def test_assembly_waits_for_parts_and_refuses_a_foreign_part(tmp_path, catalog, cfg):
    from safepoint.destinations.parts import PartDestination, part_key
    from safepoint.local.snapshot import LocalSnapshot
    from safepoint.ops.replicate import replicate

    dest = open_destination((tmp_path / "durable").as_uri())
    a = LocalSnapshot.open(make_part(tmp_path, "mn", 2, "n0", (0, 1, 2)))
    replicate(a, PartDestination(dest, part_key(a.manifest.held_ranks)))
    want = {"0": digest_bytes(a.manifest_bytes), "3": None}
    res = assemble_parts(dest, "mn", 2, want)
    assert res.state is Assembly.WAITING and res.waiting_for == ("3",)
    res = assemble_parts(dest, "mn", 2, {"0": "f" * 64})
    assert res.state is Assembly.CONFLICT
    assert dest.read_control("mn", 2, MARKER_NAME) is None


def test_reserved_prefix_is_refused(tmp_path, catalog, cfg):
    folder = tmp_path / "n0" / "x"
    (folder / ".safepoint").mkdir(parents=True)
    (folder / ".safepoint" / "parts").write_bytes(b"x")
    commit(folder, "mn", 1, world_size=2, ranks=[0], node="n0")
    with pytest.raises(FormatError, match="must not lie under"):
        ingest(folder, [(tmp_path / "d").as_uri()], catalog, cfg)
    # refused like any broken folder, inline as through the flow: corrupt, so watchers stop retrying it
    assert catalog.get("mn", 1).state is CS.CORRUPT
    assert not (tmp_path / "d" / "mn").exists()


def test_flows_parts_then_completeness(tmp_path, prefect_api, sqlite_catalog_url, sqlite_catalog, monkeypatch):
    """The same rules through the Prefect flows: ingest per part, then the periodic completeness flow."""
    from safepoint.flows.completeness import check_completeness
    from safepoint.flows.ingest import ingest as ingest_flow
    from safepoint.local.snapshot import LocalSnapshot
    from safepoint.ops.steps import register

    monkeypatch.setenv("SAFEPOINT_MULTINODE_TIMEOUT_S", "600")
    durable = (tmp_path / "durable").as_uri()
    states = [ingest_flow(snapshot=str(make_part(tmp_path, "fl", 1, n, r)), to=[durable],
                          catalog_url=sqlite_catalog_url)["state"] for n, r in NODES.items()]
    assert states == ["replicating", "replicating", "verified"]
    done = sqlite_catalog.events(sqlite_catalog.get("fl", 1).id, kind="ingest.done")
    assert [d["detail"]["part"] for d in done] == ["0", "2", "4"]
    assert [d["detail"]["state"] for d in done] == states

    # Step 2: every part committed at the destination, but the last ingest died before assembling.
    for n in ("n0", "n1"):
        ingest_flow(snapshot=str(make_part(tmp_path, "fl", 2, n, NODES[n])), to=[durable],
                    catalog_url=sqlite_catalog_url)
    snap = LocalSnapshot.open(make_part(tmp_path, "fl", 2, "n2", NODES["n2"]))
    row = register(sqlite_catalog, snap)
    assemble.replicate_part_to(sqlite_catalog, row.id, snap, durable, Config())
    # Step 3: a node never delivers.
    ingest_flow(snapshot=str(make_part(tmp_path, "fl", 3, "n0", NODES["n0"])), to=[durable],
                catalog_url=sqlite_catalog_url)
    assert check_completeness(catalog_url=sqlite_catalog_url) == [
        {"run": "fl", "step": 2, "state": "verified", "missing_ranks": []}]
    monkeypatch.setenv("SAFEPOINT_MULTINODE_TIMEOUT_S", "0")
    assert check_completeness(catalog_url=sqlite_catalog_url) == [
        {"run": "fl", "step": 3, "state": "incomplete", "missing_ranks": [2, 3, 4, 5]}]
    assert resume_point(sqlite_catalog.list_checkpoints("fl")).chosen.step == 2


def test_refused_part_through_the_flow_is_recorded_for_the_watcher(tmp_path, prefect_api, sqlite_catalog_url,
                                                                  sqlite_catalog):
    """A part the flow refuses ends with `ingest.done` too, so its watcher stops re-dispatching it."""
    from safepoint.events.markers import Marker, ingest_finished
    from safepoint.flows.ingest import ingest as ingest_flow
    from safepoint.local.snapshot import LocalSnapshot

    folder = tmp_path / "n0" / "x"
    (folder / ".safepoint").mkdir(parents=True)
    (folder / ".safepoint" / "parts").write_bytes(b"x")
    commit(folder, "rf", 1, world_size=2, ranks=[0], node="n0")
    marker = Marker.of(LocalSnapshot.open(folder), ["file:///d"], "n0")
    with pytest.raises(FormatError):
        ingest_flow(snapshot=str(folder), to=[(tmp_path / "d").as_uri()], catalog_url=sqlite_catalog_url,
                    event_id=marker.event_id)
    assert sqlite_catalog.get("rf", 1).state is CS.CORRUPT
    assert ingest_finished(sqlite_catalog, marker)["state"] == "corrupt"


def test_parts_command_shows_missing_ranks_and_applies_timeouts(tmp_path, sqlite_catalog, sqlite_catalog_url, cfg,
                                                               capsys):
    from safepoint.cli.main import main

    durable = (tmp_path / "durable").as_uri()
    ingest(make_part(tmp_path, "pc", 1, "n0", NODES["n0"]), [durable], sqlite_catalog, cfg)
    capsys.readouterr()
    assert main(["--catalog", sqlite_catalog_url, "parts", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["state"], row["delivered"], row["missing"], row["completeness"]) == (
        "replicating", [0, 1], [2, 3, 4, 5], "waiting")
    assert main(["--catalog", sqlite_catalog_url, "parts", "--apply", "--timeout", "0", "--json"]) == 0
    assert "incomplete" in capsys.readouterr().out
    assert sqlite_catalog.get("pc", 1).state is CS.INCOMPLETE


def test_parts_apply_assembles_and_validates_a_set_nobody_finished(tmp_path, sqlite_catalog, sqlite_catalog_url,
                                                                   cfg, capsys):
    """`parts --apply` is the completeness check the flow runs: the set it assembles leaves verified and is
    the resume point at once (it used to stay `replicated` until the flow or a reconcile validated it)."""
    from safepoint.cli.main import main
    from safepoint.local.snapshot import LocalSnapshot
    from safepoint.ops.steps import register

    durable = (tmp_path / "durable").as_uri()
    for n in ("n0", "n1"):
        ingest(make_part(tmp_path, "pa", 6, n, NODES[n]), [durable], sqlite_catalog, cfg)
    snap = LocalSnapshot.open(make_part(tmp_path, "pa", 6, "n2", NODES["n2"]))
    row = register(sqlite_catalog, snap)
    assemble.replicate_part_to(sqlite_catalog, row.id, snap, durable, cfg)  # ... and died before assembling
    capsys.readouterr()
    assert main(["--catalog", sqlite_catalog_url, "parts", "--apply"]) == 0
    assert "pa/6: verified" in capsys.readouterr().out
    assert sqlite_catalog.get("pa", 6).state is CS.VERIFIED
    assert sqlite_catalog.latest_validation(row.id).ok
    assert main(["--catalog", sqlite_catalog_url, "resume-point", "--run", "pa", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 6


def test_assembled_on_an_object_store_is_validated_from_a_download(tmp_path, sqlite_catalog, cfg, safepoint_home):
    """No node holds every shard and the replica is not a local folder: validation downloads it."""
    url = f"memory://mn-{tmp_path.name}"
    states = [ingest(make_part(tmp_path, "ob", 1, n, r), [url], sqlite_catalog, cfg).state for n, r in NODES.items()]
    assert states[-1] is CS.VERIFIED
    row = sqlite_catalog.get("ob", 1)
    assert sqlite_catalog.latest_validation(row.id).ok
    assert (safepoint_home / "tmp").is_dir()  # the download happened there ...
    assert not list((safepoint_home / "tmp").glob("assembled-*"))  # ... and was removed


# -- restore: the whole checkpoint, from local parts and replicas ----------------------------------

def test_restore_from_the_local_parts_alone_is_the_recorded_whole(tmp_path, catalog, cfg):
    """Every replica is gone: the parts, each held to its digest, merge into the recorded manifest."""
    from safepoint.local.snapshot import LocalSnapshot
    from safepoint.ops.restore import restore

    durable = (tmp_path / "durable").as_uri()
    for n, r in NODES.items():
        ingest(make_part(tmp_path, "rp", 1, n, r), [durable], catalog, cfg)
    row = catalog.get("rp", 1)
    assert row.state is CS.VERIFIED and row.manifest_blake3
    shutil.rmtree(tmp_path / "durable")
    result = restore("rp", tmp_path / "into", 1, catalog=catalog, config=cfg)
    snap = LocalSnapshot.open(tmp_path / "into")
    assert digest_bytes(snap.manifest_bytes) == row.manifest_blake3
    assert snap.verify().outcome is CS.VERIFIED and len(snap.manifest.files) == 7
    assert result.sources == [str(tmp_path / n / "rp" / "step-1") for n in NODES]


def test_restore_without_a_recorded_whole_digest_holds_copies_to_the_file_rows(tmp_path, catalog, cfg):
    """A set assembled before the whole digest was recorded: a replica that is not the catalog's files is bad."""
    import sqlalchemy as sa

    from safepoint.catalog.models import Checkpoint
    from safepoint.core.format import FileEntry, marker_for, parse_manifest
    from safepoint.ops.restore import NothingToRestore, restore

    durable = (tmp_path / "durable").as_uri()
    for n, r in NODES.items():
        ingest(make_part(tmp_path, "lg", 1, n, r), [durable], catalog, cfg)
    with catalog._write() as s:
        s.execute(sa.update(Checkpoint).where(Checkpoint.id == catalog.get("lg", 1).id).values(manifest_blake3=None))
    rep = tmp_path / "durable" / "lg" / "1"
    (rep / "rank00.pt").write_bytes(b"forged")
    m = parse_manifest((rep / "MANIFEST.json").read_bytes())
    files = [FileEntry(f.path, 6, digest_bytes(b"forged")) if f.path == "rank00.pt" else f for f in m.files]
    forged = build_manifest(m.run, m.step, files, created=m.created, world_size=m.world_size, ranks=m.ranks,
                            meta=m.meta)
    (rep / "MANIFEST.json").write_bytes(forged.to_json_bytes())
    (rep / MARKER_NAME).write_bytes(marker_for(forged.to_json_bytes(), forged).to_json_bytes())
    with pytest.raises(NothingToRestore, match="other files than the catalog recorded"):
        restore("lg", tmp_path / "into", 1, catalog=catalog, config=cfg, sources=[durable])
    assert not (tmp_path / "into" / MARKER_NAME).exists()



def test_restore_heals_a_rotten_local_part_file_from_a_replica(tmp_path, catalog, cfg):
    """Per file: rank 1's bytes in node n0's folder rotted; that file comes from the replica, the rest locally."""
    from safepoint.local.snapshot import LocalSnapshot
    from safepoint.ops.restore import restore

    durable = (tmp_path / "durable").as_uri()
    folders = {n: make_part(tmp_path, "hl", 1, n, r) for n, r in NODES.items()}
    for folder in folders.values():
        ingest(folder, [durable], catalog, cfg)
    data = bytearray((folders["n0"] / "rank01.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (folders["n0"] / "rank01.pt").write_bytes(bytes(data))
    result = restore("hl", tmp_path / "into", 1, catalog=catalog, config=cfg)
    assert LocalSnapshot.open(tmp_path / "into").verify().outcome is CS.VERIFIED
    assert result.sources == [str(folders[n]) for n in NODES] + [f"{durable}/hl/1"]
    assert [(f["url"], f["reason"].split(":")[0]) for f in result.failed] == [(str(folders["n0"]), "rank01.pt")]
    assert result.bytes_fetched == sum(f.stat().st_size for n in NODES for f in folders[n].glob("rank*.pt")) + \
        (folders["n0"] / "config.json").stat().st_size


def test_verify_fanout_finds_a_forged_assembled_replica(tmp_path, prefect_api, sqlite_catalog_url, sqlite_catalog, cfg):
    """The flow that verifies a large replica in batches holds it to the whole digest as `verify` does."""
    from safepoint.core.format import FileEntry, marker_for, parse_manifest
    from safepoint.core.states import ReplicaState as RS
    from safepoint.flows.scrub import verify_fanout

    durable = (tmp_path / "durable").as_uri()
    for n, r in NODES.items():
        ingest(make_part(tmp_path, "vf", 1, n, r), [durable], sqlite_catalog, cfg)
    assert verify_fanout(f"{durable}/vf/1", catalog_url=sqlite_catalog_url)["outcome"] == "verified"
    rep = tmp_path / "durable" / "vf" / "1"
    (rep / "rank00.pt").write_bytes(b"forged")
    m = parse_manifest((rep / "MANIFEST.json").read_bytes())
    files = [FileEntry(f.path, 6, digest_bytes(b"forged")) if f.path == "rank00.pt" else f for f in m.files]
    forged = build_manifest(m.run, m.step, files, created=m.created, world_size=m.world_size, ranks=m.ranks,
                            meta=m.meta)
    (rep / "MANIFEST.json").write_bytes(forged.to_json_bytes())
    (rep / MARKER_NAME).write_bytes(marker_for(forged.to_json_bytes(), forged).to_json_bytes())
    out = verify_fanout(f"{durable}/vf/1", catalog_url=sqlite_catalog_url)
    assert out["outcome"] == "corrupt" and "not the one the catalog recorded" in out["summary"]
    (r,) = sqlite_catalog.replicas(sqlite_catalog.get("vf", 1).id)
    assert r.state is RS.CORRUPT


def test_verify_binds_a_set_assembled_before_its_whole_digest_was_recorded(tmp_path, catalog, cfg):
    import sqlalchemy as sa

    from safepoint.catalog.models import Checkpoint
    from safepoint.ops.verify import verify

    durable = (tmp_path / "durable").as_uri()
    for n, r in NODES.items():
        ingest(make_part(tmp_path, "bd", 1, n, r), [durable], catalog, cfg)
    row = catalog.get("bd", 1)
    with catalog._write() as s:
        s.execute(sa.update(Checkpoint).where(Checkpoint.id == row.id).values(manifest_blake3=None))
    report = verify(catalog, f"{durable}/bd/1", cfg).report
    assert report.outcome is CS.VERIFIED
    assert catalog.get("bd", 1).manifest_blake3 == row.manifest_blake3
