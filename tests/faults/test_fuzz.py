"""Fuzz targets for the parsers that read bytes we do not trust (hypothesis, with a budget).

Targets: safepoint.format.parse_manifest, parse_marker and load_committed (manifest and marker
from disks and servers), and the safetensors header parser (safepoint.validation.loaders.safetensors_file).
The only acceptable outcomes are a parsed value that satisfies the format's rules, or the one
typed error (FormatError, LoadError(MALFORMED)); never another exception, never unbounded time.

Inputs are mutations of valid documents (bit flips, truncation, splices, structured JSON edits)
plus raw bytes. atheris does not install here (no wheel for this Python), so hypothesis drives it
with a time budget: $SAFEPOINT_FUZZ_SECONDS per target (default 4 in CI; raise it to fuzz longer).
"""

from __future__ import annotations

import json
import os
import struct
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from safepoint.core.errors import FormatError
from safepoint.core.format import (
    FileEntry,
    build_manifest,
    digest_bytes,
    load_committed,
    marker_for,
    parse_manifest,
    parse_marker,
    safe_relpath,
)
from safepoint.validation.loaders.base import Limits, LoadError, Problem
from safepoint.validation.loaders.safetensors_file import read_header
from tests.faults.conftest import figures

SECONDS = float(os.environ.get("SAFEPOINT_FUZZ_SECONDS", "4"))
# One hypothesis run is a batch of examples (shrunk to a minimal one on failure); batches repeat
# until the time budget is spent, each with fresh random inputs.
FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))

_VALID = build_manifest("run-1", 42, [FileEntry("model.pt", 10, "a" * 64), FileEntry("shards/x.bin", 0, "b" * 64)],
                        parent=("run-0", 7), world_size=2, ranks=(0, 1), meta={"tags": ["x"]})
VALID_MANIFEST = _VALID.to_json_bytes()
VALID_MARKER = marker_for(VALID_MANIFEST, _VALID).to_json_bytes()


