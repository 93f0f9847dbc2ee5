"""Checkpoints written by the real trainers (Hugging Face Trainer, Lightning, torchtitan-style DCP,
Accelerate), sealed by the integrations and judged by validation: verified as written, and each
planted fault caught and named. Tiny models built from configs; a few CPU steps; nothing downloaded."""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from safepoint.core.format import CONTROL_FILES
from safepoint.integrations import dcp as sp_dcp
from safepoint.integrations.accelerate import save_state
from safepoint.integrations.huggingface import SafepointCallback
from safepoint.integrations.lightning import SafepointCheckpointIO
from safepoint.local.snapshot import LocalSnapshot, is_committed
from safepoint.validation.audit import Baseline, stat_rows
from safepoint.validation.loaders import Problem
from safepoint.validation.settings import ValidationSettings
from safepoint.validation.validate import validate_snapshot
from tests.helpers_trainers import (
    accelerate_save_state,
    accelerate_train,
    hf_trainer_run,
    lightning_run,
    plant,
    plant_in_torch_file,
    tiny_gpt2,
    torchtitan_style_dcp,
    tracker_callback,
)


def unsealed_copy(src: Path, dst: Path) -> Path:
    """The trainer's files without Safepoint's manifest and marker (to damage, then seal again)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*CONTROL_FILES))
    return dst


def validate_sealed(folder: Path, **kw):
    m = LocalSnapshot.open(folder).manifest
    return validate_snapshot(folder, [f.path for f in m.files], step=m.step, **kw)


def problems(report) -> set[tuple[str, str | None]]:
    return {(f.problem.value, f.tensor) for f in report.findings}


# ------------------------------------------------------------------------------------ Hugging Face

@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> tuple[list[Path], SafepointCallback]:
    cb = SafepointCallback(run="hf")
    cks = hf_trainer_run(tmp_path_factory.mktemp("hf"), steps=4, save_steps=2, callbacks=[cb])
    return cks, cb


def test_hf_trainer_callback_seals_every_checkpoint_and_each_is_verified(hf) -> None:
    cks, cb = hf
    assert [c.name for c in cks] == ["checkpoint-2", "checkpoint-4"] and cb.sealed == cks
    for folder in cks:
        m = LocalSnapshot.open(folder).manifest
        assert is_committed(folder) and (m.run, m.step) == ("hf", int(folder.name.split("-")[1]))
        report = validate_sealed(folder)
        assert report.outcome == "verified", report.summary()
        assert report.findings == [] and report.warnings == []
        assert report.files["model.safetensors"] == report.files["optimizer.pt"] == "ok"
        assert report.files["rng_state.pth"] == "ok"            # numpy RNG state, through the allow-list
        assert report.files["trainer_state.json"] == "ok"
        assert report.files["training_args.bin"] == "not loaded"
        assert report.not_loaded["training_args.bin"].startswith("not loaded: opaque pickle")
        assert "TrainingArguments" in report.not_loaded["training_args.bin"]
        assert report.checks["layout"] == "huggingface-trainer"
        assert report.checks["recorded_step"]["checkpoint"] == [
            {"file": "trainer_state.json", "key": "global_step", "value": m.step}]


def test_hf_norm_audit_passes_between_early_checkpoints_of_a_correct_run(hf) -> None:
    (first, second), _cb = hf
    before = validate_sealed(first)
    baseline = Baseline("hf/2", {r["name"]: r for r in stat_rows(before.stats)}, step=2)
    report = validate_sealed(second, baseline=baseline)
    audit = report.checks["audit"]
    assert report.outcome == "verified" and audit["flagged"] == 0 and audit["compared"] >= 10, audit
    # Adam's moments are not compared (they start at zero and grow fast early on)
    assert report.warnings == []


def test_hf_sharded_safetensors_with_index_are_verified(tmp_path: Path) -> None:
    model = tiny_gpt2()
    model.save_pretrained(tmp_path / "m", max_shard_size="4KB")
    shards = sorted(p.name for p in (tmp_path / "m").glob("model-*.safetensors"))
    assert len(shards) >= 2 and (tmp_path / "m" / "model.safetensors.index.json").is_file()
    report = validate_snapshot(tmp_path / "m")
    assert report.outcome == "verified", report.summary()
    assert all(report.files[s] == "ok" for s in shards) and report.files["model.safetensors.index.json"] == "ok"
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert {st.name for st in report.stats} == set(index["weight_map"])  # lm_head is tied to wte: not saved


@pytest.mark.parametrize("where,name", [
    ("model.safetensors", "transformer.h.0.attn.c_attn.weight"),
    ("optimizer.pt", "state.0.exp_avg_sq"),
])
def test_hf_planted_nan_is_invalid_and_named(hf, tmp_path: Path, where: str, name: str) -> None:
    folder = unsealed_copy(hf[0][1], tmp_path / "checkpoint-4")
    plant(folder / where, name, math.nan)
    report = validate_snapshot(folder, step=4)
    assert report.outcome == "invalid" and problems(report) == {("nan", name)}
    [f] = report.findings
    assert f.file == where and f.role == ("parameter" if where.endswith(".safetensors") else "optimizer_state")


def test_hf_step_recorded_inside_is_checked(hf) -> None:
    report = validate_snapshot(hf[0][1], step=6)
    assert report.outcome == "invalid"
    [f] = report.findings
    assert (f.problem, f.file) == (Problem.STEP, "trainer_state.json")
    assert "records step 4, the catalog says step 6" in f.message


def test_unknown_and_opaque_files_are_reported_not_damage_unless_asked(hf, tmp_path: Path) -> None:
    folder = unsealed_copy(hf[0][0], tmp_path / "c")
    (folder / "extra.bin").write_bytes(os.urandom(4096))
    report = validate_snapshot(folder, step=2)
    assert report.outcome == "verified", report.summary()
    assert report.not_loaded["extra.bin"] == "not loaded: unknown format"
    assert "1 ok" not in report.summary() and "2 not loaded" in report.summary()

    strict = ValidationSettings.from_mapping({"opaque_pickle": "fail", "unknown_format": "fail"})
    report = validate_snapshot(folder, step=2, settings=strict)
    assert report.outcome == "invalid"
    assert {(f.file, f.problem) for f in report.findings} == {("training_args.bin", Problem.OPAQUE),
                                                              ("extra.bin", Problem.UNLOADABLE)}


@pytest.mark.parametrize("name", ["optimizer.pt", "model.safetensors", "rng_state.pth", "trainer_state.json"])
def test_a_file_claiming_a_known_format_that_does_not_parse_is_damage(hf, tmp_path: Path, name: str) -> None:
    folder = unsealed_copy(hf[0][0], tmp_path / "c")
    data = (folder / name).read_bytes()
    (folder / name).write_bytes(data[: len(data) // 2])
    report = validate_snapshot(folder, step=2)
    assert report.outcome == "invalid" and report.files[name] == "invalid", report.summary()


def test_an_opaque_checkpoint_file_is_not_loaded_and_warned_about(tmp_path: Path) -> None:
    """A .ckpt whose pickle names a class weights_only refuses (old Lightning kept hparams as an
    argparse.Namespace): never unpickled, not damage, but its tensors went unchecked, and the report says so."""
    import argparse

    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": argparse.Namespace(lr=1)},
               tmp_path / "last.ckpt")
    report = validate_snapshot(tmp_path)
    assert report.outcome == "verified" and report.files == {"last.ckpt": "not loaded"}
    assert report.not_loaded["last.ckpt"] == "not loaded: opaque pickle (names argparse.Namespace)"
    [w] = report.warnings
    assert w.problem is Problem.OPAQUE and "were not checked" in w.message


def test_a_bare_pickle_naming_code_is_unsafe_and_never_runs(hf, tmp_path: Path) -> None:
    sentinel = tmp_path / "SENTINEL"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {sentinel}",))

    folder = unsealed_copy(hf[0][0], tmp_path / "c")
    (folder / "state.pkl").write_bytes(pickle.dumps(Evil(), protocol=4))
    report = validate_snapshot(folder, step=2)
    assert report.outcome == "invalid" and problems(report) == {("unsafe", None)}
    assert not sentinel.exists()


# ------------------------------------------------------------------------------------ Lightning

@pytest.fixture(scope="module")
def pl_run(tmp_path_factory) -> tuple[Path, SafepointCheckpointIO]:
    io = SafepointCheckpointIO(run="pl")
    dirpath = lightning_run(tmp_path_factory.mktemp("pl"), steps=4, every=2, callbacks=[tracker_callback()],
                            plugins=[io])
    return dirpath, io


def test_lightning_checkpoint_io_writes_sealed_step_folders_verified(pl_run) -> None:
    dirpath, io = pl_run
    assert [p.name for p in io.sealed] == ["step-2", "step-4"]
    assert sorted(p.name for p in dirpath.iterdir()) == ["step-2", "step-4"]
    for folder in io.sealed:
        files = [f.path for f in LocalSnapshot.open(folder).manifest.files]
        assert files == [f"epoch=0-{folder.name.replace('-', '=')}.ckpt"]
        report = validate_sealed(folder)
        assert report.outcome == "verified", report.summary()
        names = {s.name for s in report.stats}
        assert "optimizer_states.0.state.0.exp_avg" in names and "state_dict.net.0.weight" in names
        [ckpt] = folder.glob("*.ckpt")
        saved = torch.load(ckpt, weights_only=True)
        assert saved["lr_schedulers"][0]["_step_count"] >= 2 and len(saved["optimizer_states"]) == 1
        # Lightning keeps inf in ModelCheckpoint.kth_value, the model a -inf mask buffer: warnings, not damage
        warned = {(w.problem.value, w.role) for w in report.warnings}
        assert warned == {("inf", "trainer_metadata"), ("inf", "buffer")}
        assert any(w.tensor.endswith(".kth_value") for w in report.warnings)
        assert report.checks["recorded_step"]["checkpoint"][0]["key"] == "global_step"


def test_lightning_planted_nan_in_optimizer_moment_is_invalid(pl_run, tmp_path: Path) -> None:
    folder = unsealed_copy(pl_run[0] / "step-4", tmp_path / "step-4")
    [ckpt] = folder.glob("*.ckpt")
    plant_in_torch_file(ckpt, "optimizer_states.0.state.1.exp_avg", math.nan)
    report = validate_snapshot(folder, step=4)
    assert report.outcome == "invalid" and problems(report) == {("nan", "optimizer_states.0.state.1.exp_avg")}


def test_lightning_planted_inf_in_callback_metadata_is_verified_with_a_warning(pl_run, tmp_path: Path) -> None:
    folder = unsealed_copy(pl_run[0] / "step-4", tmp_path / "step-4")
    [ckpt] = folder.glob("*.ckpt")
    plant_in_torch_file(ckpt, "callbacks.Tracker.best_loss", math.inf)
    report = validate_snapshot(folder, step=4)
    assert report.outcome == "verified", report.summary()
    [w] = [w for w in report.warnings if w.tensor == "callbacks.Tracker.best_loss"]
    assert w.problem is Problem.INF and w.role == "trainer_metadata" and w.file == ckpt.name


def test_lightning_global_step_is_checked(pl_run) -> None:
    report = validate_snapshot(pl_run[0] / "step-4", step=5)
    assert report.outcome == "invalid" and problems(report) == {("step", "global_step")}


# ------------------------------------------------------------------------------------ DCP (torchtitan)

def test_torchtitan_dcp_saved_and_sealed_is_verified(tmp_path: Path) -> None:
    folder = torchtitan_style_dcp(tmp_path / "checkpoint" / "step-10", step=10,
                                  save=lambda state, out: sp_dcp.save(state, out.parent, run="tt", step=10))
    assert is_committed(folder)
    report = validate_sealed(folder)
    assert report.outcome == "verified", report.summary()
    assert report.files == {".metadata": "ok", "__0_0.distcp": "ok"}
    assert report.not_loaded == {"__0_0.distcp:extra.blob": "not loaded: opaque pickle (names _io.BytesIO)"}
    assert {"0.weight", "optimizer.state.0.weight.exp_avg_sq", "train_state.step"} <= {s.name for s in report.stats}
    assert report.checks["recorded_step"]["checkpoint"][0]["value"] == 10


def test_torchtitan_folders_sealed_after_the_fact(tmp_path: Path) -> None:
    root = tmp_path / "checkpoint"
    for step in (5, 10):
        torchtitan_style_dcp(root / f"step-{step}", step=step)
    (root / "step-15").mkdir()  # being written: no .metadata yet
    assert [p.name for p in sp_dcp.seal_finished(root, run="tt")] == ["step-5", "step-10"]
    assert sp_dcp.seal_finished(root, run="tt") == []
    assert LocalSnapshot.open(root / "step-5").manifest.step == 5


def test_torchtitan_planted_nan_in_optimizer_moment_is_invalid(tmp_path: Path) -> None:
    key = "state.0.weight.exp_avg"

    def fault(state: dict) -> None:
        state["optimizer"][key].view(-1)[0] = math.nan

    folder = torchtitan_style_dcp(tmp_path / "step-10", step=10, fault=fault)
    report = validate_snapshot(folder, step=10)
    assert report.outcome == "invalid" and problems(report) == {("nan", f"optimizer.{key}")}
    assert report.findings[0].role == "optimizer_state"
    assert validate_snapshot(folder, step=11).outcome == "invalid"  # and the step is checked


# ------------------------------------------------------------------------------------ Accelerate

def test_accelerate_save_state_sealed_is_verified(tmp_path: Path) -> None:
    folder = save_state(accelerate_train(), tmp_path / "ckpt", run="acc", step=3)
    assert folder.name == "step-3" and is_committed(folder)
    report = validate_sealed(folder)
    assert report.outcome == "verified", report.summary()
    assert report.files == {"model.safetensors": "ok", "optimizer.bin": "ok", "random_states_0.pkl": "ok",
                            "scheduler.bin": "ok"}
    assert report.checks["layout"] == "accelerate"


@pytest.mark.parametrize("where,name", [("model.safetensors", "0.weight"), ("optimizer.bin", "state.0.exp_avg")])
def test_accelerate_planted_nan_is_invalid(tmp_path: Path, where: str, name: str) -> None:
    folder = accelerate_save_state(tmp_path / "acc")
    plant(folder / where, name, math.nan)
    report = validate_snapshot(folder)
    assert report.outcome == "invalid" and problems(report) == {("nan", name)}


def test_numpy_allow_list_is_scoped_to_safepoint_loads(tmp_path: Path) -> None:
    """The allow-list is added for one load and removed after: the process's own torch.load is unchanged."""
    folder = accelerate_save_state(tmp_path / "acc")
    assert validate_snapshot(folder).ok
    with pytest.raises(pickle.UnpicklingError):
        torch.load(folder / "random_states_0.pkl", weights_only=True)
