"""One contract for every destination: each backend's test module runs these against its URL.

A backend module defines a `dest_url` fixture (a fresh, empty base URL) and imports `*` from here.
"""

from __future__ import annotations

import os
import time

import pytest

from safepoint import commit
from safepoint.core.errors import FormatError
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME, FileEntry
from safepoint.core.hashing import hash_path
from safepoint.core.states import CheckpointState, ReplicaState
from safepoint.core.verify import FileStatus
from safepoint.destinations import open_destination
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.replicate import replicate
from safepoint.ops.verify import verify_replica


@pytest.fixture
def snapshot(tmp_path):
    d = tmp_path / "local" / "ckpt"
    d.mkdir(parents=True)
    (d / "a.bin").write_bytes(b"a" * 100_000)
    (d / "deep" / "er").mkdir(parents=True)
    (d / "deep" / "er" / "b.bin").write_bytes(bytes(range(256)) * 40)
    (d / "zero").write_bytes(b"")
    commit(d, "run-x", 42)
    return LocalSnapshot.open(d)


def test_upload_digest_size_roundtrip(dest_url, snapshot):
    dest = open_destination(dest_url)
    entry = snapshot.manifest.file("a.bin")
    assert dest.size("run-x", 42, "a.bin") is None
    assert dest.upload("run-x", 42, entry, snapshot.path_of("a.bin")) == entry.blake3
    assert dest.size("run-x", 42, "a.bin") == entry.size
    assert dest.digest("run-x", 42, "a.bin") == hash_path(snapshot.path_of("a.bin"))[1]


def test_control_files_exclusive(dest_url):
    dest = open_destination(dest_url)
    assert dest.read_control("r", 1, MARKER_NAME) is None
    assert dest.write_control("r", 1, MARKER_NAME, b"one", exclusive=True)
    assert not dest.write_control("r", 1, MARKER_NAME, b"two", exclusive=True)
    assert dest.read_control("r", 1, MARKER_NAME) == b"one"
    assert dest.committed_snapshots() == [("r", 1)]
    dest.delete_control("r", 1, MARKER_NAME)
    dest.delete_control("r", 1, MARKER_NAME)  # idempotent
    assert dest.committed_snapshots() == []


def test_replicate_verifies_and_commits_last(dest_url, snapshot):
    dest = open_destination(dest_url)
    result = replicate(snapshot, dest)
    assert result.state is ReplicaState.VERIFIED, result.error
    assert set(result.remote.values()) == {FileStatus.OK}
    assert result.bytes_uploaded == snapshot.manifest.total_bytes
    assert dest.read_control("run-x", 42, MANIFEST_NAME) == snapshot.manifest_bytes
    assert dest.read_control("run-x", 42, MARKER_NAME) == snapshot.marker_bytes
    assert verify_replica(dest, "run-x", 42).outcome is CheckpointState.VERIFIED
    assert result.url == dest_url.rstrip("/") + "/run-x/42"


def test_replicate_again_reuses_everything(dest_url, snapshot):
    dest = open_destination(dest_url)
    replicate(snapshot, dest)
    again = replicate(snapshot, dest)
    assert again.state is ReplicaState.VERIFIED
    assert again.bytes_uploaded == 0 and again.bytes_reused == snapshot.manifest.total_bytes


def test_partial_replica_resumes(dest_url, snapshot):
    dest = open_destination(dest_url)
    entry = snapshot.manifest.file("a.bin")
    dest.upload("run-x", 42, entry, snapshot.path_of("a.bin"))  # as if killed after one file
    assert dest.read_control("run-x", 42, MARKER_NAME) is None
    result = replicate(snapshot, dest)
    assert result.state is ReplicaState.VERIFIED
    assert result.bytes_reused == entry.size


def test_changed_local_bytes_never_commit(dest_url, snapshot):
    dest = open_destination(dest_url)
    p = snapshot.path_of("a.bin")
    p.write_bytes(b"b" * 100_000)  # same size, different bytes: caught while uploading
    result = replicate(snapshot, dest)
    assert result.state is ReplicaState.FAILED
    assert result.local["a.bin"] is FileStatus.HASH_MISMATCH
    assert result.local_outcome is CheckpointState.CORRUPT
    assert dest.read_control("run-x", 42, MARKER_NAME) is None


def test_remote_rot_is_caught_by_verify(dest_url, snapshot):
    dest = open_destination(dest_url)
    replicate(snapshot, dest)
    # Overwrite one object behind Safepoint's back (same size).
    fake = FileEntry("a.bin", 100_000, "0" * 64)
    rotten = snapshot.root.parent / "rotten"
    rotten.write_bytes(b"c" * 100_000)
    dest.upload("run-x", 42, fake, rotten)
    report = verify_replica(dest, "run-x", 42)
    assert report.files["a.bin"] is FileStatus.HASH_MISMATCH
    assert report.outcome is CheckpointState.CORRUPT


