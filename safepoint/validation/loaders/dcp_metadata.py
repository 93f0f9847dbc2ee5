"""DCP `.metadata` decoded without an unpickler: nothing in the file is imported, called or hashed.

torch writes `.metadata` with plain `pickle.dump`, so an unpickler (even one whose `find_class`
filters names) lets the file's `BUILD`, `REDUCE` and `NEWOBJ` opcodes act on whatever classes it
does allow: a 210-byte file could set a class attribute of `pathlib.PurePath` for the whole process.
So the opcode stream is decoded here, in two passes, by our own code:

1. `decode(data)` walks the opcodes (`pickletools.genops`: it parses, never executes) on a stack
   of inert values: numbers, strings, lists, tuples, `Mapping` (a dict kept as a list of pairs, so
   nothing is ever hashed), `Name` (a global, refused at once unless allow-listed, never imported)
   and `Call` (a `REDUCE`/`NEWOBJ` of an allowed name, recorded with its arguments and the state a
   later `BUILD` gives it, never called). Opcodes outside the list below are refused. Bounds: the
   objects made and fetched from the memo (`max_dcp_metadata_objects`), the stack length and the
   MARK nesting.
2. `build(root)` reads that tree against DCP's schema (Metadata, TensorStorageMetadata,
   TensorProperties, ChunkStorageMetadata, BytesStorageMetadata, MetadataIndex, _StorageInfo,
   StorageMeta) and constructs the real dataclasses from checked plain values only. Every `Call`
   must sit where the schema expects that class; `planner_data` must be plain data. The walk has a
   fixed depth (plain data: at most `max_nesting`) and counts every node it visits, shared ones
   each time, against the same object bound, so memo reuse cannot multiply work.

Error messages name types and clipped strings, never the `repr` of a decoded value, and are at
most `MAX_MESSAGE` characters.

Why not torch's weights-only unpickler with DCP's classes allow-listed (checked with torch 2.13,
every case of tests/test_dcp_metadata.py): it cannot read real metadata at all, since DCP writes
`.metadata` with `pickle.dump`'s protocol 4 and that unpickler refuses FRAME, MEMOIZE and
STACK_GLOBAL ("Unsupported operand 149"), while the public `torch.load(..., weights_only=True)`
refuses a bare pickle outright (it reads torch.save's zip or legacy formats only). Of the hostile
cases, "REDUCE on an allowed dataclass" and "NEWOBJ on an allowed name with arguments" load instead
of being refused (the constructors run), and "memory amplifier (16 MiB of empty lists)" runs past
20 s and 1 GiB where this decoder refuses it at once (stack bound); only the sandbox would stop it.
"""

from __future__ import annotations

import io
import os
import pickletools
from typing import Any

import torch

from safepoint.validation.loaders.base import Limits, LoadError, Problem

MAX_MESSAGE = 240
MAX_STACK = 100_000         # pickle batches APPENDS/SETITEMS by 1000: real stacks stay in the thousands
MAX_MARKS = 100             # MARK nesting (DCP metadata nests about 6 deep)
MAX_RANK = 64               # dimensions of a tensor size or chunk offset

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_SHARD = "torch.distributed._shard.sharded_tensor.metadata"
_PATHS = frozenset((m, n) for m in ("pathlib", "pathlib._local")
                   for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path", "PurePath"))
METADATA, TENSOR_MD, BYTES_MD, CHUNK_MD = (_MD, "Metadata"), (_MD, "TensorStorageMetadata"), \
    (_MD, "BytesStorageMetadata"), (_MD, "ChunkStorageMetadata")
PROPERTIES = frozenset({(_MD, "TensorProperties"), (_SHARD, "TensorProperties")})
MEM_FORMAT = frozenset({(_MD, "_MEM_FORMAT_ENCODING"), (_SHARD, "MEM_FORMAT_ENCODING")})
INDEX, STORAGE_INFO, STORAGE_META = (_MD, "MetadataIndex"), (_FS, "_StorageInfo"), (_MD, "StorageMeta")
SIZE, LAYOUT = ("torch", "Size"), ("torch.serialization", "_get_layout")

# torch's own dtypes and layouts, read from the module's namespace (vars(), not getattr: torch's
# lazy __getattr__ would import submodules such as torch._dynamo for an unknown name).
DTYPES: dict[str, torch.dtype] = {k: v for k, v in vars(torch).items() if isinstance(v, torch.dtype)}
LAYOUTS: dict[str, torch.layout] = {f"torch.{k}": v for k, v in vars(torch).items() if isinstance(v, torch.layout)}
MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.preserve_format)

