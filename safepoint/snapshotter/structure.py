"""The nesting of a state, as JSON: flatten a state into named tensors plus a tree, and back, without pickle.

A training state is nested dicts, lists and tuples of tensors and plain values (model and optimizer
state dicts). The tensors go to a safetensors file under flat names; the tree goes to the file's
`__metadata__` as JSON, so any safetensors loader reads the tensors and `load()` rebuilds the exact
nesting. Node kinds (each a one-key JSON object, so a reader can refuse anything unknown):

    {"tensor": "model.w"}                     a tensor, by its name in the file
    {"tensor": "w", "dtensor": {...}}         the local shard of a DTensor (global shape, placements)
    {"dict": [[key, node], ...]}              keys: str, int, finite float, bool or null, in order
    {"list": [node, ...]}  {"tuple": [node, ...]}
    {"value": v}                              None, bool, int, str, finite float
    {"float": "nan" | "inf" | "-inf"}         non-finite floats (JSON has none)
    {"size": [..]}  {"dtype": "float32"}  {"device": "cuda:0"}  {"bytes": "<base64>"}

Dict subclasses (OrderedDict) come back as dict and namedtuples as tuple. Anything else (arbitrary
objects, lambdas) is refused at save time with the path of the offending value.
"""

from __future__ import annotations

import base64
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from safepoint.core.errors import FormatError
from safepoint.snapshotter.errors import UnsupportedState
from safepoint.snapshotter.layout import st_dtype

STRUCTURE_VERSION = 1
MAX_DEPTH = 200
_KINDS = frozenset({"tensor", "dict", "list", "tuple", "value", "float", "size", "dtype", "device", "bytes"})


@dataclass(frozen=True)
class Flattened:
    tree: dict[str, Any]                          # the JSON tree (see module docstring)
    tensors: tuple[tuple[str, torch.Tensor], ...]  # (unique name, local tensor), in walk order


def _is_dtensor(t: torch.Tensor) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(t, cls)


def _path_str(path: list[str]) -> str:
    return ".".join(path) or "<root>"


def flatten(state: Any, *, max_depth: int = MAX_DEPTH) -> Flattened:
    """Split `state` into a JSON tree and named tensors. Raises UnsupportedState for what needs pickle.

    The same tensor object reached twice (tied weights) is stored once and referenced twice.
    """
    names: dict[int, str] = {}
    used: set[str] = {"__metadata__"}  # reserved by safetensors
    tensors: list[tuple[str, torch.Tensor]] = []
    keep: list[Any] = []          # holds every seen tensor so id() stays unique during the walk
    active: set[int] = set()      # containers on the current path: a cycle is an error

    def unique(path: list[str]) -> str:
        base = _path_str(path) if path else "tensor"
        name, i = base, 1
        while name in used:
            name, i = f"{base}#{i}", i + 1
        used.add(name)
        return name

    def tensor_node(t: torch.Tensor, path: list[str]) -> dict[str, Any]:
        if id(t) in names:
            return {"tensor": names[id(t)]}
        node: dict[str, Any] = {}
        local = t
        if _is_dtensor(t):
            local = t.to_local()
            node["dtensor"] = {
                "global_shape": [int(d) for d in t.shape],
                "mesh_shape": [int(d) for d in t.device_mesh.shape],
                "placements": [str(p) for p in t.placements],
            }
        if local.layout != torch.strided:
            raise UnsupportedState(f"{_path_str(path)}: tensors with layout {local.layout} are not supported")
        if local.is_quantized or local.device.type == "meta":
            raise UnsupportedState(f"{_path_str(path)}: quantized and meta tensors are not supported")

        st_dtype(local.dtype, _path_str(path))  # refuse unsupported dtypes now, with the path
        name = unique(path)
        names[id(t)] = name
        keep.append(t)
        tensors.append((name, local.detach()))
        return {"tensor": name, **node}

    def walk(o: Any, path: list[str], depth: int) -> dict[str, Any]:
        if depth > max_depth:
            raise UnsupportedState(f"{_path_str(path)}: nested deeper than {max_depth} levels")
        if isinstance(o, torch.Tensor):
            return tensor_node(o, path)
        if o is None or isinstance(o, (bool, int, str)):
            return {"value": o}
        if isinstance(o, float):
            return {"value": o} if math.isfinite(o) else {"float": repr(o)}
        if isinstance(o, torch.dtype):
            return {"dtype": str(o).removeprefix("torch.")}
        if isinstance(o, torch.device):
            return {"device": str(o)}
        if isinstance(o, (bytes, bytearray)):
            return {"bytes": base64.b64encode(bytes(o)).decode("ascii")}
        if isinstance(o, torch.Size):
            return {"size": [int(d) for d in o]}
        if isinstance(o, (dict, list, tuple)):
            if id(o) in active:
                raise UnsupportedState(f"{_path_str(path)}: the state contains a reference cycle")
            active.add(id(o))
            try:
                if isinstance(o, dict):
                    items = []
                    for k, v in o.items():
                        if not (k is None or isinstance(k, (bool, int, str))
                                or (isinstance(k, float) and math.isfinite(k))):
                            raise UnsupportedState(
                                f"{_path_str(path)}: dict key {k!r} ({type(k).__name__}) is not a str, int, "
                                "finite float, bool or None")
                        items.append([k, walk(v, [*path, str(k)], depth + 1)])
                    return {"dict": items}
                kind = "list" if isinstance(o, list) else "tuple"
                return {kind: [walk(v, [*path, str(i)], depth + 1) for i, v in enumerate(o)]}
            finally:
                active.discard(id(o))
        item = getattr(o, "item", None)
        if type(o).__module__ == "numpy" and callable(item):  # numpy scalars: plain values
            return walk(item(), path, depth)
        raise UnsupportedState(
            f"{_path_str(path)}: a {type(o).__module__}.{type(o).__qualname__} cannot be saved without pickle; "
            "convert it to tensors and plain values (dict, list, tuple, str, int, float, bool, None)")

    tree = walk(state, [], 0)
    return Flattened(tree, tuple(tensors))


