"""Pure decisions behind trainer checkpoints: tensor roles, the rules table, file kinds, recorded steps."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from safepoint.core.errors import UsageError
from safepoint.validation.audit import Thresholds, jump_ratio
from safepoint.validation.layouts import (
    ACCELERATE,
    DCP,
    HF_TRAINER,
    LIGHTNING,
    PLAIN,
    RecordedStep,
    detect_layout,
    step_mismatches,
)
from safepoint.validation.loaders.kinds import JSON, PICKLE, SAFETENSORS, TORCH, UNKNOWN, file_kind, pickle_globals
from safepoint.validation.roles import DEFAULT_RULES, Role, Rule, Rules, role_of
from safepoint.validation.settings import ValidationSettings

KTH = "callbacks.ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 2}.kth_value"


@pytest.mark.parametrize("file,name,role", [
    # Hugging Face Trainer checkpoint-N/
    ("model.safetensors", "transformer.h.0.attn.c_attn.weight", Role.PARAMETER),
    ("model-00001-of-00002.safetensors", "lm_head.weight", Role.PARAMETER),
    ("optimizer.pt", "state.3.exp_avg_sq", Role.OPTIMIZER_STATE),
    ("optimizer.pt", "param_groups.0.lr", Role.OPTIMIZER_STATE),
    ("scheduler.pt", "base_lrs", Role.TRAINER_METADATA),
    ("rng_state.pth", "cpu", Role.RNG_STATE),
    ("rng_state_3.pth", "cuda", Role.RNG_STATE),
    # Lightning .ckpt
    ("epoch=0-step=4.ckpt", "state_dict.net.0.weight", Role.PARAMETER),
    ("epoch=0-step=4.ckpt", "state_dict.attn.mask", Role.BUFFER),
    ("epoch=0-step=4.ckpt", "state_dict.bn.running_var", Role.BUFFER),
    ("epoch=0-step=4.ckpt", "optimizer_states.0.state.1.exp_avg", Role.OPTIMIZER_STATE),
    ("epoch=0-step=4.ckpt", "lr_schedulers.0.base_lrs", Role.TRAINER_METADATA),
    ("epoch=0-step=4.ckpt", KTH, Role.TRAINER_METADATA),
    ("epoch=0-step=4.ckpt", "loops.fit_loop.epoch_progress.total.ready", Role.TRAINER_METADATA),
    # torchtitan DCP (model flattened at the top level)
    (".metadata", "layers.0.attention.wq.weight", Role.PARAMETER),
    (".metadata", "optimizer.state.layers.0.attention.wq.weight.exp_avg", Role.OPTIMIZER_STATE),
    (".metadata", "train_state.step", Role.TRAINER_METADATA),
    (".metadata", "lr_scheduler.lr_scheduler_0.last_epoch", Role.TRAINER_METADATA),
    (".metadata", "freqs_cis", Role.BUFFER),
    # Accelerate save_state
    ("optimizer.bin", "state.0.exp_avg", Role.OPTIMIZER_STATE),
    ("scheduler.bin", "last_epoch", Role.TRAINER_METADATA),
    ("random_states_0.pkl", "torch_manual_seed", Role.RNG_STATE),
    ("custom_checkpoint_0.pkl", "anything", Role.UNKNOWN),
    # plain torch.save dicts
    ("ckpt.pt", "model.0.weight", Role.PARAMETER),
    ("ckpt.pt", "optimizer.state.0.exp_avg", Role.OPTIMIZER_STATE),
    ("opt.pt", "state.0.momentum_buffer", Role.OPTIMIZER_STATE),
    ("ckpt.pt", "scaler.scale", Role.TRAINER_METADATA),
    ("sub/dir/model.pt", "0.weight", Role.PARAMETER),
])
def test_role_of(file: str, name: str, role: Role) -> None:
    assert role_of(file, name) is role


def test_overrides_come_first() -> None:
    assert role_of("ckpt.pt", "teacher.0.weight", (("teacher.*", Role.UNKNOWN),)) is Role.UNKNOWN


def test_default_rules_fail_only_parameters_and_optimizer_state_on_nonfinite() -> None:
    failing = {r for r, rule in DEFAULT_RULES.items() if rule.nonfinite == "fail"}
    assert failing == {Role.PARAMETER, Role.OPTIMIZER_STATE, Role.UNKNOWN}
    assert {r for r, rule in DEFAULT_RULES.items() if rule.norm_jump != "off"} == {Role.PARAMETER, Role.UNKNOWN}


def test_rules_from_config() -> None:
    s = ValidationSettings.from_mapping({"rules": {"buffer": {"nonfinite": "fail"},
                                                   "optimizer_state": {"norm_jump": "warn"}},
                                         "roles": {"ema.*": "buffer"}, "opaque_pickle": "fail"})
    assert s.rules.rule(Role.BUFFER) == Rule("fail", "off")
    assert s.rules.rule(Role.OPTIMIZER_STATE) == Rule("fail", "warn")
    assert s.rules.role("m.pt", "ema.w") is Role.BUFFER and s.opaque_pickle == "fail"
    # a per-run override keeps the table's other cells
    merged = s.merged({"rules": {"buffer": {"norm_jump": "fail"}}}, where="[runs.r]")
    assert merged.rules.rule(Role.BUFFER) == Rule("fail", "fail")
    assert Rules().to_dict()["trainer_metadata"] == {"nonfinite": "warn", "norm_jump": "off"}


@pytest.mark.parametrize("doc,why", [
    ({"rules": {"weights": {"nonfinite": "fail"}}}, "unknown role"),
    ({"rules": {"buffer": {"nonfinite": "maybe"}}}, "must be one of"),
    ({"rules": {"buffer": {"nan": "fail"}}}, "takes nonfinite and norm_jump"),
    ({"roles": {"x.*": "weights"}}, "roles must map"),
    ({"opaque_pickle": "ignore"}, '"report" or "fail"'),
])
def test_bad_rules_are_usage_errors(doc: dict, why: str) -> None:
    with pytest.raises(UsageError, match=why):
        ValidationSettings.from_mapping(doc)


# ------------------------------------------------------------------------------------ file kinds

def _write(p: Path, data: bytes) -> Path:
    p.write_bytes(data)
    return p


def test_file_kinds(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "weights.data")
    cases = {
        "weights.data": TORCH,                                          # torch.save content, any name
        "extra.bin": UNKNOWN,                                           # random bytes: .bin claims nothing
        "blob.pkl": UNKNOWN,
        "notes.txt": UNKNOWN,
        "optimizer.bin": TORCH,                                         # a name only torch.save output gets
        "model.pt": TORCH,                                              # claims torch by suffix
        "model.safetensors": SAFETENSORS,
        "trainer_state.json": JSON,
        "state.pkl": PICKLE,                                            # a bare pickle
        "broken.bin": TORCH,                                            # a zip that does not open, torch-ish name
    }
    _write(tmp_path / "extra.bin", bytes(range(256)))
    _write(tmp_path / "blob.pkl", b"\x00\x01junk")
    _write(tmp_path / "notes.txt", b"hello")
    _write(tmp_path / "optimizer.bin", b"")
    _write(tmp_path / "model.pt", b"garbage")
    _write(tmp_path / "model.safetensors", b"")
    _write(tmp_path / "trainer_state.json", b"{}")
    _write(tmp_path / "state.pkl", pickle.dumps({"a": 1}, protocol=4))
    with zipfile.ZipFile(tmp_path / "z.zip", "w") as z:
        z.writestr("x/data.pkl", b"\x80\x02}q\x00.")
    _write(tmp_path / "broken.bin", (tmp_path / "z.zip").read_bytes()[:20])
    assert {name: file_kind(tmp_path / name) for name in cases} == cases


def test_pickle_globals_are_read_without_running_anything(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            import os
            return (os.system, ("touch " + str(tmp_path / "SENTINEL"),))

    p = _write(tmp_path / "evil.pkl", pickle.dumps(Evil(), protocol=4))
    names, why = pickle_globals(p)
    assert why is None and names and names[0].split(".")[0] in ("posix", "os", "nt")
    assert not (tmp_path / "SENTINEL").exists()
    assert pickle_globals(_write(tmp_path / "cut.pkl", pickle.dumps(list(range(100)), protocol=4)[:30]))[1]


# ------------------------------------------------------------------------------------ layouts and steps

@pytest.mark.parametrize("files,layout", [
    (["config.json", "model.safetensors", "optimizer.pt", "trainer_state.json", "training_args.bin"], HF_TRAINER),
    (["epoch=0-step=4.ckpt"], LIGHTNING),
    ([".metadata", "__0_0.distcp"], DCP),
    (["model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"], ACCELERATE),
    (["model.pt"], PLAIN),
])
def test_detect_layout(files: list[str], layout: str) -> None:
    assert detect_layout(files) == layout


@pytest.mark.parametrize("layout,recorded,step,bad", [
    (HF_TRAINER, [("trainer_state.json", "global_step", 4)], 4, []),
    (HF_TRAINER, [("trainer_state.json", "global_step", 4)], 6, ["records step 4, the catalog says step 6"]),
    (HF_TRAINER, [("trainer_state.json", "global_step", "4")], 4, ["is not a step number"]),
    (HF_TRAINER, [("trainer_state.json", "global_step", 4)], None, []),
    (DCP, [(".metadata", "train_state.step", 10.0)], 10, []),              # a one-element tensor's value
    (LIGHTNING, [("a.ckpt", "global_step", 2), ("b.ckpt", "global_step", 4)], 4, []),   # the newest counts
    (LIGHTNING, [("a.ckpt", "global_step", 2), ("b.ckpt", "global_step", 4)], 2,
     ["records step 4, the catalog says step 2"]),
])
def test_step_mismatches(layout: str, recorded: list, step: int | None, bad: list[str]) -> None:
    found = step_mismatches(layout, [RecordedStep(*r) for r in recorded], step)
    assert len(found) == len(bad) and all(b in why for (_r, why), b in zip(found, bad))


# ------------------------------------------------------------------------------------ norm jumps

@pytest.mark.parametrize("norm,prev,numel,flagged", [
    (1.0, 1.0, 100, False),
    (0.05, 0.0, 100, False),     # a zero-initialised bias starting to move: RMS 0.005 is under the floor
    (0.5, 0.0, 100, False),      # RMS 0.05 from zero: x5 against the floor
    (5.0, 0.0, 100, True),       # RMS 0.5 from zero: x50
    (0.01, 1.0, 100, True),      # a live tensor collapsing to zero
    (1e-5, 1e-3, 100, False),    # both under the floor
    (30.0, 2.0, 100, True),      # x15 growth
])
def test_jump_ratio(norm: float, prev: float, numel: int, flagged: bool) -> None:
    ratio, _grew = jump_ratio(norm, prev, numel, Thresholds())
    assert (ratio > 10.0) is flagged, ratio
