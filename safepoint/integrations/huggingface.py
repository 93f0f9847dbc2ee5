"""Hugging Face `Trainer`: seal every `checkpoint-N/` folder as soon as the Trainer has written it.

    from safepoint.integrations.huggingface import SafepointCallback
    trainer = Trainer(..., callbacks=[SafepointCallback(run="my-run")])

`on_save` fires after the Trainer wrote the model (safetensors, sharded or not), `optimizer.pt`,
`scheduler.pt`, `rng_state*.pth`, `trainer_state.json` and `training_args.bin`, and before
`save_total_limit` rotates older folders away. The folder is sealed under `state.global_step`, the
step `trainer_state.json` records (validation checks the two agree). With several processes every
rank waits for the others to finish writing, then the main process (the local main one with
`save_on_each_node`) seals. To resume: `trainer.train(resume_from_checkpoint=str(safepoint.restore(run, into)))`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from safepoint.integrations.sealing import SealOptions, seal

__all__ = ["SafepointCallback"]

log = logging.getLogger("safepoint.integrations")


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class SafepointCallback(TrainerCallback):
    """Seal each `checkpoint-N` the Trainer saves as checkpoint (run, N); optionally emit the event."""

    def __init__(self, run: str, *, emit_to: Sequence[str] = (), node: str | None = None, workers: int = 2,
                 strict: bool = True) -> None:
        self.options = SealOptions(run, tuple(emit_to), node, workers, strict)
        self.sealed: list[Path] = []

    def checkpoint_folder(self, args: Any, state: Any) -> Path:
        return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _barrier()  # every rank's files are on disk before one of them is sealed
        sealer = state.is_local_process_zero if getattr(args, "save_on_each_node", False) \
            else state.is_world_process_zero
        if not sealer:
            return
        folder = self.checkpoint_folder(args, state)
        if not folder.is_dir():  # e.g. a hyperparameter search trial folder
            found = sorted(Path(args.output_dir).glob(f"*/{folder.name}"))
            if not found:
                log.warning("safepoint: %s not found after save; not sealed", folder)
                return
            folder = found[-1]
        if seal(folder, state.global_step, self.options) is not None:
            self.sealed.append(folder)
