"""Lineage: parents from the manifest (`safepoint commit --parent`, the Python API), linked even
when the parent is cataloged later, set and checked through the catalog, shown by
`safepoint lineage RUN STEP` across runs; both backends."""

from __future__ import annotations

import json

import pytest

import safepoint
from safepoint.cli.main import main
from safepoint.core.errors import CatalogError
from safepoint.core.format import FileEntry, build_manifest, digest_bytes
from safepoint.core.states import CheckpointState as C
from safepoint.local.snapshot import LocalSnapshot
from tests.helpers_catalog import seed


def _record(catalog, folder):
    snap = LocalSnapshot.open(folder)
    return catalog.record_commit(snap.manifest, digest_bytes(snap.manifest_bytes), str(snap.root))


def _fake(catalog, run, step, parent=None):
    m = build_manifest(run, step, [FileEntry("w", 1, f"{step:064x}")], parent=parent)
    return catalog.record_commit(m, digest_bytes(m.to_json_bytes()), None)


def chain(catalog, run, step):
    return [(x.run, x.step, x.relation) for x in catalog.lineage(run, step)]


def test_lineage_across_runs_from_cli_commit_and_python_api(catalog, catalog_url, tmp_path, capsys):
    base = seed(catalog, tmp_path, "base", 1000)
    # Fine-tune forked from base/1000 with the CLI, then resumed within the run with the Python API.
    ft5 = tmp_path / "ft" / "5"
    ft5.mkdir(parents=True)
    (ft5 / "w.bin").write_bytes(b"x" * 10)
    assert main(["commit", str(ft5), "--run", "ft", "--step", "5", "--parent", "base:1000"]) == 0
    row5 = _record(catalog, ft5)
    assert row5.parent == ("base", 1000) and row5.parent_id == base.id
    ft9 = tmp_path / "ft" / "9"
    ft9.mkdir(parents=True)
    (ft9 / "w.bin").write_bytes(b"y" * 10)
    safepoint.commit(ft9, "ft", 9, parent=("ft", 5))
    row9 = _record(catalog, ft9)
    assert row9.parent_id == row5.id

    assert chain(catalog, "ft", 9) == [("ft", 9, "resumed"), ("ft", 5, "forked"), ("base", 1000, None)]
    assert [(c.run, c.step, c.relation) for c in catalog.children("base", 1000)] == [("ft", 5, "forked")]
    capsys.readouterr()
    assert main(["--catalog", catalog_url, "lineage", "ft", "9"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[:3] == ["ft/9 (committed)", "  <- resumed from ft/5 (committed)",
                                     "  <- forked from base/1000 (verified)"]
    assert main(["--catalog", catalog_url, "lineage", "base", "1000", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["chain"] == [{"run": "base", "step": 1000, "state": "verified", "cataloged": True,
                             "relation": None, "created": doc["chain"][0]["created"]}]
    assert [(c["run"], c["step"]) for c in doc["children"]] == [("ft", 5)]
    assert main(["--catalog", catalog_url, "lineage", "nope", "1"]) == 1


@pytest.mark.catalog_backends
def test_parent_cataloged_later_is_linked(catalog):
    child = _fake(catalog, "b", 1, parent=("a", 50))
    assert child.parent == ("a", 50) and child.parent_id is None
    assert chain(catalog, "b", 1) == [("b", 1, "forked"), ("a", 50, None)]
    assert catalog.lineage("b", 1)[-1].state is None  # declared, not in the catalog (yet)
    parent = _fake(catalog, "a", 50)
    assert catalog.get("b", 1).parent_id == parent.id
    assert catalog.lineage("b", 1)[-1].state is C.COMMITTED


@pytest.mark.catalog_backends
def test_set_parent_python_api_refuses_cycles(catalog):
    for s in (1, 2, 3):
        _fake(catalog, "r", s)
    assert catalog.set_parent("r", 2, ("r", 1)).parent == ("r", 1)
    assert catalog.set_parent("r", 3, ("r", 2)).parent_id == catalog.get("r", 2).id
    with pytest.raises(CatalogError, match="cycle"):
        catalog.set_parent("r", 1, ("r", 3))
    with pytest.raises(CatalogError, match="own parent"):
        catalog.set_parent("r", 1, ("r", 1))
    with pytest.raises(CatalogError):
        catalog.set_parent("r", 99, ("r", 1))
    assert chain(catalog, "r", 3) == [("r", 3, "resumed"), ("r", 2, "resumed"), ("r", 1, None)]
    assert catalog.set_parent("r", 3, None).parent is None
    assert chain(catalog, "r", 3) == [("r", 3, None)]
    assert [e["detail"]["linked"] for e in catalog.events(catalog.get("r", 3).id) if e["kind"] == "lineage"] == \
        [True, False]


@pytest.mark.catalog_backends
def test_a_manifest_made_cycle_stops(catalog):
    _fake(catalog, "x", 1, parent=("y", 1))
    _fake(catalog, "y", 1, parent=("x", 1))
    assert chain(catalog, "x", 1) == [("x", 1, "forked"), ("y", 1, "forked")]


@pytest.mark.catalog_backends
def test_lineage_survives_pruning_of_the_parent(catalog, tmp_path):
    p = seed(catalog, tmp_path, "p", 1)
    seed(catalog, tmp_path, "q", 1, parent=("p", 1))
    assert catalog.transition(p.id, C.PRUNED)
    links = catalog.lineage("q", 1)
    assert [(x.run, x.step, x.state) for x in links] == [("q", 1, C.VERIFIED), ("p", 1, C.PRUNED)]
    assert catalog.list_checkpoints("q")[0].parent == ("p", 1)
