"""torch.distributed.checkpoint (DCP) and torchtitan: seal each `step-N/` folder once it is complete.

Two ways, by who calls `dcp.save`:

    # your loop calls DCP: save and seal in one call (every rank calls it; rank 0 seals)
    from safepoint.integrations import dcp as sp_dcp
    sp_dcp.save(state_dict, "ckpt", run="my-run", step=step)

    # torchtitan's CheckpointManager writes `<dump_folder>/checkpoint/step-N/`: after each save
    # (or from a side process), seal every finished folder
    sp_dcp.seal_finished("outputs/checkpoint", run="my-run")

    # torch's own dcp.async_save: sealed in the background once the save has finished
    sealed = sp_dcp.async_save(state_dict, "ckpt", run="my-run", step=step)   # instead of dcp.async_save
    sealed = sp_dcp.seal_when_saved(dcp.async_save(state_dict, checkpoint_id=folder), folder, run="my-run",
                                    step=step)                                # or around your own call

DCP writes `.metadata` last, after every rank's `.distcp` data, so a folder with `.metadata` is
finished (async saves included); one without is still being written and is left alone. An async save
is sealed by rank 0 when torch's future completes (every rank's data written, then `.metadata`): the
future Safepoint returns completes once the folder is sealed, and fails if the save or the seal did.
Saving a step again into its sealed folder (a resumed run) re-seals it: the old seal goes first.
To resume: `sp_dcp.load(state_dict, safepoint.restore(run, into))` (`dcp.load`, and the restored
checkpoint becomes the parent of the next one saved), or point
torchtitan's `checkpoint.folder` at the restored folder's parent. A multi-node restart restores
each node's own part: `sp_dcp.restore(run, "ckpt/step-{step}", node=NODE, world_size=WORLD)`
(the whole checkpoint instead when the world size changed: a reshard; see `restore`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from safepoint.integrations.sealing import (
    SealOptions,
    note_resumed_from,
    seal_and_announce,
    step_of_folder,
    unseal_before_write,
)
from safepoint.local.snapshot import is_committed
from safepoint.validation.loaders.dcp import METADATA_NAME

__all__ = ["async_save", "load", "restore", "save", "seal_finished", "seal_when_saved"]

log = logging.getLogger("safepoint.integrations")


def _is_sealer(process_group: Any = None) -> bool:
    """Rank 0 of the group (or the only process) seals."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank(process_group) == 0 if process_group is not None else dist.get_rank() == 0


