"""Fleet restart, in one process: the scope rules (tables) and a node's part restored from file:// replicas.

The same restores across separate processes, on SeaweedFS and both catalog backends, are in
tests/test_fleet_restore_s3.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from safepoint import commit
from safepoint.core.config import Config, load_config
from safepoint.core.format import MARKER_NAME, digest_bytes
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.ingest import ingest
from safepoint.ops.restore import BadScope, NothingToRestore, restore
from safepoint.ops.resume import find_resume_point
from safepoint.ops.steps import register, replicate_to, settle
from safepoint.rules.restore import (
    ScopeError,
    file_rank,
    format_ranks,
    parse_ranks,
    scope_ranks,
    scoped_files,
)
from tests.helpers_ckpt import seal_node_part

NODES = {"n0": (0, 1), "n1": (2, 3), "n2": (4, 5)}
WORLD = 6


# -- the rules: tables ------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "ranks"), [
    ("0", (0,)),
    ("0-7,16", (*range(8), 16)),
    ("3,1,2,1", (1, 2, 3)),
    (" 4 - 4 ".replace(" ", ""), (4,)),
    ("0-2, 5", (0, 1, 2, 5)),
])
def test_parse_ranks(text, ranks):
    assert parse_ranks(text) == ranks
    assert parse_ranks(format_ranks(ranks)) == ranks


@pytest.mark.parametrize("text", ["", "a", "-1", "3-1", "1,,2", "0-", "1.5", "0-99999999", "1e3"])
def test_parse_ranks_refuses(text):
    with pytest.raises(ScopeError):
        parse_ranks(text)


@pytest.mark.parametrize(("path", "world", "rank"), [
    ("__3_0.distcp", 8, 3),
    ("__12_1.distcp", 16, 12),
    (".metadata", 8, None),
    ("rank03.pt", 8, 3),
    ("rank_5/shard.pt", 8, 5),
    ("mp_rank_02_model_states.pt", 4, 2),
    ("zero_pp_rank_1_mp_rank_00_optim_states.pt", 4, None),  # two ranks named: every rank's
    ("config.json", 8, None),
    ("frank1.txt", 8, None),
    ("rank9.pt", 8, None),                                    # past the world: nobody's own
    ("__8_0.distcp", 8, None),
])
def test_file_rank(path, world, rank):
    assert file_rank(path, world) == rank


def test_scoped_files_bring_every_shared_file():
    paths = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "train.yaml"]
    assert scoped_files(paths, 4, (2, 3)) == [".metadata", "__2_0.distcp", "__3_0.distcp", "train.yaml"]
    assert scoped_files(paths, 4, range(4)) == paths


HOLDERS = [(0, "n0"), (1, "n0"), (2, "n1"), (3, "n1")]


@pytest.mark.parametrize(("node", "ranks", "want"), [
    ("n1", None, (2, 3)),
    ("n0", None, (0, 1)),
    (None, (3, 1), (1, 3)),
    ("n9", (2, 3), (2, 3)),      # a new node taking over n1's ranks
    (None, None, (0, 1, 2, 3)),
])
def test_scope_ranks(node, ranks, want):
    assert scope_ranks(4, HOLDERS, node=node, ranks=ranks) == want


@pytest.mark.parametrize(("node", "ranks", "match"), [
    ("n9", None, "node 'n9' holds no rank.*n0, n1"),
    (None, (4,), "rank 4 is not in the checkpoint"),
    (None, (1, 7, 8), "rank 7-8 is not"),
    (None, (), "none given"),
])
def test_scope_ranks_refuses(node, ranks, match):
    with pytest.raises(ScopeError, match=match):
        scope_ranks(4, HOLDERS, node=node, ranks=ranks)


# -- a node's part, in one process, from file:// replicas --------------------------------------------

def make_part(root: Path, run: str, step: int, node: str, ranks, *, kib: int = 16) -> Path:
    """A node's folder: one torch.save shard per rank (`rank03.pt`), rank 0's node also a shared config."""
    folder = root / node / run / f"step-{step}"
    folder.mkdir(parents=True)
    for r in ranks:
        g = torch.Generator().manual_seed(1000 * step + r)
        torch.save({"shard": torch.randn(kib * 256, generator=g)}, folder / f"rank{r:02d}.pt")
    return seal_node_part(folder, run, step, node, ranks, WORLD)


@pytest.fixture
def cfg(monkeypatch):
    monkeypatch.setenv("SAFEPOINT_MULTINODE_TIMEOUT_S", "30")
    return Config()


@pytest.fixture
def fleet(tmp_path, catalog, cfg):
    """Three nodes' parts of step 1, ingested to two file:// replicas; the catalog is shared."""
    durable = [(tmp_path / "durable-a").as_uri(), (tmp_path / "durable-b").as_uri()]
    folders = {n: make_part(tmp_path, "fr", 1, n, r) for n, r in NODES.items()}
    for n in NODES:
        ingest(folders[n], durable, catalog, cfg)
    assert catalog.get("fr", 1).state is CS.VERIFIED
    return tmp_path, durable, folders


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_a_replaced_node_brings_back_its_part_from_the_replicas(fleet, catalog, cfg):
    base, durable, folders = fleet
    shutil.rmtree(folders["n1"])
    into = base / "n1-new" / "step-{step}"
    result = restore("fr", into, catalog=catalog, config=cfg, node="n1")
    folder = base / "n1-new" / "step-1"
    snap = LocalSnapshot.open(folder)
    assert snap.verify().outcome is CS.VERIFIED
    m = snap.manifest
    assert (m.world_size, m.held_ranks, m.node) == (WORLD, (2, 3), "n1")
    assert m.meta["part_of"] == catalog.get("fr", 1).manifest_blake3
    assert _files(folder) == {"rank02.pt", "rank03.pt", "config.json", "MANIFEST.json", "COMMITTED"}
    need = sum(f.size for f in m.files)
    assert result.bytes_fetched == need and result.bytes_from == {durable[0]: need}
    assert (result.ranks, result.node, result.step) == ((2, 3), "n1", 1)
    # Watch/ingest take the folder as n1's part again: nothing new, nothing refused.
    out = ingest(folder, durable, catalog, cfg)
    assert out.state is CS.VERIFIED


