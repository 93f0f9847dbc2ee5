"""Pruning a multi-node checkpoint follows docs/format.md's order, on file:// and on S3 (SeaweedFS):
the merged COMMITTED, the merged MANIFEST.json, every part's COMMITTED and MANIFEST.json, then the
data. A kill between any two deletes leaves a replica that is no longer committed, and that
`reconcile` recognises (finish_prune) and finishes deleting."""

from __future__ import annotations

import pytest

from safepoint.cli.main import main
from safepoint.core.config import Config
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.destinations import open_destination
from safepoint.ops import prune
from safepoint.ops.ingest import ingest
from safepoint.ops.reconcile import reconcile
from tests.test_multinode import make_part

NODES = {"n0": (0, 1), "n1": (2, 3)}
ORDER = ["COMMITTED", "MANIFEST.json",                                          # the merged marker, manifest
         ".safepoint/parts/0/COMMITTED", ".safepoint/parts/0/MANIFEST.json",   # every part's control files
         ".safepoint/parts/2/COMMITTED", ".safepoint/parts/2/MANIFEST.json"]


class Killed(BaseException):
    """The process dies here (nothing catches a BaseException on the way out)."""


@pytest.fixture(params=["file", "s3"])
def durable(request, tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("SAFEPOINT_MULTINODE_TIMEOUT_S", "600")
    if request.param == "file":
        return (tmp_path / "durable").as_uri()
    return request.getfixturevalue("s3_env").url("durable")


def assembled(tmp_path, catalog, durable: str, run: str, step: int) -> int:
    for node, ranks in NODES.items():
        ingest(make_part(tmp_path, run, step, node, ranks, world=4), [durable], catalog, Config())
    row = catalog.get(run, step)
    assert row.state is CS.VERIFIED
    return row.id


def record_deletes(mp: pytest.MonkeyPatch, durable: str, kill_before: int | None = None) -> list:
    """Every delete the destination's class is asked for, in order: a control file's name, or the
    set of data paths of one `delete_files` call; with `kill_before`, that call raises Killed."""
    cls = type(open_destination(durable, retries=False))  # the backend the retry layer wraps
    calls: list = []

    def wrap(name: str, record):
        orig = getattr(cls, name)

        def call(self, run, step, *args):
            if kill_before is not None and len(calls) == kill_before:
                raise Killed(f"killed before delete {kill_before}")
            calls.append(record(*args))
            return orig(self, run, step, *args)

        mp.setattr(cls, name, call)

    wrap("delete_control", lambda name: name)
    wrap("delete_files", lambda paths: frozenset(paths))
    wrap("remove_empty_folders", lambda: "folders")
    return calls


def left_at(durable: str, run: str, step: int) -> set[str]:
    dest = open_destination(durable)
    try:
        loc = dest.listing(run, step).get((run, step))
        return set(loc.objects) if loc else set()
    finally:
        dest.close()


def test_prune_deletes_the_merged_marker_first_and_every_part_s_control_files(
        tmp_path, sqlite_catalog, sqlite_catalog_url, durable, monkeypatch):
    old = assembled(tmp_path, sqlite_catalog, durable, "mn", 1)
    for step in (2, 3):  # retention always keeps the two newest verified
        assembled(tmp_path, sqlite_catalog, durable, "mn", step)
    data = set(sqlite_catalog.file_paths(old))
    before = left_at(durable, "mn", 1)
    assert set(ORDER) | data == before  # what is there: the merged and the parts' control files, the data
    calls = record_deletes(monkeypatch, durable)
    assert main(["--catalog", sqlite_catalog_url, "prune", "--run", "mn", "--keep-last", "1"]) == 0
    assert calls[:len(ORDER)] == ORDER
    assert calls[len(ORDER)] == data and calls[len(ORDER) + 1:] == ["folders"]
    assert left_at(durable, "mn", 1) == set()
    assert sqlite_catalog.get("mn", 1).state is CS.PRUNED
    assert [r.state for r in sqlite_catalog.replicas(old)] == [RS.DELETED]
    assert left_at(durable, "mn", 2) and sqlite_catalog.get("mn", 2).state is CS.VERIFIED  # the kept one


def test_a_kill_between_any_two_deletes_leaves_what_reconcile_finishes(tmp_path, sqlite_catalog, durable):
    cuts = range(1, len(ORDER) + 2)  # after each control file, and after the data before the folders go
    for cut in cuts:
        ident = assembled(tmp_path / str(cut), sqlite_catalog, durable, "k", cut)
        (view,) = sqlite_catalog.mark_pruned("k", [ident], lambda views, i=ident: [i])
        view = next(v for v in sqlite_catalog.list_checkpoints("k", states=[CS.PRUNED]) if v.id == ident)
        with pytest.MonkeyPatch.context() as mp, pytest.raises(Killed):
            calls = record_deletes(mp, durable, kill_before=cut)
            prune.delete_copies(sqlite_catalog, view, Config())
        assert calls == (ORDER + [set(sqlite_catalog.file_paths(ident))])[:cut]
        left = left_at(durable, "k", cut)
        assert "COMMITTED" not in left  # never a committed replica with something missing
        assert [r.state for r in sqlite_catalog.replicas(ident)] == [RS.VERIFIED]  # the kill came first
        report = reconcile(sqlite_catalog, [durable], Config(), scope=("k", cut))
        assert report.count("finish_prune") == 1, (cut, left, report.to_dict())
        assert left_at(durable, "k", cut) == set()
        assert [r.state for r in sqlite_catalog.replicas(ident)] == [RS.DELETED]


@pytest.mark.parametrize("paths, controls, data", [
    (["w.pt"], ["COMMITTED", "MANIFEST.json"], ["w.pt"]),                      # a whole replica
    (["MANIFEST.json", "w.pt", "COMMITTED"], ["COMMITTED", "MANIFEST.json"], ["w.pt"]),
    ([".safepoint/parts/10/MANIFEST.json", "a.pt", ".safepoint/parts/2/COMMITTED", ".safepoint/parts/10/COMMITTED",
      ".safepoint/parts/2/MANIFEST.json"],
     ["COMMITTED", "MANIFEST.json", ".safepoint/parts/2/COMMITTED", ".safepoint/parts/2/MANIFEST.json",
      ".safepoint/parts/10/COMMITTED", ".safepoint/parts/10/MANIFEST.json"], ["a.pt"]),  # parts by key, numerically
    ([".safepoint/parts/x/COMMITTED", ".safepoint/parts/2/other", "d/.safepoint/parts/2/COMMITTED"],
     ["COMMITTED", "MANIFEST.json"],                                            # not control files: data
     [".safepoint/parts/x/COMMITTED", ".safepoint/parts/2/other", "d/.safepoint/parts/2/COMMITTED"]),
])
def test_deletion_order_table(paths, controls, data):
    from safepoint.rules.deletion import deletion_order

    assert deletion_order(paths) == (controls, data)
