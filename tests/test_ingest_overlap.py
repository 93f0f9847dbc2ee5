"""An ingest's dry-run load reads the local bytes while the upload runs (ops/ingest.py), and its report
counts only once the replicas are verified: overlapped, never recorded ahead of the proof."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from safepoint import commit
from safepoint.catalog.store import open_catalog
from safepoint.core.states import CheckpointState as CS
from safepoint.ops import ingest as ingest_mod
from safepoint.ops import steps
from safepoint.ops import validation as validation_step
from safepoint.ops.ingest import ingest


def _folder(root: Path, step: int, value: float) -> Path:
    folder = root / f"step-{step}"
    folder.mkdir(parents=True)
    torch.save({"w": torch.full((16, 16), value), "b": torch.zeros(16)}, folder / "model.pt")
    commit(folder, "overlap", step)
    return folder


@pytest.fixture
def seen(monkeypatch):
    """Events of the two halves: `reading` once validation has begun, `uploading` while the upload waits."""
    events = {"reading": threading.Event(), "uploaded": threading.Event()}
    real_validate, real_replicate = validation_step.validate_snapshot, steps.replicate_to

    def validate_snapshot(*args, **kwargs):
        events["reading"].set()
        return real_validate(*args, **kwargs)

    def replicate_to(*args, **kwargs):
        # An upload that lasts until the load has started; sequential steps would wait here 20 s and fail.
        events["overlapped"] = events["reading"].wait(timeout=20)
        try:
            return real_replicate(*args, **kwargs)
        finally:
            events["uploaded"].set()

    monkeypatch.setattr(validation_step, "validate_snapshot", validate_snapshot)
    monkeypatch.setattr(ingest_mod.steps, "replicate_to", replicate_to)
    return events


def test_the_load_runs_while_the_upload_does_and_is_recorded_after_it(tmp_path, seen):
    cat = open_catalog(f"sqlite:///{tmp_path / 'c.db'}")
    out = ingest(_folder(tmp_path / "local", 1, 1.0), [(tmp_path / "durable").as_uri()], cat)
    assert seen["overlapped"] is True
    assert out.state is CS.VERIFIED
    row = cat.get("overlap", 1)
    kinds = [e["kind"] for e in cat.events(row.id)]
    # The report is recorded after the replica's proof, and the state goes through validating as before.
    assert kinds.index("validation") > max(i for i, k in enumerate(kinds) if k == "replica")
    moves = [(e["detail"].get("from"), e["detail"].get("to")) for e in cat.events(row.id, kind="state")]
    assert ("replicated", "validating") in moves and ("validating", "verified") in moves


def test_a_failed_upload_records_no_report(tmp_path, seen, monkeypatch):
    """The load ran beside an upload that failed: nothing of it reaches the catalog."""
    def broken(*args, **kwargs):
        seen["reading"].wait(timeout=20)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ingest_mod.steps, "replicate_to", broken)
    cat = open_catalog(f"sqlite:///{tmp_path / 'c.db'}")
    out = ingest(_folder(tmp_path / "local", 1, 1.0), [(tmp_path / "durable").as_uri()], cat)
    assert out.state is CS.COMMITTED and "Input/output error" in out.message  # never replicated, never validated
    row = cat.get("overlap", 1)
    assert cat.events(row.id, kind="validation") == [] and cat.latest_validation(row.id) is None
