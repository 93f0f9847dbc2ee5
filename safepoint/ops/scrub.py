"""Scrubbing: re-read a rotating slice of every verified replica, like `restic check --read-data-subset`.

Bit rot on a remote disk is silent until someone reads the bytes. Reading every replica in full
on every pass is too expensive, so each pass reads one slice `i` of `n` of every replica's files
(a file's slice is a hash of run, step and path: stable across passes and hosts), and the next pass
reads slice `i+1`. After `n` passes every byte was read once. A slice that finds a problem is
followed at once by a full verification through `pipeline.verify_url`, which records the replica
as corrupt or missing and settles the checkpoint (the last good copy is never dropped).

The choice of what to read is pure (`slice_of`, `select`, `next_slice`); reading goes through
`verify_slice` (destinations) and the scrub flow (flows/scrub.py), which can fan batches out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from safepoint.catalog.store import Catalog
from safepoint.core.errors import FormatError
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME, FileEntry, Manifest, digest_bytes, load_committed
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.core.verify import FileStatus, VerifyReport, check_file
from safepoint.destinations.base import Destination

SCRUB_EVENT = "scrub"


def slice_of(run: str, step: int, path: str, of: int) -> int:
    """The slice (0..of-1) a file belongs to; stable for a given file."""
    return int(digest_bytes(f"{run}/{step}/{path}".encode())[:12], 16) % of


def select(manifest: Manifest, index: int, of: int) -> list[FileEntry]:
    """The files of slice `index` of `of`."""
    if of < 1 or not 0 <= index < of:
        raise ValueError(f"slice {index}/{of} is out of range")
    return [f for f in manifest.files if slice_of(manifest.run, manifest.step, f.path, of) == index]


def next_slice(previous: dict[str, Any] | None, of: int) -> int:
    """The slice after the last pass (restart at 0 when the number of slices changed)."""
    if not previous or previous.get("of") != of:
        return 0
    return (int(previous.get("index", -1)) + 1) % of


def parse_subset(text: str) -> tuple[int | None, int]:
    """'n' -> (None, n): rotate through n slices; 'i/n' -> slice i-1 of n (1-based, as restic)."""
    if "/" in text:
        a, b = text.split("/", 1)
        i, n = int(a), int(b)
        if n < 1 or not 1 <= i <= n:
            raise ValueError(f"subset {text!r}: need 1 <= i <= n")
        return i - 1, n
    n = int(text)
    if n < 1:
        raise ValueError(f"subset {text!r}: need n >= 1")
    return None, n


@dataclass(frozen=True)
class Target:
    checkpoint_id: int
    run: str
    step: int
    url: str            # the replica (snapshot URL)
    destination: str    # its base URL


def targets(catalog: Catalog, run: str | None = None) -> list[Target]:
    """Every verified replica of every verified checkpoint."""
    out = []
    for v in catalog.list_checkpoints(run, states=[CS.VERIFIED]):
        for r in v.replicas:
            if r.state is RS.VERIFIED:
                out.append(Target(v.id, v.run, v.step, r.url, r.destination))
    return out


def replica_manifest(dest: Destination, run: str, step: int) -> Manifest:
    """The replica's own manifest, bound by its marker (FormatError otherwise)."""
    return load_committed(dest.read_control(run, step, MANIFEST_NAME), dest.read_control(run, step, MARKER_NAME))


def verify_files(dest: Destination, run: str, step: int, files: Sequence[FileEntry]) -> VerifyReport:
    """Hash some files of a replica against their manifest entries (one batch of a scrub)."""
    report = VerifyReport()
    for f in files:
        status = check_file(f, dest.size(run, step, f.path), lambda f=f: dest.digest(run, step, f.path))
        report.files[f.path] = status
        if status is FileStatus.OK:
            report.bytes_checked += f.size
    return report


def merge_reports(reports: Sequence[VerifyReport]) -> VerifyReport:
    out = VerifyReport()
    for r in reports:
        out.files.update(r.files)
        out.bytes_checked += r.bytes_checked
        if r.error and not out.error:
            out.error = r.error
    return out


def last_pass(catalog: Catalog) -> dict[str, Any] | None:
    """Detail of the most recent scrub pass (a `scrub` catalog event with `pass: true`)."""
    for e in reversed(catalog.events(kind=SCRUB_EVENT)):
        if e["detail"].get("pass"):
            return e["detail"]
    return None


def slice_plan(dest: Destination, target: Target, index: int, of: int) -> tuple[list[FileEntry], str | None]:
    """The files of the slice for one replica, or an error when its control files are unusable."""
    try:
        return select(replica_manifest(dest, target.run, target.step), index, of), None
    except FormatError as e:
        return [], f"{target.url}: {e}"
