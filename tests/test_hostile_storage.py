"""Hostile folders and racing writers against storage (issue 14, storage half).

A committed folder changed after commit (a sub-folder replaced by a symlink, MANIFEST.json
rewritten) must not steer prune, eviction or reconcile into deleting anything outside the folder or
beyond the manifest the marker binds. Two commits of one folder have one winner whose marker binds
its own manifest; a replica's manifest is never replaced by a writer that lost. `--min-replicas 0`
is refused. Secrets in the usual text forms are redacted.
"""

from __future__ import annotations

import fcntl
import importlib
import os
import subprocess
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

import pytest

from safepoint.cli.main import main
from safepoint.core.errors import CommitError
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME, digest_bytes, load_committed, marker_for, parse_manifest
from safepoint.core.redact import redact
from safepoint.core.states import CheckpointState as C
from safepoint.core.states import ReplicaState as R
from safepoint.destinations import open_destination
from safepoint.local.commit import commit
from safepoint.local.safe_delete import remove_snapshot_folder
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.evict import Usage, evict, plan_eviction, remove_local_snapshot
from safepoint.ops.prune import execute_plan
from safepoint.ops.reconcile import reconcile
from safepoint.ops.replicate import replicate
from safepoint.rules import retention as rt
from safepoint.rules.resume import resume_point
from tests.helpers_catalog import PATHS, durable, local_folder

NOW = datetime(2026, 6, 1, tzinfo=timezone.utc)
commit_mod = importlib.import_module("safepoint.local.commit")  # the module (safepoint.commit is also the function)


def seed_nested(catalog, root: Path, run: str, step: int):
    """A verified checkpoint with a sub-folder, replicated to durable0 (like helpers_catalog.seed)."""
    folder = local_folder(root, run, step)
    (folder / "sub").mkdir(parents=True)
    (folder / "weights.bin").write_bytes(b"w" * 100)
    (folder / "sub" / "part.bin").write_bytes(b"p" * 100)
    commit(folder, run, step)
    snap = LocalSnapshot.open(folder)
    row = catalog.record_commit(snap.manifest, digest_bytes(snap.manifest_bytes), str(snap.root))
    dest = open_destination(durable(root))
    assert replicate(snap, dest).state is R.VERIFIED
    catalog.set_replica(row.id, dest.snapshot_url(run, step), dest.url, R.VERIFIED)
    for to in PATHS[C.VERIFIED]:
        assert catalog.transition(row.id, to)
    return row


def victim(root: Path, name: str) -> Path:
    """A folder outside every snapshot holding files with the snapshot's names."""
    v = root / name
    v.mkdir()
    (v / "part.bin").write_bytes(b"precious")
    (v / "other.txt").write_text("precious")
    return v


def link_sub(folder: Path, target: Path) -> None:
    """Replace folder/sub by a symlink to `target` (what an attacker does after commit)."""
    for p in (folder / "sub").iterdir():
        p.unlink()
    (folder / "sub").rmdir()
    os.symlink(target, folder / "sub")


def intact(v: Path) -> bool:
    return (v / "part.bin").read_bytes() == b"precious" and (v / "other.txt").read_text() == "precious"


# -- deletion that cannot escape -----------------------------------------------------------------

def test_prune_through_a_symlinked_subfolder_deletes_nothing_outside(sqlite_catalog, tmp_path):
    rows = [seed_nested(sqlite_catalog, tmp_path, "s", s) for s in (1, 2, 3)]
    local_victim, replica_victim = victim(tmp_path, "local-victim"), victim(tmp_path, "replica-victim")
    link_sub(local_folder(tmp_path, "s", 1), local_victim)
    link_sub(tmp_path / "durable0" / "s" / "1", replica_victim)

    res = execute_plan(sqlite_catalog, rt.plan(sqlite_catalog.list_checkpoints("s"), rt.KeepLastN(1), NOW))
    assert res.pruned == [("s", 1)]
    assert intact(local_victim) and intact(replica_victim)
    # What is inside the folders went; the links themselves are left, and reported for the replica.
    assert not (local_folder(tmp_path, "s", 1) / "weights.bin").exists()
    assert not (local_folder(tmp_path, "s", 1) / MARKER_NAME).exists()
    assert not (tmp_path / "durable0" / "s" / "1" / "weights.bin").exists()
    assert any("symlink" in e for e in res.errors), res.errors
    assert sqlite_catalog.get_by_id(rows[1].id).state is C.VERIFIED


