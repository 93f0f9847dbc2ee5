"""Hostile DCP `.metadata`: each crafted file ends `invalid`, quickly, in bounded memory, and leaves the
process as it found it (the sentinel: how paths turn into strings, pathlib's classes, sys.modules).

Also: real metadata decodes to what torch's own pickle.load gives, and chunk tiling is exact.
"""

from __future__ import annotations

import pathlib
import pickle
import resource
import struct
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem  # noqa: F401 - imported before the sys.modules sentinel
import torch.distributed.checkpoint.metadata  # noqa: F401

from safepoint.validation.loaders.base import Limits, LoadError, Problem
from safepoint.validation.loaders.dcp import read_metadata
from safepoint.validation.loaders.dcp_metadata import MAX_MESSAGE, decode_metadata
from safepoint.validation.loaders.dcp_tiling import tiling_problem
from safepoint.validation.settings import ValidationSettings
from safepoint.validation.validate import validate_snapshot

MAX_SECONDS = 10.0
MAX_RSS_GROWTH = 256 << 20


# ------------------------------------------------------------------------------------------ pickle bytes

def u(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b            # BINUNICODE


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"   # GLOBAL


PROTO, STOP, MARK, NONE = b"\x80\x04", b".", b"(", b"N"
EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE = b"}", b"]", b")"
SETITEM, SETITEMS, APPEND, TUPLE, TUPLE1, TUPLE2 = b"s", b"u", b"a", b"t", b"\x85", b"\x86"
BUILD, REDUCE, NEWOBJ, LIST, MEMOIZE, POP = b"b", b"R", b"\x81", b"l", b"\x94", b"0"
MD = "torch.distributed.checkpoint.metadata"


def binget(i: int) -> bytes:
    return b"j" + struct.pack("<I", i)                       # LONG_BINGET


def metadata_with(sdm: bytes) -> bytes:
    """A Metadata object whose state_dict_metadata is the value that `sdm` pushes."""
    return (PROTO + glob(MD, "Metadata") + EMPTY_TUPLE + NEWOBJ + EMPTY_DICT + MARK + u("state_dict_metadata") + sdm
            + u("storage_data") + EMPTY_DICT + SETITEMS + BUILD + STOP)


def tensor_entry(dtype: bytes) -> bytes:
    """state_dict_metadata {"w": TensorStorageMetadata} whose dtype slot holds what `dtype` pushes."""
    size = glob("torch", "Size") + MARK + b"K\x04" + TUPLE + TUPLE1 + REDUCE
    props = (glob(MD, "TensorProperties") + EMPTY_TUPLE + NEWOBJ + MARK + dtype
             + glob("torch.serialization", "_get_layout") + u("torch.strided") + TUPLE1 + REDUCE
             + b"\x89" + glob(MD, "_MEM_FORMAT_ENCODING") + b"K\x00" + TUPLE1 + REDUCE + b"\x89" + TUPLE + BUILD)
    chunk = (glob(MD, "ChunkStorageMetadata") + EMPTY_TUPLE + NEWOBJ + EMPTY_DICT + MARK
             + u("offsets") + glob("torch", "Size") + MARK + b"K\x00" + TUPLE + TUPLE1 + REDUCE
             + u("sizes") + size + SETITEMS + BUILD)
    tsm = (glob(MD, "TensorStorageMetadata") + EMPTY_TUPLE + NEWOBJ + EMPTY_DICT + MARK + u("properties") + props
           + u("size") + size + u("chunks") + EMPTY_LIST + chunk + APPEND + SETITEMS + BUILD)
    return EMPTY_DICT + u("w") + tsm + SETITEM


def build_on_purepath() -> bytes:
    """BUILD on the allowed class itself: sets PurePath._str for every path in the process."""
    return PROTO + glob("pathlib", "PurePath") + NONE + EMPTY_DICT + u("_str") + u("/evil") + SETITEM + TUPLE2 \
        + BUILD + STOP


def reduce_on_dataclass() -> bytes:
    """REDUCE calls an allowed class with arguments (plain pickle would run its __init__)."""
    return PROTO + glob(MD, "ChunkStorageMetadata") + u("a") + u("b") + TUPLE2 + REDUCE + STOP


def newobj_on_path() -> bytes:
    """NEWOBJ of an allowed name that is not one of DCP's dataclasses, with arguments."""
    return PROTO + glob("pathlib", "PurePath") + u("/etc") + TUPLE1 + NEWOBJ + STOP


def hash_bomb(depth: int = 30) -> bytes:
    """A dict keyed by a tuple that shares itself 2^depth times: hashing it takes minutes."""
    body = EMPTY_TUPLE + MEMOIZE + POP
    for i in range(depth):
        body += binget(i) + binget(i) + TUPLE2 + MEMOIZE + POP
    return metadata_with(body + EMPTY_DICT + binget(depth) + u("x") + SETITEM)


def repr_bomb(depth: int = 27) -> bytes:
    """A nested list that shares itself where a dtype belongs: its repr is 2^depth * 4 characters."""
    body = EMPTY_LIST + MEMOIZE + POP
    for i in range(depth):
        body += EMPTY_LIST + binget(i) + APPEND + binget(i) + APPEND + MEMOIZE + POP
    return metadata_with(body + tensor_entry(binget(depth)))


def memory_amplifier(n: int = 16 << 20) -> bytes:
    """16 MiB of empty lists: ~85 bytes of memory per byte of file when unpickled."""
    return PROTO + MARK + EMPTY_LIST * n + LIST + STOP


def forced_import() -> bytes:
    """A name whose lookup on torch would import torch._dynamo (hundreds of modules)."""
    return metadata_with(tensor_entry(glob("torch", "_dynamo")))


HOSTILE = {
    "BUILD on an allowed class (pathlib.PurePath)": (build_on_purepath, Problem.UNSAFE, "BUILD"),
    "REDUCE on an allowed dataclass": (reduce_on_dataclass, Problem.UNSAFE, "REDUCE"),
    "NEWOBJ on an allowed name with arguments": (newobj_on_path, Problem.UNSAFE, "NEWOBJ"),
    "hash bomb (dict keyed by a deeply shared tuple)": (hash_bomb, Problem.MALFORMED, "not a string"),
    "repr bomb (nested list where a dtype belongs)": (repr_bomb, Problem.MALFORMED, "not a torch dtype"),
    "memory amplifier (16 MiB of empty lists)": (memory_amplifier, Problem.MALFORMED, "stack deeper"),
    "forced import (torch._dynamo)": (forced_import, Problem.UNSAFE, "_dynamo"),
}


# ------------------------------------------------------------------------------------------ sentinel

def _sentinel() -> tuple:
    return (str(pathlib.PurePath("a/b")), str(Path("/x/y") / "z"), dict(vars(pathlib.PurePath)),
            dict(vars(pathlib.PurePosixPath)), dict(vars(pathlib.Path)), frozenset(sys.modules))


@pytest.fixture
def sentinel():
    """The process-wide state a hostile pickle could steer; restored after the test if it did."""
    saved = {cls: dict(vars(cls)) for cls in (pathlib.PurePath, pathlib.PurePosixPath, pathlib.Path)}
    before = _sentinel()
    yield before
    for cls, attrs in saved.items():   # on a reader that can be steered, undo the damage for later tests
        for k in set(vars(cls)) - set(attrs):
            delattr(cls, k)
        for k, v in attrs.items():
            if vars(cls).get(k) is not v and k not in ("__dict__", "__doc__", "__weakref__"):
                setattr(cls, k, v)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_metadata_is_refused_and_changes_nothing(name, tmp_path, sentinel):
    make, problem, needle = HOSTILE[name]
    path = tmp_path / ".metadata"
    path.write_bytes(make())
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.monotonic()
    with pytest.raises(LoadError) as exc:
        read_metadata(path)
    seconds = time.monotonic() - t0
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    assert _sentinel() == sentinel, f"{name}: process-wide state changed"
    assert exc.value.problem is problem, exc.value.message
    assert needle in exc.value.message
    assert len(exc.value.message) <= MAX_MESSAGE
    assert seconds < MAX_SECONDS
    assert growth < MAX_RSS_GROWTH


@pytest.mark.parametrize("name", ["BUILD on an allowed class (pathlib.PurePath)", "hash bomb (dict keyed by a "
                                  "deeply shared tuple)", "forced import (torch._dynamo)"])
def test_hostile_metadata_makes_the_snapshot_invalid(name, tmp_path, sentinel):
    """Through validation (sandboxed): `invalid`, with the reason, and nothing changed here either."""
    make, problem, needle = HOSTILE[name]
    (tmp_path / ".metadata").write_bytes(make())
    report = validate_snapshot(tmp_path, [".metadata"])
    assert report.outcome == "invalid"
    assert [(f.file, f.problem) for f in report.findings] == [(".metadata", problem)]
    assert needle in report.findings[0].message
    assert _sentinel()[:5] == sentinel[:5]   # (the parent's imports for the sandbox are its own business)


def test_memory_limit_of_the_sandbox_ends_validation_invalid(tmp_path):
    """With the object bound lifted, 8 Mi appended empty lists need ~600 MiB: the sandbox stops it at 64 MiB."""
    (tmp_path / ".metadata").write_bytes(PROTO + EMPTY_LIST + (EMPTY_LIST + APPEND) * (8 << 20) + STOP)
    settings = ValidationSettings.from_mapping({"max_dcp_metadata_objects": 10**9, "sandbox_memory_bytes": 64 << 20})
    report = validate_snapshot(tmp_path, [".metadata"], settings=settings)
    assert report.outcome == "invalid"
    [f] = report.findings
    assert f.problem is Problem.LIMIT and f.file == ".metadata"
    assert "validation exceeded 64 MiB of memory" in f.message


# ------------------------------------------------------------------------------------------ real metadata

@pytest.fixture(scope="module")
def real_metadata(tmp_path_factory) -> bytes:
    folder = tmp_path_factory.mktemp("dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(64.0).reshape(8, 8), "b": torch.zeros(3, dtype=torch.bfloat16),
                  "opt": {"lr": 0.1, "betas": (0.9, 0.99), "groups": [{"params": [0, 1]}]}}, checkpoint_id=str(folder))
    return (folder / ".metadata").read_bytes()


