"""What a file in a snapshot claims to be, from its name and its first bytes, before anything loads it.

The decision that matters: a file that claims a known format (by magic bytes, or by a name only that
format uses) and does not parse is damage; a file in no known format is hashed, replicated and
verified like every byte, and reported "not loaded: unknown format", never counted as damage.

`.bin` and `.pkl` claim nothing by themselves (any tool writes them): they are torch.save files when
their bytes say so (zip with data.pkl, legacy magic), or when their name is one trainers give to
torch.save output (`pytorch_model*.bin`, `optimizer.bin`, `random_states_0.pkl`...). A bare pickle
(pickle.dump, protocol 2-5) is never unpickled: it is an opaque pickle, or UNSAFE when its opcodes
name a global that could run code (read with pickletools, which executes nothing).
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from safepoint.validation.loaders.allowlist import MAX_PICKLE_SCAN_BYTES, dangerous, globals_in_pickle
from safepoint.validation.loaders.safetensors_file import SAFETENSORS_SUFFIXES
from safepoint.validation.loaders.torchsave import LEGACY_MAGIC, ZIP_MAGIC, sniff_torch

__all__ = ["JSON", "PICKLE", "SAFETENSORS", "TORCH", "UNKNOWN", "file_kind", "holds_tensors", "pickle_globals"]

TORCH, SAFETENSORS, JSON, PICKLE, UNKNOWN = "torch", "safetensors", "json", "pickle", "unknown"

# Names only torch.save output gets (suffix or trainer file names).
TORCH_NAME_SUFFIXES = frozenset({".pt", ".pth", ".ckpt"})
TORCH_NAMES = ("pytorch_model*.bin", "optimizer*.bin", "scheduler*.bin", "scaler*.bin", "training_args.bin",
               "random_states_*.pkl", "custom_checkpoint_*.pkl", "model*.bin", "*.pt.bin")
JSON_SUFFIXES = frozenset({".json"})
# Files that normally hold model or optimizer tensors: if one is an opaque pickle, say so loudly.
TENSOR_NAMES = ("*.ckpt", "*.pt", "*.pth", "pytorch_model*.bin", "optimizer*.bin", "model*.bin")
# ...but not these, which trainers write as plain pickled objects on purpose.
OBJECT_NAMES = ("training_args.bin", "custom_checkpoint_*.pkl")


def file_kind(path: str | os.PathLike) -> str:
    """TORCH, SAFETENSORS, JSON, PICKLE (a bare pickle) or UNKNOWN. Raises OSError if unreadable."""
    p = Path(path)
    name, suffix = p.name, p.suffix.lower()
    if suffix in SAFETENSORS_SUFFIXES:
        return SAFETENSORS
    if suffix in JSON_SUFFIXES:
        return JSON
    with open(p, "rb") as f:
        head = f.read(len(LEGACY_MAGIC))
    if head.startswith(LEGACY_MAGIC) or sniff_torch(p) is not None:
        return TORCH
    if suffix in TORCH_NAME_SUFFIXES or any(fnmatch.fnmatchcase(name, pat) for pat in TORCH_NAMES):
        return TORCH
    if head.startswith(ZIP_MAGIC) and suffix in (".bin", ".pkl", ".tar"):
        return TORCH  # a zip under a torch-ish name that does not open: a broken torch.save
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return PICKLE
    return UNKNOWN


def holds_tensors(rel: str) -> bool:
    """Whether a file of this name is expected to hold tensors (model or optimizer state)."""
    name = rel.rsplit("/", 1)[-1]
    if any(fnmatch.fnmatchcase(name, pat) for pat in OBJECT_NAMES):
        return False
    return any(fnmatch.fnmatchcase(name, pat) for pat in TENSOR_NAMES)


def pickle_globals(path: str | os.PathLike, limit: int = MAX_PICKLE_SCAN_BYTES) -> tuple[list[str], str | None]:
    """(globals a bare pickle names, why it does not parse or None). Nothing is executed."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            return [], None  # too big to scan: still never loaded
        return globals_in_pickle(data), None
    except Exception as e:  # noqa: BLE001 - a bare pickle that does not parse
        return [], f"{type(e).__name__}: {e}"


def bare_pickle_dangerous(path: str | os.PathLike) -> tuple[list[str], list[str], str | None]:
    """(globals, dangerous ones, parse error) of a bare pickle."""
    names, why = pickle_globals(path)
    return names, dangerous(names), why
