"""The on-disk format: manifest and marker (see docs/format.md, the specification)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import blake3

from safepoint.core.errors import FormatError

MANIFEST_NAME = "MANIFEST.json"
MARKER_NAME = "COMMITTED"
TMP_PREFIX = ".safepoint-tmp-"
#: control folder of a multi-node checkpoint's parts, relative to the snapshot folder (safepoint.destinations.parts)
PARTS_DIR = ".safepoint/parts"
CONTROL_FILES = frozenset({MANIFEST_NAME, MARKER_NAME})
FORMAT_VERSION = 1
# Bounds on a control file (docs/format.md, "Bounds"), checked in one linear pass before anything
# else reads it: a hostile manifest costs at most its size in time and memory.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_FILES = 1_000_000          # entries in `files`
MAX_PATH_BYTES = 4096          # one path, UTF-8 (Linux's PATH_MAX)
MAX_PATH_DEPTH = 128           # segments of one path
MAX_MARKER_BYTES = 64 * 1024

_RUN_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")


def digest_bytes(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def utcnow_iso() -> str:
    from datetime import datetime, timezone  # only when writing: reading a snapshot never needs it

    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def check_run(run: str) -> str:
    if not isinstance(run, str) or not _RUN_RE.match(run):
        raise FormatError(f"invalid run name {run!r}: use 1-128 of [A-Za-z0-9._-], not starting with '.'")
    return run


MAX_STEP = 2**63 - 1  # the catalog's BIGINT: a larger step could be sealed but never cataloged


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise FormatError(f"invalid step {step!r}: must be an integer in [0, 2**63 - 1]")
    return step


def safe_relpath(path: str) -> str:
    """Return `path` if it is a safe relative path inside a snapshot, else raise FormatError.

    Manifests come from disks and servers we do not trust: a path must never escape its folder.
    """
    if not isinstance(path, str) or not path:
        raise FormatError(f"unsafe path {path!r}: empty")
    if "\\" in path or "\x00" in path or path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        raise FormatError(f"unsafe path {path!r}: absolute or not '/'-separated")
    check_path_bounds(path)
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise FormatError(f"unsafe path {path!r}: contains '', '.' or '..' segments")
    if parts[0] in CONTROL_FILES and len(parts) == 1:
        raise FormatError(f"unsafe path {path!r}: a control file cannot be a data file")
    if any(p.startswith(TMP_PREFIX) for p in parts):
        raise FormatError(f"unsafe path {path!r}: temporary file name")
    return path


def check_path_bounds(path: str) -> None:
    """Refuse a path over MAX_PATH_BYTES or MAX_PATH_DEPTH segments, in time linear in its length."""
    if len(path) > MAX_PATH_BYTES or len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise FormatError(f"unsafe path {path[:80]!r}...: longer than {MAX_PATH_BYTES} bytes")
    if path.count("/") >= MAX_PATH_DEPTH:
        raise FormatError(f"unsafe path {path[:80]!r}...: deeper than {MAX_PATH_DEPTH} segments")


def _check_bounds(raw_files: list) -> None:
    """The entry count and every path's length and depth, before any entry is interpreted."""
    if len(raw_files) > MAX_FILES:
        raise FormatError(f"manifest: {len(raw_files)} files is over the {MAX_FILES} limit")
    for raw in raw_files:
        path = raw.get("path") if isinstance(raw, dict) else None
        if isinstance(path, str):
            check_path_bounds(path)


def _file_and_dir(paths: set[str]) -> bool:
    """Whether some path is also a directory of another: in sorted segment order a path's
    descendants come right after it, so neighbours suffice (no set of every prefix, which is
    quadratic in a path's depth)."""
    keyed = sorted(p.split("/") for p in paths)
    return any(len(b) > len(a) and b[: len(a)] == a for a, b in zip(keyed, keyed[1:]))


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    blake3: str


@dataclass(frozen=True)
class Manifest:
    run: str
    step: int
    files: tuple[FileEntry, ...]
    created: str = field(default_factory=utcnow_iso)
    world_size: int = 1
    ranks: tuple[int, ...] | None = None
    node: str | None = None
    parent: tuple[str, int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def held_ranks(self) -> tuple[int, ...]:
        return self.ranks if self.ranks is not None else tuple(range(self.world_size))

    def file(self, path: str) -> FileEntry:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)

    def to_json_bytes(self) -> bytes:
        doc = {
            "format": "safepoint.manifest",
            "format_version": FORMAT_VERSION,
            "run": self.run,
            "step": self.step,
            "created": self.created,
            "hash": "blake3",
            "world_size": self.world_size,
            "ranks": list(self.held_ranks),
            "node": self.node,
            "parent": {"run": self.parent[0], "step": self.parent[1]} if self.parent else None,
            "files": [{"path": f.path, "size": f.size, "blake3": f.blake3} for f in self.files],
            "meta": self.meta,
        }
        return (json.dumps(doc, indent=1, sort_keys=False) + "\n").encode()


def build_manifest(run: str, step: int, files: list[FileEntry], **kw: Any) -> Manifest:
    """Make a validated manifest; files are sorted by path."""
    m = Manifest(run=check_run(run), step=check_step(step), files=tuple(sorted(files, key=lambda f: f.path)), **kw)
    return parse_manifest(m.to_json_bytes())