def test_restoring_into_the_nodes_own_folder_moves_nothing_and_leaves_it_as_sealed(fleet, catalog, cfg):
    base, durable, folders = fleet
    before = {p: (folders["n0"] / p).read_bytes() for p in ("MANIFEST.json", "COMMITTED")}
    result = restore("fr", folders["n0"], catalog=catalog, config=cfg, node="n0")
    assert result.bytes_fetched == 0 and set(result.bytes_from) == {"local"}
    assert {p: (folders["n0"] / p).read_bytes() for p in before} == before  # its own seal, byte for byte


def test_a_rotten_local_file_is_fetched_alone_and_recorded(fleet, catalog, cfg):
    base, durable, folders = fleet
    bad = folders["n2"] / "rank05.pt"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 1
    bad.write_bytes(bytes(data))
    into = base / "n2-into"
    result = restore("fr", into, catalog=catalog, config=cfg, node="n2")
    assert LocalSnapshot.open(into).verify().outcome is CS.VERIFIED
    size = bad.stat().st_size
    assert result.bytes_from[durable[0]] == size + (folders["n0"] / "config.json").stat().st_size
    assert [(f["url"], f["reason"].split(":")[0]) for f in result.failed] == [(str(folders["n2"]), "rank05.pt")]
    ev = catalog.events(catalog.get("fr", 1).id, kind="restore")[-1]["detail"]
    assert ev["failed"][0]["url"] == str(folders["n2"])


def test_replicas_in_the_configured_order(fleet, catalog, cfg, safepoint_home):
    base, durable, folders = fleet
    shutil.rmtree(folders["n1"])
    (safepoint_home / "config.toml").write_text(f'[restore]\nprefer = ["{durable[1]}"]\n')
    result = restore("fr", base / "into", catalog=catalog, config=load_config(), node="n1")
    assert set(result.bytes_from) == {durable[1]}