def save(state_dict: dict[str, Any], root: str | os.PathLike, *, run: str, step: int, emit_to: Sequence[str] = (),
         node: str | None = None, process_group: Any = None, **dcp_kwargs: Any) -> Path:
    """`dcp.save(state_dict)` into `root/step-N`, wait for every rank, seal on rank 0. Returns the folder."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    folder = Path(root) / f"step-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        unseal_before_write(folder)  # a step saved again: its old seal goes before any new byte
    if distributed:
        dist.barrier(group=process_group)
    dcp.save(state_dict, checkpoint_id=str(folder), process_group=process_group, **dcp_kwargs)
    if distributed:
        dist.barrier(group=process_group)
    if not distributed or dist.get_rank() == 0:
        seal_and_announce(folder, step, SealOptions(run, tuple(emit_to), node))
    if distributed:
        dist.barrier(group=process_group)  # nobody moves on before the seal
    return folder


def seal_when_saved(saving: Any, folder: str | os.PathLike, *, run: str, step: int, emit_to: Sequence[str] = (),
                    node: str | None = None, strict: bool = True, process_group: Any = None) -> Future:
    """Seal `folder` once torch's `dcp.async_save` (its Future, or AsyncSaveResponse) has finished.

    Call it on every rank with what `dcp.async_save` returned. Rank 0 seals, in the thread that finishes
    the save, and only a folder whose `.metadata` is there (DCP writes it last, after every rank's data).
    Returns a Future: the sealed folder on rank 0, None on the others (and where a seal failed that
    was not `strict`); it fails with the save's error,
    or with the seal's (`CommitError`, or `FileNotFoundError` for a save that left no `.metadata`)."""
    done: Future = Future()
    upload = getattr(saving, "upload_completion", saving)  # AsyncSaveResponse: its upload future
    target = Path(folder)
    options = SealOptions(run, tuple(emit_to), node, strict=strict)
    sealer = _is_sealer(process_group)

    def finished(f: Future) -> None:
        try:
            f.result()
            if sealer:
                if not (target / METADATA_NAME).is_file():
                    raise FileNotFoundError(f"{target}: the async save finished without {METADATA_NAME}: not sealed")
                sealed = seal_and_announce(target, step, options) is not None  # False: not strict, logged
                done.set_result(target if sealed else None)
            else:
                done.set_result(None)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            if sealer:
                log.error("safepoint: %s (step %s) not sealed: %s", target, step, e)
            done.set_exception(e)

    upload.add_done_callback(finished)
    return done


def async_save(state_dict: dict[str, Any], root: str | os.PathLike, *, run: str, step: int,
               emit_to: Sequence[str] = (), node: str | None = None, process_group: Any = None,
               **dcp_kwargs: Any) -> Future:
    """`dcp.async_save(state_dict)` into `root/step-N`, sealed by rank 0 once it has finished.

    Every rank calls it. Returns a Future that completes when the folder is sealed (see `seal_when_saved`):
    wait on it before the next async save, as torch asks of its own future."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    folder = Path(root) / f"step-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    if _is_sealer(process_group):
        unseal_before_write(folder)  # a step saved again: its old seal goes before any new byte
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=process_group)
    saving = dcp.async_save(state_dict, checkpoint_id=str(folder), process_group=process_group, **dcp_kwargs)
    return seal_when_saved(saving, folder, run=run, step=step, emit_to=emit_to, node=node,
                           process_group=process_group)


def load(state_dict: dict[str, Any], folder: str | os.PathLike, *, process_group: Any = None,
         **dcp_kwargs: Any) -> None:
    """`dcp.load(state_dict)` from a sealed (or restored) folder; the next `save` then names it as its parent."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state_dict, checkpoint_id=os.fspath(folder), process_group=process_group, **dcp_kwargs)
    note_resumed_from(folder)


def seal_finished(root: str | os.PathLike, *, run: str, emit_to: Sequence[str] = (), node: str | None = None,
                  strict: bool = True) -> list[Path]:
    """Seal every finished, unsealed `step-N` folder under root (torchtitan's layout); the ones sealed now."""
    sealed: list[Path] = []
    options = SealOptions(run, tuple(emit_to), node, strict=strict)
    folders = [p for p in Path(root).iterdir() if p.is_dir() and step_of_folder(p) is not None]
    for folder in sorted(folders, key=lambda p: step_of_folder(p) or 0):
        if is_committed(folder) or not (folder / METADATA_NAME).is_file():
            continue
        if seal_and_announce(folder, step_of_folder(folder) or 0, options) is not None:
            sealed.append(folder)
    return sealed


# -- the restore side (a fleet restart) ----------------------------------------------------------

def restore(run: str, into: str | os.PathLike, *, node: str | None = None, world_size: int | None = None,
            step: int | None = None, **restore_kwargs: Any) -> Any:
    """Bring back what this node's ranks will `dcp.load`: its own part for a same-topology restart,
    the whole checkpoint for a reshard. Returns safepoint.restore's RestoreResult (a path).

    Same topology (`world_size` is the checkpoint's, or not given, and `node` given): each rank
    reads only the `__<rank>_*.distcp` files it wrote and `.metadata`, so the node's part is enough
    and the fleet moves only what it lost. Another world size: DCP reshards at load time, where each
    new rank reads every saved shard that overlaps what it now owns, which `.metadata`'s plan decides
    per tensor; any file may be needed, so the node gets the whole checkpoint. Run it once per node,
    every node without `step`: all get the same step or exit 1 (docs/fleet-restore.md).
    """
    from safepoint.ops.restore import choose
    from safepoint.ops.restore import restore as restore_op

    if node is not None and world_size is not None:
        from safepoint.catalog.lite import open_fast
        from safepoint.core.config import load_config

        config = restore_kwargs.setdefault("config", load_config())
        catalog = restore_kwargs.setdefault("catalog", open_fast(config.catalog_url))
        chosen = choose(catalog, run, step, min_replicas=restore_kwargs.get("min_replicas", 1))
        if chosen.world_size != world_size:  # a reshard: every rank may read any shard
            return restore_op(run, into, chosen.step, **restore_kwargs)
    return restore_op(run, into, step, node=node, **restore_kwargs)
