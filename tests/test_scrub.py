"""Scrubbing: rotating slices of every verified replica, rot found and recorded (restic --read-data-subset)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from safepoint import commit
from safepoint.core.config import Config
from safepoint.core.format import FileEntry, build_manifest
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.ops.ingest import ingest
from safepoint.rules import scrub as scrub_rules


def manifest(n: int):
    files = [FileEntry(f"shard-{i:03d}.pt", i + 1, f"{i:064x}") for i in range(n)]
    return build_manifest("r", 5, files)


@pytest.mark.parametrize("of", [1, 2, 3, 7, 16])
def test_slices_partition_the_files(of):
    m = manifest(40)
    slices = [scrub_rules.select(m, i, of) for i in range(of)]
    paths = [f.path for s in slices for f in s]
    assert sorted(paths) == [f.path for f in m.files]       # every file in exactly one slice
    assert len(set(paths)) == len(paths)
    assert [scrub_rules.select(m, i, of) for i in range(of)] == slices  # stable


@pytest.mark.parametrize(("previous", "of", "expected"), [
    (None, 4, 0), ({"index": 0, "of": 4}, 4, 1), ({"index": 3, "of": 4}, 4, 0),
    ({"index": 2, "of": 8}, 4, 0),  # the number of slices changed: start over
])
def test_next_slice_rotates(previous, of, expected):
    assert scrub_rules.next_slice(previous, of) == expected


@pytest.mark.parametrize(("text", "expected"), [("16", (None, 16)), ("1/4", (0, 4)), ("4/4", (3, 4))])
def test_parse_subset(text, expected):
    assert scrub_rules.parse_subset(text) == expected


@pytest.mark.parametrize("text", ["0", "0/4", "5/4", "x"])
def test_parse_subset_rejects(text):
    with pytest.raises(ValueError):
        scrub_rules.parse_subset(text)


def ingested(tmp_path: Path, catalog, step: int, files: int = 6) -> Path:
    folder = tmp_path / "nvme" / f"step-{step}"
    folder.mkdir(parents=True)
    for i in range(files):
        torch.save({"w": torch.full((16,), float(i + step))}, folder / f"shard-{i}.pt")
    commit(folder, "sc", step)
    assert ingest(folder, [(tmp_path / "durable").as_uri()], catalog, Config()).state is CS.VERIFIED
    return folder


def test_scrub_flow_rotates_and_finds_rot(tmp_path, prefect_api, sqlite_catalog_url, sqlite_catalog):
    from safepoint.flows.scrub import scrub_replicas

    for step in (1, 2):
        ingested(tmp_path, sqlite_catalog, step)
    read: dict[str, set[str]] = {}
    for expected in (0, 1, 2, 0):  # rotation, then wrap around
        out = scrub_replicas(subset="3", catalog_url=sqlite_catalog_url)
        assert (out["index"], out["of"], out["replicas"], out["problems"]) == (expected, 3, 2, 0)
        for e in sqlite_catalog.events(kind="scrub"):
            d = e["detail"]
            if not d.get("pass") and d["index"] == expected:
                read.setdefault(d["url"], set()).add(expected)
    assert all(v == {0, 1, 2} for v in read.values()) and len(read) == 2
    # Rot one byte of one replica file, behind the catalog's back.
    m = sqlite_catalog.files(sqlite_catalog.get("sc", 2).id)
    victim = m[0].path
    path = tmp_path / "durable" / "sc" / "2" / victim
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    from safepoint.core.format import build_manifest as bm

    index = scrub_rules.slice_of("sc", 2, victim, 3)
    other = (index + 1) % 3
    assert victim not in {f.path for f in scrub_rules.select(bm("sc", 2, m), other, 3)}
    # The slice without the file does not see the rot; the slice with it does, and the full
    # verification that follows records the replica as corrupt.
    assert scrub_replicas(subset=f"{other + 1}/3", catalog_url=sqlite_catalog_url)["problems"] == 0
    out = scrub_replicas(subset=f"{index + 1}/3", catalog_url=sqlite_catalog_url)
    assert out["problems"] == 1
    row = sqlite_catalog.get("sc", 2)
    (rep,) = sqlite_catalog.replicas(row.id)
    # Recorded corrupt, then re-replicated from the local copy, which still verifies (reconcile.repair).
    bad = [e["detail"] for e in sqlite_catalog.events(row.id, kind="replica") if e["detail"]["state"] == "corrupt"]
    assert bad and victim in bad[-1]["error"]
    assert rep.state is RS.VERIFIED and out["repair"]["actions"].get("replica_verified") == 1
    assert row.state is CS.VERIFIED  # the local copy still verifies: the checkpoint is not lost
    found = [e["detail"] for e in sqlite_catalog.events(row.id, kind="scrub") if e["detail"].get("problems")]
    assert found[-1]["problems"] == {victim: "hash_mismatch"} and found[-1]["outcome"] == "corrupt"