def test_a_rank_not_in_the_checkpoint_is_refused(fleet, catalog, cfg):
    base, _durable, _folders = fleet
    with pytest.raises(BadScope, match="rank 6 is not in the checkpoint") as e:
        restore("fr", base / "into", catalog=catalog, config=cfg, ranks=[5, 6])
    assert e.value.exit_code == 2
    with pytest.raises(BadScope, match="node 'n7'"):
        restore("fr", base / "into", catalog=catalog, config=cfg, node="n7")
    assert not (base / "into").exists() or not (base / "into" / MARKER_NAME).exists()


def test_a_part_missing_everywhere_commits_nothing_and_is_recorded(fleet, catalog, cfg):
    base, durable, folders = fleet
    shutil.rmtree(folders["n1"])
    for d in durable:
        (Path(d[len("file://"):]) / "fr" / "1" / "rank03.pt").unlink()
    into = base / "into"
    with pytest.raises(NothingToRestore, match="ranks 2-3 \\(node n1\\) has no whole copy") as e:
        restore("fr", into, catalog=catalog, config=cfg, node="n1")
    assert e.value.exit_code == 1
    assert not (into / MARKER_NAME).exists()
    row = catalog.get("fr", 1)
    assert {r.state for r in catalog.replicas(row.id)} == {RS.MISSING}  # recorded, with the file and why
    assert "rank03.pt" in catalog.replicas(row.id)[0].error
    assert find_resume_point(catalog, "fr").chosen is None  # the resume point moved back for every node
    assert catalog.events(row.id, kind="restore.part_failed")[-1]["detail"]["ranks"] == [2, 3]
    # n0's part is still whole at its own folder, but no node resumes a step another cannot.
    with pytest.raises(NothingToRestore):
        restore("fr", base / "n0-into", catalog=catalog, config=cfg, node="n0")


def test_every_rank_is_the_whole_restore(fleet, catalog, cfg):
    base, _durable, _folders = fleet
    result = restore("fr", base / "into", catalog=catalog, config=cfg, ranks=range(WORLD))
    assert result.ranks is None
    assert digest_bytes((base / "into" / "MANIFEST.json").read_bytes()) == catalog.get("fr", 1).manifest_blake3


def test_sp_dcp_restores_the_part_for_the_same_topology_and_the_whole_for_a_reshard(fleet, catalog, cfg):
    from safepoint.integrations import dcp as sp_dcp

    base, _durable, _folders = fleet
    same = sp_dcp.restore("fr", base / "same" / "step-{step}", node="n2", world_size=WORLD, catalog=catalog,
                          config=cfg)
    assert same.ranks == (4, 5) and LocalSnapshot.open(same).manifest.held_ranks == (4, 5)
    other = sp_dcp.restore("fr", base / "reshard" / "step-{step}", node="n2", world_size=4, catalog=catalog,
                           config=cfg)
    assert other.ranks is None and LocalSnapshot.open(other).manifest.held_ranks == tuple(range(WORLD))


def test_the_light_catalog_reads_ranks_as_the_catalog_proper(fleet, sqlite_catalog):
    """A fleet restore on a SQLite catalog scopes by the rank rows without loading SQLAlchemy (catalog.lite)."""
    from safepoint.catalog.lite import LiteCatalog, open_fast

    lite = open_fast(sqlite_catalog.url)
    assert isinstance(lite, LiteCatalog)
    cid = sqlite_catalog.get("fr", 1).id
    assert lite.ranks(cid) == sqlite_catalog.ranks(cid) and len(lite.ranks(cid)) == WORLD
    assert lite._proper is None, [k for k in vars(lite)]


