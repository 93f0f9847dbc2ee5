"""safetensors files: the header is checked here, with bounded memory, before safetensors reads it."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from safepoint.loaders.base import Limits, LoadError, OnProblem, Problem, one_line, raise_problem

SAFETENSORS_SUFFIXES = frozenset({".safetensors"})

# safetensors dtype -> bits per element (F4/F6 are packed sub-byte types).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "E8M0": 8,
    "U16": 16, "I16": 16, "F16": 16, "BF16": 16,
    "U32": 32, "I32": 32, "F32": 32, "C64": 64,
    "U64": 64, "I64": 64, "F64": 64, "C128": 128,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
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
    return entries


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
