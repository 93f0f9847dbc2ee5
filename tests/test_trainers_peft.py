"""PEFT LoRA adapters through Hugging Face `Trainer`: what it writes (`adapter_model.safetensors`,
`adapter_config.json`, the adapter's optimizer state, no full model) is sealed by `SafepointCallback`,
ingested verified through the real ingest with a strict load into the base model, each planted fault
named, and restored and resumed with `train(resume_from_checkpoint=...)` to the uninterrupted run's
adapter, bit for bit. A tiny GPT-2 from a config; nothing downloaded."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

import safepoint  # noqa: E402
from safepoint.core import resumed  # noqa: E402
from safepoint.core.config import Config  # noqa: E402
from safepoint.core.states import CheckpointState as CS  # noqa: E402
from safepoint.integrations.huggingface import SafepointCallback  # noqa: E402
from safepoint.local.snapshot import LocalSnapshot, is_committed  # noqa: E402
from safepoint.ops.ingest import ingest  # noqa: E402
from safepoint.validation.settings import ValidationSettings  # noqa: E402
from safepoint.validation.validate import validate_snapshot  # noqa: E402
from tests.helpers_trainers import _Tokens, plant, tiny_gpt2  # noqa: E402

BASE = "tests.test_trainers_peft:tiny_gpt2"         # the harness: the base model the adapter was trained on
LORA_A = "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"
LORA_B = "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"


def wider_gpt2():
    """A base model the adapter was not trained on (n_embd 32, not 16)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))


def no_attention():
    """A base model without the adapter's target module (`c_attn`)."""
    return torch.nn.Sequential(torch.nn.Linear(16, 16))


def lora_model():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_gpt2(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True))


def peft_trainer(out: Path, *, steps: int, callbacks: list | None = None):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(out), max_steps=steps, save_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-2, use_cpu=True, report_to=[], disable_tqdm=True,
                             dataloader_num_workers=0, save_strategy="steps")
    return Trainer(model=lora_model(), args=args, train_dataset=_Tokens(), callbacks=callbacks or [])


@pytest.fixture(scope="module")
def peft_run(tmp_path_factory) -> tuple[list[Path], SafepointCallback]:
    resumed.forget()
    cb = SafepointCallback(run="lora")
    out = tmp_path_factory.mktemp("peft") / "node"
    peft_trainer(out, steps=6, callbacks=[cb]).train()
    resumed.forget()
    return sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])), cb


def unsealed_copy(src: Path, dst: Path) -> Path:
    from safepoint.core.format import CONTROL_FILES

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*CONTROL_FILES))
    return dst


def test_adapter_checkpoints_are_sealed_as_written(peft_run) -> None:
    cks, cb = peft_run
    assert [c.name for c in cks] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"] and cb.sealed == cks
    for folder in cks:
        files = {f.path for f in LocalSnapshot.open(folder).manifest.files}
        assert is_committed(folder) and {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt",
                                         "trainer_state.json"} <= files
        assert "model.safetensors" not in files   # the base model is not saved: only the adapter


def test_adapter_tensors_and_optimizer_state_are_read_and_the_base_model_loads_them(peft_run) -> None:
    folder = peft_run[0][1]
    report = validate_snapshot(folder, step=4, model=BASE)
    assert report.outcome == "verified", report.summary()
    assert report.findings == [] and report.warnings == []
    assert report.files["adapter_model.safetensors"] == report.files["optimizer.pt"] == "ok"
    rules = ValidationSettings().rules
    roles = {s.name: str(rules.role(s.file, s.name)) for s in report.stats}
    assert roles[LORA_A] == roles[LORA_B] == "parameter"
    assert {roles[f"state.{i}.exp_avg"] for i in (0, 1)} == {"optimizer_state"}
    harness = report.checks["harness"]
    assert harness["adapter"] == {"peft_type": "LORA", "trainable": 2} and harness["model_tensors"] == 2
    assert harness["optimizer_key"] == "optimizer"


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_one_harness_serves_every_adapter_checkpoint(peft_run, device: str) -> None:
    """The harness an ingest builds once is not changed by an adapter's load: the next checkpoint gets the same."""
    from safepoint.validation.harness import build_harness

    harness = build_harness(BASE, device)
    before = dict(harness.model.state_dict())
    for folder in peft_run[0]:
        report = validate_snapshot(folder, step=int(folder.name.split("-")[1]), model=harness)
        assert report.outcome == "verified" and report.checks["harness"]["adapter"]["trainable"] == 2, report.summary()
    assert list(harness.model.state_dict()) == list(before)  # no adapter layers injected into the factory's model


