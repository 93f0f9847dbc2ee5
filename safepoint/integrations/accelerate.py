"""Accelerate: `Accelerator.save_state` into `step-N/`, sealed once every process has written.

    from safepoint.integrations.accelerate import save_state
    save_state(accelerator, "ckpt", run="my-run", step=step)

Accelerate writes `model.safetensors`, `optimizer.bin`, `scheduler.bin` and one
`random_states_<rank>.pkl` per process (numpy and Python RNG state, loaded through Safepoint's
allow-list). Saving a step again into its sealed folder (a resumed run) re-seals it: the old seal goes
first. To resume: `accelerator.load_state(os.fspath(safepoint.restore(run, into)))` (the restore is then
the lineage parent of the next checkpoint saved here).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safepoint.integrations.sealing import SealOptions, note_resumed_from, seal_and_announce, unseal_before_write

__all__ = ["load_state", "save_state"]


def save_state(accelerator: Any, root: str | os.PathLike, *, run: str, step: int, emit_to: Sequence[str] = (),
               node: str | None = None, **kwargs: Any) -> Path:
    """accelerator.save_state(root/step-N), wait for everyone, seal on the main process. Returns the folder."""
    folder = Path(root) / f"step-{step}"
    if accelerator.is_main_process:
        unseal_before_write(folder)
    accelerator.wait_for_everyone()  # nobody writes into a folder that is still sealed
    accelerator.save_state(str(folder), **kwargs)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        seal_and_announce(folder, step, SealOptions(run, tuple(emit_to), node))
    accelerator.wait_for_everyone()
    return folder


def load_state(accelerator: Any, folder: str | os.PathLike, **kwargs: Any) -> None:
    """accelerator.load_state(folder); when it is sealed (or restored), the next save names it as parent."""
    accelerator.load_state(os.fspath(folder), **kwargs)
    note_resumed_from(folder)
