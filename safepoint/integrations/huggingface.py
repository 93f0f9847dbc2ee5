"""Hugging Face `Trainer`: seal every `checkpoint-N/` folder as soon as the Trainer has written it.

    from safepoint.integrations.huggingface import SafepointCallback
    trainer = Trainer(..., callbacks=[SafepointCallback(run="my-run")])

`on_save` fires after the Trainer wrote the model (safetensors, sharded or not), `optimizer.pt`,
`scheduler.pt`, `rng_state*.pth`, `trainer_state.json` and `training_args.bin`. The folder is sealed
under `state.global_step`, the step `trainer_state.json` records (validation checks the two agree).
With several processes every rank waits for the others to finish writing, then the main process
(the local main one with `save_on_each_node`) seals.

Resuming into the same `output_dir` (the ordinary HF way) re-saves `checkpoint-N` folders that are
already sealed: `on_step_end` / `on_epoch_end` take the old seal away before the Trainer writes, and
`on_save` seals the new bytes (a new version in the catalog). A resumed Trainer's checkpoints name
their lineage parent: the one it resumed from, then the one before.

`keep_local=N` is the retention to use instead of `save_total_limit` (which makes the Trainer delete
older folders itself, ingested or not; the callback warns once): the newest N verified checkpoints
and any newer stay, and an older `checkpoint-N/` goes only once it has a verified replica
(safepoint.integrations.keep_local, in a child process, after each seal; `on_train_end` waits for it).

To resume: `trainer.train(resume_from_checkpoint=os.fspath(safepoint.restore(run, into)))`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from safepoint.core import resumed
from safepoint.integrations.keep_local import LocalRetention
from safepoint.integrations.sealing import SealOptions, note_resumed_from, seal_and_announce, unseal_before_write

__all__ = ["SafepointCallback"]

log = logging.getLogger("safepoint.integrations")


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class SafepointCallback(TrainerCallback):
    """Seal each `checkpoint-N` the Trainer saves as checkpoint (run, N); optionally emit the event.

    `keep_local=N`: remove older local folders once a newer checkpoint is verified and the old one has a
    verified replica (`catalog`: the catalog URL, default `SAFEPOINT_CATALOG_URL` or the config's)."""

    def __init__(self, run: str, *, emit_to: Sequence[str] = (), node: str | None = None, workers: int = 2,
                 strict: bool = True, keep_local: int | None = None, catalog: str | None = None) -> None:
        self.options = SealOptions(run, tuple(emit_to), node, workers, strict)
        self.sealed: list[Path] = []
        self.warned_rotation = False
        self.retention = LocalRetention(keep_local, catalog=catalog) if keep_local is not None else None

    def checkpoint_folder(self, args: Any, state: Any) -> Path:
        return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        limit = getattr(args, "save_total_limit", None)
        if limit and not self.warned_rotation and state.is_world_process_zero:
            self.warned_rotation = True
            log.warning("safepoint: save_total_limit=%s makes the Trainer delete checkpoint folders itself, "
                        "ingested or not, so a checkpoint can be lost before it is replicated. Set "
                        "save_total_limit=None and SafepointCallback(..., keep_local=N): older local folders "
                        "then go only once a newer checkpoint is verified and they have a verified replica",
                        limit)
        if state.global_step > 0:  # resumed: the next checkpoint follows the one the Trainer resumed from
            point = resumed.resumed_point()
            if point is not None and point[1] == state.global_step:
                return  # safepoint.restore noted it, with its run
            chosen = getattr(args, "resume_from_checkpoint", None)
            folder = Path(chosen) if isinstance(chosen, str) and chosen else self.checkpoint_folder(args, state)
            if note_resumed_from(folder) is None:
                resumed.note_resumed(self.options.run, state.global_step)

    def _unseal_if_saving(self, args: Any, state: Any, control: Any) -> None:
        """The Trainer saves right after this event: a sealed folder of that step loses its seal first."""
        if not getattr(control, "should_save", False):
            return
        sealer = state.is_local_process_zero if getattr(args, "save_on_each_node", False) \
            else state.is_world_process_zero
        if sealer:
            unseal_before_write(self.checkpoint_folder(args, state))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._unseal_if_saving(args, state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._unseal_if_saving(args, state, control)

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
        if seal_and_announce(folder, state.global_step, self.options) is not None:
            self.sealed.append(folder)
            if self.retention is not None:
                self.retention.after_seal(folder.parent)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.retention is not None:
            self.retention.finish()  # the last pass, waited for: the trainer's folders end as keep_local says