def test_evict_through_a_symlinked_subfolder_deletes_nothing_outside(sqlite_catalog, tmp_path):
    for s in (1, 2, 3):
        seed_nested(sqlite_catalog, tmp_path, "e", s)
    v = victim(tmp_path, "victim")
    link_sub(local_folder(tmp_path, "e", 1), v)
    res = evict(sqlite_catalog, tmp_path / "nvme", high_water=0.1, low_water=0.0, capacity_bytes=1000)
    assert str(local_folder(tmp_path, "e", 1).resolve()) in res.evicted
    assert intact(v)
    assert not (local_folder(tmp_path, "e", 1) / "weights.bin").exists()


def test_a_symlinked_snapshot_folder_is_not_followed(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "a.bin").write_bytes(b"a")
    commit(real, "l", 1)
    os.symlink(real, tmp_path / "link")
    out = remove_snapshot_folder(tmp_path / "link", "l", 1)
    assert not out.done and "symlink" in out.reason
    assert (real / "a.bin").exists() and (real / MARKER_NAME).exists()


def _rewrite_manifest(folder: Path, extra: str, *, with_marker: bool) -> None:
    """Add `extra` to MANIFEST.json (and, with_marker, forge a COMMITTED that binds the new one)."""
    m = parse_manifest((folder / MANIFEST_NAME).read_bytes())
    from safepoint.core.format import FileEntry, build_manifest

    forged = build_manifest(m.run, m.step, [*m.files, FileEntry(extra, 8, "0" * 64)])
    data = forged.to_json_bytes()
    (folder / MANIFEST_NAME).write_bytes(data)
    if with_marker:
        (folder / MARKER_NAME).write_bytes(marker_for(data, forged).to_json_bytes())


@pytest.mark.parametrize("with_marker", [False, True], ids=["manifest-only", "manifest-and-marker"])
def test_a_rewritten_manifest_deletes_nothing_it_added(sqlite_catalog, tmp_path, with_marker):
    for s in (1, 2, 3):
        seed_nested(sqlite_catalog, tmp_path, "m", s)
    folder = local_folder(tmp_path, "m", 1)
    (folder / "notes.txt").write_text("the user's own file")
    _rewrite_manifest(folder, "notes.txt", with_marker=with_marker)
    res = execute_plan(sqlite_catalog, rt.plan(sqlite_catalog.list_checkpoints("m"), rt.KeepLastN(1), NOW))
    assert res.pruned == [("m", 1)]
    assert (folder / "notes.txt").read_text() == "the user's own file"
    # Also through eviction's entry point, with the catalog's digest as the binding.
    row = sqlite_catalog.get("m", 2)
    f2 = local_folder(tmp_path, "m", 2)
    (f2 / "notes.txt").write_text("mine")
    _rewrite_manifest(f2, "notes.txt", with_marker=with_marker)
    assert not remove_local_snapshot(f2, "m", 2, expect_digest=row.manifest_blake3)
    assert (f2 / "notes.txt").read_text() == "mine" and (f2 / "weights.bin").exists()


def test_interrupted_eviction_finishes_with_the_catalog_digest(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"a")
    commit(folder, "i", 1)
    digest = digest_bytes((folder / MANIFEST_NAME).read_bytes())
    (folder / MARKER_NAME).unlink()  # a crash right after the marker went
    assert not remove_local_snapshot(folder, "i", 1)  # unbound: nothing proves the folder is (i, 1)
    assert (folder / "a.bin").exists()
    assert remove_local_snapshot(folder, "i", 1, expect_digest=digest)
    assert not folder.exists()