@pytest.mark.parametrize("where,name", [("adapter_model.safetensors", LORA_B), ("optimizer.pt", "state.1.exp_avg")])
def test_a_planted_nan_in_the_adapter_or_its_optimizer_state_is_invalid_and_named(peft_run, tmp_path: Path,
                                                                                  where: str, name: str) -> None:
    folder = unsealed_copy(peft_run[0][1], tmp_path / "checkpoint-4")
    plant(folder / where, name, math.nan)
    report = validate_snapshot(folder, step=4)
    assert report.outcome == "invalid"
    assert {(f.problem.value, f.tensor, f.file) for f in report.findings} == {("nan", name, where)}


def test_the_strict_load_refuses_an_adapter_for_another_base_model(peft_run) -> None:
    folder = peft_run[0][1]
    wider = validate_snapshot(folder, step=4, model="tests.test_trainers_peft:wider_gpt2")
    assert wider.outcome == "invalid"
    shapes = {f.tensor for f in wider.findings if f.problem.value == "shape"}
    assert shapes == {LORA_A, LORA_B}, wider.summary()
    assert {f.problem.value for f in wider.findings} == {"shape", "optimizer"}  # its moments do not fit either

    other = validate_snapshot(folder, step=4, model="tests.test_trainers_peft:no_attention")
    [f] = other.findings
    assert other.outcome == "invalid" and f.problem.value == "load"
    assert "adapter_config.json: the adapter does not fit the model" in f.message and "c_attn" in f.message


def test_a_renamed_adapter_key_is_refused_by_the_strict_load(peft_run, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = unsealed_copy(peft_run[0][1], tmp_path / "checkpoint-4")
    tensors = load_file(folder / "adapter_model.safetensors")
    tensors[LORA_B.replace("lora_B", "lora_C")] = tensors.pop(LORA_B)
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    assert validate_snapshot(folder, step=4).outcome == "verified"           # no harness: the bytes are fine
    report = validate_snapshot(folder, step=4, model=BASE)
    assert report.outcome == "invalid"
    assert {(f.problem.value, f.tensor) for f in report.findings} == {
        ("missing_key", LORA_B), ("unexpected_key", LORA_B.replace("lora_B", "lora_C"))}


def test_adapter_run_is_ingested_restored_and_resumed_to_the_uninterrupted_adapter(
        peft_run, tmp_path: Path, sqlite_catalog, monkeypatch) -> None:
    """Checkpoints 2 and 4 ingested with the strict load; the node is lost; `safepoint.restore` brings 4
    back and `train(resume_from_checkpoint=...)` ends at step 6 with the uninterrupted run's adapter."""
    from safetensors.torch import load_file

    cks = peft_run[0]
    node = tmp_path / "node"
    shutil.copytree(cks[0].parent, node)       # this test's own copy of the node's checkpoints
    durable = (tmp_path / "durable").as_uri()
    for name in ("checkpoint-2", "checkpoint-4"):
        outcome = ingest(node / name, [durable], sqlite_catalog, Config(), model=BASE)
        assert outcome.state is CS.VERIFIED, outcome.message
        checks = sqlite_catalog.latest_validation(sqlite_catalog.get("lora", outcome.step).id).report["checks"]
        assert checks["harness"]["adapter"] == {"peft_type": "LORA", "trainable": 2}   # the strict load ran
    uninterrupted = load_file(node / "checkpoint-6" / "adapter_model.safetensors")
    shutil.rmtree(node)

    monkeypatch.chdir(tmp_path)
    resumed.forget()
    try:
        r = safepoint.restore("lora", "resume/")
        assert r.step == 4 and (r.path / "adapter_model.safetensors").is_file()
        trainer = peft_trainer(tmp_path / "again", steps=6)
        trainer.train(resume_from_checkpoint=os.fspath(r))
        assert trainer.state.global_step == 6
    finally:
        resumed.forget()
    got = load_file(tmp_path / "again" / "checkpoint-6" / "adapter_model.safetensors")
    assert set(got) == set(uninterrupted) == {LORA_A, LORA_B}
    assert [k for k in got if not torch.equal(got[k], uninterrupted[k])] == []
