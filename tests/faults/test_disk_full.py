"""Disk full during commit and during replication, on a real 2 MiB tmpfs.

Injection: `mount -t tmpfs -o size=2m` (skipped, with the reason, where mounting is not allowed;
a failure instead in CI, CI=true or SAFEPOINT_REQUIRE_DISKFULL=1, so CI cannot pass without them).
Commit: the training's files fill the disk to the last page, so writing MANIFEST.json fails
with ENOSPC. Replication: the destination is the small disk and the checkpoint does not fit.
Expected: the commit is aborted (no marker, no manifest, no temporary file) and succeeds once
space is freed; the replication is recorded failed (never pending, never verified), leaves no
COMMITTED, and a later ingest with more space reuses what was sent and ends verified; the
partial objects are orphans the reconciler removes after the grace period.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import pytest

from safepoint.core.errors import CommitError
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME, TMP_PREFIX
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.local.commit import commit
from safepoint.ops import ingest as pipeline
from safepoint.ops.reconcile import reconcile
from tests.faults.conftest import figures
from tests.faults.world import copy_template
from tests.helpers_disk import mount_tmpfs


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs; yields (path, resize(mib))."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mount_tmpfs(mnt)

    def resize(mib: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={mib}m", str(mnt)], check=True, capture_output=True)

    try:
        yield mnt, resize
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(folder: Path) -> int:
    """Write a data file until the disk is full (the last page included); returns its size."""
    n = 0
    with open(folder / "filler.bin", "wb", buffering=0) as f:
        chunk = os.urandom(4096)
        while True:
            try:
                n += f.write(chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                break
    # A last partial write may have taken the final bytes of a page; try single bytes until ENOSPC.
    with open(folder / "filler.bin", "ab", buffering=0) as f:
        for _ in range(4096):
            try:
                n += f.write(b"x")
            except OSError:
                break
    return n


def _more(folder: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"more": torch.randn(384 * 1024)}, str(folder / "more.safetensors"))  # 1.5 MiB


def test_disk_full_during_commit(small_disk, template):
    mnt, _resize = small_disk
    folder = mnt / "ckpt"
    folder.mkdir()
    (folder / "model.pt").write_bytes((template / "model.pt").read_bytes())
    ballast = mnt / "ballast"
    ballast.write_bytes(b"b" * 64 * 1024)   # outside the checkpoint: what we free afterwards
    filled = _fill(folder)
    with pytest.raises(CommitError, match="No space left on device"):
        commit(folder, "full", 1)
    assert not (folder / MARKER_NAME).exists() and not (folder / MANIFEST_NAME).exists()
    assert not list(folder.glob(f"{TMP_PREFIX}*"))
    ballast.unlink()
    m = commit(folder, "full", 1)
    assert {f.path for f in m.files} == {"model.pt", "filler.bin"}
    figures("disk full during commit", disk="tmpfs 2 MiB", filled_bytes=filled,
            outcome="CommitError ENOSPC, no marker/manifest/tmp; commit after freeing space: ok")


def test_disk_full_during_replication(small_disk, tmp_path, template, sqlite_catalog):
    mnt, resize = small_disk
    folder = copy_template(template, tmp_path / "nvme" / "s")
    _more(folder)  # ~2.4 MiB in all: does not fit
    m = commit(folder, "full", 2)
    dest = (mnt / "durable").as_uri()
    t0 = time.perf_counter()
    out = pipeline.ingest(folder, [dest], sqlite_catalog)
    assert out.state is CS.COMMITTED and "No space left on device" in out.message, out
    row = sqlite_catalog.get("full", 2)
    [rep] = sqlite_catalog.replicas(row.id)
    assert rep.state is RS.FAILED and "No space left" in rep.error
    snapdir = mnt / "durable" / "full" / "2"
    assert not (snapdir / MARKER_NAME).exists() and not list(snapdir.rglob(f"{TMP_PREFIX}*"))
    sent = [p for p in snapdir.rglob("*") if p.is_file()]
    # What was sent is a partial replica: kept within the grace period, removed after it.
    if sent:
        assert reconcile(sqlite_catalog, [dest], grace_s=3600, finish=False).count("remove_partial") == 0
    # More space: the next ingest reuses what verifies and ends verified.
    resize(8)
    again = pipeline.ingest(folder, [dest], sqlite_catalog)
    assert again.state is CS.VERIFIED, again
    assert (snapdir / MARKER_NAME).is_file()
    figures("disk full during replication", disk="tmpfs 2 MiB", checkpoint_bytes=m.total_bytes,
            objects_sent_before_full=len(sent), outcome="replica failed (ENOSPC), no COMMITTED; "
            "after resize to 8 MiB: verified", seconds=round(time.perf_counter() - t0, 2))


def test_disk_full_partial_replica_is_removed_after_grace(small_disk, tmp_path, template, sqlite_catalog):
    mnt, _resize = small_disk
    folder = copy_template(template, tmp_path / "nvme" / "s")
    _more(folder)
    commit(folder, "full", 3)
    dest = (mnt / "durable").as_uri()
    assert pipeline.ingest(folder, [dest], sqlite_catalog).state is CS.COMMITTED
    snapdir = mnt / "durable" / "full" / "3"
    rep = reconcile(sqlite_catalog, [dest], grace_s=3600, now=time.time() + 3601)
    assert rep.count("remove_partial") == 1, rep.to_dict()
    assert not snapdir.exists()
    # The checkpoint itself is untouched: still committed locally, ready for the next ingest.
    assert sqlite_catalog.get("full", 3).state is CS.COMMITTED


def test_short_write_on_a_full_disk_is_no_space_not_corruption(small_disk, tmp_path, template, sqlite_catalog):
    """A write into the last free pages returns short instead of raising: it must not be dropped.

    Found by this suite: the file:// upload ignored short writes, so a full disk produced a
    truncated object that the read-back then reported as a corrupt replica.
    """
    mnt, _resize = small_disk
    (mnt / "ballast").write_bytes(b"b" * (2 * 1024 * 1024 - 256 * 1024))   # ~256 KiB left
    folder = tmp_path / "nvme" / "short"
    folder.mkdir(parents=True)
    (folder / "big.safetensors").write_bytes((template / "big.safetensors").read_bytes())  # one 768 KiB write
    commit(folder, "full", 4)
    out = pipeline.ingest(folder, [(mnt / "durable").as_uri()], sqlite_catalog)
    [rep] = sqlite_catalog.replicas(sqlite_catalog.get("full", 4).id)
    assert rep.state is RS.FAILED and "No space left on device" in rep.error, (rep, out)
    assert not list((mnt / "durable").rglob(MARKER_NAME)) and not list((mnt / "durable").rglob(f"{TMP_PREFIX}*"))


@pytest.mark.parametrize("env,outcome", [
    ({"SAFEPOINT_REQUIRE_DISKFULL": "1"}, pytest.fail.Exception),
    ({"CI": "true"}, pytest.fail.Exception),
    ({}, pytest.skip.Exception),
], ids=["required", "ci", "local"])
def test_a_refused_mount_fails_in_ci_and_skips_elsewhere(tmp_path, monkeypatch, env, outcome):
    monkeypatch.delenv("SAFEPOINT_REQUIRE_DISKFULL", raising=False)
    monkeypatch.delenv("CI", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    def refused(*a, **kw):
        raise subprocess.CalledProcessError(32, a[0], stderr=b"mount: only root can do that")

    monkeypatch.setattr(subprocess, "run", refused)
    with pytest.raises(outcome, match="cannot mount a tmpfs"):
        mount_tmpfs(tmp_path)