def test_reconcile_stale_tmp_files_are_removed_without_following_a_symlinked_folder(sqlite_catalog, tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir()
    tmp = real / ".safepoint-tmp-MANIFEST.json"
    tmp.write_text("not ours to delete")
    os.symlink(real, tmp_path / "linked")
    report = reconcile(sqlite_catalog, [], grace_s=0, local=[tmp_path / "linked"], now=tmp.stat().st_mtime + 10)
    assert tmp.exists()
    assert any("symlink" in e for e in report.errors), report.errors


# -- exclusive commits ---------------------------------------------------------------------------

def _folder(tmp_path: Path, name: str = "ck", files: int = 4) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    for i in range(files):
        (folder / f"f{i}.bin").write_bytes(os.urandom(1000))
    return folder


def test_two_concurrent_commits_have_one_winner_that_binds_its_own_manifest(tmp_path, monkeypatch):
    folder = _folder(tmp_path)
    barrier = threading.Barrier(2, timeout=2.0)
    real = commit_mod._hash_and_sync

    def rendezvous(path):
        # Both writers hash in lockstep when both get this far; a writer left alone goes on after 2 s.
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            pass
        return real(path)

    monkeypatch.setattr(commit_mod, "_hash_and_sync", rendezvous)
    results: dict[int, object] = {}

    def one(step: int) -> None:
        try:
            results[step] = commit(folder, "race", step, workers=1)
        except CommitError as e:
            results[step] = e

    threads = [threading.Thread(target=one, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    won = [s for s, r in results.items() if not isinstance(r, CommitError)]
    lost = [r for r in results.values() if isinstance(r, CommitError)]
    assert len(won) == 1 and len(lost) == 1, results
    m = load_committed((folder / MANIFEST_NAME).read_bytes(), (folder / MARKER_NAME).read_bytes())
    assert m.step == won[0]
    assert "in progress" in str(lost[0]) or "already committed" in str(lost[0])


def _cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "safepoint.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def test_commit_while_another_holds_the_folder_fails_cleanly(tmp_path):
    folder = _folder(tmp_path)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what a commit in progress holds
        p = _cli("commit", str(folder), "--run", "held", "--step", "1")
        out, err = p.communicate(timeout=60)
    finally:
        os.close(fd)
    assert p.returncode == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("safepoint:") and "in progress" in err
    assert not (folder / MARKER_NAME).exists() and not (folder / MANIFEST_NAME).exists()


def test_two_concurrent_cli_commits(tmp_path):
    folder = _folder(tmp_path, files=64)
    procs = {s: _cli("commit", str(folder), "--run", "cli", "--step", str(s)) for s in (1, 2)}
    done = {s: (p.wait(timeout=120), p.stderr.read()) for s, p in procs.items()}
    winners = [s for s, (rc, _) in done.items() if rc == 0]
    assert len(winners) == 1, done
    loser = next(v for s, v in done.items() if s not in winners)
    assert loser[0] == 2 and len(loser[1].strip().splitlines()) == 1, loser
    m = load_committed((folder / MANIFEST_NAME).read_bytes(), (folder / MARKER_NAME).read_bytes())
    assert m.step == winners[0]
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".safepoint-tmp-")) == []


class RacingDestination:
    """Wraps a destination; the first marker read returns 'none yet' but first lets `other` commit."""

    def __init__(self, inner, other):
        self.inner, self.other, self.fired = inner, other, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read_control(self, run, step, name):
        before = self.inner.read_control(run, step, name)
        if name == MARKER_NAME and not self.fired:
            self.fired = True
            assert replicate(self.other, self.inner).state is R.VERIFIED  # the winner commits meanwhile
        return before


def test_replica_manifest_is_never_replaced_by_a_writer_that_lost(tmp_path):
    a, b = _folder(tmp_path, "a", 2), _folder(tmp_path, "b", 3)
    commit(a, "rep", 1)
    commit(b, "rep", 1)
    snap_a, snap_b = LocalSnapshot.open(a), LocalSnapshot.open(b)
    dest = open_destination((tmp_path / "durable").as_uri())
    res = replicate(snap_b, RacingDestination(dest, snap_a))
    assert res.state is R.FAILED, res
    replica = tmp_path / "durable" / "rep" / "1"
    assert (replica / MANIFEST_NAME).read_bytes() == snap_a.manifest_bytes
    load_committed((replica / MANIFEST_NAME).read_bytes(), (replica / MARKER_NAME).read_bytes())


def test_replica_manifest_of_a_writer_in_flight_is_left_alone(tmp_path):
    a, b = _folder(tmp_path, "a", 2), _folder(tmp_path, "b", 3)
    commit(a, "fl", 1)
    commit(b, "fl", 1)
    dest = open_destination((tmp_path / "durable").as_uri())
    dest.write_control("fl", 1, MANIFEST_NAME, LocalSnapshot.open(a).manifest_bytes)  # a's commit, no marker yet
    res = replicate(LocalSnapshot.open(b), dest)
    assert res.state is R.FAILED and "another writer" in res.error
    assert dest.read_control("fl", 1, MANIFEST_NAME) == LocalSnapshot.open(a).manifest_bytes
    assert dest.read_control("fl", 1, MARKER_NAME) is None
    # The same writer again (a retry after a crash) goes through.
    assert replicate(LocalSnapshot.open(a), dest).state is R.VERIFIED


# -- min-replicas 0 ------------------------------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda: resume_point([], min_replicas=0),
    lambda: rt.plan([], rt.KeepLastN(1), NOW, min_replicas=0),
    lambda: plan_eviction([], {}, Usage(1, 2), min_replicas=0),
], ids=["resume_point", "retention.plan", "plan_eviction"])
def test_min_replicas_zero_is_refused_by_the_api(call):
    with pytest.raises(ValueError, match="min_replicas"):
        call()


