"""safetensors files: the header is checked here, with bounded memory, before safetensors reads it.

For validation, tensors are then streamed straight from the file: each piece is read with `preadv`
into one reusable buffer, so peak memory is one piece whatever the file size, and nothing stays
mapped. The safetensors library still opens the file once, so a file it would refuse at resume
time is refused here too.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from safepoint.validation.loaders.base import (
    Limits,
    LoadError,
    OnProblem,
    Problem,
    TensorSource,
    one_line,
    raise_problem,
)

SAFETENSORS_SUFFIXES = frozenset({".safetensors"})

# safetensors dtype -> bits per element (F4/F6 are packed sub-byte types).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "E8M0": 8,
    "U16": 16, "I16": 16, "F16": 16, "BF16": 16,
    "U32": 32, "I32": 32, "F32": 32, "C64": 64,
    "U64": 64, "I64": 64, "F64": 64, "C128": 128,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

# safetensors dtype -> torch dtype, where torch has one (sub-byte floats have none: no stats).
TORCH_DTYPES: dict[str, torch.dtype] = {
    k: v for k, v in {
        "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
        "I64": torch.int64, "U16": getattr(torch, "uint16", None), "U32": getattr(torch, "uint32", None),
        "U64": getattr(torch, "uint64", None), "F16": torch.float16, "BF16": torch.bfloat16,
        "F32": torch.float32, "F64": torch.float64, "C64": torch.complex64,
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None), "E8M0": getattr(torch, "float8_e8m0fnu", None),
    }.items() if v is not None
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: str | os.PathLike, limits: Limits = Limits()) -> list[TensorEntry]:
    """Parse and check a safetensors header. Raises LoadError(MALFORMED) with the reason.

    The length prefix is checked against the limit and the file size before anything is read.
    """
    return _read_header(path, limits)[0]


def _read_header(path: str | os.PathLike, limits: Limits) -> tuple[list[TensorEntry], int]:
    """(entries, offset of the data section)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise LoadError(Problem.MALFORMED, f"safetensors header: file too short ({size} bytes)")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > limits.max_safetensors_header_bytes:
            raise LoadError(Problem.MALFORMED, f"safetensors header length {n} is over the "
                            f"{limits.max_safetensors_header_bytes}-byte limit")
        if n > size - 8:
            raise LoadError(Problem.MALFORMED, f"safetensors header length {n} is larger than the file "
                            f"({size} bytes): truncated or corrupt")
        raw = f.read(n)
    if len(raw) != n:
        raise LoadError(Problem.MALFORMED, "safetensors header: short read (file changed while reading)")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise LoadError(Problem.MALFORMED, f"safetensors header is not valid JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise LoadError(Problem.MALFORMED, "safetensors header is not a JSON object")
    data_len = size - 8 - n
    entries: list[TensorEntry] = []
    for name, info in doc.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise LoadError(Problem.MALFORMED, "safetensors header: __metadata__ must map strings to strings")
            continue
        entries.append(_check_entry(name, info, data_len))
    entries.sort(key=lambda e: (e.begin, e.end))
    prev: TensorEntry | None = None  # the non-empty tensor that ends last so far
    for e in entries:
        if e.end == e.begin:
            continue
        if prev is not None and e.begin < prev.end:
            raise LoadError(Problem.MALFORMED, f"safetensors header: tensors {prev.name!r} [{prev.begin}, {prev.end}) "
                            f"and {e.name!r} [{e.begin}, {e.end}) overlap", tensor=e.name)
        if prev is None or e.end > prev.end:
            prev = e
    return entries, 8 + n


def _check_entry(name: str, info: object, data_len: int) -> TensorEntry:
    def bad(why: str) -> LoadError:
        return LoadError(Problem.MALFORMED, f"safetensors header: tensor {name!r}: {why}", tensor=name)

    if not isinstance(info, dict):
        raise bad("entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise bad(f"unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise bad(f"bad shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise bad(f"bad data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise bad(f"data_offsets [{begin}, {end}] outside the data section ({data_len} bytes)")
    nbits = math.prod(shape) * DTYPE_BITS[dtype]
    if nbits % 8 or nbits // 8 != end - begin:
        raise bad(f"shape {shape} x {dtype} is {nbits / 8:g} bytes but data_offsets span {end - begin}")
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def is_safetensors_file(path: str | os.PathLike) -> bool:
    return os.path.splitext(os.fspath(path))[1].lower() in SAFETENSORS_SUFFIXES


def iter_safetensors_tensors(
    path: str | os.PathLike, limits: Limits = Limits(), on_problem: OnProblem = raise_problem,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Check the header, then read one tensor at a time (peak memory ~ one tensor)."""
    from safetensors import safe_open

    entries = read_header(path, limits)
    try:
        handle = safe_open(os.fspath(path), framework="pt", device="cpu")
    except Exception as e:
        raise LoadError(Problem.UNLOADABLE, f"safetensors refused the file: {one_line(e)}") from None
    with handle as f:
        for e in sorted(entries, key=lambda e: e.name):
            if limits.max_tensor_bytes is not None and e.end - e.begin > limits.max_tensor_bytes:
                on_problem(LoadError(Problem.UNLOADABLE, f"{e.name}: {e.end - e.begin} bytes is over the "
                                     f"max_tensor_bytes limit", tensor=e.name))
                continue
            try:
                t = f.get_tensor(e.name)
            except Exception as exc:
                on_problem(LoadError(Problem.UNLOADABLE, f"{e.name}: cannot read: {one_line(exc)}", tensor=e.name))
                continue
            yield e.name, t
            del t


class SafetensorsTensor(TensorSource):
    """One tensor of a safetensors file, read piece by piece into a shared reusable buffer."""

    def __init__(self, fd: int, entry: TensorEntry, data_start: int, buffer: _Buffer) -> None:
        self.entry = entry
        self.torch_dtype = TORCH_DTYPES.get(entry.dtype)
        self.dtype = self.torch_dtype  # type: ignore[assignment]  # None: no torch dtype, no stats
        self.dtype_name = entry.dtype if self.torch_dtype is None else None
        self.shape = entry.shape
        self._fd, self._start, self._buffer = fd, data_start + entry.begin, buffer

    def pieces(self, max_elems: int) -> Iterator[torch.Tensor]:
        if self.torch_dtype is None:
            return
        itemsize = self.torch_dtype.itemsize
        total = self.entry.end - self.entry.begin
        step = max(1, max_elems) * itemsize
        done = 0
        while done < total:
            n = min(step, total - done)
            buf = self._buffer.get(n)
            got = os.preadv(self._fd, [memoryview(buf.numpy())[:n]], self._start + done)
            if got != n:
                raise LoadError(Problem.UNLOADABLE, f"{self.entry.name}: short read ({got} of {n} bytes at "
                                f"{self._start + done}): file truncated while reading", tensor=self.entry.name)
            yield buf[:n].view(self.torch_dtype)
            done += n


class _Buffer:
    """One growable byte buffer reused by every piece of a file."""

    def __init__(self) -> None:
        self._t = torch.empty(0, dtype=torch.uint8)

    def get(self, n: int) -> torch.Tensor:
        if self._t.numel() < n:
            self._t = torch.empty(n, dtype=torch.uint8)
        return self._t


def iter_safetensors_leaves(
    path: str | os.PathLike, limits: Limits = Limits(), on_problem: OnProblem = raise_problem,
) -> Iterator[tuple[str, Any]]:
    """(name, SafetensorsTensor) for every tensor, in file order (sequential reads)."""
    from safetensors import safe_open

    entries, data_start = _read_header(path, limits)
    try:
        with safe_open(os.fspath(path), framework="pt", device="cpu"):
            pass  # the library's own checks (e.g. gaps in data_offsets), without reading data
    except Exception as e:
        raise LoadError(Problem.UNLOADABLE, f"safetensors refused the file: {one_line(e)}") from None
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer = _Buffer()
        for e in entries:
            if limits.max_tensor_bytes is not None and e.end - e.begin > limits.max_tensor_bytes:
                on_problem(LoadError(Problem.UNLOADABLE, f"{e.name}: {e.end - e.begin} bytes is over the "
                                     f"max_tensor_bytes limit", tensor=e.name))
                continue
            yield e.name, SafetensorsTensor(fd, e, data_start, buffer)
    finally:
        os.close(fd)