def test_delete_snapshot_marker_first(dest_url, snapshot):
    dest = open_destination(dest_url)
    replicate(snapshot, dest)
    dest.delete_snapshot("run-x", 42, [f.path for f in snapshot.manifest.files])
    assert dest.read_control("run-x", 42, MARKER_NAME) is None
    assert dest.read_control("run-x", 42, MANIFEST_NAME) is None
    assert all(dest.size("run-x", 42, f.path) is None for f in snapshot.manifest.files)


@pytest.fixture
def dest_options():
    """Storage options for the fetch tests; a backend module may override it (S3: small parts, so ranged reads)."""
    return {}


def test_fetch_whole_file_hashed_as_it_arrives(dest_url, snapshot, tmp_path):
    dest = open_destination(dest_url)
    replicate(snapshot, dest)
    seen: list[int] = []
    for f in snapshot.manifest.files:
        target = tmp_path / f"got-{f.path.replace('/', '_')}"
        assert dest.fetch("run-x", 42, f.path, target, seen.append, size=f.size) == f.blake3
        assert target.read_bytes() == snapshot.path_of(f.path).read_bytes()
    assert sum(seen) == snapshot.manifest.total_bytes


def test_fetch_ranged_large_file(dest_url, dest_options, tmp_path):
    """A file of several read parts (ranged GETs on S3) comes back whole, in order."""
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(1 << 20) * 11 + b"tail")
    entry = FileEntry("big.bin", src.stat().st_size, hash_path(src)[1])
    dest = open_destination(dest_url, dest_options)
    try:
        dest.upload("run-x", 43, entry, src)
        target = tmp_path / "got.bin"
        assert dest.fetch("run-x", 43, "big.bin", target, size=entry.size) == entry.blake3
        assert target.read_bytes() == src.read_bytes()
    finally:
        dest.close()


def test_fetch_refuses_a_lying_size_before_reading(dest_url, snapshot, tmp_path):
    """The manifest says 99_999 bytes, the store holds 100_000: FormatError, never more than the size read."""
    dest = open_destination(dest_url)
    entry = snapshot.manifest.file("a.bin")
    dest.upload("run-x", 42, entry, snapshot.path_of("a.bin"))
    target = tmp_path / "got"
    seen: list[int] = []
    for lie in (entry.size - 1, entry.size + 1):
        with pytest.raises(FormatError):
            dest.fetch("run-x", 42, "a.bin", target, seen.append, size=lie)
    assert sum(seen) == 0
    with pytest.raises(FileNotFoundError):
        dest.fetch("run-x", 42, "nope.bin", target, size=1)


def test_fetch_refuses_what_is_not_a_regular_file(dest_url, snapshot, tmp_path):
    """A folder (a key prefix on S3) where a file should be is not fetched: missing or bad, never read."""
    dest = open_destination(dest_url)
    dest.upload("run-x", 42, FileEntry("dir/inner.bin", 100_000, "0" * 64), snapshot.path_of("a.bin"))
    with pytest.raises((FileNotFoundError, FormatError)):
        dest.fetch("run-x", 42, "dir", tmp_path / "got", size=0)


def test_listing_by_run_and_step(dest_url, snapshot):
    dest = open_destination(dest_url)
    replicate(snapshot, dest)
    dest.upload("run-x", 7, snapshot.manifest.file("a.bin"), snapshot.path_of("a.bin"))  # a partial
    dest.upload("run-y", 1, snapshot.manifest.file("zero"), snapshot.path_of("zero"))
    everything = dest.listing()
    assert set(everything) == {("run-x", 42), ("run-x", 7), ("run-y", 1)}
    loc = everything[("run-x", 42)]
    want = {f.path: f.size for f in snapshot.manifest.files}
    want[MANIFEST_NAME] = len(snapshot.manifest_bytes)
    want[MARKER_NAME] = len(snapshot.marker_bytes)
    assert {p: o.size for p, o in loc.objects.items()} == want
    assert all(o.mtime is not None and abs(o.mtime - time.time()) < 3600 for o in loc.objects.values())
    assert set(dest.listing("run-x")) == {("run-x", 42), ("run-x", 7)}
    assert set(dest.listing("run-x", 7)) == {("run-x", 7)}
    assert set(dest.listing("run-x", 7)[("run-x", 7)].objects) == {"a.bin"}
    assert dest.listing("run-z") == {}
    assert dest.abort_stale_uploads(3600.0) == 0