def unflatten(tree: Any, get_tensor: Callable[[str], torch.Tensor], *, max_depth: int = MAX_DEPTH) -> Any:
    """Rebuild the state from a tree read from disk (untrusted: every node is checked).

    A tensor referenced twice comes back as the same object. Raises FormatError on a bad tree.
    """
    cache: dict[str, torch.Tensor] = {}

    def bad(why: str) -> FormatError:
        return FormatError(f"snapshot structure: {why}")

    def build(node: Any, depth: int) -> Any:
        if depth > max_depth:
            raise bad(f"nested deeper than {max_depth} levels")
        if not isinstance(node, dict) or not node:
            raise bad(f"node {node!r:.80} is not a one-key object")
        kind = next(iter(node))
        if kind not in _KINDS or (len(node) != 1 and not (kind == "tensor" and set(node) == {"tensor", "dtensor"})):
            raise bad(f"unknown node {sorted(node)!r}")
        v = node[kind]
        if kind == "tensor":
            if not isinstance(v, str):
                raise bad("tensor name is not a string")
            if v not in cache:
                cache[v] = get_tensor(v)
            return cache[v]
        if kind == "dict":
            if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 for p in v):
                raise bad("dict is not a list of [key, node] pairs")
            out = {}
            for k, child in v:
                if not (k is None or isinstance(k, (bool, int, str, float))):
                    raise bad(f"dict key {k!r:.80} has an unsupported type")
                out[k] = build(child, depth + 1)
            return out
        if kind in ("list", "tuple"):
            if not isinstance(v, list):
                raise bad(f"{kind} is not a list")
            items = [build(child, depth + 1) for child in v]
            return items if kind == "list" else tuple(items)
        if kind == "value":
            if not (v is None or isinstance(v, (bool, int, str, float))):
                raise bad(f"value {v!r:.80} is not a plain value")
            return v
        if kind == "float":
            if v not in ("nan", "inf", "-inf"):
                raise bad(f"float {v!r:.80} is not nan, inf or -inf")
            return float(v)
        if kind == "size":
            if not isinstance(v, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in v):
                raise bad("size is not a list of ints")
            return torch.Size(v)
        if kind == "dtype":
            dt = getattr(torch, v, None) if isinstance(v, str) else None
            if not isinstance(dt, torch.dtype):
                raise bad(f"unknown dtype {v!r:.80}")
            return dt
        if kind == "device":
            try:
                return torch.device(v)
            except (TypeError, RuntimeError):
                raise bad(f"bad device {v!r:.80}") from None
        try:  # bytes
            return base64.b64decode(v, validate=True)
        except (TypeError, ValueError):
            raise bad("bytes are not base64") from None

    return build(tree, 0)


def tensor_names(tree: Any) -> set[str]:
    """Every tensor name a tree references (to check a file holds them all)."""
    out: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("tensor"), str):
                out.add(node["tensor"])
            for v in node.values():
                if isinstance(v, (list, dict)):
                    stack.append(v)
        elif isinstance(node, list):
            stack.extend(node)
    return out