class Budget:
    """Run hypothesis batches until the time budget is spent (hypothesis has no wall-clock limit)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.n = 0
        self.slowest = 0.0  # CPU seconds of the costliest input (thread time: a busy machine does not inflate it)

    def run(self, batch) -> None:
        while True:
            batch()
            if time.monotonic() > self.end:
                return


def _json_edit(doc: dict, draw) -> dict:
    key = draw(st.sampled_from(sorted(doc)))
    doc[key] = draw(st.recursive(
        st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=10))
    return doc


def _mutate(data: bytes, draw, *, structured=None) -> bytes:
    """A mutation of `data`; `structured(draw)` makes a format-aware edit (the "json" kind)."""
    kind = draw(st.sampled_from(["flip", "truncate", "splice", "insert", "raw", "json"]))
    b = bytearray(data)
    if kind == "flip" and b:
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(b) - 1))
            b[i] ^= 1 << draw(st.integers(0, 7))
    elif kind == "truncate":
        b = b[: draw(st.integers(0, len(b)))]
    elif kind == "splice" and b:
        i, j = sorted((draw(st.integers(0, len(b))), draw(st.integers(0, len(b)))))
        b[i:j] = draw(st.binary(max_size=64))
    elif kind == "insert":
        i = draw(st.integers(0, len(b)))
        b[i:i] = draw(st.sampled_from([b"..", b"/", b"\\", b"\x00", b"\xff", b"-1", b"1e999", b"[[[[", b'"'])) * \
            draw(st.integers(1, 4))
    elif kind == "raw":
        b = bytearray(draw(st.binary(max_size=512)))
    elif kind == "json":
        b = bytearray(structured(draw) if structured else json.dumps(_json_edit(json.loads(data), draw)).encode())
    return bytes(b)


def _check_manifest(m) -> None:
    """What every parsed manifest must satisfy (docs/format.md)."""
    paths = [f.path for f in m.files]
    assert paths == sorted(paths) and len(set(paths)) == len(paths)
    for f in m.files:
        assert safe_relpath(f.path) == f.path
        assert f.size >= 0 and len(f.blake3) == 64
    assert m.step >= 0 and m.world_size >= 1


def test_fuzz_manifest_and_marker() -> None:
    budget = Budget(SECONDS)

    @FUZZ
    @given(st.data())
    def one(data) -> None:
        budget.n += 1
        raw = _mutate(VALID_MANIFEST, data.draw)
        # Every draw happens before the clock starts: hypothesis's own work is not the parsers' cost.
        marker = _mutate(VALID_MARKER, data.draw) if data.draw(st.booleans()) else marker_for(
            raw, _VALID).to_json_bytes()
        t = time.thread_time()
        try:
            _check_manifest(parse_manifest(raw))
        except FormatError:
            pass
        try:
            parse_marker(marker)
        except FormatError:
            pass
        try:
            m = load_committed(raw, marker)
            assert digest_bytes(raw) == json.loads(marker)["manifest_blake3"]
            _check_manifest(m)
        except FormatError:
            pass
        budget.slowest = max(budget.slowest, time.thread_time() - t)

    budget.run(one)
    assert budget.n > 50
    assert budget.slowest < 2.0
    figures("fuzz manifest/marker", inputs=budget.n, seconds=SECONDS, slowest_ms=round(budget.slowest * 1000, 1),
            crashes=0)


def _valid_safetensors() -> bytes:
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                         "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
                         "c": {"dtype": "I64", "shape": [0], "data_offsets": [22, 22]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(22)


def test_fuzz_safetensors_header(tmp_path) -> None:
    budget = Budget(SECONDS)
    valid = _valid_safetensors()
    path = tmp_path / "x.safetensors"
    limits = Limits(max_safetensors_header_bytes=1 << 20)

    def header_edit(draw) -> bytes:
        (n,) = struct.unpack("<Q", valid[:8])
        doc = json.loads(valid[8:8 + n])
        name = draw(st.sampled_from(["a", "b", "c"]))
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        doc[name][field] = draw(st.one_of(st.text(max_size=6), st.lists(st.integers(-5, 2**66), max_size=4),
                                          st.integers(-1, 40), st.none()))
        header = json.dumps(doc).encode()
        return struct.pack("<Q", len(header)) + header + valid[8 + n:]

    @FUZZ
    @given(st.data())
    def one(data) -> None:
        budget.n += 1
        raw = _mutate(valid, data.draw, structured=header_edit) if data.draw(st.integers(0, 9)) else (
            struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1))) + valid[8:])
        path.write_bytes(raw)
        t = time.thread_time()
        try:
            entries = read_header(path, limits)
        except LoadError as e:
            assert e.problem is Problem.MALFORMED and e.message
        else:
            size = len(raw)
            (n,) = struct.unpack("<Q", raw[:8])
            spans = sorted((e.begin, e.end) for e in entries if e.end > e.begin)
            for (_b0, e0), (b1, _e1) in zip(spans, spans[1:]):
                assert e0 <= b1, "overlapping tensors accepted"
            assert all(0 <= e.begin <= e.end <= size - 8 - n for e in entries)
        budget.slowest = max(budget.slowest, time.thread_time() - t)

    budget.run(one)
    assert budget.n > 50
    assert budget.slowest < 2.0
    figures("fuzz safetensors header", inputs=budget.n, seconds=SECONDS,
            slowest_ms=round(budget.slowest * 1000, 1), crashes=0)


# ------------------------------------------------------------------------------------------ DCP .metadata

# Opcodes a hostile .metadata may string together (with their arguments), for the raw-opcode strategy.
_OPS = [b"(", b")", b"]", b"}", b"N", b"\x88", b"\x89", b"K\x07", b"J\xff\xff\xff\xff", b"\x8a\x01\x80", b"a", b"e",
        b"s", b"u", b"t", b"\x85", b"\x86", b"\x87", b"l", b"d", b"0", b"1", b"2", b"\x94", b"h\x00", b"h\x01",
        b"q\x05", b"R", b"\x81", b"b", b"\x93", b"\x8c\x05torch", b"\x8c\x04Size", b"\x8c\x07_dynamo",
        b"cpathlib\nPurePath\n", b"ctorch\nfloat32\n", b"cos\nsystem\n", b"ctorch\n_dynamo\n",
        b"ctorch.distributed.checkpoint.metadata\nMetadata\n", b"ccollections\nOrderedDict\n", b"\x8c\x04_str",
        b"i", b"o", b"P", b"Q", b"\x8f", b"\x91", b"\x92", b"\x95\x00\x00\x00\x00\x00\x00\x00\x00", b"G" + bytes(8)]


def _dcp_metadata_sample() -> bytes:
    import tempfile
    import warnings
    from pathlib import Path

    import torch
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(16.0).reshape(4, 4), "opt": {"lr": 0.1, "betas": (0.9, 0.99)}}, checkpoint_id=d)
        return (Path(d) / ".metadata").read_bytes()


def test_fuzz_dcp_metadata() -> None:
    """Arbitrary pickle byte strings into the .metadata reader: a Metadata whose chunks tile each tensor, or
    LoadError (UNSAFE/MALFORMED); never another exception, a hang, an import, or a change to the process."""
    import pathlib
    import sys

    from safepoint.validation.loaders.dcp_metadata import MAX_MESSAGE, decode_metadata
    from safepoint.validation.loaders.dcp_tiling import tiling_problem

    budget = Budget(SECONDS)
    valid = _dcp_metadata_sample()
    limits = Limits(max_dcp_metadata_objects=100_000)
    modules = frozenset(sys.modules)
    path_str = str(pathlib.PurePath("a/b"))
    path_attrs = dict(vars(pathlib.PurePath))

    def opcodes(draw) -> bytes:
        ops = draw(st.lists(st.sampled_from(_OPS), max_size=60))
        return b"\x80\x04" + b"".join(ops) + b"."

    @FUZZ
    @given(st.data())
    def one(data) -> None:
        budget.n += 1
        kind = data.draw(st.integers(0, 2))
        raw = opcodes(data.draw) if kind == 0 else _mutate(valid, data.draw, structured=opcodes) if kind == 1 else \
            data.draw(st.binary(max_size=256))
        t = time.thread_time()
        try:
            md = decode_metadata(raw, limits)
        except LoadError as e:
            assert e.problem in (Problem.UNSAFE, Problem.MALFORMED) and 0 < len(e.message) <= MAX_MESSAGE
        else:
            for item in md.state_dict_metadata.values():
                chunks = getattr(item, "chunks", None)
                if chunks is not None:
                    tiling_problem(tuple(item.size), [(tuple(c.offsets), tuple(c.sizes)) for c in chunks])
        budget.slowest = max(budget.slowest, time.thread_time() - t)

    budget.run(one)
    new = sorted(m for m in set(sys.modules) - modules if m.split(".")[0] in ("torch", "sympy", "os", "pathlib",
                                                                            "subprocess", "functorch"))
    assert not new, f"the reader imported {new[:10]}"   # (hypothesis itself imports numpy.random, hmac, ...)
    assert str(pathlib.PurePath("a/b")) == path_str and dict(vars(pathlib.PurePath)) == path_attrs
    assert budget.n > 50
    assert budget.slowest < 2.0
    figures("fuzz DCP .metadata", inputs=budget.n, seconds=SECONDS, slowest_ms=round(budget.slowest * 1000, 1),
            crashes=0)
