"""What every loader shares: limits, problem kinds, the load error, and the tensor walker."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

MiB = 1024 * 1024


class Problem(str, Enum):
    """Why a file or a tensor failed validation."""

    NAN = "nan"                  # a tensor holds NaN values
    INF = "inf"                  # a tensor holds +/-inf values
    UNLOADABLE = "unloadable"    # the loader failed (truncated, corrupt, unsupported)
    UNSAFE = "unsafe"            # loading would run code or escape the folder: refused
    MALFORMED = "malformed"      # the bytes break the format (bad header, bad offsets, bad metadata)
    MISSING = "missing"          # a file the snapshot needs is absent

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Limits:
    """Bounds on what validation will read or allocate for one file (bounded memory)."""

    max_safetensors_header_bytes: int = 100 * MiB
    max_dcp_metadata_bytes: int = 512 * MiB
    max_dcp_bytes_entry: int = 64 * MiB       # a non-tensor DCP entry (e.g. param_groups)
    max_tensor_bytes: int | None = None       # refuse to materialize a bigger tensor (None: no limit)
    stats_chunk_elems: int = 1 << 22          # elements per chunk when computing stats
    max_nesting: int = 200                    # depth of nested dicts/lists walked in a loaded object


class LoadError(Exception):
    """A file (or one tensor of it) could not be validated; `problem` says why, message is one line."""

    def __init__(self, problem: Problem, message: str, *, file: str | None = None, tensor: str | None = None):
        super().__init__(message)
        self.problem = problem
        self.message = message
        self.file = file
        self.tensor = tensor


# on_problem(LoadError) receives non-fatal problems (one tensor, one referenced file) and lets the
# loader continue; a fatal problem is raised instead.
OnProblem = Callable[[LoadError], None]


def raise_problem(err: LoadError) -> None:
    raise err


def one_line(exc: BaseException, limit: int = 300) -> str:
    """A short one-line description of an exception (no tracebacks, no paragraphs)."""
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    boiler = ("Weights only load failed", "Please file an issue", "Check the documentation", "In PyTorch 2.6")
    useful = [ln for ln in lines if not ln.startswith(boiler)]
    msg = (useful or lines or [""])[0]
    if msg.startswith("WeightsUnpickler error:"):
        msg = msg[len("WeightsUnpickler error:"):].strip() or (useful[1] if len(useful) > 1 else msg)
    msg = f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def join_name(prefix: str, key: Any) -> str:
    key = str(key)
    return f"{prefix}.{key}" if prefix else key


def iter_tensors(obj: Any, prefix: str = "", *, max_nesting: int = 200) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (dotted name, tensor) for every tensor in nested dicts, lists and tuples.

    `{"optimizer": {"state": {3: {"exp_avg_sq": t}}}}` yields `("optimizer.state.3.exp_avg_sq", t)`.
    Cycles are visited once; nesting deeper than `max_nesting` raises LoadError(MALFORMED).
    """
    seen: set[int] = set()

    def walk(o: Any, name: str, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(o, torch.Tensor):
            yield name, o
            return
        if isinstance(o, (dict, list, tuple)):
            if depth > max_nesting:
                raise LoadError(Problem.MALFORMED, f"{name or '<root>'}: nested deeper than {max_nesting} levels")
            if id(o) in seen:
                return
            seen.add(id(o))
            items = o.items() if isinstance(o, dict) else enumerate(o)
            for k, v in items:
                yield from walk(v, join_name(name, k), depth + 1)

    yield from walk(obj, prefix, 0)


def file_size(path: str | os.PathLike) -> int:
    return os.stat(path).st_size
