"""Sealing folders: write order, refusals, and failure injection."""

import os

import pytest

from safepoint import commit
from safepoint.core.errors import CommitError
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME
from safepoint.core.hashing import hash_path
from safepoint.core.states import CheckpointState
from safepoint.core.verify import FileStatus
from safepoint.local.snapshot import LocalSnapshot


def make_folder(tmp_path, files=None):
    d = tmp_path / "snap"
    for rel, data in (files or {"model.pt": b"weights", "sub/opt.bin": b"x" * 1000, "empty": b""}).items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return d


def test_commit_writes_manifest_then_marker(tmp_path):
    d = make_folder(tmp_path)
    m = commit(d, "run-a", 5)
    assert [f.path for f in m.files] == ["empty", "model.pt", "sub/opt.bin"]
    assert m.file("sub/opt.bin").blake3 == hash_path(d / "sub/opt.bin")[1]
    snap = LocalSnapshot.open(d)
    assert snap.manifest == m
    assert snap.verify().outcome is CheckpointState.VERIFIED
    assert not list(d.glob(".safepoint-tmp-*"))


def test_recommit_same_is_noop_other_is_error(tmp_path):
    d = make_folder(tmp_path)
    m = commit(d, "run-a", 5)
    assert commit(d, "run-a", 5) == m
    with pytest.raises(CommitError, match="already committed"):
        commit(d, "run-a", 6)


def test_symlinks_are_refused(tmp_path):
    d = make_folder(tmp_path)
    (tmp_path / "outside").write_bytes(b"secret")
    os.symlink(tmp_path / "outside", d / "link")
    with pytest.raises(CommitError, match="symlink"):
        commit(d, "r", 1)
    assert not (d / MARKER_NAME).exists() and not (d / MANIFEST_NAME).exists()


def test_symlinked_dir_is_refused(tmp_path):
    d = make_folder(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", d / "dirlink")
    with pytest.raises(CommitError, match="symlink"):
        commit(d, "r", 1)


def test_fsync_eio_aborts_without_marker(tmp_path, monkeypatch):
    d = make_folder(tmp_path)
    real = os.fsync
    calls = {"n": 0}

    def failing(fd):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(5, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(CommitError, match="nothing was committed"):
        commit(d, "r", 1)
    assert not (d / MARKER_NAME).exists() and not (d / MANIFEST_NAME).exists()
    assert not list(d.glob(".safepoint-tmp-*"))


def test_bit_flip_after_commit_is_corrupt(tmp_path):
    d = make_folder(tmp_path)
    commit(d, "r", 1)
    data = bytearray((d / "model.pt").read_bytes())
    data[0] ^= 1
    (d / "model.pt").write_bytes(bytes(data))
    report = LocalSnapshot.open(d).verify()
    assert report.files["model.pt"] is FileStatus.HASH_MISMATCH
    assert report.outcome is CheckpointState.CORRUPT


def test_missing_file_after_commit_is_incomplete(tmp_path):
    d = make_folder(tmp_path)
    commit(d, "r", 1)
    (d / "sub/opt.bin").unlink()
    report = LocalSnapshot.open(d).verify()
    assert report.files == {"empty": FileStatus.OK, "model.pt": FileStatus.OK, "sub/opt.bin": FileStatus.MISSING}
    assert report.outcome is CheckpointState.INCOMPLETE
