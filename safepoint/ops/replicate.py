"""Replicate a committed local snapshot to a destination: upload, read back, then commit there.

Each local byte is read once: the upload hashes what it reads, which is also the check of the
local copy against the manifest. Every object is then read back and hashed, or attested by the
store (a checksum of the same bytes it checked on arrival, Destination.attest), before the replica's
manifest and marker are written (docs/format.md, "Replica layout").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from safepoint.core.errors import FormatError
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME, FileEntry, Manifest, digest_bytes, load_committed
from safepoint.core.states import CheckpointState, ReplicaState
from safepoint.core.verify import FileStatus, VerifyReport, check_file, outcome_of
from safepoint.destinations.base import Destination
from safepoint.destinations.replica_commit import commit_replica, read_committed
from safepoint.local.snapshot import LocalSnapshot

log = logging.getLogger(__name__)

Progress = Callable[[int], None]


@dataclass
class ReplicaResult:
    url: str
    destination: str
    state: ReplicaState
    local: dict[str, FileStatus] = field(default_factory=dict)   # what reading the local bytes found
    remote: dict[str, FileStatus] = field(default_factory=dict)  # what reading the replica back found
    bytes_uploaded: int = 0
    bytes_reused: int = 0
    error: str | None = None
    proofs: dict[str, str] = field(default_factory=dict)  # per file: "read-back" or the store's (attest)

    @property
    def proof(self) -> str | None:
        """What vouches for the replica's bytes: one proof, or several joined by "+" (catalog: replicas.proof)."""
        return "+".join(sorted(set(self.proofs.values()))) or None

    @property
    def local_outcome(self) -> CheckpointState:
        return outcome_of(self.local.values())


READ_BACK = "read-back"


def _upload_one(
    dest: Destination, snap: LocalSnapshot, entry: FileEntry
) -> tuple[FileStatus, FileStatus, int, int, str]:
    """Upload or reuse one file. Returns (local status, remote status, uploaded, reused, proof)."""
    run, step = snap.manifest.run, snap.manifest.step
    # Resume: an object already there with the right size is reused if it hashes right.
    if dest.size(run, step, entry.path) == entry.size and dest.digest(run, step, entry.path) == entry.blake3:
        return FileStatus.OK, FileStatus.OK, 0, entry.size, READ_BACK
    try:
        source = snap.path_of(entry.path)
    except FormatError:
        return FileStatus.UNSAFE_PATH, FileStatus.MISSING, 0, 0, READ_BACK
    local_status = check_file(entry, snap.size_of(entry.path), lambda: "")
    if local_status is not FileStatus.SIZE_MISMATCH and local_status is not FileStatus.MISSING:
        sent = dest.upload(run, step, entry, source)
        local_status = FileStatus.OK if sent == entry.blake3 else FileStatus.HASH_MISMATCH
    if local_status is not FileStatus.OK:
        return local_status, FileStatus.MISSING, 0, 0, READ_BACK
    # The bytes sent are the manifest's (their BLAKE3 just matched): where the store attests that it
    # holds exactly what was sent, that stands for the read-back (Destination.attest).
    proof = dest.attest(run, step, entry.path, entry.size)
    if proof is not None:
        return FileStatus.OK, FileStatus.OK, entry.size, 0, proof
    remote = check_file(entry, dest.size(run, step, entry.path), lambda: dest.digest(run, step, entry.path))
    return FileStatus.OK, remote, entry.size, 0, READ_BACK


def replicate(
    snap: LocalSnapshot, dest: Destination, *, workers: int = 4, progress: Progress | None = None
) -> ReplicaResult:
    """Copy `snap` to `dest` and commit it there if, and only if, every byte verified."""
    m = snap.manifest
    result = ReplicaResult(url=dest.snapshot_url(m.run, m.step), destination=dest.url, state=ReplicaState.PENDING)

    existing = dest.read_control(m.run, m.step, MARKER_NAME)
    if existing is not None and existing != snap.marker_bytes and _drop_superseded(dest, m):
        existing = None
    if existing is not None and existing != snap.marker_bytes:
        result.state = ReplicaState.FAILED
        result.error = f"{result.url} is already committed with a different manifest; refusing to overwrite"
        return result

    # Cheap pre-check: a file missing or of the wrong size locally stops us before any upload.
    for entry in m.files:
        try:
            status = check_file(entry, snap.size_of(entry.path), lambda e=entry: e.blake3)
        except FormatError:
            status = FileStatus.UNSAFE_PATH
        if status is not FileStatus.OK:
            result.local[entry.path] = status
    if result.local:
        for entry in m.files:
            result.local.setdefault(entry.path, FileStatus.OK)
        result.state = ReplicaState.FAILED
        result.error = "local copy does not match its manifest: " + VerifyReport(result.local).summary()
        return result

    def one(entry: FileEntry):
        out = _upload_one(dest, snap, entry)
        if progress:
            progress(entry.size)
        return out

    # Many small files are bound by per-object latency (fsync, requests), not bandwidth: overlap more.
    with ThreadPoolExecutor(max_workers=max(1, workers, min(16, len(m.files) // 64))) as pool:
        for entry, (loc, rem, up, reused, proof) in zip(m.files, pool.map(one, m.files)):
            result.local[entry.path] = loc
            result.remote[entry.path] = rem
            result.proofs[entry.path] = proof
            result.bytes_uploaded += up
            result.bytes_reused += reused

    if result.local_outcome is not CheckpointState.VERIFIED:
        result.state = ReplicaState.FAILED
        result.error = "local copy does not match its manifest: " + VerifyReport(result.local).summary()
        return result
    remote_report = VerifyReport(result.remote)
    if remote_report.problems:
        result.state = ReplicaState.CORRUPT
        result.error = "replica did not read back correctly: " + remote_report.summary()
        return result

    if existing is None:
        # Never replaces another writer's manifest; accepts a concurrent commit of the same manifest.
        why_not = commit_replica(dest, m.run, m.step, snap.manifest_bytes, snap.marker_bytes)
        if why_not is not None:
            result.state = ReplicaState.FAILED
            result.error = f"{result.url}: {why_not}"
            return result
    elif dest.read_control(m.run, m.step, MANIFEST_NAME) != snap.manifest_bytes:
        # Our marker, but the manifest it binds is gone or damaged: a marker without a manifest is
        # a corrupt replica, never a verified one. Restore the exact bytes the marker binds.
        dest.write_control(m.run, m.step, MANIFEST_NAME, snap.manifest_bytes)
    result.state = ReplicaState.VERIFIED
    return result


def _drop_superseded(dest: Destination, m: Manifest) -> bool:
    """The replica there is the version this re-sealed manifest supersedes: remove it (marker first). True if so."""
    supersedes = m.meta.get("supersedes")
    if not isinstance(supersedes, str):
        return False
    try:
        manifest_bytes, marker = read_committed(dest, m.run, m.step)
        old = load_committed(manifest_bytes, marker)
    except FormatError:
        return False
    if digest_bytes(manifest_bytes or b"") != supersedes:
        return False
    log.info("%s: replacing the superseded version of %s/%s (re-saved and sealed again)",
             dest.snapshot_url(m.run, m.step), m.run, m.step)
    dest.delete_snapshot(m.run, m.step, [f.path for f in old.files])
    return True