ALLOWED_NAMES: frozenset[tuple[str, str]] = frozenset(
    {METADATA, TENSOR_MD, BYTES_MD, CHUNK_MD, INDEX, STORAGE_INFO, STORAGE_META, SIZE, LAYOUT,
     (_FS, "_StoragePrefix"), ("collections", "OrderedDict")} | PROPERTIES | MEM_FORMAT | _PATHS
    | {("torch", name) for name in DTYPES})


# ------------------------------------------------------------------------------------------ pass 1

class Name:
    """A global named by the pickle: only its two strings (nothing imported)."""

    __slots__ = ("key",)

    def __init__(self, module: str, name: str) -> None:
        self.key = (module, name)


class Call:
    """`REDUCE` or `NEWOBJ` of an allowed Name, recorded (never called); `state` from one `BUILD`."""

    __slots__ = ("key", "kind", "args", "state", "built")

    def __init__(self, key: tuple[str, str], kind: str, args: tuple) -> None:
        self.key, self.kind, self.args, self.state, self.built = key, kind, args, None, False


class Mapping:
    """A pickled dict as its (key, value) pairs in order: building it would hash attacker-made keys."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[tuple[Any, Any]] = []


class _Mark:
    __slots__ = ()


_PLAIN_PUSH = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_VALUE_OPS = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
                        "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES",
                        "BINBYTES8"})


def clip(text: str, limit: int = MAX_MESSAGE) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _show(s: str) -> str:
    """A string from the file, clipped before it is quoted."""
    return repr(s[:60] + ("..." if len(s) > 60 else ""))


def malformed(why: str) -> LoadError:
    return LoadError(Problem.MALFORMED, clip(f"DCP .metadata: {why}"))


def unsafe(why: str) -> LoadError:
    return LoadError(Problem.UNSAFE, clip(f"DCP .metadata refused: {why}"))


class _Decoder:
    def __init__(self, limits: Limits) -> None:
        self.max_objects = limits.max_dcp_metadata_objects
        self.objects = 0
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}

    def count(self, n: int = 1) -> None:
        self.objects += n
        if self.objects > self.max_objects:
            raise malformed(f"more than {self.max_objects} objects (max_dcp_metadata_objects)")

    def push(self, v: Any) -> None:
        if len(self.stack) >= MAX_STACK:
            raise malformed(f"pickle stack deeper than {MAX_STACK} entries")
        self.stack.append(v)

    def pop(self) -> Any:
        if not self.stack:
            raise malformed("pickle stack underflow")
        v = self.stack.pop()
        if isinstance(v, _Mark):
            raise malformed("pickle MARK used as a value")
        return v

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise malformed("pickle has no MARK to pop to")
        at = self.marks.pop()
        items = self.stack[at + 1:]
        del self.stack[at:]
        return items

    def top(self) -> Any:
        if not self.stack or isinstance(self.stack[-1], _Mark):
            raise malformed("pickle stack underflow")
        return self.stack[-1]

    def run(self, data: bytes) -> Any:
        try:
            for op, arg, _pos in pickletools.genops(io.BytesIO(data)):
                name = op.name
                if name == "STOP":
                    if len(self.stack) != 1 or self.marks:
                        raise malformed("pickle stops with a stack that does not hold one value")
                    return self.pop()
                self.step(name, arg)
        except LoadError:
            raise
        except RecursionError:
            raise malformed("nested too deeply") from None
        except (ValueError, EOFError) as e:
            if isinstance(e, EOFError) or "not enough data" in str(e) or "exhausted" in str(e):
                raise malformed("truncated (pickle ends early)") from None
            raise malformed(f"corrupt pickle ({type(e).__name__}: {clip(str(e), 120)})") from None
        except (UnicodeDecodeError, OverflowError, IndexError, TypeError) as e:
            raise malformed(f"corrupt pickle ({type(e).__name__}: {clip(str(e), 120)})") from None
        raise malformed("truncated (pickle ends early)")

    def step(self, name: str, arg: Any) -> None:  # noqa: C901 - one branch per opcode
        if name in ("PROTO", "FRAME"):
            return
        if name in _VALUE_OPS:
            if isinstance(arg, (str, bytes)):
                self.count()
            self.push(arg)
        elif name in _PLAIN_PUSH:
            self.push(_PLAIN_PUSH[name])
        elif name == "MARK":
            if len(self.marks) >= MAX_MARKS:
                raise malformed(f"MARKs nested deeper than {MAX_MARKS}")
            self.marks.append(len(self.stack))
            self.push(_Mark())
        elif name == "POP":
            if self.stack and isinstance(self.stack[-1], _Mark):
                self.pop_mark()
            else:
                self.pop()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            self.push(self.top())
        elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            key = len(self.memo) if name == "MEMOIZE" else arg
            if not isinstance(key, int) or key < 0:
                raise malformed("bad memo key")
            if key not in self.memo:
                self.count()
            self.memo[key] = self.top()
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if arg not in self.memo:
                raise malformed(f"memo entry {clip(str(arg), 30)} used before it is set")
            self.count()
            self.push(self.memo[arg])
        elif name == "EMPTY_LIST":
            self.count()
            self.push([])
        elif name == "EMPTY_TUPLE":
            self.push(())
        elif name == "EMPTY_DICT":
            self.count()
            self.push(Mapping())
        elif name in ("LIST", "TUPLE", "DICT"):
            items = self.pop_mark()
            self.count(1 + len(items))
            if name == "LIST":
                self.push(items)
            elif name == "TUPLE":
                self.push(tuple(items))
            else:
                if len(items) % 2:
                    raise malformed("DICT with an odd number of items")
                m = Mapping()
                m.items = list(zip(items[::2], items[1::2]))
                self.push(m)
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = [self.pop() for _ in range(n)][::-1]
            self.count(1 + n)
            self.push(tuple(items))
        elif name in ("APPEND", "APPENDS"):
            items = [self.pop()] if name == "APPEND" else self.pop_mark()
            target = self.top()
            if not isinstance(target, list):
                raise malformed(f"{name} on {_kind(target)}, not a list")
            self.count(len(items))
            target.extend(items)
        elif name in ("SETITEM", "SETITEMS"):
            if name == "SETITEM":
                v, k = self.pop(), self.pop()
                items = [k, v]
            else:
                items = self.pop_mark()
            target = self.top()
            if not isinstance(target, Mapping) or len(items) % 2:
                raise malformed(f"{name} on {_kind(target)}, not a dict")
            self.count(len(items) // 2)
            target.items.extend(zip(items[::2], items[1::2]))
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            if name == "GLOBAL":
                module, _, attr = str(arg).partition(" ")
            else:
                attr, module = self.pop(), self.pop()
                if not isinstance(module, str) or not isinstance(attr, str):
                    raise malformed("STACK_GLOBAL of non-strings")
            if (module, attr) not in ALLOWED_NAMES:
                raise unsafe(f"global {_show(module)}.{_show(attr)} is not allowed")
            self.count()
            self.push(Name(module, attr))
        elif name in ("REDUCE", "NEWOBJ"):
            args, fn = self.pop(), self.pop()
            if not isinstance(fn, Name) or not _callable(name, fn.key, args):
                raise unsafe(f"{name} of {_kind(fn)} with {_kind(args)} is not allowed")
            self.count()
            self.push(Mapping() if fn.key == ("collections", "OrderedDict") else Call(fn.key, name, args))
        elif name == "BUILD":
            state = self.pop()
            target = self.top()
            if not isinstance(target, Call) or target.kind != "NEWOBJ" or target.built:
                raise unsafe(f"BUILD on {_kind(target)} (only a new object, once)")
            target.state, target.built = state, True
        else:
            raise unsafe(f"pickle opcode {name} is not allowed")


# What REDUCE/NEWOBJ may record, by name: the shape DCP's own pickles use, with plain arguments.
NEWOBJ_NAMES = frozenset({METADATA, TENSOR_MD, BYTES_MD, CHUNK_MD, INDEX, STORAGE_INFO, STORAGE_META,
                          (_FS, "_StoragePrefix")} | PROPERTIES)


def _callable(op: str, key: tuple[str, str], args: Any) -> bool:
    if not isinstance(args, tuple):
        return False
    if op == "NEWOBJ":
        return key in NEWOBJ_NAMES and args == ()
    if key == SIZE:
        return len(args) == 1 and isinstance(args[0], (tuple, list))
    if key == LAYOUT:
        return len(args) == 1 and isinstance(args[0], str)
    if key in MEM_FORMAT:
        return len(args) == 1 and isinstance(args[0], int)
    if key in _PATHS:
        return all(isinstance(a, str) for a in args)
    return key == ("collections", "OrderedDict") and args == ()


def _kind(v: Any) -> str:
    if isinstance(v, Name):
        return f"the name {v.key[0]}.{v.key[1]}"
    if isinstance(v, Call):
        return f"a {v.key[1]} object"
    if isinstance(v, Mapping):
        return "a dict"
    return type(v).__name__


def decode(data: bytes, limits: Limits = Limits()) -> Any:
    """Pass 1: the inert value tree of a pickle. Raises LoadError (UNSAFE or MALFORMED)."""
    return _Decoder(limits).run(data)


# ------------------------------------------------------------------------------------------ pass 2

class _Builder:
    def __init__(self, limits: Limits) -> None:
        self.budget = limits.max_dcp_metadata_objects
        self.max_nesting = limits.max_nesting

    def visit(self, n: int = 1) -> None:
        self.budget -= n
        if self.budget < 0:
            raise malformed("metadata refers to its objects too many times (max_dcp_metadata_objects)")

    def pairs(self, node: Any, what: str) -> list[tuple[Any, Any]]:
        if not isinstance(node, Mapping):
            raise malformed(f"{what} is {_kind(node)}, not a dict")
        self.visit(len(node.items) + 1)
        return node.items

    def fields(self, node: Any, key: tuple[str, str] | frozenset, what: str, allowed: set[str],
               required: set[str] = frozenset()) -> dict[str, Any]:
        """The BUILD state of a new `key` object (NEWOBJ with no arguments) as field -> node."""
        keys = key if isinstance(key, frozenset) else {key}
        if not isinstance(node, Call) or node.key not in keys or node.kind != "NEWOBJ" or node.args != ():
            raise malformed(f"{what} is {_kind(node)}, not a {next(iter(keys))[1]}")
        self.visit()
        if node.state is None:
            out: dict[str, Any] = {}
        else:
            out = {}
            for k, v in self.pairs(node.state, what):
                if not isinstance(k, str) or k not in allowed:
                    shown = _show(k) if isinstance(k, str) else _kind(k)
                    raise malformed(f"{what}: unknown field {shown}")
                if k in out:
                    raise malformed(f"{what}: field {k} given twice")
                out[k] = v
        missing = required - set(out)
        if missing:
            raise malformed(f"{what}: missing {', '.join(sorted(missing))}")
        return out

    def string(self, v: Any, what: str, *, optional: bool = False) -> str | None:
        if v is None and optional:
            return None
        if not isinstance(v, str):
            raise malformed(f"{what} is {_kind(v)}, not a string")
        return v

    def integer(self, v: Any, what: str, *, optional: bool = False) -> int | None:
        if v is None and optional:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 62:
            raise malformed(f"{what} is not a non-negative integer" if not isinstance(v, int) or isinstance(v, bool)
                            else f"{what} is out of range")
        return v

    def flag(self, v: Any, what: str) -> bool:
        if not isinstance(v, bool):
            raise malformed(f"{what} is {_kind(v)}, not true/false")
        return v

    def size(self, v: Any, what: str, *, optional: bool = False) -> torch.Size | None:
        if v is None and optional:
            return None
        if not isinstance(v, Call) or v.key != SIZE or v.kind != "REDUCE" or v.state is not None \
                or len(v.args) != 1 or not isinstance(v.args[0], (tuple, list)):
            raise malformed(f"{what} is {_kind(v)}, not a torch.Size")
        dims = v.args[0]
        if len(dims) > MAX_RANK:
            raise malformed(f"{what} has more than {MAX_RANK} dimensions")
        self.visit(len(dims) + 1)
        return torch.Size([self.integer(d, what) for d in dims])

    def dtype(self, v: Any, what: str) -> torch.dtype:
        if not isinstance(v, Name) or v.key[0] != "torch" or v.key[1] not in DTYPES:
            raise malformed(f"{what} is {_kind(v)}, not a torch dtype")
        return DTYPES[v.key[1]]

    def layout(self, v: Any, what: str) -> torch.layout:
        if not isinstance(v, Call) or v.key != LAYOUT or v.kind != "REDUCE" or v.state is not None \
                or len(v.args) != 1 or not isinstance(v.args[0], str) or v.args[0] not in LAYOUTS:
            raise malformed(f"{what} is {_kind(v)}, not a torch layout")
        return LAYOUTS[v.args[0]]

    def memory_format(self, v: Any, what: str) -> torch.memory_format:
        if not isinstance(v, Call) or v.key not in MEM_FORMAT or v.kind != "REDUCE" or v.state is not None \
                or len(v.args) != 1 or v.args[0] not in (0, 1, 2) or isinstance(v.args[0], bool):
            raise malformed(f"{what} is {_kind(v)}, not a memory format")
        return MEMORY_FORMATS[v.args[0]]

    def properties(self, v: Any, what: str) -> Any:
        from torch.distributed.checkpoint.metadata import TensorProperties

        if not isinstance(v, Call) or v.key not in PROPERTIES or v.kind != "NEWOBJ" or v.args != ():
            raise malformed(f"{what} is {_kind(v)}, not TensorProperties")
        self.visit()
        st = v.state
        if not isinstance(st, tuple) or len(st) != 5:
            raise malformed(f"{what}: TensorProperties state is {_kind(st)}, not 5 values")
        return TensorProperties(dtype=self.dtype(st[0], f"{what}.dtype"), layout=self.layout(st[1], f"{what}.layout"),
                                requires_grad=self.flag(st[2], f"{what}.requires_grad"),
                                memory_format=self.memory_format(st[3], f"{what}.memory_format"),
                                pin_memory=self.flag(st[4], f"{what}.pin_memory"))

    def chunk(self, v: Any, what: str) -> Any:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        f = self.fields(v, CHUNK_MD, what, {"offsets", "sizes"}, {"offsets", "sizes"})
        return ChunkStorageMetadata(offsets=self.size(f["offsets"], f"{what}.offsets"),
                                    sizes=self.size(f["sizes"], f"{what}.sizes"))

    def entry(self, v: Any, fqn: str) -> Any:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        what = _show(fqn)
        if isinstance(v, Call) and v.key == BYTES_MD:
            self.fields(v, BYTES_MD, what, set())
            return BytesStorageMetadata()
        f = self.fields(v, TENSOR_MD, what, {"properties", "size", "chunks"}, {"properties", "size", "chunks"})
        chunks = f["chunks"]
        if not isinstance(chunks, list):
            raise malformed(f"{what}: chunks is {_kind(chunks)}, not a list")
        self.visit(len(chunks))
        return TensorStorageMetadata(properties=self.properties(f["properties"], f"{what}.properties"),
                                     size=self.size(f["size"], f"{what}.size"),
                                     chunks=[self.chunk(c, f"{what} chunk {i}") for i, c in enumerate(chunks)])

    def index(self, v: Any) -> Any:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        f = self.fields(v, INDEX, "storage_data key", {"fqn", "offset", "index"}, {"fqn"})
        fqn = self.string(f["fqn"], "storage_data key fqn")
        return MetadataIndex(fqn, self.size(f.get("offset"), f"{_show(fqn)} offset", optional=True),
                             self.integer(f.get("index"), f"{_show(fqn)} index", optional=True))

    def storage_info(self, v: Any, fqn: str) -> Any:
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        what = f"storage of {_show(fqn)}"
        f = self.fields(v, STORAGE_INFO, what, {"relative_path", "offset", "length", "transform_descriptors"},
                        {"relative_path", "offset", "length"})
        td = f.get("transform_descriptors")
        if td is not None:
            if not isinstance(td, (list, tuple)) or len(td) > 64:
                raise malformed(f"{what}: bad transform_descriptors")
            self.visit(len(td))
            td = [self.string(d, f"{what} transform descriptor") for d in td]
        return _StorageInfo(relative_path=self.string(f["relative_path"], f"{what} path"),
                            offset=self.integer(f["offset"], f"{what} offset"),
                            length=self.integer(f["length"], f"{what} length"), transform_descriptors=td)

    def storage_meta(self, v: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        if v is None:
            return None
        f = self.fields(v, STORAGE_META, "storage_meta", {"checkpoint_id", "save_id", "load_id", "modules"})
        cid = f.get("checkpoint_id")
        if isinstance(cid, Call) and cid.key in _PATHS and cid.kind == "REDUCE" and cid.state is None:
            cid = os.path.join(*[self.string(p, "storage_meta.checkpoint_id part") for p in cid.args]) \
                if cid.args else ""
        modules = f.get("modules", [])
        if not isinstance(modules, list):
            raise malformed(f"storage_meta.modules is {_kind(modules)}, not a list")
        self.visit(len(modules))
        return StorageMeta(checkpoint_id=self.string(cid, "storage_meta.checkpoint_id", optional=True),
                           save_id=self.string(f.get("save_id"), "storage_meta.save_id", optional=True),
                           load_id=self.string(f.get("load_id"), "storage_meta.load_id", optional=True),
                           modules=[self.string(m, "storage_meta module") for m in modules])

    def plain(self, v: Any, what: str) -> None:
        """planner_data: plain values only (checked, then dropped: validation does not use it)."""
        todo: list[tuple[Any, int]] = [(v, 0)]
        while todo:
            node, depth = todo.pop()
            self.visit()
            if node is None or isinstance(node, (bool, int, float, str, bytes)):
                continue
            if depth >= self.max_nesting:
                raise malformed(f"{what} is nested deeper than {self.max_nesting} levels")
            if isinstance(node, (list, tuple)):
                todo.extend((x, depth + 1) for x in node)
            elif isinstance(node, Mapping):
                for k, x in self.pairs(node, what):
                    todo.append((k, depth + 1))
                    todo.append((x, depth + 1))
            else:
                raise malformed(f"{what} holds {_kind(node)}, not plain data")

    def metadata(self, root: Any) -> Any:
        from torch.distributed.checkpoint.metadata import Metadata

        f = self.fields(root, METADATA, "the top object", {"state_dict_metadata", "planner_data", "storage_data",
                                                             "storage_meta", "version"}, {"state_dict_metadata"})
        sdm: dict[str, Any] = {}
        for fqn, item in self.pairs(f["state_dict_metadata"], "state_dict_metadata"):
            if not isinstance(fqn, str):
                raise malformed(f"state_dict_metadata key is {_kind(fqn)}, not a string")
            if fqn in sdm:
                raise malformed(f"state_dict_metadata lists {_show(fqn)} twice")
            sdm[fqn] = self.entry(item, fqn)
        storage: dict[Any, Any] = {}
        for idx, info in self.pairs(f.get("storage_data", Mapping()), "storage_data"):
            key = self.index(idx)
            if key in storage:
                raise malformed(f"storage_data lists {_show(key.fqn)} at {list(key.offset or [])} twice")
            storage[key] = self.storage_info(info, key.fqn)
        self.plain(f.get("planner_data"), "planner_data")
        return Metadata(state_dict_metadata=sdm, planner_data=None, storage_data=storage,
                        storage_meta=self.storage_meta(f.get("storage_meta")),
                        version=self.string(f.get("version"), "version", optional=True))


def build(root: Any, limits: Limits = Limits()) -> Any:
    """Pass 2: a DCP Metadata made from checked plain values. Raises LoadError(MALFORMED)."""
    return _Builder(limits).metadata(root)


def decode_metadata(data: bytes, limits: Limits = Limits()) -> Any:
    """The DCP Metadata in `data` (a `.metadata` file's bytes). Raises LoadError (UNSAFE or MALFORMED)."""
    if len(data) > limits.max_dcp_metadata_bytes:
        raise malformed(f"{len(data)} bytes, over the {limits.max_dcp_metadata_bytes}-byte limit")
    return build(decode(data, limits), limits)


__all__ = ["ALLOWED_NAMES", "MAX_MESSAGE", "build", "decode", "decode_metadata"]
