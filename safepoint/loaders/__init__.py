"""One loader per checkpoint format behind one interface: iter_file_tensors(path) -> (name, tensor).

Formats: torch.save files (weights-only unpickler), safetensors (header checked first), DCP folders
(restricted metadata unpickler, chunks read directly). Every loader raises LoadError for a fatal
problem and passes non-fatal ones (one tensor, one referenced file) to `on_problem`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch

from safepoint.loaders.base import (
    Limits,
    LoadError,
    OnProblem,
    Problem,
    iter_tensors,
    one_line,
    raise_problem,
)
from safepoint.loaders.dcp import METADATA_NAME, DcpCheckpoint, is_dcp_folder, iter_dcp_tensors, read_metadata
from safepoint.loaders.safetensors_file import is_safetensors_file, iter_safetensors_tensors, read_header
from safepoint.loaders.torchsave import is_torch_file, iter_torch_tensors, load_torch, torch_load_safely

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


__all__ = [
    "DCP", "SAFETENSORS", "TORCH", "DcpCheckpoint", "Limits", "LoadError", "OnProblem", "Problem", "detect_format",
    "iter_file_tensors", "iter_tensors", "load_torch", "one_line", "raise_problem", "read_header", "read_metadata",
    "torch_load_safely",
]
