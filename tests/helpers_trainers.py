"""Checkpoints written by stock trainers, with tiny models built from configs (nothing downloaded).

Each builder runs a few CPU steps and returns the folder(s) the trainer wrote, as it wrote them.
`plant(...)` helpers then damage one tensor the way a real fault would (NaN in a parameter or an
optimizer moment, inf in callback metadata), rewriting the file in its own format.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, length: int = 8, vocab: int = 64):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    return GPT2LMHeadModel(cfg)


def hf_trainer_run(out: Path, *, steps: int = 4, save_steps: int = 2, callbacks: list | None = None,
                   resume_from: str | os.PathLike | None = None, **overrides) -> list[Path]:
    """Train a tiny GPT-2 with transformers.Trainer; return its checkpoint-N folders, oldest first.

    `overrides` go to TrainingArguments (bf16, gradient_accumulation_steps, learning_rate, ...);
    `resume_from` to `train(resume_from_checkpoint=...)`."""
    from transformers import Trainer, TrainingArguments

    kw = dict(output_dir=str(out), max_steps=steps, save_steps=save_steps, per_device_train_batch_size=4,
              learning_rate=1e-3, use_cpu=True, report_to=[], logging_steps=1, disable_tqdm=True,
              dataloader_num_workers=0, save_strategy="steps")
    args = TrainingArguments(**{**kw, **overrides})
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=_Tokens(), callbacks=callbacks or [])
    trainer.train(resume_from_checkpoint=os.fspath(resume_from) if resume_from is not None else None)
    return sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))


def _lightning_module(package: str = "pytorch_lightning"):
    """A tiny regression LightningModule of `package` (`pytorch_lightning` or `lightning.pytorch`)."""
    pl = importlib.import_module(package)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"width": 8})
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
            self.register_buffer("mask", torch.full((2,), float("-inf")))  # like an attention mask buffer

        def training_step(self, batch, _idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(32, 4, generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)

    return Tiny()


def tracker_callback():
    """A Lightning callback with a tensor in its state (like ModelCheckpoint's best score)."""
    import pytorch_lightning as pl

    class Tracker(pl.Callback):
        @property
        def state_key(self) -> str:
            return "Tracker"

        def state_dict(self) -> dict:
            return {"best_loss": torch.tensor(0.5)}

        def load_state_dict(self, state: dict) -> None:
            pass

    return Tracker()


def lightning_run(root: Path, *, steps: int = 4, every: int = 2, callbacks: list | None = None,
                  plugins: list | None = None, stock_checkpoint: bool = True) -> Path:
    """Train a tiny LightningModule with AdamW and a scheduler; return the ModelCheckpoint folder."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    dirpath = root / "ckpts"
    cbs = list(callbacks or [])
    if stock_checkpoint:
        cbs.append(ModelCheckpoint(dirpath=dirpath, every_n_train_steps=every, save_top_k=-1))
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=cbs, plugins=plugins or [], default_root_dir=root)
    trainer.fit(_lightning_module())
    return dirpath


def accelerate_save_state(out: Path, *, steps: int = 3) -> Path:
    """A few AdamW steps under Accelerator(cpu=True), then save_state(out)."""
    accelerate_train(steps).save_state(str(out))
    return out


def accelerate_train(steps: int = 3):
    """An Accelerator(cpu=True) after a few AdamW steps of a tiny model (ready for save_state)."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    model, opt, sched = acc.prepare(model, opt, sched)
    for _ in range(steps):
        x = torch.randn(4, 4)
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
    return acc


def torchtitan_style_dcp(out: Path, *, step: int = 10, fault: Callable[[dict], None] | None = None,
                         save: Callable[[dict, Path], None] | None = None) -> Path:
    """A DCP checkpoint laid out the way torchtitan's CheckpointManager writes one.

    Model weights at the top level (ModelWrapper flattens them), the optimizer through
    get_optimizer_state_dict(flatten_optimizer_state_dict=True), the LR scheduler, the dataloader as
    bytes and `train_state` with the step; written with `dcp.save` (no process group), or `save`.
    `fault(state)` may damage the state dict first.
    """
    import io
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for _ in range(3):
        model(torch.randn(4, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    state: dict = dict(model.state_dict())
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    state["optimizer"] = get_optimizer_state_dict(model, opt, options=flat)
    state["lr_scheduler"] = {"lr_scheduler_0": sched.state_dict()}
    # torchtitan's dataloader: its state pickled to bytes per rank; plus raw bytes as io.BytesIO
    state["dataloader"] = {"dp_rank_0": pickle.dumps({"sample": 3}), "world_size": 1}
    state["extra"] = {"blob": io.BytesIO(b"raw-bytes")}
    state["train_state"] = {"step": torch.tensor(step, dtype=torch.int32), "ntokens_seen": torch.tensor(step * 32)}
    if fault is not None:
        fault(state)
    if save is not None:
        save(state, out)
        return out
    out.mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(out))
    return out


# ------------------------------------------------------------------------------------------ faults

def plant(path: Path, name: str, value: float) -> None:
    """Plant `value` into tensor `name` of a safetensors or torch.save file, by its suffix."""
    if path.suffix == ".safetensors":
        plant_in_safetensors(path, name, value)
    else:
        plant_in_torch_file(path, name, value)


def plant_in_safetensors(path: Path, name: str, value: float) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    t = tensors[name].clone()
    t.view(-1)[0] = value
    tensors[name] = t
    save_file(tensors, str(path), metadata={"format": "pt"})


def plant_in_torch_file(path: Path, dotted: str, value: float) -> None:
    """Set the first element of the tensor at `a.b.0.c` in a torch.save file (loaded weights-only)."""
    import numpy as np

    np_globals = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(np_globals):
        obj = torch.load(path, weights_only=True)
    node = obj
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, (list, tuple)) or (isinstance(node, dict) and int_key(node, p)) \
            else node[p]
    last = parts[-1]
    t = node[last]
    t.view(-1)[0] = value
    torch.save(obj, path)


def int_key(d: dict, p: str) -> bool:
    return p.isdigit() and int(p) in d and p not in d


def lightning_two_optimizers_module(shift: float = 0.0):
    """A LightningModule with two optimizers (a GAN-style generator and critic, manual optimization).

    `shift` moves the inputs: a resumed run with another shift writes other bytes at the same steps."""
    import pytorch_lightning as pl

    class TwoOptimizers(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.gen = torch.nn.Linear(4, 4)
            self.critic = torch.nn.Linear(4, 1)

        def training_step(self, batch, _idx):
            (x,) = batch
            x = x + shift
            g_opt, c_opt = self.optimizers()
            c_loss = (self.critic(self.gen(x).detach()) - self.critic(x)).mean()
            c_opt.zero_grad()
            self.manual_backward(c_loss)
            c_opt.step()
            g_loss = -self.critic(self.gen(x)).mean()
            g_opt.zero_grad()
            self.manual_backward(g_loss)
            g_opt.step()

        def configure_optimizers(self):
            return (torch.optim.AdamW(self.gen.parameters(), lr=1e-2),
                    torch.optim.AdamW(self.critic.parameters(), lr=1e-2))

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g)),
                                               batch_size=4)

    return TwoOptimizers()


def lightning_fit(root: Path, module, *, steps: int, every: int, plugins: list, ckpt_path: str | None = None,
                  package: str = "pytorch_lightning") -> Path:
    """fit() with a ModelCheckpoint every `every` steps into root/ckpts (resumed from `ckpt_path`), by the
    Trainer of `package` (`pytorch_lightning` or `lightning.pytorch`, the module's own)."""
    pl = importlib.import_module(package)
    ModelCheckpoint = pl.callbacks.ModelCheckpoint  # noqa: N806

    torch.manual_seed(0)
    dirpath = root / "ckpts"
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root, plugins=plugins,
                         callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=every, save_top_k=-1)])
    trainer.fit(module, ckpt_path=ckpt_path)
    return dirpath
