"""The destination interface: a handful of verbs in domain words, over any fsspec URL."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from safepoint.core.errors import FormatError
from safepoint.core.format import FileEntry, check_run
from safepoint.core.naming import join, snapshot_key
from safepoint.destinations.retry import RetryPolicy, is_transient
from safepoint.rules.deletion import deletion_order


def check_size(found: int | None, expected: int | None, where: str) -> None:
    """FileNotFoundError when a stored file is absent (`found` None), FormatError when its size is not `expected`."""
    if found is None:
        raise FileNotFoundError(where)
    if expected is not None and found != expected:
        raise FormatError(f"size {found}, the manifest says {expected}")


@dataclass(frozen=True)
class Capabilities:
    """What a backend guarantees, as data (docs/reliability.md, "One winner", says it per backend)."""

    #: `write_control(exclusive=True)` has exactly one winner, enforced by the store itself (a link on
    #: POSIX, If-None-Match on S3); False: it looks first and then writes (two racers may both win)
    atomic_exclusive_create: bool
    #: unfinished multipart uploads can exist, and `abort_stale_uploads` removes them
    multipart_uploads: bool = False
    #: folders outlive their files (`remove_empty_folders` has something to do)
    folders: bool = False


@dataclass(frozen=True)
class StoredObject:
    """One stored file, as listed."""

    size: int
    mtime: float | None     # seconds since the epoch; None when the store does not say


@dataclass
class SnapshotListing:
    """What a destination holds at <base>/<run>/<step>/: every object below it, by relative path."""

    run: str
    step: int
    objects: dict[str, StoredObject] = field(default_factory=dict)
    folder_mtime: float | None = None   # the snapshot folder itself (stores with folders), when it exists


def group_listing(entries: Iterable[tuple[str, StoredObject | None, float | None]]
                  ) -> dict[tuple[str, int], SnapshotListing]:
    """(path relative to the base, object or None for a folder, folder mtime) into listings by (run, step).

    Paths that are not <run>/<step>/... with a valid run and step are not Safepoint's and are skipped.
    """
    out: dict[tuple[str, int], SnapshotListing] = {}
    for rel, obj, folder_mtime in entries:
        parts = rel.strip("/").split("/")
        if len(parts) < 2 or not parts[1].isdigit() or str(int(parts[1])) != parts[1]:
            continue
        try:
            key = (check_run(parts[0]), int(parts[1]))
        except FormatError:
            continue
        loc = out.setdefault(key, SnapshotListing(*key))
        if len(parts) == 2 and obj is None:
            loc.folder_mtime = folder_mtime
        elif obj is not None and len(parts) > 2:
            loc.objects["/".join(parts[2:])] = obj
    return out


class Destination(ABC):
    """Where replicas live. Keys follow docs/format.md: <base>/<run>/<step>/<path>.

    Implementations stream bytes and hash them as they go; they never report an ETag as a hash.
    """

    #: the base URL, safe to print and store (no credentials)
    url: str
    capabilities: Capabilities = Capabilities(atomic_exclusive_create=False)
    #: which of this backend's failures another try may fix, and how many tries (safepoint.destinations.retrying)
    transient: Callable[[BaseException], bool] = staticmethod(is_transient)
    retry_policy: RetryPolicy = RetryPolicy()

    def snapshot_url(self, run: str, step: int) -> str:
        return join(self.url, snapshot_key(run, step))

    @abstractmethod
    def size(self, run: str, step: int, relpath: str) -> int | None:
        """Size of a stored file, or None when it is absent."""

    @abstractmethod
    def upload(self, run: str, step: int, entry: FileEntry, source: Path) -> str:
        """Copy `source` to the replica, reading it once, and return the BLAKE3 of the bytes read."""

    @abstractmethod
    def digest(self, run: str, step: int, relpath: str) -> str:
        """Read a stored file back and return its BLAKE3."""

    def attest(self, run: str, step: int, relpath: str, size: int) -> str | None:
        """The store's own proof (its name) that the file `upload` just sent is stored as sent, or None.

        Only for a file this object uploaded, right after `upload` returned the manifest's BLAKE3:
        then a checksum of the same buffers, checked by the store on arrival and returned by it,
        stands for a read-back. None (the default: no store attests anything) means read it back.
        """
        return None

    def fetch(self, run: str, step: int, relpath: str, target: Path,
              on_bytes: Callable[[int], None] | None = None, *, size: int | None = None) -> str:
        """Copy a stored file to the local `target`, fsynced, and return the BLAKE3 of the bytes as they arrived.

        A missing file (or one that is not a regular file) raises FileNotFoundError, a stored size
        other than `size` (when given) FormatError before any byte is copied (see `check_size`), and
        no more than `size` bytes are ever read (a file that grows is FormatError); a failure of the
        store is DestinationError; an OSError is the local disk's (safepoint.ops.fetch tells them
        apart: only the first three say anything of the replica).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot fetch files")

    @abstractmethod
    def listing(self, run: str | None = None, step: int | None = None) -> dict[tuple[str, int], SnapshotListing]:
        """Every <run>/<step>/ location under the base (or only `run`, or only (run, step)), with its objects.

        Always read from the store (never a cache): reconcile lists after crashes and other writers.
        """

    @abstractmethod
    def read_control(self, run: str, step: int, name: str) -> bytes | None:
        """Read MANIFEST.json or COMMITTED; None when absent."""

    @abstractmethod
    def write_control(self, run: str, step: int, name: str, data: bytes, *, exclusive: bool = False) -> bool:
        """Write a control file. With exclusive=True, return False if it already exists."""

    @abstractmethod
    def delete_files(self, run: str, step: int, relpaths: list[str]) -> None:
        """Delete data files (missing ones are fine)."""

    @abstractmethod
    def delete_control(self, run: str, step: int, name: str) -> None:
        """Delete a control file (missing is fine)."""

    @abstractmethod
    def committed_snapshots(self) -> list[tuple[str, int]]:
        """(run, step) of every snapshot that has a COMMITTED marker here."""

    def delete_snapshot(self, run: str, step: int, relpaths: list[str]) -> None:
        """Delete in the safe order of docs/format.md (safepoint.rules.deletion): marker, manifest, the
        parts' control files among `relpaths` (a multi-node replica), then the data."""
        controls, data = deletion_order(relpaths)
        for name in controls:
            self.delete_control(run, step, name)
        self.delete_files(run, step, data)

    def abort_stale_uploads(self, older_than_s: float) -> int:
        """Abort unfinished multipart uploads under the base started more than `older_than_s` ago; how many.

        Younger ones may belong to an upload in flight. Stores without multipart uploads have none (0).
        """
        return 0

    def remove_empty_folders(self, run: str, step: int) -> None:  # noqa: B027 - stores without folders
        """Remove the snapshot's folders left empty by a deletion (capabilities.folders); never follows a link."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
