"""Verification of files against a manifest. Results are data: one status per file."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from safepoint.core.format import FileEntry, Manifest
from safepoint.core.states import CheckpointState


class FileStatus(str, Enum):
    OK = "ok"
    MISSING = "missing"
    SIZE_MISMATCH = "size_mismatch"
    HASH_MISMATCH = "hash_mismatch"
    UNSAFE_PATH = "unsafe_path"

    def __str__(self) -> str:
        return self.value


@dataclass
class VerifyReport:
    files: dict[str, FileStatus] = field(default_factory=dict)
    bytes_checked: int = 0
    error: str | None = None  # the snapshot itself is unusable (no marker, bad manifest)

    @property
    def outcome(self) -> CheckpointState:
        return outcome_of(self.files.values(), self.error)

    @property
    def problems(self) -> dict[str, FileStatus]:
        return {p: s for p, s in self.files.items() if s is not FileStatus.OK}

    def summary(self) -> str:
        if self.error:
            return self.error
        bad = self.problems
        if not bad:
            return f"{len(self.files)} files verified ({self.bytes_checked} bytes)"
        shown = ", ".join(f"{p}: {s}" for p, s in sorted(bad.items())[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        return f"{len(bad)} of {len(self.files)} files bad: {shown}{more}"


def outcome_of(statuses, error: str | None = None) -> CheckpointState:
    """Pure: the checkpoint state implied by per-file statuses."""
    statuses = list(statuses)
    if error:
        return CheckpointState.CORRUPT
    if any(s in (FileStatus.SIZE_MISMATCH, FileStatus.HASH_MISMATCH, FileStatus.UNSAFE_PATH) for s in statuses):
        return CheckpointState.CORRUPT
    if any(s is FileStatus.MISSING for s in statuses):
        return CheckpointState.INCOMPLETE
    return CheckpointState.VERIFIED


def check_file(entry: FileEntry, size: int | None, digest: Callable[[], str]) -> FileStatus:
    """Pure decision for one file; `digest` is only called when the size already matches."""
    if size is None:
        return FileStatus.MISSING
    if size != entry.size:
        return FileStatus.SIZE_MISMATCH
    return FileStatus.OK if digest() == entry.blake3 else FileStatus.HASH_MISMATCH


def verify_manifest(
    manifest: Manifest | Sequence[FileEntry],
    size_of: Callable[[str], int | None],
    digest_of: Callable[[str], str],
    *,
    workers: int = 4,
) -> VerifyReport:
    """Check every file of `manifest` (or a batch of its entries) with the given stat and hash functions
    (local or remote)."""
    files = tuple(manifest.files if isinstance(manifest, Manifest) else manifest)
    report = VerifyReport()

    def one(entry: FileEntry) -> FileStatus:
        return check_file(entry, size_of(entry.path), lambda: digest_of(entry.path))

    if workers > 1 and len(files) > 1:
        from concurrent.futures import ThreadPoolExecutor  # not for one file: its imports cost ~2 ms

        with ThreadPoolExecutor(max_workers=workers) as pool:
            _record(report, files, pool.map(one, files))
    else:
        _record(report, files, map(one, files))
    return report


def _record(report: VerifyReport, files: Sequence[FileEntry], statuses: Iterable[FileStatus]) -> None:
    for entry, status in zip(files, statuses):
        report.files[entry.path] = status
        if status is FileStatus.OK:
            report.bytes_checked += entry.size
