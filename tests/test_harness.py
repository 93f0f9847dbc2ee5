"""Strict dry-run load against a model factory, on real checkpoints (torch.save, safetensors, DCP from 2 ranks).

The factories below are referenced as `tests.test_harness:<name>`, the way a user passes
`--model mypkg.models:build`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from safepoint.core.errors import UsageError
from safepoint.validation.harness import (
    Found,
    HarnessError,
    TensorSpec,
    build_harness,
    check_step,
    find_optimizer,
    resolve_model_prefix,
)
from safepoint.validation.loaders import Problem
from safepoint.validation.settings import ValidationSettings
from safepoint.validation.validate import ValidationReport, validate_snapshot
from tests.helpers_ckpt import (
    make_dcp_ckpt,
    make_malicious_pickle,
    make_safetensors_ckpt,
    make_torch_save_ckpt,
    small_model,
    trained_model_and_optimizer,
)

H = "tests.test_harness"


# ---------------------------------------------------------------------------------------- factories

def model_and_adamw():
    model = small_model()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def model_only():
    return small_model()


def wider_model():
    """The same architecture after a code edit: hidden size 16 -> 32."""
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def bf16_model():
    return small_model().to(torch.bfloat16)


def model_and_sgd():
    model = small_model()
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}


def model_and_two_groups():
    model = small_model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return model, torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)


seen_devices: list[str] = []


def records_device(device: str = "cpu"):
    seen_devices.append(device)
    return small_model()


def broken():
    raise RuntimeError("the config file is missing")


def not_a_model():
    return {"weights": 1}


def _problems(report: ValidationReport) -> list[tuple[Problem, str | None]]:
    return [(f.problem, f.tensor) for f in report.findings]


# ---------------------------------------------------------------------------------------- torch.save

def test_matching_checkpoint_passes_strict_load_with_optimizer_and_step(tmp_path: Path) -> None:
    make_torch_save_ckpt(tmp_path)
    report = validate_snapshot(tmp_path, model=f"{H}:model_and_adamw", step=2)
    assert report.ok, report.summary()
    h = report.checks["harness"]
    assert (h["model_key"], h["optimizer_key"], h["optimizer"]) == ("model", "optimizer", "AdamW")
    assert h["step"] == {"catalog": 2, "checkpoint": 2, "key": "step"}
    assert h["model_tensors"] == 4


def test_factory_is_built_on_meta(tmp_path: Path) -> None:
    h = build_harness(f"{H}:model_and_adamw")
    assert all(p.device.type == "meta" for p in h.model.parameters())
    assert h.optimizer is not None and h.optimizer.groups == (("0.weight", "0.bias", "2.weight", "2.bias"),)
    seen_devices.clear()
    build_harness(f"{H}:records_device")
    assert seen_devices == ["meta"]


def test_renamed_key_is_reported_with_a_hint(tmp_path: Path) -> None:
    path = make_torch_save_ckpt(tmp_path)
    sd = torch.load(path, weights_only=True)
    sd["model"]["2.w"] = sd["model"].pop("2.weight")
    torch.save(sd, path)
    report = validate_snapshot(tmp_path, model=f"{H}:model_and_adamw", step=2)
    assert report.outcome == "invalid"
    assert sorted(_problems(report)) == sorted([(Problem.MISSING_KEY, "model.2.weight"),
                                                (Problem.UNEXPECTED_KEY, "model.2.w")])
    missing = next(f for f in report.findings if f.problem is Problem.MISSING_KEY)
    assert "'model.2.w'" in missing.message and "renamed" in missing.message
    assert "float32 [4, 16]" in missing.message
    assert missing.file == "model.pt" and report.files == {"model.pt": "invalid"}


def test_changed_shape_against_the_factory(tmp_path: Path) -> None:
    make_torch_save_ckpt(tmp_path)
    report = validate_snapshot(tmp_path, model=f"{H}:wider_model", step=2)
    assert report.outcome == "invalid"
    shapes = {f.tensor: f.message for f in report.findings if f.problem is Problem.SHAPE}
    assert set(shapes) == {"model.0.weight", "model.0.bias", "model.2.weight"}
    assert "shape [16, 8] in the checkpoint, the model expects [32, 8]" in shapes["model.0.weight"]
    # The optimizer state is checked against the factory's parameters too.
    opt = {f.tensor: f.message for f in report.findings if f.problem is Problem.OPTIMIZER}
    assert "optimizer.state.0.exp_avg" in opt and "optimizer.state.0.exp_avg_sq" in opt
    assert "its parameter 0.weight is [32, 8]" in opt["optimizer.state.0.exp_avg"]
    assert not any(f.problem is Problem.LOAD for f in report.findings)  # no dry run after a mismatch


def test_dtype_mismatch_fails_unless_warn_only(tmp_path: Path) -> None:
    make_torch_save_ckpt(tmp_path)
    report = validate_snapshot(tmp_path, model=f"{H}:bf16_model")
    assert report.outcome == "invalid"
    assert {f.problem for f in report.findings} == {Problem.DTYPE}
    assert "dtype float32 in the checkpoint, the model expects bfloat16" in report.findings[0].message
    lenient = ValidationSettings.from_mapping({"warn_only": ["dtype"]})
    report = validate_snapshot(tmp_path, model=f"{H}:bf16_model", settings=lenient)
    assert report.ok and len(report.warnings) == 4 and "4 warnings" in report.summary()


def test_optimizer_of_another_type(tmp_path: Path) -> None:
    make_torch_save_ckpt(tmp_path)
    report = validate_snapshot(tmp_path, model=f"{H}:model_and_sgd")
    [f] = report.findings
    assert f.problem is Problem.OPTIMIZER and f.tensor == "optimizer.param_groups.0"
    assert "no dampening, momentum, nesterov" in f.message and "SGD" in f.message


def test_optimizer_with_other_param_groups(tmp_path: Path) -> None:
    make_torch_save_ckpt(tmp_path)
    report = validate_snapshot(tmp_path, model=f"{H}:model_and_two_groups")
    msgs = [f.message for f in report.findings if f.problem is Problem.OPTIMIZER]
    assert any("1 groups in the checkpoint, the factory's AdamW has 2" in m for m in msgs), msgs
    assert any("param_groups.0: 4 parameters in the checkpoint, the factory's AdamW has 2" in m for m in msgs), msgs


def test_missing_optimizer_state_when_the_factory_has_one(tmp_path: Path) -> None:
    model, _ = trained_model_and_optimizer()
    torch.save({"model": model.state_dict(), "step": 2}, tmp_path / "model.pt")
    report = validate_snapshot(tmp_path, model=f"{H}:model_and_adamw")
    [f] = report.findings
    assert f.problem is Problem.OPTIMIZER and "holds no optimizer state" in f.message
    assert validate_snapshot(tmp_path, model=f"{H}:model_only").ok


def test_optimizer_state_inconsistent_without_factory_optimizer(tmp_path: Path) -> None:
    path = make_torch_save_ckpt(tmp_path)
    sd = torch.load(path, weights_only=True)
    sd["optimizer"]["state"][2]["exp_avg_sq"] = torch.zeros(16, 4)   # param 2 is [4, 16]
    sd["optimizer"]["state"][9] = {"exp_avg": torch.zeros(3)}      # no group lists param 9
    torch.save(sd, path)
    report = validate_snapshot(tmp_path, model=f"{H}:model_only")
    by_tensor = {f.tensor: f.message for f in report.findings}
    assert set(by_tensor) == {"optimizer.state.2", "optimizer.state.9.exp_avg"}
    assert "disagree on shape" in by_tensor["optimizer.state.2"]
    assert "no param group lists" in by_tensor["optimizer.state.9.exp_avg"]
    # With the factory's optimizer the wrong tensor itself is named.
    report = validate_snapshot(tmp_path, model=f"{H}:model_and_adamw")
    assert "optimizer.state.2.exp_avg_sq" in {f.tensor for f in report.findings}


def test_step_recorded_in_checkpoint_against_catalog(tmp_path: Path) -> None:
    make_torch_save_ckpt(tmp_path)  # records "step": 2
    report = validate_snapshot(tmp_path, model=f"{H}:model_and_adamw", step=100)
    [f] = report.findings
    assert (f.problem, f.tensor) == (Problem.STEP, "step")
    assert "records step 2, the catalog says step 100" in f.message
    off = ValidationSettings(check_step=False)
    assert validate_snapshot(tmp_path, model=f"{H}:model_and_adamw", step=100, settings=off).ok
    # A step stored as a 0-d tensor is read too.
    model, opt = trained_model_and_optimizer()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "global_step": torch.tensor(7)},
               tmp_path / "model.pt")
    assert validate_snapshot(tmp_path, model=f"{H}:model_and_adamw", step=7).ok
    assert not validate_snapshot(tmp_path, model=f"{H}:model_and_adamw", step=8).ok


@pytest.mark.parametrize("layout", ["state_dict", "top", "module_prefixed"])
def test_model_state_key_defaults(tmp_path: Path, layout: str) -> None:
    model, _ = trained_model_and_optimizer()
    sd = model.state_dict()
    if layout == "state_dict":
        obj = {"state_dict": sd, "epoch": 3}
    elif layout == "top":
        obj = dict(sd)
    else:  # DDP-style: "module." inside the "model" key is a rename of every key
        obj = {"model": {f"module.{k}": v for k, v in sd.items()}}
    torch.save(obj, tmp_path / "model.pt")
    report = validate_snapshot(tmp_path, model=f"{H}:model_only")
    if layout == "module_prefixed":
        assert {f.problem for f in report.findings} == {Problem.MISSING_KEY, Problem.UNEXPECTED_KEY}
        assert "'model.module.0.weight'" in next(f.message for f in report.findings if f.tensor == "model.0.weight")
    else:
        assert report.ok, report.summary()
        assert report.checks["harness"]["model_key"] == ("state_dict" if layout == "state_dict" else "")


def test_configured_model_key_is_strict(tmp_path: Path) -> None:
    make_torch_save_ckpt(tmp_path)
    settings = ValidationSettings.from_mapping({"model_key": "state_dict"})
    report = validate_snapshot(tmp_path, model=f"{H}:model_only", settings=settings)
    assert {f.problem for f in report.findings} == {Problem.MISSING_KEY}
    assert "under 'state_dict'" in report.findings[0].message


def test_safetensors_top_level_strict_load(tmp_path: Path) -> None:
    make_safetensors_ckpt(tmp_path)  # the model's state_dict plus one extra bf16 tensor
    report = validate_snapshot(tmp_path, model=f"{H}:model_only")
    assert _problems(report) == [(Problem.UNEXPECTED_KEY, "extra.bf16")]
    assert report.checks["harness"]["model_key"] == ""


def test_malicious_pickle_is_refused_before_any_harness_check(tmp_path: Path) -> None:
    sentinel = tmp_path / "SENTINEL"
    make_malicious_pickle(tmp_path / "snap" / "model.pt", sentinel)
    report = validate_snapshot(tmp_path / "snap", model=f"{H}:model_and_adamw", step=1)
    assert not sentinel.exists()
    assert _problems(report) == [(Problem.UNSAFE, None)]
    assert "harness" not in report.checks


# ---------------------------------------------------------------------------------------- DCP

@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dcp_ckpt(tmp_path_factory.mktemp("dcp-harness") / "ckpt", world_size=2)


def test_dcp_two_ranks_strict_load(dcp_folder: Path) -> None:
    settings = ValidationSettings.from_mapping({"step_key": "extra.step"})
    report = validate_snapshot(dcp_folder, model=f"{H}:model_and_adamw", settings=settings, step=2)
    assert report.ok, report.summary()
    h = report.checks["harness"]
    assert (h["model_key"], h["optimizer_key"], h["step"]["checkpoint"]) == ("model", "optimizer", 2)
    report = validate_snapshot(dcp_folder, model=f"{H}:wider_model", settings=settings, step=3)
    problems = {f.problem for f in report.findings}
    assert {Problem.SHAPE, Problem.OPTIMIZER, Problem.STEP} <= problems
    assert all(f.file == ".metadata" for f in report.findings)


# ---------------------------------------------------------------------------------------- factory errors

@pytest.mark.parametrize("spec,needle", [
    ("no_colon", "package.module:function"),
    ("tests.no_such_module:f", "cannot import"),
    (f"{H}:no_such_factory", "has no attribute"),
    (f"{H}:broken", "the config file is missing"),
    (f"{H}:not_a_model", "not a torch.nn.Module"),
])
def test_bad_factory_is_a_usage_error(tmp_path: Path, spec: str, needle: str) -> None:
    make_torch_save_ckpt(tmp_path)
    with pytest.raises(HarnessError, match=needle) as e:
        validate_snapshot(tmp_path, model=spec)
    assert isinstance(e.value, UsageError)


# ---------------------------------------------------------------------------------------- pure decisions

def test_resolve_model_prefix_by_best_match() -> None:
    expected = ["embed.weight", "layers.0.w", "lm_head.weight"]
    hf_flat = ["model.embed.weight", "model.layers.0.w", "lm_head.weight"]  # HF: "model." is a submodule
    assert resolve_model_prefix(["model." + k for k in expected], expected, ("model", "")) == "model"
    assert resolve_model_prefix(hf_flat, ["model.embed.weight", "model.layers.0.w", "lm_head.weight"],
                                ("model", "state_dict", "")) == ""
    assert resolve_model_prefix(["state_dict.x"], expected, ("model", "state_dict", "")) == "state_dict"
    assert resolve_model_prefix(["optimizer.state.0.exp_avg"], expected, ("model", ""), exclude="optimizer") == ""


@pytest.mark.parametrize("values,step,problem", [
    ({"step": 5}, 5, None),
    ({"step": 5.0}, 5, None),
    ({"global_step": 6}, 5, Problem.STEP),
    ({"step": 5.5}, 5, Problem.STEP),
    ({"step": "five"}, 5, None),        # not a number: ignored like an absent step
    ({}, 5, None),
])
def test_check_step_table(values: dict, step: int, problem: Problem | None) -> None:
    issues, _ = check_step(values, step, ("step", "global_step"))
    assert [i.problem for i in issues] == ([problem] if problem else [])


def test_find_optimizer_with_fqn_keyed_state() -> None:
    """DCP's get_state_dict keys optimizer state by parameter FQN, dots included."""
    spec = TensorSpec((4, 2), "float32")
    found = Found(tensors={"optim.state.layer.0.weight.exp_avg": spec, "optim.state.layer.0.weight.step":
                           TensorSpec((), "float32"), "model.layer.0.weight": spec},
                  values={"optim.param_groups.0.params": ["layer.0.weight"], "optim.param_groups.0.lr": 0.1})
    opt = find_optimizer(found, ("optimizer", "optim"))
    assert opt is not None and opt.prefix == "optim" and not opt.orphans
    assert set(opt.state["layer.0.weight"]) == {"exp_avg", "step"}
