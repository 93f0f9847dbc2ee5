"""The order in which a replica's objects are deleted (docs/format.md), as a pure function.

The marker goes first, so a replica stops being committed before anything it binds is gone; then
the manifest; for a multi-node replica then every part's marker and manifest, so no part can be
taken for committed and assembled again; then the data. A crash between any two deletes leaves a
partial replica (or loose parts) that reconcile finishes deleting, never a committed one with
files missing.
"""

from __future__ import annotations

from collections.abc import Iterable

from safepoint.core.format import MANIFEST_NAME, MARKER_NAME, PARTS_DIR


def part_of(path: str) -> tuple[int, int] | None:
    """(part key, 0 for its marker / 1 for its manifest) when `path` is a part's control file."""
    head, _, rest = path.partition(PARTS_DIR + "/")
    key, _, name = rest.partition("/")
    if head or not key.isdigit() or name not in (MARKER_NAME, MANIFEST_NAME):
        return None
    return int(key), 0 if name == MARKER_NAME else 1


def deletion_order(relpaths: Iterable[str]) -> tuple[list[str], list[str]]:
    """(control files in the order they are deleted, the data files) of one replica.

    The merged (or only) marker and manifest always come first; the parts' control files among
    `relpaths` follow, part by part (lowest key first), marker before manifest; everything else is data.
    """
    parts: list[tuple[tuple[int, int], str]] = []
    data: list[str] = []
    for path in dict.fromkeys(relpaths):
        if path in (MARKER_NAME, MANIFEST_NAME):
            continue
        where = part_of(path)
        if where is None:
            data.append(path)
        else:
            parts.append((where, path))
    return [MARKER_NAME, MANIFEST_NAME] + [p for _, p in sorted(parts)], data