def test_a_restored_part_serves_again_as_that_nodes_local_part(fleet, catalog, cfg):
    """n1's part restored into its own folder; every replica then gone: the whole checkpoint still comes
    back from the three nodes' folders, the restored one included, as the recorded whole."""
    base, durable, folders = fleet
    shutil.rmtree(folders["n1"])
    restore("fr", folders["n1"], catalog=catalog, config=cfg, node="n1")
    for d in durable:
        shutil.rmtree(d[len("file://"):])
    result = restore("fr", base / "whole", 1, catalog=catalog, config=cfg)
    snap = LocalSnapshot.open(base / "whole")
    assert digest_bytes(snap.manifest_bytes) == catalog.get("fr", 1).manifest_blake3
    assert snap.verify().outcome is CS.VERIFIED
    assert set(result.bytes_from) == {"local"} and result.sources == [str(folders[n]) for n in NODES]
    assert {f["state"] for f in result.failed} == {"missing"}  # the replicas that are gone, none of the folders


def test_a_single_node_checkpoint_is_its_own_part(tmp_path, catalog, cfg):
    folder = tmp_path / "solo" / "step-3"
    folder.mkdir(parents=True)
    torch.save({"w": torch.ones(4)}, folder / "model.pt")
    commit(folder, "solo", 3)
    snap = LocalSnapshot.open(folder)  # replicated and recorded verified (no dry-run load: not what is tested)
    row = register(catalog, snap)
    settle(catalog, row.id, [replicate_to(catalog, row.id, snap, (tmp_path / "durable").as_uri(), cfg)])
    catalog.transition(row.id, CS.VALIDATING)
    catalog.transition(row.id, CS.VERIFIED)
    result = restore("solo", tmp_path / "into", catalog=catalog, config=cfg, node="any-node")
    assert result.ranks is None and LocalSnapshot.open(tmp_path / "into").verify().outcome is CS.VERIFIED
    with pytest.raises(BadScope, match="rank 1 is not in the checkpoint"):
        restore("solo", tmp_path / "into2", catalog=catalog, config=cfg, ranks=[1])


def test_any_ranks_for_a_node_that_takes_over(fleet, catalog, cfg, monkeypatch):
    """`--ranks` across two nodes' parts: exactly those ranks' files and the shared one, under this host's name."""
    base, durable, _folders = fleet
    monkeypatch.setenv("SAFEPOINT_NODE", "spare-1")
    result = restore("fr", base / "spare", catalog=catalog, config=cfg, ranks=[1, 2])
    m = LocalSnapshot.open(base / "spare").manifest
    assert (m.held_ranks, m.node, result.node) == ((1, 2), "spare-1", "spare-1")
    assert _files(base / "spare") == {"rank01.pt", "rank02.pt", "config.json", "MANIFEST.json", "COMMITTED"}
    # The ranks of one node, without --node: committed under that node's name.
    assert restore("fr", base / "n2-ranks", catalog=catalog, config=cfg, ranks=[4, 5]).node == "n2"


@pytest.mark.catalog_backends
def test_a_node_chooses_its_checkpoint_in_one_catalog_read(fleet, catalog, monkeypatch):
    """No herd: a restoring node reads the resume point, the checkpoint, its replicas and ranks in one
    transaction, on the catalog proper (SQLite and PostgreSQL) and on the light one."""
    import sqlite3

    from sqlalchemy import event

    import safepoint.catalog.lite as lite_mod
    from safepoint.ops.restore import choose

    begins: list[object] = []
    on_begin = begins.append
    event.listen(catalog.engine, "begin", on_begin)
    try:
        choice = choose(catalog, "fr", None)
        assert len(begins) == 1, f"{len(begins)} read transactions"
        assert choice.step == 1 and len(choice.holders) == WORLD and choice.replicas
        begins.clear()
        assert choose(catalog, "fr", 1) == choice and len(begins) == 1
    finally:
        event.remove(catalog.engine, "begin", on_begin)
    if not catalog.url.startswith("sqlite"):
        return
    lite = lite_mod.open_fast(catalog.url)
    assert isinstance(lite, lite_mod.LiteCatalog)
    connects: list[object] = []
    real = sqlite3.connect

    def spy(*a, **k):
        connects.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(lite_mod.sqlite3, "connect", spy)
    assert choose(lite, "fr", None) == choice and choose(lite, "fr", 1) == choice
    assert len(connects) == 2, connects   # one connection (one transaction) per choice
    assert lite._proper is None