def _need(doc: dict, key: str, typ: type | tuple[type, ...]) -> Any:
    if key not in doc:
        raise FormatError(f"manifest: missing field {key!r}")
    val = doc[key]
    if not isinstance(val, typ) or (typ is int and isinstance(val, bool)):
        raise FormatError(f"manifest: field {key!r} has the wrong type")
    return val


def parse_manifest(data: bytes) -> Manifest:
    """Parse and validate manifest bytes. Raises FormatError on anything unexpected."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise FormatError(f"manifest: {len(data)} bytes is over the {MAX_MANIFEST_BYTES} limit")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSON, an int past 4300 digits
        raise FormatError(f"manifest: not valid JSON ({e.__class__.__name__})") from None
    if not isinstance(doc, dict):
        raise FormatError("manifest: not a JSON object")
    if isinstance(doc.get("files"), list):
        _check_bounds(doc["files"])  # first: nothing below may cost more than the bytes read
    if doc.get("format") != "safepoint.manifest":
        raise FormatError("manifest: unknown format")
    if _need(doc, "format_version", int) != FORMAT_VERSION:
        raise FormatError(f"manifest: unsupported format_version {doc['format_version']!r}")
    if doc.get("hash", "blake3") != "blake3":
        raise FormatError("manifest: unsupported hash")
    run = check_run(_need(doc, "run", str))
    step = check_step(_need(doc, "step", int))
    created = _need(doc, "created", str)
    world_size = doc.get("world_size", 1)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise FormatError("manifest: world_size must be an integer >= 1")
    ranks = doc.get("ranks")
    if ranks is not None:
        if not isinstance(ranks, list) or not all(
            isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world_size for r in ranks
        ) or len(set(ranks)) != len(ranks):
            raise FormatError("manifest: ranks must be distinct integers in [0, world_size)")
        ranks = tuple(sorted(ranks))
    node = doc.get("node")
    if node is not None and not isinstance(node, str):
        raise FormatError("manifest: node must be a string")
    parent = doc.get("parent")
    if parent is not None:
        if not isinstance(parent, dict):
            raise FormatError("manifest: parent must be an object")
        parent = (check_run(_need(parent, "run", str)), check_step(_need(parent, "step", int)))
    meta = doc.get("meta", {})
    if not isinstance(meta, dict):
        raise FormatError("manifest: meta must be an object")
    raw_files = _need(doc, "files", list)
    files: list[FileEntry] = []
    seen: set[str] = set()
    for raw in raw_files:
        if not isinstance(raw, dict):
            raise FormatError("manifest: file entry is not an object")
        path = safe_relpath(_need(raw, "path", str))
        size = _need(raw, "size", int)
        digest = _need(raw, "blake3", str)
        if size < 0:
            raise FormatError(f"manifest: negative size for {path!r}")
        if not _HEX64_RE.match(digest):
            raise FormatError(f"manifest: bad digest for {path!r}")
        if path in seen:
            raise FormatError(f"manifest: duplicate path {path!r}")
        seen.add(path)
        files.append(FileEntry(path, size, digest))
    # A file cannot also be a directory of another file.
    if _file_and_dir(seen):
        raise FormatError("manifest: a path is both a file and a directory")
    return Manifest(
        run=run, step=step, files=tuple(sorted(files, key=lambda f: f.path)), created=created,
        world_size=world_size, ranks=ranks, node=node, parent=parent, meta=meta,
    )


@dataclass(frozen=True)
class Marker:
    run: str
    step: int
    manifest_blake3: str

    def to_json_bytes(self) -> bytes:
        return (json.dumps({
            "format": "safepoint.marker", "format_version": FORMAT_VERSION,
            "manifest_blake3": self.manifest_blake3, "run": self.run, "step": self.step,
        }) + "\n").encode()


def marker_for(manifest_bytes: bytes, manifest: Manifest) -> Marker:
    return Marker(manifest.run, manifest.step, digest_bytes(manifest_bytes))


def parse_marker(data: bytes) -> Marker:
    if len(data) > MAX_MARKER_BYTES:
        raise FormatError(f"marker: over the {MAX_MARKER_BYTES}-byte limit")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: JSON, an int past 4300 digits
        raise FormatError("marker: not valid JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != "safepoint.marker":
        raise FormatError("marker: unknown format")
    if doc.get("format_version") != FORMAT_VERSION:
        raise FormatError("marker: unsupported format_version")
    digest = doc.get("manifest_blake3")
    if not isinstance(digest, str) or not _HEX64_RE.match(digest):
        raise FormatError("marker: bad manifest digest")
    return Marker(check_run(doc.get("run")), check_step(doc.get("step")), digest)


def load_committed(manifest_bytes: bytes | None, marker_bytes: bytes | None) -> Manifest:
    """Check that a marker binds a manifest, and return the manifest.

    Raises FormatError for a missing marker (not committed), a missing manifest, or a mismatch.
    """
    if marker_bytes is None:
        raise FormatError("not committed: no COMMITTED marker")
    marker = parse_marker(marker_bytes)
    if manifest_bytes is None:
        raise FormatError("COMMITTED marker without MANIFEST.json")
    if digest_bytes(manifest_bytes) != marker.manifest_blake3:
        raise FormatError("MANIFEST.json does not match the digest in COMMITTED")
    manifest = parse_manifest(manifest_bytes)
    if (manifest.run, manifest.step) != (marker.run, marker.step):
        raise FormatError("COMMITTED names another run or step than MANIFEST.json")
    return manifest