def test_real_metadata_decodes_like_torch(real_metadata):
    ours = decode_metadata(real_metadata)
    theirs = pickle.loads(real_metadata)  # trusted here: we wrote it a moment ago
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert ours.version == theirs.version
    assert ours.storage_meta.save_id == theirs.storage_meta.save_id


def test_object_bound_is_a_setting(real_metadata):
    with pytest.raises(LoadError, match="max_dcp_metadata_objects"):
        decode_metadata(real_metadata, Limits(max_dcp_metadata_objects=20))


@pytest.mark.parametrize("cut", [1, 10, 100, -2, -1])
def test_truncated_metadata(real_metadata, cut):
    with pytest.raises(LoadError) as exc:
        decode_metadata(real_metadata[:cut])
    assert exc.value.problem is Problem.MALFORMED


@pytest.mark.parametrize("opcode", [b"i", b"o", b"P", b"Q", b"\x82\x01", b"\x8f", b"\x91", b"\x92"])
def test_opcodes_outside_the_list_are_refused(opcode):
    with pytest.raises(LoadError) as exc:
        decode_metadata(PROTO + MARK + opcode + STOP)
    assert exc.value.problem in (Problem.UNSAFE, Problem.MALFORMED)


# ------------------------------------------------------------------------------------------ tiling

