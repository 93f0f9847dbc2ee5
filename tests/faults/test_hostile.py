"""Hostile inputs: checkpoints someone handed us, built to escape, execute, exhaust or confuse.

Injection: each case crafts a committed folder (a forged manifest and marker where needed) and
ingests it in a child process of the fork server, measuring its time and peak memory growth.
Expected: a clear error naming the problem, bounded memory (< 256 MiB growth) and time (< 60 s),
and a catalog state of `invalid` (the bytes are intact, the content is bad) or `corrupt` (the
bytes or the control files are bad). Nothing outside the folder is read or written, and no code
from the checkpoint runs.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from safepoint.catalog.store import open_catalog
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME, Manifest, digest_bytes, marker_for
from safepoint.core.hashing import hash_path
from safepoint.core.states import CheckpointState as CS
from safepoint.local.commit import commit
from safepoint.ops.resume import find_resume_point
from tests.faults.conftest import figures
from tests.faults.world import copy_template
from tests.helpers_ckpt import make_malicious_pickle

MAX_RSS_GROWTH_KIB = 256 * 1024
MAX_SECONDS = 60.0


def _forge(folder: Path, run: str, step: int, paths: dict[str, Path]) -> None:
    """Write a manifest that lists `paths` (manifest path -> real file for its size and hash) and a
    marker that binds it, bypassing every check `safepoint commit` makes."""
    files = []
    for rel, real in paths.items():
        size, digest = hash_path(real)
        files.append({"path": rel, "size": size, "blake3": digest})
    doc = {"format": "safepoint.manifest", "format_version": 1, "run": run, "step": step,
           "created": "2026-11-30T00:00:00.000000Z", "hash": "blake3", "world_size": 1, "ranks": [0],
           "node": None, "parent": None, "files": files, "meta": {}}
    data = (json.dumps(doc) + "\n").encode()
    (folder / MANIFEST_NAME).write_bytes(data)
    m = Manifest(run, step, ())
    (folder / MARKER_NAME).write_bytes(marker_for(data, m).to_json_bytes())


def _committed(tmp_path: Path, template: Path, name: str, step: int) -> Path:
    folder = copy_template(template, tmp_path / "nvme" / name)
    commit(folder, "hostile", step)
    return folder


def _ingest(server, catalog_url: str, folder: Path, dest: Path):
    ran = server.run("ingest_hostile", {"folder": str(folder), "dest": dest.as_uri(), "catalog_url": catalog_url})
    assert ran.exit == 0, ran
    assert ran.seconds < MAX_SECONDS
    assert ran.result["peak_rss_growth_kib"] < MAX_RSS_GROWTH_KIB, ran.result
    return ran


CASES: dict[str, tuple] = {}


def case(name: str, expected: CS, needle: str):
    def deco(fn):
        CASES[name] = (fn, expected, needle)
        return fn
    return deco


@case("manifest path with ../", CS.CORRUPT, "unsafe path '../outside.bin'")
def _dotdot(tmp_path, template, step):
    folder = copy_template(template, tmp_path / "nvme" / "dotdot")
    outside = tmp_path / "nvme" / "outside.bin"
    outside.write_bytes(b"secret" * 100)
    _forge(folder, "hostile", step, {"model.pt": folder / "model.pt", "../outside.bin": outside})
    return folder


@case("manifest with an absolute path", CS.CORRUPT, "unsafe path '/etc/hostname'")
def _absolute(tmp_path, template, step):
    folder = copy_template(template, tmp_path / "nvme" / "absolute")
    _forge(folder, "hostile", step, {"model.pt": folder / "model.pt", "/etc/hostname": Path("/etc/hostname")})
    return folder


@case("data file swapped for a symlink that escapes", CS.CORRUPT, "unsafe_path")
def _symlink_file(tmp_path, template, step):
    folder = _committed(tmp_path, template, "symlink-file", step)
    outside = tmp_path / "nvme" / "outside-model.pt"
    outside.write_bytes((folder / "model.pt").read_bytes())   # same bytes: only the link gives it away
    (folder / "model.pt").unlink()
    os.symlink(outside, folder / "model.pt")
    return folder


@case("folder swapped for a symlink that escapes", CS.CORRUPT, "unsafe_path")
def _symlink_dir(tmp_path, template, step):
    folder = _committed(tmp_path, template, "symlink-dir", step)
    outside = tmp_path / "nvme" / "outside-shards"
    (folder / "shards").rename(outside)
    os.symlink(outside, folder / "shards")
    return folder


@case("malicious pickle", CS.INVALID, "model.pt")
def _pickle(tmp_path, template, step):
    folder = tmp_path / "nvme" / "pickle"
    folder.mkdir(parents=True)
    make_malicious_pickle(folder / "model.pt", tmp_path / "SENTINEL")
    commit(folder, "hostile", step)
    return folder


@case("safetensors header length 2^40", CS.INVALID, "header length 1099511627776")
def _st_huge(tmp_path, template, step):
    folder = copy_template(template, tmp_path / "nvme" / "st-huge")
    with open(folder / "big.safetensors", "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))
    commit(folder, "hostile", step)
    return folder


@case("safetensors overlapping offsets", CS.INVALID, "overlap")
def _st_overlap(tmp_path, template, step):
    folder = copy_template(template, tmp_path / "nvme" / "st-overlap")
    header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                         "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}).encode()
    (folder / "overlap.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(24))
    commit(folder, "hostile", step)
    return folder


@case("truncated DCP .metadata", CS.INVALID, ".metadata")
def _dcp_truncated(tmp_path, template, step):
    import warnings

    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "nvme" / "dcp"
    folder.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(64, dtype=torch.float32)}, checkpoint_id=str(folder))
    meta = folder / ".metadata"
    meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    commit(folder, "hostile", step)
    return folder


@case("DCP .metadata whose BUILD steers pathlib", CS.INVALID, "BUILD on the name pathlib.PurePath")
def _dcp_build(tmp_path, template, step):
    from tests.test_dcp_metadata import build_on_purepath

    folder = tmp_path / "nvme" / "dcp-build"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(build_on_purepath())
    commit(folder, "hostile", step)
    return folder


@case("DCP .metadata hash bomb", CS.INVALID, "not a string")
def _dcp_hash_bomb(tmp_path, template, step):
    from tests.test_dcp_metadata import hash_bomb

    folder = tmp_path / "nvme" / "dcp-hash"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(hash_bomb())
    commit(folder, "hostile", step)
    return folder


@case("0-byte checkpoint file", CS.INVALID, "model.pt: truncated")
def _zero(tmp_path, template, step):
    folder = tmp_path / "nvme" / "zero"
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"")
    commit(folder, "hostile", step)
    return folder


@case("marker without a manifest", CS.CORRUPT, "COMMITTED marker without MANIFEST.json")
def _marker_only(tmp_path, template, step):
    folder = _committed(tmp_path, template, "marker-only", step)
    (folder / MANIFEST_NAME).unlink()
    return folder


@case("marker that binds another manifest", CS.CORRUPT, "does not match the digest in COMMITTED")
def _marker_mismatch(tmp_path, template, step):
    folder = _committed(tmp_path, template, "mismatch", step)
    data = (folder / MANIFEST_NAME).read_bytes().replace(b'"meta": {}', b'"meta": {"x": 1}')
    (folder / MANIFEST_NAME).write_bytes(data)
    return folder


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_checkpoint(name, tmp_path, template, shared_fork_server, sqlite_catalog_url):
    fn, expected, needle = CASES[name]
    step = list(CASES).index(name) + 1
    folder = fn(tmp_path, template, step)
    catalog = open_catalog(sqlite_catalog_url)
    dest = tmp_path / "durable"
    ran = _ingest(shared_fork_server, sqlite_catalog_url, folder, dest)
    row = catalog.get("hostile", step)
    assert row is not None, f"{name}: not in the catalog ({ran.result})"
    assert row.state is expected, (name, row.state, row.error, ran.result)
    message = " | ".join(x for x in (ran.result.get("error"), ran.result.get("message"), row.error) if x)
    assert needle in message, (name, message)
    if expected is CS.CORRUPT:   # bad bytes never become a replica; intact but invalid ones may (evidence)
        assert not (dest / "hostile" / str(step) / MARKER_NAME).exists()
    assert not (tmp_path / "SENTINEL").exists()
    for p in (dest.rglob("*") if dest.exists() else ()):   # nothing from outside the folder was copied
        assert b"secret" not in (p.read_bytes() if p.is_file() else b"")
    assert find_resume_point(catalog, "hostile").chosen is None
    figures(f"hostile input: {name}", state=str(row.state), seconds=round(ran.seconds, 2),
            peak_rss_growth_mib=round(ran.result["peak_rss_growth_kib"] / 1024, 1),
            error=repr((row.error or message)[-110:]))


def test_manifest_without_marker_does_not_exist(tmp_path, template, sqlite_catalog):
    """docs/format.md: a folder without COMMITTED does not exist for Safepoint. It is refused with a
    clear error and never cataloged (there is nothing to call valid or corrupt yet)."""
    from safepoint.core.errors import FormatError
    from safepoint.events.watch import pending_snapshots
    from safepoint.ops import ingest as pipeline

    folder = _committed(tmp_path, template, "manifest-only", 99)
    (folder / MARKER_NAME).unlink()
    with pytest.raises(FormatError, match="not committed: no COMMITTED marker"):
        pipeline.ingest(folder, [(tmp_path / "d").as_uri()], sqlite_catalog)
    assert sqlite_catalog.get("hostile", 99) is None
    assert list(pending_snapshots(tmp_path / "nvme", sqlite_catalog)) == []
    figures("hostile input: manifest without a marker", state="not cataloged (not committed)",
            error="'not committed: no COMMITTED marker'")


def test_refused_folder_is_not_retried_by_watch(tmp_path, template, sqlite_catalog):
    """Quarantined as corrupt, a refused folder stops being pending for `watch`."""
    from safepoint.core.errors import FormatError
    from safepoint.events.watch import pending_snapshots
    from safepoint.ops import ingest as pipeline

    folder = _committed(tmp_path, template, "refused", 7)
    (folder / MANIFEST_NAME).unlink()
    assert list(pending_snapshots(tmp_path / "nvme", sqlite_catalog)) == [folder.resolve()]
    with pytest.raises(FormatError):
        pipeline.ingest(folder, [(tmp_path / "d").as_uri()], sqlite_catalog)
    assert list(pending_snapshots(tmp_path / "nvme", sqlite_catalog)) == []
    assert sqlite_catalog.get("hostile", 7).state is CS.CORRUPT
    assert digest_bytes(b"") != sqlite_catalog.get("hostile", 7).manifest_blake3
