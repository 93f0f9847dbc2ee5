"""Where each tensor's bytes go in a rank's safetensors file, and the file's name: pure functions.

The file is standard safetensors (8-byte little-endian header length, JSON header padded with
spaces to a multiple of 8, then the tensors' bytes back to back with no gaps, as the reference
implementation requires). Tensors are laid out by element size, largest first, so every tensor
starts at an offset that is a multiple of its element size; pool buffers are powers of two, so a
tensor split across buffers is split on an element boundary, and staged bytes can be viewed in the
tensor's own dtype without copies.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch

from safepoint.snapshotter.errors import UnsupportedState

SHARD_SUFFIX = ".safetensors"
META_FORMAT = "safepoint.local.snapshot"
META_VERSION = "1"

# torch dtype -> safetensors dtype name (only names both safetensors and Safepoint's validator know).
_ST_NAMES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
}
ST_DTYPES: dict[torch.dtype, str] = {
    getattr(torch, n): st for n, st in _ST_NAMES.items() if isinstance(getattr(torch, n, None), torch.dtype)
}


def st_dtype(dtype: torch.dtype, where: str = "") -> str:
    try:
        return ST_DTYPES[dtype]
    except KeyError:
        raise UnsupportedState(f"{where or 'tensor'}: dtype {dtype} has no safetensors equivalent") from None


def shard_name(rank: int, world_size: int) -> str:
    """The file a rank writes: rank-00000-of-00002.safetensors."""
    return f"rank-{rank:05d}-of-{world_size:05d}{SHARD_SUFFIX}"


@dataclass(frozen=True)
class Slot:
    """One tensor's place in the data section: bytes [begin, end)."""

    name: str
    index: int          # position in the flattened tensor list
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class FileLayout:
    header: bytes             # length prefix + padded JSON header: the first bytes of the file
    slots: tuple[Slot, ...]   # in file order
    data_bytes: int

    @property
    def total_bytes(self) -> int:
        return len(self.header) + self.data_bytes


def plan_file(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> FileLayout:
    """Lay out named tensors (name, dtype, shape) in one safetensors file with `metadata` (str -> str)."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i][1].itemsize)
    slots: list[Slot] = []
    offset = 0
    for i in order:
        name, dtype, shape = tensors[i]
        n = dtype.itemsize
        for d in shape:
            n *= int(d)
        slots.append(Slot(name, i, dtype, tuple(int(d) for d in shape), offset, offset + n))
        offset += n
    doc: dict[str, object] = {"__metadata__": dict(metadata)}
    for s in slots:
        doc[s.name] = {"dtype": st_dtype(s.dtype, s.name), "shape": list(s.shape), "data_offsets": [s.begin, s.end]}
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()
    raw += b" " * (-len(raw) % 8)
    return FileLayout(struct.pack("<Q", len(raw)) + raw, tuple(slots), offset)
