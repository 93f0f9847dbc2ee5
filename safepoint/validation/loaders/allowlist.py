"""Which non-tensor content a checkpoint may hold and still be loaded, and what a refusal means.

Trainers save more than tensors: Hugging Face `rng_state.pth` and Accelerate `random_states_0.pkl`
hold numpy RNG state (arrays), which torch's weights-only unpickler refuses by default. Numpy arrays
and dtypes are plain data, so they are allowed here, by name, through
`torch.serialization.safe_globals` scoped to one load: never plain pickle, never a global the list
does not name.

Everything else that the weights-only unpickler refuses is never loaded. Such a refusal is not damage:
`training_args.bin` is a pickled `TrainingArguments`, its bytes are hashed and replicated like every
byte, and validation reports it as "not loaded: opaque pickle". A pickle that names a global able to
run commands or code (os.system, builtins.eval, subprocess...) is different: that is an attack, and
it stays UNSAFE, failing the checkpoint. The globals are read from the pickle's opcodes
(torch.serialization.get_unsafe_globals_in_checkpoint), without executing anything.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickletools
import re
import warnings
import zipfile
from collections.abc import Iterator
from typing import IO, Any

import numpy as np
import torch

__all__ = ["DANGEROUS_MODULES", "dangerous", "known_safe_globals", "refused_globals", "scoped_safe_globals"]

# Module roots whose globals can run commands, code, or reach the network or the filesystem.
DANGEROUS_MODULES = frozenset({
    "os", "posix", "nt", "subprocess", "sys", "builtins", "__builtin__", "shutil", "socket", "pty", "importlib",
    "runpy", "code", "codeop", "ctypes", "marshal", "pickle", "_pickle", "types", "webbrowser", "multiprocessing",
    "signal", "tempfile", "urllib", "http", "ftplib", "smtplib", "telnetlib", "asyncio",
    "threading", "_thread", "operator", "functools", "inspect", "pdb", "bdb", "timeit", "trace", "profile",
    "cProfile", "platform", "glob", "zipimport", "pkgutil", "site", "sysconfig", "distutils", "setuptools", "pip",
    "numpy",  # the allowed ones are listed below; any other numpy global is a gadget (numpy.testing runstring)
})


def known_safe_globals() -> list[Any]:
    """Numpy arrays, dtypes and scalars (RNG state of trainers): data, never behaviour."""
    core = getattr(np, "_core", None) or np.core
    found: list[Any] = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    scalar = getattr(core.multiarray, "scalar", None)
    if scalar is not None:
        found.append(scalar)
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        for name in dir(dtypes):
            obj = getattr(dtypes, name)
            if name.endswith("DType") and isinstance(obj, type) and name not in ("ObjectDType", "VoidDType"):
                found.append(obj)
    for name in ("bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                 "float32", "float64"):
        found.append(getattr(np, name))
    return found


_SAFE = known_safe_globals()


@contextlib.contextmanager
def scoped_safe_globals() -> Iterator[None]:
    """The allow-list, for one torch.load: removed again afterwards, whatever happens."""
    with torch.serialization.safe_globals(_SAFE):
        yield


MAX_PICKLE_SCAN_BYTES = 64 * 1024 * 1024


def globals_in_pickle(data: bytes) -> list[str]:
    """Every global a pickle names, in the order it names them (the outermost object's class first),
    read with pickletools: nothing is executed. Raises on a pickle that does not parse."""
    names: list[str] = []
    strings: list[str] = []
    for op, arg, _pos in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            strings = [*strings[-1:], str(arg)]
        elif op.name == "GLOBAL":
            names.append(str(arg).replace(" ", "."))
        elif op.name == "STACK_GLOBAL" and len(strings) == 2:
            names.append(".".join(strings))
        elif op.name == "STOP":
            break
    return list(dict.fromkeys(names))


def refused_globals(source: str | os.PathLike | IO[bytes]) -> list[str] | None:
    """The globals a torch.save (zip) pickle names that are not allowed, outermost first, read without
    unpickling (torch.serialization.get_unsafe_globals_in_checkpoint, ordered by the pickle's own
    opcodes); None when they cannot be listed (not the zip format, or broken)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with scoped_safe_globals():
                unsafe = list(torch.serialization.get_unsafe_globals_in_checkpoint(_rewound(source)))
    except Exception:  # noqa: BLE001 - any failure: cannot tell
        return None
    try:
        with zipfile.ZipFile(_rewound(source)) as z:
            member = next(n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl"))
            if z.getinfo(member).file_size > MAX_PICKLE_SCAN_BYTES:
                return unsafe
            order = globals_in_pickle(z.read(member))
    except Exception:  # noqa: BLE001 - the listing stands, unordered
        return unsafe
    finally:
        _rewound(source)
    rank = {n: i for i, n in enumerate(order)}
    return sorted(unsafe, key=lambda n: rank.get(n, len(rank)))


def _rewound(source: str | os.PathLike | IO[bytes]) -> str | os.PathLike | IO[bytes]:
    if isinstance(source, io.IOBase) or hasattr(source, "seek"):
        with contextlib.suppress(Exception):
            source.seek(0)  # type: ignore[union-attr]
    return source


_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL ([\w.]+)")


def globals_in_message(text: str) -> list[str]:
    return _GLOBAL_IN_MESSAGE.findall(text)


def dangerous(names: list[str]) -> list[str]:
    """The names among `names` whose module could run code: these make a pickle an attack."""
    return [n for n in names if n.split(".", 1)[0] in DANGEROUS_MODULES]
