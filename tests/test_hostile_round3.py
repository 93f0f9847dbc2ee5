"""Hostile inputs, round three: a step past int64, a destination that cannot work, a sealed folder
whose files changed. Each is one clear answer (exit 2 with one `safepoint: error:` line for an
infrastructure failure, a verdict for a checkpoint), nothing is lost, and a watcher goes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import safepoint.cli.main as cli
from safepoint.core.errors import CommitError, FormatError
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME, digest_bytes
from safepoint.local.commit import commit
from safepoint.local.snapshot import LocalSnapshot
from tests.test_cli_exit_codes import assert_one_error_line


def sp(*args: object) -> int:
    return cli.main([str(a) for a in args])


def _folder(path: Path, data: bytes = b"w" * 64) -> Path:
    path.mkdir(parents=True)
    (path / "w.bin").write_bytes(data)
    return path


def _forge_step(folder: Path, step: int) -> None:
    """Control files a tool other than Safepoint wrote, naming `step` (commit itself refuses it)."""
    commit(folder, "huge", 1)
    doc = json.loads((folder / MANIFEST_NAME).read_text())
    doc["step"] = step
    manifest = json.dumps(doc).encode()
    (folder / MANIFEST_NAME).write_bytes(manifest)
    marker = json.loads((folder / MARKER_NAME).read_text())
    marker.update(step=step, manifest_blake3=digest_bytes(manifest))
    (folder / MARKER_NAME).write_text(json.dumps(marker))


# ------------------------------------------------------------------------------------ steps past int64

def test_a_step_past_int64_is_refused_at_commit_and_at_parse(tmp_path: Path, capsys) -> None:
    with pytest.raises(CommitError, match=r"2\*\*63 - 1"):
        commit(_folder(tmp_path / "a"), "r", 2**64)
    assert not (tmp_path / "a" / MARKER_NAME).exists()
    line = assert_one_error_line(capsys, sp("commit", _folder(tmp_path / "b"), "--run", "r", "--step", 2**63))
    assert "invalid step" in line
    assert sp("commit", tmp_path / "b", "--run", "r", "--step", 2**63 - 1) == 0  # the largest one is fine

    forged = _folder(tmp_path / "c")
    _forge_step(forged, 2**64)
    with pytest.raises(FormatError, match="invalid step"):
        LocalSnapshot.open(forged)


def test_watch_sets_a_bad_folder_aside_and_ingests_the_others(tmp_path: Path, prefect_api, sqlite_catalog_url,
                                                              capsys) -> None:
    root, durable = tmp_path / "nvme", (tmp_path / "durable").as_uri()
    _forge_step(_folder(root / "a-huge"), 2**64)          # walked first
    good = _folder(root / "b-good")
    commit(good, "ok", 3)
    capsys.readouterr()
    code = sp("--catalog", sqlite_catalog_url, "watch", root, "--to", durable, "--once")
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert "ok/3: verified" in captured.out
    assert f"set aside {(root / 'a-huge').resolve()}: " in captured.err and "invalid step" in captured.err
    assert code == 1   # a verdict on one checkpoint; the watcher itself did not fail


# ------------------------------------------------------------------------------------ destinations up front

def test_an_unknown_destination_scheme_is_an_immediate_error_and_changes_nothing(
        tmp_path: Path, prefect_api, sqlite_catalog_url, capsys) -> None:
    folder = _folder(tmp_path / "ck")
    commit(folder, "r", 1)
    d1 = (tmp_path / "d1").as_uri()
    assert sp("--catalog", sqlite_catalog_url, "ingest", folder, "--to", d1) == 0
    capsys.readouterr()
    line = assert_one_error_line(capsys, sp("--catalog", sqlite_catalog_url, "ingest", folder, "--to", d1,
                                            "--to", "ftp://127.0.0.1:9/x"))
    assert "ftp://127.0.0.1:9/x" in line and "unsupported destination scheme 'ftp'" in line
    assert sp("--catalog", sqlite_catalog_url, "ls", "--json") == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["state"] == "verified"     # never dropped back to committed


def test_a_missing_bucket_is_said_as_such(s3_env, tmp_path: Path, sqlite_catalog_url, capsys) -> None:
    folder = _folder(tmp_path / "ck")
    commit(folder, "r", 1)
    line = assert_one_error_line(capsys, sp("--catalog", sqlite_catalog_url, "ingest", folder, "--to",
                                            "s3://no-such-bucket-here/x"))
    assert "NoSuchBucket" in line and "AccessDenied" not in line


def test_missing_s3_credentials_are_one_line(s3_env, tmp_path: Path, sqlite_catalog_url, capsys,
                                             monkeypatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    folder = _folder(tmp_path / "ck")
    commit(folder, "r", 1)
    line = assert_one_error_line(capsys, sp("--catalog", sqlite_catalog_url, "ingest", folder, "--to",
                                            s3_env.url()))
    assert "no S3 credentials" in line


# ------------------------------------------------------------------------------------ a sealed folder that changed

def test_commit_of_a_sealed_folder_whose_files_changed_fails_loudly_unless_resealed(tmp_path: Path, capsys) -> None:
    folder = _folder(tmp_path / "ck")
    first = commit(folder, "r", 4)
    assert commit(folder, "r", 4) == first                       # unchanged: a no-op, as before
    (folder / "w.bin").write_bytes(b"x" * 64)                    # re-saved by the trainer
    with pytest.raises(CommitError, match="no longer match that seal.*--reseal"):
        commit(folder, "r", 4)
    assert LocalSnapshot.open(folder).manifest == first          # nothing changed
    capsys.readouterr()
    assert sp("commit", folder, "--run", "r", "--step", 4, "--reseal") == 0
    snap = LocalSnapshot.open(folder)
    assert snap.verify().outcome.value == "verified" and snap.manifest.meta["supersedes"] != ""
    (folder / "extra.bin").write_bytes(b"new")                   # a new file counts as a change too
    line = assert_one_error_line(capsys, sp("commit", folder, "--run", "r", "--step", 4))
    assert "new files ['extra.bin']" in line
