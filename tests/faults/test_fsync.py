"""fsync failing with EIO, at every fsync of a commit and of a replication, injected by patching.

Injection: os.fsync raises EIO at its k-th call, for every k from 1 to the number of fsyncs a
clean run makes. Expected: the commit is aborted with CommitError, leaving no marker, no manifest
and no temporary file; a replication is recorded failed, never verified, and leaves no COMMITTED at
the destination. After a failed fsync the page cache may hold bytes the disk never got, so nothing
is retried-then-trusted: the failing file is never fsynced again by the same run, an object whose
fsync failed never reaches its final name, and a later run sends it again and re-hashes it.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from safepoint.core.errors import CommitError
from safepoint.core.exits import EXIT_ERROR
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME, TMP_PREFIX
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.local.commit import commit
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops import ingest as pipeline
from safepoint.ops import steps
from safepoint.ops.reconcile import reconcile
from tests.faults.conftest import figures
from tests.faults.world import copy_template


class FailingFsync:
    """os.fsync that raises EIO at call number `fail_at` and records what each call synced."""

    def __init__(self, real, fail_at: int | None):
        self.real, self.fail_at = real, fail_at
        self.calls: list[str] = []
        self.failed: str | None = None
        self.after_failure: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, fd: int) -> None:
        try:
            what = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            what = f"fd{fd}"
        with self.lock:
            self.calls.append(what)
            n = len(self.calls)
            if self.failed is not None:
                self.after_failure.append(what)
            if n == self.fail_at:
                self.failed = what
                raise OSError(errno.EIO, "Input/output error (injected)")
        self.real(fd)


def _count(monkeypatch, fn) -> int:
    probe = FailingFsync(os.fsync, None)
    monkeypatch.setattr(os, "fsync", probe)
    fn()
    monkeypatch.undo()
    return len(probe.calls)


def test_commit_fsync_eio_at_every_point(tmp_path, template, monkeypatch):
    n = _count(monkeypatch, lambda: commit(copy_template(template, tmp_path / "probe"), "e", 1))
    assert n >= 8
    for k in range(1, n + 1):
        folder = copy_template(template, tmp_path / f"k{k}")
        before = {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        fs = FailingFsync(os.fsync, k)
        monkeypatch.setattr(os, "fsync", fs)
        with pytest.raises(CommitError, match="nothing was committed"):
            commit(folder, "e", 1)
        monkeypatch.undo()
        assert not (folder / MARKER_NAME).exists(), f"fsync #{k} ({fs.failed}) failed but the marker stayed"
        assert not (folder / MANIFEST_NAME).exists(), k
        assert not list(folder.rglob(f"{TMP_PREFIX}*")), k
        assert fs.failed not in fs.after_failure, f"fsync #{k}: {fs.failed} was fsynced again after EIO"
        after = {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        assert after == before  # the training's files are untouched
    figures("fsync EIO during commit", points=n, outcome="CommitError, no marker, no manifest, no tmp",
            retried_then_trusted=0)


def test_replication_fsync_eio_at_every_point(tmp_path, template, monkeypatch, sqlite_catalog):
    folder = copy_template(template, tmp_path / "src")
    commit(folder, "r", 1)
    snap = LocalSnapshot.open(folder)
    files = {f.path for f in snap.manifest.files}

    def replicate_once(dest: Path):
        row = steps.register(sqlite_catalog, snap)
        return row, steps.replicate_to(sqlite_catalog, row.id, snap, dest.as_uri())

    n = _count(monkeypatch, lambda: replicate_once(tmp_path / "probe"))
    assert n >= len(files) + 3
    outcomes = set()
    checked = 0
    for k in range(1, n + 1):
        dest = tmp_path / f"d{k}"
        fs = FailingFsync(os.fsync, k)
        monkeypatch.setattr(os, "fsync", fs)
        try:
            _row, result = replicate_once(dest)
            state, error = result.state, result.error
        except OSError as e:
            state, error = None, str(e)
        monkeypatch.undo()
        assert fs.failed is not None
        outcomes.add(str(state))
        snapdir = dest / "r" / "1"
        assert state is not RS.VERIFIED, f"fsync #{k} ({fs.failed}) failed but the replica was verified"
        assert not (snapdir / MARKER_NAME).exists(), f"fsync #{k} ({fs.failed}) failed but COMMITTED stayed"
        assert fs.failed not in fs.after_failure, f"fsync #{k}: {fs.failed} fsynced again after EIO"
        failed = Path(fs.failed)
        if failed.name.startswith(TMP_PREFIX) and failed.is_relative_to(snapdir):
            # temp names are TMP_PREFIX + name + ".<pid>.<random>" (safepoint.local.atomic)
            final = (failed.parent / failed.name[len(TMP_PREFIX):].rsplit(".", 2)[0]).relative_to(snapdir)
            if final.as_posix() in files:
                checked += 1
                assert not (snapdir / final).exists(), f"{final} reached its final name after its fsync failed"
        assert "Input/output error" in (error or "")
        cid = sqlite_catalog.get("r", 1).id
        rep = next(r for r in sqlite_catalog.replicas(cid) if r.url == f"{dest.as_uri()}/r/1")
        assert rep.state is RS.FAILED and "Input/output error" in rep.error
        # The reconciler must not trust what the failed run left either.
        assert reconcile(sqlite_catalog, [dest.as_uri()], grace_s=3600, finish=False).count("replica_verified") == 0
        # A clean run later sends again what never got durable, re-hashes everything, and verifies.
        _row, again = replicate_once(dest)
        assert again.state is RS.VERIFIED
    assert checked == len(files)  # every data file's own fsync failed once
    figures("fsync EIO during replication", points=n, outcomes=sorted(outcomes), falsely_verified=0)


def test_eio_during_ingest_is_a_clean_failure(tmp_path, template, monkeypatch, sqlite_catalog):
    folder = copy_template(template, tmp_path / "src")
    commit(folder, "i", 1)
    fs = FailingFsync(os.fsync, 1)
    monkeypatch.setattr(os, "fsync", fs)
    out = pipeline.ingest(folder, [(tmp_path / "d").as_uri()], sqlite_catalog)
    monkeypatch.undo()
    assert out.state is CS.COMMITTED and "Input/output error" in out.message
    assert out.exit_code == EXIT_ERROR
    assert pipeline.ingest(folder, [(tmp_path / "d").as_uri()], sqlite_catalog).state is CS.VERIFIED