@pytest.mark.parametrize("args", [
    ["resume-point", "--run", "r", "--min-replicas", "0"],
    ["prune", "--run", "r", "--keep-last", "1", "--min-replicas", "0"],
    ["evict", "ROOT", "--min-replicas", "0"],
], ids=["resume-point", "prune", "evict"])
def test_min_replicas_zero_is_a_usage_error(args, sqlite_catalog_url, tmp_path, capsys):
    args = [str(tmp_path) if a == "ROOT" else a for a in args]
    assert main(["--catalog", sqlite_catalog_url, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("safepoint: error:") and "--min-replicas" in err[0], err


# -- redaction -----------------------------------------------------------------------------------

@pytest.mark.parametrize("text,secret", [
    ('{"SecretAccessKey": "wJalrXUtnFEMI/K7MDENG"}', "wJalrXUtnFEMI"),
    ('{"Credentials": {"AccessKeyId": "ASIA1", "SessionToken": "FwoGZX IvYXdz"}}', "IvYXdz"),
    ("{'SecretAccessKey': 'abc/def+ghi'}", "abc/def"),
    ("aws_secret_access_key wJalrXUtnFEMI", "wJalrXUtnFEMI"),
    ("aws configure set aws_secret_access_key 'abc def ghi'", "def ghi"),
    ("AWS_SESSION_TOKEN\tFwoGZXIvYXdz", "FwoGZXIvYXdz"),
    ('password = "correct horse battery staple"', "horse battery"),
    ("token='a b c' and more", "b c"),
    ('secret_key: "with \\" an escaped quote"', "escaped quote"),
    ('password="cut off in the middle', "off in the"),
])
def test_redaction_forms(text, secret):
    out = redact(text)
    assert secret not in out, out
    assert "***" in out
    assert redact(out) == out


@pytest.mark.parametrize("text", ["max_tokens=5", "missing aws_secret_access_key", "AccessKeyId: ASIA1",
                                  "tokens are counted"])
def test_redaction_leaves_plain_text(text):
    assert redact(text) == text
