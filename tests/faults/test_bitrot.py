"""Bit rot: locally after commit, and remotely behind the storage's back.

Injection: one byte flipped in a data file (or in COMMITTED) of the local folder or of a file://
replica, with no Safepoint code involved. Expected: `safepoint verify` and `safepoint scrub`
detect it; the replica is recorded corrupt and replicated again from a copy that verifies (the
local folder, or another replica); with no good copy left the checkpoint becomes corrupt, the
resume point falls back, and no copy, rotten or not, is deleted; retention keeps the newest
checkpoint that still has intact copies.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path

from safepoint.cli.main import main
from safepoint.core.format import MARKER_NAME
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.local.commit import commit
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops import ingest as pipeline
from safepoint.ops.prune import prune
from safepoint.ops.resume import find_resume_point
from safepoint.rules.retention import KeepLastN
from tests.faults.conftest import figures
from tests.faults.world import copy_template, flip_byte


def sp(*args) -> int:
    return main([str(a) for a in args])


def _replica_states(catalog, run, step) -> dict[str, RS]:
    return {r.url: r.state for r in catalog.replicas(catalog.get(run, step).id)}


def _setup(tmp_path, template, catalog, run="rot", steps=(1, 2), dests=("a", "b")):
    urls = [(tmp_path / d).as_uri() for d in dests]
    folders = {}
    for step in steps:
        folder = copy_template(template, tmp_path / "nvme" / f"step-{step}")
        commit(folder, run, step)
        assert pipeline.ingest(folder, urls, catalog).state is CS.VERIFIED
        folders[step] = folder
    return urls, folders


def test_local_rot_is_detected_and_never_used_as_a_source(tmp_path, template, sqlite_catalog, sqlite_catalog_url,
                                                           capsys):
    urls, folders = _setup(tmp_path, template, sqlite_catalog, dests=("a",))
    flip_byte(folders[2] / "big.safetensors")
    capsys.readouterr()
    assert sp("--catalog", sqlite_catalog_url, "verify", folders[2]) == 1
    assert "hash_mismatch" in capsys.readouterr().err
    row = sqlite_catalog.get("rot", 2)
    assert row.state is CS.VERIFIED     # its replica is intact: still safe to resume from
    assert [e for e in sqlite_catalog.events(row.id) if e["kind"] == "verify.local"][-1]["detail"]["outcome"] \
        == "corrupt"
    assert find_resume_point(sqlite_catalog, "rot").chosen.step == 2
    # Rot the replica too: the repair must not copy the rotten local bytes over it.
    flip_byte(tmp_path / "a" / "rot" / "2" / "shards" / "part-1.safetensors")
    assert sp("--catalog", sqlite_catalog_url, "scrub", "--subset", "1") == 1
    assert _replica_states(sqlite_catalog, "rot", 2) == {f"{urls[0]}/rot/2": RS.CORRUPT}
    assert sqlite_catalog.get("rot", 2).state is CS.CORRUPT
    assert find_resume_point(sqlite_catalog, "rot").chosen.step == 1
    assert (tmp_path / "a" / "rot" / "2" / MARKER_NAME).exists() and folders[2].exists()  # nothing deleted


def test_remote_rot_is_repaired_from_the_local_copy(tmp_path, template, sqlite_catalog, sqlite_catalog_url, capsys):
    urls, folders = _setup(tmp_path, template, sqlite_catalog)
    victim = tmp_path / "a" / "rot" / "2" / "big.safetensors"
    flip_byte(victim)
    capsys.readouterr()
    assert sp("--catalog", sqlite_catalog_url, "scrub", "--subset", "1", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["problems"] == 1 and doc["unrepaired"] == []
    assert doc["repair"]["actions"].get("replica_verified") == 1, doc
    assert _replica_states(sqlite_catalog, "rot", 2) == {f"{urls[0]}/rot/2": RS.VERIFIED,
                                                         f"{urls[1]}/rot/2": RS.VERIFIED}
    assert LocalSnapshot.open(victim.parent).verify().outcome is CS.VERIFIED   # the bytes really are fixed
    kinds = [e["detail"].get("state") for e in sqlite_catalog.events(sqlite_catalog.get("rot", 2).id)
             if e["kind"] == "replica"]
    assert "corrupt" in kinds   # it was recorded corrupt before it was repaired
    figures("remote bit rot, local copy good", detected_by="safepoint scrub", outcome="corrupt, re-replicated "
            "from the local copy, verified", bytes_lost=0)


def test_remote_rot_is_repaired_from_another_replica(tmp_path, template, sqlite_catalog, sqlite_catalog_url, capsys):
    urls, folders = _setup(tmp_path, template, sqlite_catalog)
    shutil.rmtree(folders[2])                       # the local copy is gone (evicted)
    flip_byte(tmp_path / "a" / "rot" / "2" / "model.pt", 200)
    capsys.readouterr()
    assert sp("--catalog", sqlite_catalog_url, "verify", f"{urls[0]}/rot/2") == 1
    assert _replica_states(sqlite_catalog, "rot", 2)[f"{urls[0]}/rot/2"] is RS.CORRUPT
    assert sqlite_catalog.get("rot", 2).state is CS.VERIFIED     # b still verifies
    assert sp("--catalog", sqlite_catalog_url, "reconcile") == 0
    assert set(_replica_states(sqlite_catalog, "rot", 2).values()) == {RS.VERIFIED}
    assert LocalSnapshot.open(tmp_path / "a" / "rot" / "2").verify().outcome is CS.VERIFIED
    figures("remote bit rot, local copy gone", detected_by="safepoint verify",
            outcome="corrupt, re-replicated from the other replica, verified", bytes_lost=0)


def test_rotten_marker_is_repaired(tmp_path, template, sqlite_catalog, sqlite_catalog_url):
    urls, _folders = _setup(tmp_path, template, sqlite_catalog, dests=("a",))
    marker = tmp_path / "a" / "rot" / "2" / MARKER_NAME
    flip_byte(marker, 10)
    assert sp("--catalog", sqlite_catalog_url, "scrub", "--subset", "1") == 0   # found, recorded, repaired
    assert marker.read_bytes() == LocalSnapshot.open(tmp_path / "nvme" / "step-2").marker_bytes
    assert _replica_states(sqlite_catalog, "rot", 2) == {f"{urls[0]}/rot/2": RS.VERIFIED}


def test_no_good_copy_left_nothing_is_deleted_and_retention_keeps_a_good_one(tmp_path, template, sqlite_catalog,
                                                                             sqlite_catalog_url, capsys):
    urls, folders = _setup(tmp_path, template, sqlite_catalog, steps=(1, 2, 3))
    shutil.rmtree(folders[3])
    for d in ("a", "b"):
        flip_byte(tmp_path / d / "rot" / "3" / "big.safetensors")
    before = sorted(p for d in ("a", "b") for p in (tmp_path / d / "rot" / "3").rglob("*"))
    assert sp("--catalog", sqlite_catalog_url, "scrub", "--subset", "1") == 1
    row = sqlite_catalog.get("rot", 3)
    assert row.state is CS.CORRUPT and set(_replica_states(sqlite_catalog, "rot", 3).values()) == {RS.CORRUPT}
    after = sorted(p for d in ("a", "b") for p in (tmp_path / d / "rot" / "3").rglob("*"))
    assert after == before                          # the last copies, rotten or not, are kept
    assert find_resume_point(sqlite_catalog, "rot").chosen.step == 2
    res = prune(sqlite_catalog, ["rot"], KeepLastN(1), now=datetime.now(timezone.utc))
    kept = {c.step for c in sqlite_catalog.list_checkpoints("rot") if c.state is CS.VERIFIED}
    assert 2 in kept and (tmp_path / "a" / "rot" / "2" / MARKER_NAME).exists(), res.plan.to_rows()
    assert find_resume_point(sqlite_catalog, "rot").chosen.step == 2
    figures("bit rot in every copy", outcome="checkpoint corrupt, resume point falls back to step 2, "
            "no copy deleted, retention keeps step 2", bytes_lost_of_good_checkpoints=0)


def test_missing_marker_at_replica_is_missing_then_repaired(tmp_path, template, sqlite_catalog, sqlite_catalog_url):
    """A manifest without a marker at a destination: the replica is missing, then re-committed."""
    urls, _ = _setup(tmp_path, template, sqlite_catalog, dests=("a",))
    (tmp_path / "a" / "rot" / "2" / MARKER_NAME).unlink()
    assert sp("--catalog", sqlite_catalog_url, "reconcile") == 0
    assert _replica_states(sqlite_catalog, "rot", 2) == {f"{urls[0]}/rot/2": RS.VERIFIED}
    assert (tmp_path / "a" / "rot" / "2" / MARKER_NAME).exists()


def test_marker_without_manifest_at_replica_is_corrupt_then_repaired(tmp_path, template, sqlite_catalog,
                                                                     sqlite_catalog_url):
    urls, _ = _setup(tmp_path, template, sqlite_catalog, dests=("a",))
    (tmp_path / "a" / "rot" / "2" / "MANIFEST.json").unlink()
    assert sp("--catalog", sqlite_catalog_url, "verify", f"{urls[0]}/rot/2") == 1
    assert _replica_states(sqlite_catalog, "rot", 2) == {f"{urls[0]}/rot/2": RS.CORRUPT}
    assert sp("--catalog", sqlite_catalog_url, "reconcile") == 0
    assert _replica_states(sqlite_catalog, "rot", 2) == {f"{urls[0]}/rot/2": RS.VERIFIED}
    assert LocalSnapshot.open(Path(tmp_path / "a" / "rot" / "2")).verify().outcome is CS.VERIFIED
