"""Multi-node checkpoints at a destination: per-part control files, then one merged commit.

Every node replicates its own part (the ranks it holds) into the shared snapshot folder
`<base>/<run>/<step>/`. Data files of different ranks have distinct names, but each part's
`MANIFEST.json` and `COMMITTED` would collide, so a part commits under its own control folder,
`.safepoint/parts/<first rank>/`. Whoever finds every part committed writes the merged manifest
and the snapshot's `COMMITTED` (docs/format.md, "Multi-node checkpoints"). The merge is a pure,
deterministic function of the parts, so concurrent finalizers write identical bytes and the
conditional put of the marker lets exactly one of them win.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from safepoint.core.errors import FormatError
from safepoint.core.format import (
    MANIFEST_NAME,
    MARKER_NAME,
    PARTS_DIR,
    FileEntry,
    Manifest,
    build_manifest,
    digest_bytes,
    load_committed,
    marker_for,
)
from safepoint.destinations.base import Destination, SnapshotListing
from safepoint.destinations.replica_commit import commit_replica

#: data files of a multi-node checkpoint MUST NOT live under this prefix
RESERVED_PREFIX = ".safepoint/"


def is_part(m: Manifest) -> bool:
    """True when the manifest holds a strict subset of the world's ranks (one node's part)."""
    return m.ranks is not None and set(m.ranks) != set(range(m.world_size))


def part_key(ranks: Iterable[int]) -> str:
    """The name of a part's control folder: its lowest rank (parts hold disjoint ranks)."""
    ranks = list(ranks)
    if not ranks:
        raise FormatError("a part holds at least one rank")
    return str(min(ranks))


def part_control(key: str, name: str) -> str:
    """Relative path of a part's control file, e.g. `.safepoint/parts/2/COMMITTED`."""
    if not key.isdigit() or name not in (MANIFEST_NAME, MARKER_NAME):
        raise FormatError(f"bad part control file {key!r}/{name!r}")
    return f"{PARTS_DIR}/{key}/{name}"


def check_part(m: Manifest) -> None:
    """Refuse a part whose data files would shadow the reserved control folder."""
    for f in m.files:
        if f.path.startswith(RESERVED_PREFIX):
            raise FormatError(f"{f.path!r}: data files of a multi-node checkpoint must not lie under "
                              f"{RESERVED_PREFIX!r}")


class PartDestination(Destination):
    """A view of a destination for one part: data files are shared, control files are the part's own.

    `safepoint.ops.replicate.replicate(snap, PartDestination(dest, key))` then uploads, reads back and
    commits the part with the exact rules of a whole snapshot, under the part's control folder.
    """

    def __init__(self, inner: Destination, key: str):
        self.inner = inner
        self.key = key
        self.url = inner.url

    def snapshot_url(self, run: str, step: int) -> str:
        return self.inner.snapshot_url(run, step)

    def size(self, run: str, step: int, relpath: str) -> int | None:
        return self.inner.size(run, step, relpath)

    def upload(self, run: str, step: int, entry: FileEntry, source: Path) -> str:
        return self.inner.upload(run, step, entry, source)

    def digest(self, run: str, step: int, relpath: str) -> str:
        return self.inner.digest(run, step, relpath)

    def read_control(self, run: str, step: int, name: str) -> bytes | None:
        return self.inner.read_control(run, step, part_control(self.key, name))

    def write_control(self, run: str, step: int, name: str, data: bytes, *, exclusive: bool = False) -> bool:
        return self.inner.write_control(run, step, part_control(self.key, name), data, exclusive=exclusive)

    def delete_files(self, run: str, step: int, relpaths: list[str]) -> None:
        self.inner.delete_files(run, step, relpaths)

    def delete_control(self, run: str, step: int, name: str) -> None:
        self.inner.delete_control(run, step, part_control(self.key, name))

    def committed_snapshots(self) -> list[tuple[str, int]]:
        return self.inner.committed_snapshots()

    def listing(self, run: str | None = None, step: int | None = None) -> dict[tuple[str, int], SnapshotListing]:
        return self.inner.listing(run, step)

    def close(self) -> None:
        """The caller owns the inner destination."""


