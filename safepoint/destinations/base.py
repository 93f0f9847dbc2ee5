"""The destination interface: a handful of verbs in domain words, over any fsspec URL."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from safepoint.core.errors import FormatError
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME, FileEntry
from safepoint.core.naming import join, snapshot_key


def check_size(found: int | None, expected: int | None, where: str) -> None:
    """FileNotFoundError when a stored file is absent (`found` None), FormatError when its size is not `expected`."""
    if found is None:
        raise FileNotFoundError(where)
    if expected is not None and found != expected:
        raise FormatError(f"size {found}, the manifest says {expected}")


class Destination(ABC):
    """Where replicas live. Keys follow docs/format.md: <base>/<run>/<step>/<path>.

    Implementations stream bytes and hash them as they go; they never report an ETag as a hash.
    """

    #: the base URL, safe to print and store (no credentials)
    url: str

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
        """Copy a stored file to the local `target` and return the BLAKE3 of the bytes as they arrived.

        A missing file raises FileNotFoundError, a stored size other than `size` (when given)
        FormatError before any byte is copied (see `check_size`), a failure of the store
        DestinationError; an OSError is the local disk's (restore tells them apart: only the first
        three say anything of the replica).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot fetch files")

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
        """Delete in the safe order: marker, manifest, then data (docs/format.md)."""
        self.delete_control(run, step, MARKER_NAME)
        self.delete_control(run, step, MANIFEST_NAME)
        self.delete_files(run, step, relpaths)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
