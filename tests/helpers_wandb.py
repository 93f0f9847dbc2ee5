"""Read what an offline W&B run holds, from its own file (`wandb/offline-run-*/run-*.wandb`).

The file is W&B's transaction log: a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then LevelDB-log
records in 32 KiB blocks (CRC32C, length, type FULL/FIRST/MIDDLE/LAST), each payload one protobuf
`wandb_internal_pb2.Record`. wandb no longer ships a Python reader (its core is in Go), so this is
the few lines of one; the records are parsed with wandb's own protobuf classes.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def payloads(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
        elif kind == 0 and length == 0:
            pos += left - HEADER  # zero padding to the block's end
        else:
            raise AssertionError(f"{path}: unknown record type {kind} at {pos}")


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    for payload in payloads(path):
        r = pb.Record()
        r.ParseFromString(payload)
        yield r


def closed(path: Path) -> bool:
    """The run file ends with its `exit` record: W&B's service has written all of it."""
    try:
        return any(r.WhichOneof("record_type") == "exit" for r in records(path))
    except (AssertionError, OSError):
        return False


def run_files(root: Path, timeout_s: float = 30.0) -> list[Path]:
    """The offline run files under `root`, each once W&B's service has finished writing it: `run.finish()`
    returns before the service (a separate process) has flushed the last records, so read too early, a
    file can miss the artifacts just logged. Polls for the `exit` record, up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    files = sorted(root.glob("wandb/offline-run-*/run-*.wandb"))
    while not all(closed(f) for f in files):
        assert time.monotonic() < deadline, f"W&B never finished writing {[f for f in files if not closed(f)]}"
        time.sleep(0.05)
    return files


def artifacts(root: Path) -> list[dict[str, Any]]:
    """Every artifact logged by the offline runs under `root` (a `wandb/` folder's parent), as data."""
    out = []
    for f in run_files(root):
        for r in records(f):
            if r.WhichOneof("record_type") != "artifact":
                continue
            a = r.artifact
            out.append({
                "file": f.name, "run_id": a.run_id, "project": a.project, "name": a.name, "type": a.type,
                "aliases": list(a.aliases), "digest": a.digest, "description": a.description,
                "metadata": json.loads(a.metadata) if a.metadata else {},
                "manifest": [{"path": e.path, "ref": e.ref, "digest": e.digest, "size": e.size}
                             for e in a.manifest.contents],
            })
    return out


def run_config(root: Path) -> list[dict[str, Any]]:
    """The `run` records' id, group, job type and config of the offline runs under `root`."""
    out = []
    for f in run_files(root):
        for r in records(f):
            if r.WhichOneof("record_type") == "run":
                cfg = {u.key: json.loads(u.value_json) for u in r.run.config.update}
                out.append({"id": r.run.run_id, "group": r.run.run_group, "job_type": r.run.job_type, "config": cfg})
    return out
