"""Hostile inputs, round four: validation judges the bytes the manifest names, and no others.

The dry-run load runs beside the upload and reads the local files. A trainer that re-saves the step
while the ingest runs leaves the replica with the committed bytes (a NaN here) and the local folder
with new ones: validation that does not hash what it reads recorded the checkpoint `verified` and
made it the resume point. Now each file is hashed against the manifest as the validator reads it,
and a file that is not the manifest's makes the ingest fail as corrupt (exit 1).
"""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest
import torch

import safepoint.cli.main as cli
from safepoint.catalog.store import open_catalog
from safepoint.local.commit import commit
from safepoint.ops import steps
from safepoint.ops import validation as validation_step
from safepoint.validation.problems import Problem
from safepoint.validation.validate import validate_snapshot


def sp(*args: object) -> int:
    return cli.main([str(a) for a in args])


def _state(value: float) -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.full((64, 64), value), "b": torch.zeros(64)}, buf)
    return buf.getvalue()


def _checkpoint(root: Path, step: int, data: bytes) -> Path:
    folder = root / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(data)
    commit(folder, "resave", step)
    return folder


@pytest.fixture
def resaved_during_ingest(monkeypatch):
    """The trainer re-saves model.pt (a clean state over the committed NaN one, same size) once the upload
    has read it and before the dry-run load does: the order the race produced, made certain."""
    folders: dict[str, bytes] = {}   # folder -> the bytes the trainer writes there during the ingest
    uploaded = threading.Event()
    real_replicate, real_validate = steps.replicate_to, validation_step.validate_snapshot

    def replicate_to(catalog, checkpoint_id, snap, *args, **kwargs):
        try:
            return real_replicate(catalog, checkpoint_id, snap, *args, **kwargs)
        finally:
            new = folders.get(str(snap.root))
            if new is not None:
                (snap.root / "model.pt").write_bytes(new)   # in place, as torch.save does
                uploaded.set()

    def validate(folder, *args, **kwargs):
        if str(Path(folder)) in folders:
            assert uploaded.wait(timeout=120)
        return real_validate(folder, *args, **kwargs)

    monkeypatch.setattr(steps, "replicate_to", replicate_to)
    monkeypatch.setattr(validation_step, "validate_snapshot", validate)
    return folders


def test_a_file_rewritten_during_the_ingest_is_never_verified_nor_the_resume_point(
        tmp_path: Path, prefect_api, sqlite_catalog_url, capsys, resaved_during_ingest) -> None:
    local, durable = tmp_path / "nvme", (tmp_path / "durable").as_uri()
    good = _checkpoint(local, 1, _state(1.0))
    assert sp("--catalog", sqlite_catalog_url, "ingest", good, "--to", durable) == 0

    nan, clean = _state(float("nan")), _state(2.0)
    assert len(nan) == len(clean)     # the size alone cannot tell the re-save apart
    bad = _checkpoint(local, 2, nan)  # committed with a NaN: the bytes the replica will hold
    resaved_during_ingest[str(bad.resolve())] = clean
    capsys.readouterr()
    code = sp("--catalog", sqlite_catalog_url, "ingest", bad, "--to", durable)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert code == 1, captured.out + captured.err        # a verdict on the checkpoint
    assert "corrupt" in captured.out and "does not match the manifest" in captured.out

    row = open_catalog(sqlite_catalog_url).get("resave", 2)
    assert str(row.state) == "corrupt"
    assert (tmp_path / "durable" / "resave" / "2" / "model.pt").read_bytes() == nan  # what the replica holds
    assert sp("--catalog", sqlite_catalog_url, "resume-point", "--run", "resave", "--json") == 0
    assert json.loads(capsys.readouterr().out)["step"] == 1   # never the step whose replica holds the NaN


def test_the_reader_binds_every_file_to_the_manifest(tmp_path: Path) -> None:
    """The same rule without the ingest around it: in the sandbox and in-process, a file whose bytes are
    not the manifest's is a CHANGED finding, never judged, and the outcome is corrupt."""
    folder = _checkpoint(tmp_path, 1, _state(float("nan")))
    digests = {"model.pt": json.loads((folder / "MANIFEST.json").read_text())["files"][0]["blake3"]}
    assert validate_snapshot(folder, ["model.pt"], digests=digests).outcome == "invalid"   # the NaN, judged
    (folder / "model.pt").write_bytes(_state(1.0))
    report = validate_snapshot(folder, ["model.pt"], digests=digests)
    assert report.outcome == "corrupt" and [f.problem for f in report.findings] == [Problem.CHANGED]
    assert report.stats == []   # nothing was read from the other bytes


def test_a_file_rewritten_while_the_reader_reads_it_is_never_judged(tmp_path: Path, monkeypatch) -> None:
    """Hashed and found the manifest's, then rewritten while the loader reads it: the read is void."""
    from dataclasses import replace

    from safepoint.validation import reading
    from safepoint.validation.sandbox import SandboxLimits
    from safepoint.validation.settings import ValidationSettings

    folder = _checkpoint(tmp_path, 1, _state(1.0))
    digests = {"model.pt": json.loads((folder / "MANIFEST.json").read_text())["files"][0]["blake3"]}
    real = reading.iter_file_leaves

    def rewritten_midway(path, **kwargs):
        Path(path).write_bytes(_state(float("nan")))   # the trainer's re-save lands during the read
        return real(path, **kwargs)

    monkeypatch.setattr(reading, "iter_file_leaves", rewritten_midway)
    settings = replace(ValidationSettings(), sandbox=replace(SandboxLimits(), enabled=False))   # in this process
    report = validate_snapshot(folder, ["model.pt"], settings=settings, digests=digests)
    assert report.outcome == "corrupt"
    assert any(f.problem is Problem.CHANGED and "changed while it was validated" in f.message
               for f in report.findings)


def test_a_reader_killed_by_a_rewrite_leaves_a_corrupt_outcome_not_a_verdict(tmp_path: Path, monkeypatch) -> None:
    """A file truncated under the reader's map kills it (SIGBUS): the parent finds the file is no longer the
    manifest's, so the outcome is corrupt rather than invalid on bytes nobody committed."""
    import os
    import signal

    from safepoint.validation import reading

    folder = _checkpoint(tmp_path, 1, _state(1.0))
    digests = {"model.pt": json.loads((folder / "MANIFEST.json").read_text())["files"][0]["blake3"]}

    def truncated_under_the_map(path, **kwargs):   # runs in the sandboxed child, forked from here
        Path(path).write_bytes(b"")
        os.kill(os.getpid(), signal.SIGBUS)

    monkeypatch.setattr(reading, "iter_file_leaves", truncated_under_the_map)
    report = validate_snapshot(folder, ["model.pt"], digests=digests)
    assert report.outcome == "corrupt", report.summary()
    assert {f.problem for f in report.findings} == {Problem.UNLOADABLE, Problem.CHANGED}


def test_validate_by_hand_holds_a_committed_folder_to_its_manifest(tmp_path, capsys):
    """`safepoint validate FOLDER` judges a committed folder's manifest bytes only: a file rewritten
    after the seal (same size, other bytes) is `changed`, never judged good (exit 1)."""
    folder = _checkpoint(tmp_path, 1, _state(1.0))
    assert sp("validate", folder) == 0
    capsys.readouterr()
    (folder / "model.pt").write_bytes(_state(2.0))  # same shape, same size: only the digest tells
    assert sp("validate", folder, "--json") == 1
    report = json.loads(capsys.readouterr().out)
    assert report["outcome"] == "corrupt"
    assert any(f["problem"] == str(Problem.CHANGED) for f in report["findings"])
