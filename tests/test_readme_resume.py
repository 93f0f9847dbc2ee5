"""The README's resume lines, run as written: each one restores the verified checkpoint into
`resume/` and the stock trainer's own loader takes the result as it is (RestoreResult is a path:
`str`, `os.fspath` and `/` give the restored folder). The LINES below are the README's, verbatim."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import safepoint
from safepoint.core import resumed
from safepoint.core.config import Config
from safepoint.core.states import CheckpointState as CS
from safepoint.integrations import dcp as sp_dcp
from safepoint.integrations.accelerate import load_state, save_state
from safepoint.integrations.huggingface import SafepointCallback
from safepoint.integrations.lightning import SafepointCheckpointIO, sealed_checkpoint
from safepoint.ops.ingest import ingest
from tests.helpers_trainers import (
    _lightning_module,
    _Tokens,
    accelerate_train,
    hf_trainer_run,
    lightning_run,
    tiny_gpt2,
    torchtitan_style_dcp,
)

HF = 'trainer.train(resume_from_checkpoint=str(safepoint.restore("my-run", "resume/")))'
LIGHTNING = 'trainer.fit(model, ckpt_path=sealed_checkpoint(safepoint.restore("my-run", "resume/")))'
DCP = 'sp_dcp.load(state_dict, safepoint.restore("my-run", "resume/"))'
ACCELERATE = 'load_state(accelerator, safepoint.restore("my-run", "resume/"))'
PYTHON = ['r = safepoint.restore("my-run", "resume/")',
          'trainer.train(resume_from_checkpoint=str(r))']


def test_the_lines_are_the_readmes() -> None:
    """Each trainer's resume line here is the README's, word for word (tests/test_readme.py runs them there too)."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for line in (HF, LIGHTNING, DCP, ACCELERATE):
        assert f"\n{line}  # to resume\n" in text, line


@pytest.fixture
def here(tmp_path: Path, monkeypatch, sqlite_catalog):
    resumed.forget()
    monkeypatch.chdir(tmp_path)
    yield sqlite_catalog
    resumed.forget()


def _ingested(folders, catalog, tmp_path: Path) -> None:
    for f in folders:
        assert ingest(f, [(tmp_path / "durable").as_uri()], catalog, Config()).state is CS.VERIFIED


def _hf_trainer(out: Path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(out), max_steps=4, save_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-3, use_cpu=True, report_to=[], disable_tqdm=True,
                             dataloader_num_workers=0, save_strategy="steps")
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=_Tokens(), callbacks=[SafepointCallback("my-run")])


@pytest.mark.parametrize("lines", [[HF], PYTHON], ids=["trainers-section", "python-section"])
def test_hugging_face_line(here, tmp_path: Path, lines) -> None:
    _ingested(hf_trainer_run(tmp_path / "hf", steps=4, save_steps=2, callbacks=[SafepointCallback("my-run")]),
              here, tmp_path)
    trainer = _hf_trainer(tmp_path / "again")
    scope = {"safepoint": safepoint, "trainer": trainer}
    for line in lines:
        exec(line, scope)
    assert trainer.state.global_step == 4 and (tmp_path / "resume" / "trainer_state.json").is_file()


def test_lightning_line(here, tmp_path: Path) -> None:
    import pytorch_lightning as pl

    io = SafepointCheckpointIO(run="my-run")
    lightning_run(tmp_path / "pl", steps=4, every=2, plugins=[io])
    _ingested(io.sealed, here, tmp_path)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path / "x")
    exec(LIGHTNING, {"safepoint": safepoint, "trainer": trainer, "model": _lightning_module(),
                     "sealed_checkpoint": sealed_checkpoint})
    assert trainer.global_step == 4


def test_dcp_line(here, tmp_path: Path) -> None:
    torchtitan_style_dcp(tmp_path / "ckpt" / "step-10", step=10,
                         save=lambda state, out: sp_dcp.save(state, out.parent, run="my-run", step=10))
    _ingested([tmp_path / "ckpt" / "step-10"], here, tmp_path)
    state_dict = {"train_state": {"step": torch.tensor(0, dtype=torch.int32)}}
    exec(DCP, {"safepoint": safepoint, "sp_dcp": sp_dcp, "state_dict": state_dict})
    assert int(state_dict["train_state"]["step"]) == 10
    assert resumed.resumed_point() == ("my-run", 10)   # the next checkpoint saved names it as parent


def test_accelerate_line(here, tmp_path: Path) -> None:
    acc = accelerate_train(steps=3)
    folder = save_state(acc, tmp_path / "ckpt", run="my-run", step=3)
    want = {k: v.clone() for k, v in acc._models[0].state_dict().items()}
    _ingested([folder], here, tmp_path)
    accelerator = accelerate_train(steps=0)
    exec(ACCELERATE, {"safepoint": safepoint, "load_state": load_state, "accelerator": accelerator})
    got = accelerator._models[0].state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
