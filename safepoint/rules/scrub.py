"""Which files a scrub pass reads, as pure functions (safepoint.ops.scrub reads them).

A file's slice is a hash of run, step and path: stable across passes and hosts. Each pass reads
slice `i` of `n`, the next one `i+1`, so after `n` passes every byte was read once.
"""

from __future__ import annotations

from typing import Any

from safepoint.core.format import FileEntry, Manifest, digest_bytes

__all__ = ["next_slice", "parse_subset", "select", "slice_of"]


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
