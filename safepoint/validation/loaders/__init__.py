"""One loader per checkpoint format behind one interface: iter_file_tensors(path) -> (name, tensor).

Formats: torch.save files (weights-only unpickler), safetensors (header checked first), DCP folders
(restricted metadata unpickler, chunks read directly). Every loader raises LoadError for a fatal
problem and passes non-fatal ones (one tensor, one referenced file) to `on_problem`.

`iter_file_leaves(path)` is the streaming form validation uses: (name, TensorSource or plain value)
per leaf, where a TensorSource is read piece by piece when asked (bounded memory), and names follow
DCP's flattening (`optimizer.param_groups.0.params`) whatever the format.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from safepoint.validation.loaders.base import (
    Limits,
    LoadedTensor,
    LoadError,
    OnProblem,
    Problem,
    TensorSource,
    iter_leaves,
    iter_tensors,
    one_line,
    raise_problem,
)
from safepoint.validation.loaders.dcp import (
    METADATA_NAME,
    DcpCheckpoint,
    is_dcp_folder,
    iter_dcp_tensors,
    read_metadata,
)
from safepoint.validation.loaders.safetensors_file import (
    is_safetensors_file,
    iter_safetensors_leaves,
    iter_safetensors_tensors,
    read_header,
)
from safepoint.validation.loaders.torchsave import (
    is_torch_file,
    iter_torch_leaves,
    iter_torch_tensors,
    load_torch,
    torch_load_safely,
)

TORCH = "torch"
SAFETENSORS = "safetensors"
DCP = "dcp"


def detect_format(path: str | os.PathLike) -> str | None:
    """'torch', 'safetensors', 'dcp' (a folder with .metadata, or the .metadata file) or None."""
    p = Path(path)
    if p.is_dir():
        return DCP if is_dcp_folder(p) else None
    if p.name == METADATA_NAME:
        return DCP
    if is_safetensors_file(p):
        return SAFETENSORS
    if is_torch_file(p):
        return TORCH
    return None


def iter_file_tensors(
    path: str | os.PathLike, *, limits: Limits = Limits(), on_problem: OnProblem = raise_problem,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (dotted name, tensor) for every tensor of a checkpoint file or DCP folder.

    Raises LoadError when the file cannot be validated at all, or when a format is not recognized.
    """
    fmt = detect_format(path)
    if fmt == TORCH:
        yield from iter_torch_tensors(path, limits)
    elif fmt == SAFETENSORS:
        yield from iter_safetensors_tensors(path, limits, on_problem)
    elif fmt == DCP:
        yield from iter_dcp_tensors(path, limits, on_problem)
    else:
        raise LoadError(Problem.UNLOADABLE, f"{os.fspath(path)}: not a recognized checkpoint format")


def iter_file_leaves(
    path: str | os.PathLike, *, limits: Limits = Limits(), on_problem: OnProblem = raise_problem,
) -> Iterator[tuple[str, Any]]:
    """Yield (dotted name, TensorSource or plain value) for every leaf of a checkpoint file or DCP folder.

    Nothing is materialized: tensor data is read when a TensorSource's pieces are iterated.
    Raises LoadError when the file cannot be validated at all, or when a format is not recognized.
    """
    fmt = detect_format(path)
    if fmt == TORCH:
        yield from iter_torch_leaves(path, limits)
    elif fmt == SAFETENSORS:
        yield from iter_safetensors_leaves(path, limits, on_problem)
    elif fmt == DCP:
        yield from DcpCheckpoint.open(path, limits).iter_leaves(on_problem)
    else:
        raise LoadError(Problem.UNLOADABLE, f"{os.fspath(path)}: not a recognized checkpoint format")


__all__ = [
    "DCP", "SAFETENSORS", "TORCH", "DcpCheckpoint", "Limits", "LoadError", "LoadedTensor", "OnProblem", "Problem",
    "TensorSource", "detect_format", "iter_file_leaves", "iter_file_tensors", "iter_leaves", "iter_tensors",
    "load_torch", "one_line", "raise_problem", "read_header", "read_metadata", "torch_load_safely",
]
