"""PyTorch Lightning: each checkpoint written into its own `step-N/` folder, and sealed there.

    import lightning.pytorch as pl            # or: import pytorch_lightning as pl
    from safepoint.integrations.lightning import SafepointCheckpointIO
    trainer = pl.Trainer(..., plugins=[SafepointCheckpointIO(run="my-run")])

Both packages work, alone or together: the unified `lightning` ships its own copy of
`lightning_fabric`'s `CheckpointIO`, and each Trainer accepts only a plugin of its own copy, so
`SafepointCheckpointIO` subclasses the copy of every package installed (`lightning` first).

`ModelCheckpoint` keeps choosing names and when to save; this CheckpointIO redirects each save of
`dirpath/epoch=0-step=100.ckpt` to `dirpath/step-100/epoch=0-step=100.ckpt` (N is the checkpoint's
own `global_step`, which validation checks against the catalog's step) and seals that folder at
once. A second save at the same step under another name (`last.ckpt`) is written where Lightning
asked, unsealed: the sealed copy is already the resume point. A save of the same file into a sealed
folder (a run resumed from an older step into the same `dirpath`) re-seals it: the old seal goes
first, then the new file, manifest and marker. Loading a checkpoint from a sealed folder (`fit(ckpt_path=...)`)
makes it the lineage parent of the next one sealed. Removing a sealed checkpoint (`save_top_k` rotation) only
removes files of folders that are not sealed: sealed ones belong to retention: `keep_local=N` removes
older sealed step folders once a newer checkpoint is verified and they have a verified replica
(safepoint.integrations.keep_local, after each seal; `teardown` at the end of `fit` waits for it).
Single-file strategies (single device, DDP) write on global rank 0 only, which is where this runs.
To resume: `trainer.fit(model, ckpt_path=sealed_checkpoint(safepoint.restore(run, into)))`.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from safepoint.core import resumed
from safepoint.integrations.keep_local import LocalRetention
from safepoint.integrations.sealing import SealOptions, note_resumed_from, seal_and_announce, unseal_before_write
from safepoint.local.snapshot import LocalSnapshot, is_committed

__all__ = ["SafepointCheckpointIO", "sealed_checkpoint", "step_folder"]

log = logging.getLogger("safepoint.integrations")

#: where each Lightning package keeps its CheckpointIO and TorchCheckpointIO, in the order Ray and
#: NVIDIA's resiliency kit try them: the unified `lightning`, then `pytorch_lightning`'s `lightning_fabric`
_PACKAGES = ("lightning.fabric.plugins.io.torch_io", "lightning_fabric.plugins.io.torch_io")


def _installed(names: Sequence[str]) -> list[ModuleType]:
    """The `torch_io` module of each Lightning package installed; a clear ImportError if none is."""
    found = []
    for name in names:
        try:
            found.append(importlib.import_module(name))
        except ModuleNotFoundError as e:
            if e.name != name.split(".")[0]:
                raise  # the package is there but broken: its own error says why
    if not found:
        raise ImportError("safepoint.integrations.lightning needs Lightning: "
                          "pip install lightning (import lightning.pytorch) or pytorch-lightning "
                          "(import pytorch_lightning)")
    return found


_IO = _installed(_PACKAGES)
CheckpointIO = _IO[0].CheckpointIO
TorchCheckpointIO = _IO[0].TorchCheckpointIO


def step_folder(path: str | os.PathLike, step: int) -> Path:
    """Where a checkpoint Lightning names `path` goes: a `step-N` folder beside it."""
    p = Path(path)
    return p.parent / f"step-{step}" / p.name


def sealed_checkpoint(folder: str | os.PathLike) -> str:
    """The `.ckpt` file of a sealed (or restored) `step-N` folder, for `fit(ckpt_path=...)`.

    The one named after its step (`epoch=E-step=N.ckpt`) where the folder holds several."""
    files = sorted(f.path for f in LocalSnapshot.open(folder).manifest.files if f.path.endswith(".ckpt"))
    if not files:
        raise FileNotFoundError(f"{os.fspath(folder)}: no .ckpt file in this checkpoint")
    named = [f for f in files if "step=" in f]
    return os.path.join(os.fspath(folder), (named or files)[0])


class SafepointCheckpointIO(*(m.CheckpointIO for m in _IO)):  # type: ignore[misc]
    """A CheckpointIO that writes through `inner` (torch.save by default) into step folders, sealed.

    A subclass of each installed package's `CheckpointIO`: `lightning.pytorch.Trainer` and
    `pytorch_lightning.Trainer` both accept it."""

    def __init__(self, run: str, *, inner: CheckpointIO | None = None, emit_to: Sequence[str] = (),
                 node: str | None = None, workers: int = 2, strict: bool = True, keep_local: int | None = None,
                 catalog: str | None = None) -> None:
        self.inner = inner or TorchCheckpointIO()
        self.options = SealOptions(run, tuple(emit_to), node, workers, strict)
        self.sealed: list[Path] = []
        self.retention = LocalRetention(keep_local, catalog=catalog) if keep_local is not None else None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        step = int(checkpoint.get("global_step", 0))
        target = step_folder(path, step)
        if is_committed(target.parent):
            if target.name not in {f.path for f in LocalSnapshot.open(target.parent).manifest.files}:
                self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
                return
            unseal_before_write(target.parent)  # the same checkpoint saved again (a resumed run): a new seal
        self.inner.save_checkpoint(checkpoint, target, storage_options=storage_options)
        if seal_and_announce(target.parent, step, self.options) is not None:
            self.sealed.append(target.parent)
            if self.retention is not None:
                self.retention.after_seal(target.parent.parent)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        loaded = self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if note_resumed_from(Path(path).parent) is None and isinstance(loaded.get("global_step"), int):
            point = resumed.resumed_point()
            if point is None or point[1] != loaded["global_step"]:
                resumed.note_resumed(self.options.run, loaded["global_step"])
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        p = Path(path)
        for folder in p.parent.glob(f"step-*/{p.name}"):
            if is_committed(folder.parent):
                log.info("safepoint: keeping sealed %s (retention decides)", folder.parent)
                return
        if p.exists():
            self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        if self.retention is not None:
            self.retention.finish()
        self.inner.teardown()
