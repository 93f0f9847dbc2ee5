"""Read a Snapshotter snapshot back: the nested state, rebuilt without pickle.

`load(folder)` refuses a folder without a valid COMMITTED marker (docs/format.md), checks the
rank's file against the manifest's BLAKE3 (unless verify=False), checks the safetensors header
with Safepoint's own bounded parser, and rebuilds the nesting from the JSON tree in the header's
metadata. `load_file(path)` does the last two steps for one shard file, wherever it came from.
Any safetensors loader reads the same files as a flat {name: tensor} dict.
"""

from __future__ import annotations

import json
import os
from typing import Any

from safepoint.core.errors import FormatError, UsageError
from safepoint.core.hashing import hash_path
from safepoint.local.snapshot import LocalSnapshot
from safepoint.snapshotter.errors import SnapshotError
from safepoint.snapshotter.layout import META_FORMAT, shard_name
from safepoint.snapshotter.structure import tensor_names, unflatten
from safepoint.validation.loaders.base import LoadError
from safepoint.validation.loaders.safetensors_file import read_header


def load_file(path: str | os.PathLike, *, device: str = "cpu") -> Any:
    """Rebuild the state saved in one Snapshotter safetensors file. Raises FormatError on bad bytes."""
    from safetensors import safe_open

    try:
        entries = read_header(path)
    except LoadError as e:
        raise FormatError(f"{os.fspath(path)}: {e.message}") from None
    with safe_open(os.fspath(path), framework="pt", device=device) as f:
        md = f.metadata() or {}
        if md.get("format") != META_FORMAT:
            raise FormatError(f"{os.fspath(path)}: not a Safepoint snapshot file (no structure in its metadata); "
                              "read it as a flat dict with safetensors instead")
        try:
            tree = json.loads(md["structure"])
        except (KeyError, json.JSONDecodeError, RecursionError):
            raise FormatError(f"{os.fspath(path)}: the snapshot structure is missing or not JSON") from None
        missing = tensor_names(tree) - {e.name for e in entries}
        if missing:
            raise FormatError(f"{os.fspath(path)}: the structure names tensors the file lacks: {sorted(missing)[:5]}")
        return unflatten(tree, f.get_tensor)


def load(folder: str | os.PathLike, *, rank: int | None = None, device: str = "cpu", verify: bool = True) -> Any:
    """The state one rank saved in a committed snapshot folder (rank may be omitted when world_size is 1)."""
    snap = LocalSnapshot.open(folder)
    m = snap.manifest
    if rank is None:
        if m.world_size != 1:
            raise UsageError(f"{os.fspath(folder)} holds {m.world_size} ranks; pass rank=")
        rank = 0
    name = shard_name(rank, m.world_size)
    try:
        entry = m.file(name)
    except KeyError:
        raise SnapshotError(f"{os.fspath(folder)}: no file for rank {rank} ({name}) in the manifest") from None
    path = snap.path_of(name)
    if verify:
        try:
            size, digest = hash_path(path)
        except FileNotFoundError:
            raise SnapshotError(f"{path}: missing") from None
        if (size, digest) != (entry.size, entry.blake3):
            raise SnapshotError(f"{path}: does not match the manifest (size or BLAKE3): corrupt")
    return load_file(path, device=device)