def merge_manifests(parts: Iterable[tuple[Manifest, str]]) -> Manifest:
    """The manifest of the whole checkpoint from its parts, given as (manifest, BLAKE3 of its bytes).

    Pure and deterministic. Parts must agree on run, step, world_size and parent, hold disjoint
    ranks, and list any shared path with the same size and digest. `created` is the latest part's;
    `meta` is the meta of the part holding the lowest rank plus `meta.parts`: one entry per part
    (node, ranks, manifest_blake3), which binds the merged manifest to the parts it was made of.
    """
    ordered = sorted(parts, key=lambda p: min(p[0].held_ranks))
    if not ordered:
        raise FormatError("no parts to merge")
    parts = [m for m, _ in ordered]
    first = parts[0]
    files: dict[str, FileEntry] = {}
    ranks: set[int] = set()
    for m in parts:
        if (m.run, m.step, m.world_size, m.parent) != (first.run, first.step, first.world_size, first.parent):
            raise FormatError(f"{first.run}/{first.step}: parts disagree on run, step, world_size or parent")
        overlap = ranks & set(m.held_ranks)
        if overlap:
            raise FormatError(f"{m.run}/{m.step}: ranks {sorted(overlap)} are held by two parts")
        ranks |= set(m.held_ranks)
        for f in m.files:
            old = files.get(f.path)
            if old is not None and old != f:
                raise FormatError(f"{m.run}/{m.step}: parts disagree on {f.path!r}")
            files[f.path] = f
    meta: dict[str, Any] = dict(first.meta)
    meta["parts"] = [{"node": m.node, "ranks": list(m.held_ranks), "manifest_blake3": digest}
                     for m, digest in ordered]
    return build_manifest(
        first.run, first.step, list(files.values()), created=max(m.created for m in parts),
        world_size=first.world_size, ranks=tuple(sorted(ranks)), node=None, parent=first.parent, meta=meta,
    )


class Assembly(str, Enum):
    COMMITTED = "committed"    # the merged manifest and marker are in place (now or before)
    WAITING = "waiting"        # some part has not committed at this destination yet
    CONFLICT = "conflict"      # parts disagree, or another merged marker is already there

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class AssemblyResult:
    state: Assembly
    url: str
    manifest: Manifest | None = None
    waiting_for: tuple[str, ...] = ()
    error: str | None = None


def read_part(dest: Destination, run: str, step: int, key: str) -> tuple[Manifest, str] | None:
    """A committed part at `dest` as (manifest, BLAKE3 of its bytes); None when it has no marker yet."""
    marker = dest.read_control(run, step, part_control(key, MARKER_NAME))
    if marker is None:
        return None
    raw = dest.read_control(run, step, part_control(key, MANIFEST_NAME))
    return load_committed(raw, marker), digest_bytes(raw or b"")


def assemble(dest: Destination, run: str, step: int, parts: dict[str, str | None]) -> AssemblyResult:
    """Write the merged manifest and marker once every part in `parts` has committed at `dest`.

    `parts` maps part key -> the part manifest's BLAKE3 the catalog recorded (None: don't check).
    Idempotent; safe to call from every node at once.
    """
    url = dest.snapshot_url(run, step)
    manifests: list[tuple[Manifest, str]] = []
    waiting: list[str] = []
    try:
        for key in sorted(parts, key=int):
            found = read_part(dest, run, step, key)
            if found is None:
                waiting.append(key)
                continue
            want = parts[key]
            if want is not None and found[1] != want:
                return AssemblyResult(Assembly.CONFLICT, url,
                                      error=f"part {key} at {url} is not the part the catalog recorded")
            manifests.append(found)
        if waiting:
            return AssemblyResult(Assembly.WAITING, url, waiting_for=tuple(waiting))
        merged = merge_manifests(manifests)
    except FormatError as e:
        return AssemblyResult(Assembly.CONFLICT, url, error=f"{url}: {e}")
    if set(merged.held_ranks) != set(range(merged.world_size)):
        missing = sorted(set(range(merged.world_size)) - set(merged.held_ranks))
        return AssemblyResult(Assembly.WAITING, url, merged, error=f"ranks {missing} have no part")
    data = merged.to_json_bytes()
    marker = marker_for(data, merged).to_json_bytes()
    why_not = commit_replica(dest, run, step, data, marker)  # never replaces another writer's manifest
    if why_not is None:
        return AssemblyResult(Assembly.COMMITTED, url, merged)
    return AssemblyResult(Assembly.CONFLICT, url, merged, error=f"{url}: {why_not}")