@pytest.mark.parametrize("shape, chunks, expected", [
    ((8, 8), [((0, 0), (8, 8))], None),
    ((8, 8), [((0, 0), (4, 8)), ((4, 0), (4, 8))], None),                              # row-wise
    ((8, 8), [((0, 0), (8, 4)), ((0, 4), (8, 4))], None),                              # column-wise
    ((4, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2))], None),   # grid
    ((), [((), ())], None),                                                            # scalar
    ((0, 4), [((0, 0), (0, 4))], None),                                                # empty tensor
    ((8, 8), [((0, 0), (4, 8)), ((0, 0), (4, 8))], "overlap"),                         # one chunk listed twice
    ((8,), [((0,), (6,)), ((4,), (4,))], "overlap"),
    ((8,), [((0,), (4,)), ((6,), (4,))], "outside"),
    ((8,), [((0,), (5,)), ((3,), (3,))], "overlap"),                                   # volumes add up, overlap
    ((8, 8), [((0, 0), (4, 4)), ((2, 2), (4, 4)), ((4, 4), (4, 4)), ((0, 4), (2, 4))], "overlap"),
    ((8,), [((0,), (4,))], "cover 4 of 8"),                                            # a gap
    ((8,), [((0,), (4,)), ((-4,), (4,))], "outside"),
    ((8, 8), [((0,), (8,))], "rank"),
    ((), [((), ()), ((), ())], "2 chunks for a scalar"),
])
def test_tiling(shape, chunks, expected):
    problem = tiling_problem(shape, chunks)
    assert (problem is None) if expected is None else (problem is not None and expected in problem), problem


def test_chunk_listed_twice_makes_a_dcp_checkpoint_invalid(tmp_path):
    """Half of the tensor stored nowhere, the other half's chunk listed twice: summing volumes passed it."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(16.0).reshape(4, 4)}, checkpoint_id=str(tmp_path))
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    item = md.state_dict_metadata["w"]
    whole = item.chunks[0]
    half = type(whole)(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 4]))
    item.chunks = [half, half]
    info = md.storage_data.pop(MetadataIndex("w", torch.Size([0, 0])))
    md.storage_data[MetadataIndex("w", torch.Size([0, 0]))] = info
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    report = validate_snapshot(tmp_path)
    assert report.outcome == "invalid"
    assert any("overlap" in f.message for f in report.findings), report.summary()
