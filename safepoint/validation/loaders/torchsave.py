"""torch.save files, loaded only with the weights-only unpickler (never plain pickle).

For validation the zip format is memory-mapped (`mmap=True`): the pickle is read, tensor data is
not; each tensor is then read in place, piece by piece, and its pages are released as soon as they
have been read (safepoint.validation.loaders.mapped), so peak memory does not grow with the file. The legacy
and tar formats cannot be mapped and are loaded whole.
"""

from __future__ import annotations

import os
import pickle
import tarfile
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from safepoint.validation.loaders.allowlist import dangerous, globals_in_message, refused_globals, scoped_safe_globals
from safepoint.validation.loaders.base import (
    Limits,
    LoadedTensor,
    LoadError,
    Problem,
    iter_leaves,
    iter_tensors,
    one_line,
)
from safepoint.validation.loaders.mapped import MappedFile
from safepoint.validation.problems import ZIP_MAGIC

TORCH_SUFFIXES = frozenset({".pt", ".pth", ".bin", ".ckpt", ".tar"})
# The legacy (pre-1.6) format starts with pickle protocol 2 and LONG1 of torch's magic number.
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
# Weights-only refusals that mean "this pickle wants to call or build something not allowed".
_UNSAFE_HINTS = ("GLOBAL", "global", "Unsupported class", "reduce", "blocked", "not allowed")


def sniff_torch(path: str | os.PathLike) -> str | None:
    """'zip', 'legacy' or 'tar' when the content looks like torch.save output, else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(LEGACY_MAGIC))
        if head.startswith(ZIP_MAGIC):
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
            return "zip" if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names) else None
        if head.startswith(LEGACY_MAGIC):
            return "legacy"
        if tarfile.is_tarfile(path):
            with tarfile.open(path) as t:
                names = set(t.getnames())
            return "tar" if {"pickle", "storages", "tensors"} <= names else None
    except (OSError, zipfile.BadZipFile, tarfile.TarError, ValueError):
        return None
    return None


def is_torch_file(path: str | os.PathLike) -> bool:
    """By name (.pt .pth .bin .ckpt; .tar only when its content is torch's) or by content."""
    suffix = Path(path).suffix.lower()
    if suffix in TORCH_SUFFIXES and suffix != ".tar":
        return True
    return sniff_torch(path) is not None


def load_torch(path: str | os.PathLike) -> object:
    """torch.load a file with weights_only=True (mmap for the zip format). Raises LoadError."""
    return torch_load_safely(path, mmap=sniff_torch(path) == "zip")


def torch_load_safely(source: str | os.PathLike | IO[bytes], *, mmap: bool = False) -> object:
    """torch.load(source, map_location="cpu", weights_only=True), with the numpy allow-list
    (safepoint.validation.loaders.allowlist); any failure becomes a LoadError.

    A refusal is OPAQUE (not loaded, not damage) when the pickle names no global that could run
    code, UNSAFE when it does.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with scoped_safe_globals():
                return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        text = str(e)
        if any(k in text for k in _UNSAFE_HINTS):
            raise _refusal(source, e) from None
        if "Weights only load failed" in text:
            raise LoadError(Problem.UNLOADABLE, f"corrupt or unsupported pickle: {one_line(e)}") from None
        raise LoadError(Problem.UNLOADABLE, f"corrupt pickle: {one_line(e)}") from None
    except EOFError as e:
        raise LoadError(Problem.UNLOADABLE, f"truncated: {one_line(e)}") from None
    except MemoryError:
        raise LoadError(Problem.UNLOADABLE, "out of memory while loading") from None
    except Exception as e:  # torch raises RuntimeError/ValueError/KeyError/... for corrupt files
        raise LoadError(Problem.UNLOADABLE, f"torch.load failed: {one_line(e)}") from None


def _refusal(source: str | os.PathLike | IO[bytes], e: Exception) -> LoadError:
    names = refused_globals(source)
    if names is None:
        names = globals_in_message(str(e))
    bad = dangerous(names)
    if bad or not names or "blocked" in str(e):
        return LoadError(Problem.UNSAFE, f"refused by the weights-only unpickler: {one_line(e)}")
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return LoadError(Problem.OPAQUE, f"not loaded: opaque pickle (names {shown})")


def iter_torch_tensors(path: str | os.PathLike, limits: Limits = Limits()) -> Iterator[tuple[str, torch.Tensor]]:
    obj = load_torch(path)
    yield from iter_tensors(obj, max_nesting=limits.max_nesting)


def iter_torch_leaves(path: str | os.PathLike, limits: Limits = Limits()) -> Iterator[tuple[str, Any]]:
    """(dotted name, LoadedTensor or plain value) for every leaf of a torch.save file.

    Tensors of the zip format stay memory-mapped: nothing is read until a piece is asked for, and
    each piece's pages are released after use.
    """
    mapped = sniff_torch(path) == "zip"
    obj = torch_load_safely(path, mmap=mapped)
    release = MappedFile.of(path).release if mapped else None
    for name, leaf in iter_leaves(obj, max_nesting=limits.max_nesting):
        yield name, (LoadedTensor(leaf, release) if isinstance(leaf, torch.Tensor) else leaf)
