"""Training-side snapshots: `Snapshotter.save()` isolates a state in a fraction of a second, within a
host-memory budget, and a background writer commits it in Safepoint's format (docs/format.md).

Modules: structure (nesting <-> JSON), layout (safetensors placement), pool (budgeted buffers),
memory (the host-memory floor), staging (copies), writer (disk, hash, commit), rendezvous
(multi-rank commit through the filesystem), loader (read back without pickle), snapshotter (API).
"""

from safepoint.snapshotter.errors import CommitTimeout, MemoryFloorError, SnapshotError, UnsupportedState
from safepoint.snapshotter.loader import load, load_file
from safepoint.snapshotter.memory import MemInfo
from safepoint.snapshotter.snapshotter import SaveHandle, SaveStats, Snapshotter

__all__ = [
    "CommitTimeout", "MemInfo", "MemoryFloorError", "SaveHandle", "SaveStats", "SnapshotError", "Snapshotter",
    "UnsupportedState", "load", "load_file",
]
