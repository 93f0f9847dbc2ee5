"""SafepointWriter: dcp.save / dcp.async_save output a Safepoint-committed snapshot the pipeline ingests."""

from __future__ import annotations

import warnings

import pytest
import torch

from safepoint.core.errors import UsageError
from safepoint.core.format import MARKER_NAME
from safepoint.core.states import CheckpointState
from safepoint.local.snapshot import LocalSnapshot
from safepoint.validation.validate import validate_snapshot

dcp = pytest.importorskip("torch.distributed.checkpoint")


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 16, generator=g), "b": torch.zeros(16)},
            "optim": {"state": {0: {"exp_avg": torch.randn(64, 16, generator=g)}}, "param_groups": [{"lr": 0.1}]}}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
        yield


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_dcp_output_is_committed_after_metadata(tmp_path, mode):
    from safepoint.snapshotter.dcp_writer import SafepointWriter

    folder = tmp_path / "run-d" / "20"
    writer = SafepointWriter(folder, run="run-d", meta={"tags": ["dcp"]})  # step from the folder name
    if mode == "save":
        dcp.save(state(), storage_writer=writer)
    else:
        dcp.async_save(state(), storage_writer=writer).result()
    snap = LocalSnapshot.open(folder)
    assert (snap.manifest.run, snap.manifest.step, snap.manifest.world_size) == ("run-d", 20, 1)
    assert {f.path for f in snap.manifest.files} == {".metadata", "__0_0.distcp"}
    assert snap.manifest.meta["tags"] == ["dcp"] and writer.manifest == snap.manifest
    assert snap.verify().outcome is CheckpointState.VERIFIED
    assert validate_snapshot(folder).ok
    loaded = {"model": {"w": torch.empty(64, 16), "b": torch.ones(16)}}
    dcp.load(loaded, checkpoint_id=folder)  # DCP itself still reads it
    assert torch.equal(loaded["model"]["w"], state()["model"]["w"])


def test_a_committed_folder_is_refused(tmp_path):
    from safepoint.snapshotter.dcp_writer import SafepointWriter

    folder = tmp_path / "run-d" / "3"
    dcp.save(state(), storage_writer=SafepointWriter(folder, run="run-d"))
    before = (folder / MARKER_NAME).read_bytes()
    with pytest.raises(BaseException, match="already committed"):  # DCP wraps it in a CheckpointException
        dcp.save({"model": {"w": torch.ones(2)}}, storage_writer=SafepointWriter(folder, run="run-d"))
    assert (folder / MARKER_NAME).read_bytes() == before and validate_snapshot(folder).ok


def test_step_must_be_given_or_be_the_folder_name(tmp_path):
    from safepoint.snapshotter.dcp_writer import SafepointWriter

    with pytest.raises(BaseException, match="step"):
        dcp.save(state(), storage_writer=SafepointWriter(tmp_path / "latest", run="run-d"))
    assert not (tmp_path / "latest" / MARKER_NAME).exists()
    dcp.save(state(), storage_writer=SafepointWriter(tmp_path / "latest", run="run-d", step=9))
    assert LocalSnapshot.open(tmp_path / "latest").manifest.step == 9
    with pytest.raises(UsageError):
        SafepointWriter(tmp_path / "x", run="run-d").step_for(tmp_path / "x")


def test_dcp_snapshot_ingests(tmp_path, sqlite_catalog):
    from safepoint.ops.ingest import ingest
    from safepoint.snapshotter.dcp_writer import SafepointWriter

    folder = tmp_path / "run-d" / "30"
    dcp.save(state(), storage_writer=SafepointWriter(folder, run="run-d"))
    outcome = ingest(folder, ["file://" + str(tmp_path / "durable")], sqlite_catalog)
    assert outcome.state is CheckpointState.VERIFIED, outcome.message
