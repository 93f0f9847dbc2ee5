"""The Snapshotter's pure parts: structure <-> JSON, file layout, buffer sizing, the memory floor, staging splits."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from safepoint.core.errors import FormatError
from safepoint.snapshotter.layout import plan_file, shard_name
from safepoint.snapshotter.memory import MemInfo, floor_allows, read_meminfo
from safepoint.snapshotter.pool import BufferPool, choose_buffer_bytes, plan_sizes
from safepoint.snapshotter.rendezvous import missing_ranks
from safepoint.snapshotter.staging import Stager
from safepoint.snapshotter.structure import flatten, unflatten

MiB = 1024 * 1024

plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    | st.floats(allow_nan=False) | st.binary(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.tuples(kids, kids)
    | st.dictionaries(st.text(max_size=4) | st.integers(), kids, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(plain)
def test_plain_values_round_trip_through_json(value):
    flat = flatten(value)
    tree = json.loads(json.dumps(flat.tree, allow_nan=False))  # what is stored is strict JSON
    assert flat.tensors == () and unflatten(tree, lambda n: pytest.fail("no tensors")) == value


def test_tensor_names_are_unique_and_tied_tensors_shared():
    t = torch.ones(2)
    flat = flatten({"a.b": t, "a": {"b": torch.zeros(1)}, "tied": t, "__metadata__": torch.ones(1)})
    names = [n for n, _ in flat.tensors]
    assert names == ["a.b", "a.b#1", "__metadata__#1"]
    back = unflatten(flat.tree, dict(flat.tensors).__getitem__)
    assert back["tied"] is back["a.b"] and torch.equal(back["a"]["b"], torch.zeros(1))


@pytest.mark.parametrize("tree, why", [
    ({"pickle": "x"}, "unknown node"),
    ({"value": {"a": 1}}, "not a plain value"),
    ({"dict": [[[1], {"value": 1}]]}, "unsupported type"),
    ({"dtype": "os.system"}, "unknown dtype"),
    ({"float": "1e999"}, "nan, inf"),
    ({"tensor": "x", "extra": 1}, "unknown node"),
    ({"list": [{"list": [{"list": [{"list": []}]}]}]}, "deeper"),
])
def test_bad_structures_are_refused(tree, why):
    with pytest.raises(FormatError, match=why):
        unflatten(tree, lambda n: torch.ones(1), max_depth=2)


def test_layout_is_standard_safetensors_aligned_and_gapless():
    from safepoint.validation.loaders.safetensors_file import read_header

    specs = [("u8", torch.uint8, (3,)), ("f64", torch.float64, (5,)), ("bf16", torch.bfloat16, (7, 1)),
             ("f32", torch.float32, ()), ("empty", torch.float32, (0, 3))]
    layout = plan_file(specs, {"k": "v"})
    (n,) = struct.unpack("<Q", layout.header[:8])
    assert n == len(layout.header) - 8 and n % 8 == 0
    end = 0
    for s in layout.slots:  # back to back, each at a multiple of its element size
        assert s.begin == end and s.begin % s.dtype.itemsize == 0
        end = s.end
    assert end == layout.data_bytes == 3 + 40 + 14 + 4
    assert [s.name for s in layout.slots][:2] == ["f64", "f32"]
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(layout.header + bytes(layout.data_bytes))
        f.flush()
        assert {e.name for e in read_header(f.name)} == {n for n, _, _ in specs}
    assert shard_name(3, 16) == "rank-00003-of-00016.safetensors"


@pytest.mark.parametrize("budget, requested, expected", [
    (8 * 1024**3, None, 64 * MiB),
    (256 * MiB, None, 32 * MiB),
    (16 * MiB, None, 2 * MiB),
    (3 * MiB, None, MiB),
    (600 * 1024, None, 512 * 1024),
    (16 * MiB, 4 * MiB, 4 * MiB),
])
def test_buffer_size(budget, requested, expected):
    assert choose_buffer_bytes(budget, requested) == expected


@pytest.mark.parametrize("budget, buffer, sizes", [
    (4 * MiB, MiB, [MiB] * 4),
    (MiB * 2 + 200 * 1024 + 100, MiB, [MiB, MiB, 128 * 1024, 64 * 1024, 8 * 1024, 64, 32]),  # a state-sized budget
    (MiB + 15, MiB, [MiB]),
])
def test_pool_sizes_cover_the_budget_in_powers_of_two(budget, buffer, sizes):
    assert plan_sizes(budget, buffer) == sizes
    assert budget - 16 < sum(sizes) <= budget and all(s & (s - 1) == 0 for s in sizes)


@pytest.mark.parametrize("budget, requested", [(100, None), (16 * MiB, 3 * MiB), (MiB, 2 * MiB)])
def test_bad_buffer_sizes(budget, requested):
    with pytest.raises(ValueError):
        choose_buffer_bytes(budget, requested)


@pytest.mark.parametrize("available, want, floor, ok", [
    (600, 100, 0.25, True), (600, 400, 0.25, False), (250, 0, 0.25, True), (249, 0, 0.25, False),
    (10, 100, 0.0, True),
])
def test_floor_rule(available, want, floor, ok):
    assert floor_allows(MemInfo(total=1000, available=available), want, floor) is ok
    assert floor_allows(None, want, floor) is True  # no /proc/meminfo: nothing to enforce


def test_read_meminfo(tmp_path):
    p = tmp_path / "meminfo"
    p.write_text("MemTotal:       16384 kB\nMemFree:  1 kB\nMemAvailable:    8192 kB\n")
    assert read_meminfo(str(p)) == MemInfo(16384 * 1024, 8192 * 1024)
    assert read_meminfo(str(tmp_path / "nope")) is None


def test_missing_ranks():
    assert missing_ranks({0, 2}, 4) == [1, 3] and missing_ranks({0, 1}, 2) == []


def test_staging_splits_any_tensor_into_small_buffers_in_order():
    g = torch.Generator().manual_seed(0)
    ts = [
        torch.randn(1000, generator=g, dtype=torch.float64),            # 8000 B > a 4 KiB buffer
        torch.randn(300, 40, generator=g).t(),                          # strided, rows of 1200 B
        torch.randn(3, 2000, generator=g)[:, ::2],                      # strided, rows of 4000 B
        torch.randn(9, 700, generator=g)[:, 1:].t().contiguous().t(),   # strided the other way
        torch.tensor(3.5),
        torch.empty(0),
    ]
    ts = sorted(ts, key=lambda t: -t.element_size())
    pool = BufferPool(16 * 1024, 4096, pin=False)
    got = bytearray()

    def emit(chunk):
        got.extend(chunk.buffer.view(chunk.nbytes))
        pool.release(chunk.buffer)

    Stager(pool).stage(ts, emit)
    want = b"".join(t.contiguous().numpy().tobytes() for t in ts)
    assert bytes(got) == want and pool.high_water_in_use <= 16 * 1024
