"""The way back with stock trainers: what Hugging Face `Trainer` and Lightning wrote, sealed by their
Safepoint integration and ingested, is restored after the node is lost (`safepoint restore`, the
CLI) and resumed by the trainer's own loader (`resume_from_checkpoint=`, `ckpt_path=`): the HF run
ends bit-equal to the same run never interrupted, and Lightning restores every tensor, the
scheduler and the step bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from safepoint.cli.main import main
from safepoint.core.config import Config
from safepoint.core.states import CheckpointState as CS
from safepoint.integrations.huggingface import SafepointCallback
from safepoint.integrations.lightning import SafepointCheckpointIO
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.ingest import ingest
from tests.helpers_trainers import _lightning_module, _Tokens, hf_trainer_run, lightning_run, tiny_gpt2


def restore_cli(catalog_url: str, run: str, into: Path, capsys) -> dict:
    capsys.readouterr()
    assert main(["--catalog", catalog_url, "restore", "--run", run, "--into", str(into), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_hf_trainer_resumes_from_a_restored_checkpoint(tmp_path: Path, sqlite_catalog, sqlite_catalog_url, capsys):
    """A 6-step run checkpoints at 2, 4 and 6; the node dies after 4 was ingested. Restored and
    resumed by `Trainer.train(resume_from_checkpoint=...)`, it ends bit-equal to the run's own step 6."""
    from safetensors.torch import load_file
    from transformers import Trainer, TrainingArguments

    out, durable = tmp_path / "node" / "hf", (tmp_path / "durable").as_uri()
    cks = hf_trainer_run(out, steps=6, save_steps=2, callbacks=[SafepointCallback(run="hf")])
    assert [c.name for c in cks] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    for folder in cks[:2]:
        assert ingest(folder, [durable], sqlite_catalog, Config()).state is CS.VERIFIED
    uninterrupted = load_file(cks[2] / "model.safetensors")

    shutil.rmtree(tmp_path / "node")                       # the node and its checkpoints are gone
    into = tmp_path / "restored" / "checkpoint-4"
    doc = restore_cli(sqlite_catalog_url, "hf", into, capsys)
    assert doc["step"] == 4 and doc["sources"] == [f"{durable}/hf/4"]
    assert LocalSnapshot.open(into).verify().outcome is CS.VERIFIED

    args = TrainingArguments(output_dir=str(tmp_path / "resumed"), max_steps=6, save_steps=2,
                             per_device_train_batch_size=4, learning_rate=1e-3, use_cpu=True, report_to=[],
                             logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, save_strategy="steps")
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=_Tokens())
    trainer.train(resume_from_checkpoint=str(into))        # model, optimizer, scheduler, RNG and step
    assert trainer.state.global_step == 6
    resumed = trainer.model.state_dict()
    assert set(uninterrupted) <= set(resumed)
    assert [k for k in uninterrupted if not torch.equal(resumed[k], uninterrupted[k])] == []


def test_lightning_resumes_from_a_restored_checkpoint(tmp_path: Path, sqlite_catalog, sqlite_catalog_url, capsys):
    """Lightning's own `fit(ckpt_path=...)` on the restored folder: weights, optimizer state, scheduler
    and step are the step-4 checkpoint's, bit for bit; training then carries on to step 6."""
    import pytorch_lightning as pl

    durable = (tmp_path / "durable").as_uri()
    io = SafepointCheckpointIO(run="pl")
    lightning_run(tmp_path / "node", steps=4, every=2, plugins=[io])
    for folder in io.sealed:
        assert ingest(folder, [durable], sqlite_catalog, Config()).state is CS.VERIFIED
    (written,) = io.sealed[-1].glob("*.ckpt")
    saved = torch.load(written, weights_only=False)   # our own file, read as Lightning writes it

    shutil.rmtree(tmp_path / "node")
    into = tmp_path / "restored"
    assert restore_cli(sqlite_catalog_url, "pl", into, capsys)["step"] == 4
    (ckpt,) = into.glob("*.ckpt")

    module, trainer = _fit(pl, tmp_path / "again", steps=4, ckpt_path=ckpt)  # restores, then nothing to do
    assert trainer.global_step == 4
    assert [k for k, v in saved["state_dict"].items() if not torch.equal(module.state_dict()[k], v)] == []
    opt = trainer.optimizers[0].state_dict()["state"]
    want = saved["optimizer_states"][0]["state"]
    assert opt.keys() == want.keys()
    assert [(p, k) for p in want for k in want[p] if not torch.equal(opt[p][k], want[p][k])] == []
    assert trainer.lr_scheduler_configs[0].scheduler.state_dict() == saved["lr_schedulers"][0]

    _, trainer = _fit(pl, tmp_path / "resumed", steps=6, ckpt_path=ckpt)
    assert trainer.global_step == 6


def _fit(pl, root: Path, *, steps: int, ckpt_path: Path):
    torch.manual_seed(0)
    module = _lightning_module()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=root)
    trainer.fit(module, ckpt_path=str(ckpt_path))
    return module, trainer
