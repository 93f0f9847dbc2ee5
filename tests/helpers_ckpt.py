"""Make real checkpoints in temporary folders, for tests (reusable by any test module).

Every helper writes a real checkpoint with the real tool (torch.save, safetensors, DCP) from a small
model trained for a couple of real optimizer steps, so tests see the files training would write.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import zlib
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn

__all__ = [
    "DCP_SHARDED_KEY",
    "dcp_sharded_reference",
    "make_dcp_ckpt",
    "make_malicious_pickle",
    "make_safetensors_ckpt",
    "make_torch_save_ckpt",
    "small_model",
    "trained_model_and_optimizer",
]

# The DCP key of the DTensor sharded across ranks (row-wise) in make_dcp_ckpt.
DCP_SHARDED_KEY = "extra.sharded"


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def trained_model_and_optimizer(seed: int = 0, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small nn.Linear stack and its AdamW optimizer after `steps` real training steps."""
    model = small_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=gen)
        y = torch.randn(32, 4, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def seed_for(folder: Path, seed: int | None) -> int:
    """`seed`, or one derived from the folder's last two names: checkpoints in different folders (steps)
    hold different states, as training writes them. The same state under a later step is a finding of
    its own (safepoint.rules.consistency: duplicate); a test that wants it passes the same `seed`."""
    if seed is not None:
        return seed
    return zlib.crc32(f"{folder.parent.name}/{folder.name}".encode()) % 100_000


def make_torch_save_ckpt(
    folder: str | os.PathLike,
    *,
    nan_in_optimizer: bool = False,
    inf_in_weight: bool = False,
    seed: int | None = None,
    name: str = "model.pt",
) -> Path:
    """torch.save({"model", "optimizer", "step"}) of a trained model; returns the file path.

    nan_in_optimizer puts 3 NaNs in optimizer.state[0]["exp_avg_sq"]; inf_in_weight puts one inf
    in model["0.weight"]. `seed`: see seed_for.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model, opt = trained_model_and_optimizer(seed_for(folder, seed))
    sd = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2}
    if nan_in_optimizer:
        sd["optimizer"]["state"][0]["exp_avg_sq"].view(-1)[:3] = float("nan")
    if inf_in_weight:
        sd["model"]["0.weight"][0, 0] = float("inf")
    path = folder / name
    torch.save(sd, path)
    return path


def make_safetensors_ckpt(folder: str | os.PathLike, *, seed: int | None = None,
                          name: str = "model.safetensors") -> Path:
    """safetensors.torch.save_file of a trained model's state_dict (plus a bf16 tensor); returns the path.
    `seed`: see seed_for."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model, _ = trained_model_and_optimizer(seed_for(folder, seed))
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    tensors["extra.bf16"] = torch.linspace(-2, 2, 10).to(torch.bfloat16)
    path = folder / name
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def dcp_sharded_reference() -> torch.Tensor:
    """The full (global) value of the DTensor that make_dcp_ckpt shards across ranks."""
    return torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) / 7.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dcp_worker(rank: int, world_size: int, init_method: str, folder: str, seed: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        model, opt = trained_model_and_optimizer(seed)
        # Shard one parameter row-wise and the reference tensor: each rank writes its own shard.
        sharded_weight = distribute_tensor(model.state_dict()["0.weight"].detach().clone(), mesh, [Shard(0)])
        state = {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "extra": {
                "sharded": distribute_tensor(dcp_sharded_reference(), mesh, [Shard(0)]),
                "sharded_weight": sharded_weight,
                "step": 2,
            },
        }
        dcp.save(state, checkpoint_id=folder)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def make_dcp_ckpt(folder: str | os.PathLike, world_size: int = 2, *, seed: int | None = None) -> Path:
    """Save a DCP checkpoint from `world_size` real ranks (gloo on CPU); returns the folder.

    The state holds the model state_dict and AdamW state_dict (replicated, deduplicated by DCP)
    and two DTensors sharded row-wise over a 1-D mesh: DCP_SHARDED_KEY (== dcp_sharded_reference())
    and "extra.sharded_weight" (== model "0.weight"). Each rank writes its own `__<rank>_0.distcp`.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{Path(tmp) / 'pg-init'}"
        mp.spawn(_dcp_worker, args=(world_size, init_method, str(folder), seed_for(folder, seed)),
                 nprocs=world_size, join=True)
    return folder


class _Sentinel:
    """Unpickling this calls os.system("touch <sentinel>"): what a malicious checkpoint does."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return (os.system, (f"touch '{self.sentinel}'",))


def make_malicious_pickle(path: str | os.PathLike, sentinel: str | os.PathLike) -> Path:
    """torch.save a payload whose unpickling would create `sentinel` (os.system). Returns `path`.

    A safe loader must refuse it; the sentinel file must never appear.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"x": _Sentinel(Path(sentinel)), "w": torch.ones(2)}, path, pickle_protocol=2)
    return path


def seal_node_part(folder: Path, run: str, step: int, node: str, ranks, world: int) -> Path:
    """Commit `folder` as node `node`'s part (ranks `ranks` of `world`); rank 0's node also writes the
    shared config.json every rank reads."""
    from safepoint import commit

    if 0 in ranks:
        (folder / "config.json").write_text(json.dumps({"world_size": world}))
    commit(folder, run, step, world_size=world, ranks=list(ranks), node=node)
    return folder
