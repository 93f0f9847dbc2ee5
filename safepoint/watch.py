"""Find committed snapshot folders under a root that the catalog has not finished with."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from catalog.store import Catalog
from safepoint.format import MARKER_NAME
from safepoint.states import CheckpointState as CS

DONE = frozenset({CS.VERIFIED, CS.CORRUPT, CS.INVALID, CS.INCOMPLETE, CS.PRUNED})


def committed_folders(root: Path) -> Iterator[Path]:
    """Folders under root holding a marker; a committed folder is not searched further."""
    for dirpath, dirnames, filenames in os.walk(root):
        if MARKER_NAME in filenames:
            dirnames.clear()
            yield Path(dirpath).resolve()
        else:
            dirnames.sort()


def pending_snapshots(root: Path, catalog: Catalog) -> Iterator[Path]:
    for folder in committed_folders(root):
        row = catalog.find_by_local_path(str(folder))
        if row is None or row.state not in DONE:
            yield folder
