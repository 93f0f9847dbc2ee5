"""Checkpoint references for the trackers people already run (MLflow, Weights & Biases).

A tracker gets a *reference*, never the bytes: where the verified replicas are, the BLAKE3 digest of
the manifest (which names every file's BLAKE3), the checkpoint's state, its step and the checkpoint it
resumed or forked from. A W&B reference artifact alone records an ETag and a size, and an MLflow model
version only a `source`; neither says whether the bytes behind it were verified. This does.

`CheckpointRef` is plain data; each backend module (`mlflow`, `wandb`) writes a list of them and
imports its tracker library only when called (`require`), so Safepoint needs neither installed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from safepoint.core.errors import UsageError

__all__ = ["BACKENDS", "KEYS", "CheckpointRef", "require"]

#: the keys of a reference in a tracker (MLflow tags, W&B metadata and config), each `safepoint.<key>`
KEYS = ("run", "step", "state", "manifest_blake3", "replicas", "total_bytes", "file_count", "parent",
        "parent_manifest_blake3", "forked_from", "resumed_from", "latest_verified_step", "latest_verified_url",
        "latest_verified_blake3")

#: backend name -> the pip extra that installs its library
BACKENDS = {"mlflow": "mlflow", "wandb": "wandb"}


@dataclass(frozen=True)
class CheckpointRef:
    """What a tracker records about one checkpoint (safepoint.ops.export builds it from the catalog)."""

    run: str
    step: int
    state: str                        # the catalog's state: a reader can tell verified from corrupt
    manifest_blake3: str              # BLAKE3 of MANIFEST.json, the digest of the whole checkpoint
    replicas: tuple[str, ...]         # URLs of the verified replicas, credentials stripped
    total_bytes: int = 0
    file_count: int = 0
    parent: tuple[str, int] | None = None   # the checkpoint it resumed (same run) or forked (other run) from
    parent_manifest_blake3: str | None = None

    @property
    def url(self) -> str:
        """The first verified replica: the one a tracker points at."""
        return self.replicas[0] if self.replicas else ""

    @property
    def recordable(self) -> bool:
        """Verified, with a verified replica to point at: what a tracker may record as a new entry."""
        return self.state == "verified" and bool(self.replicas)

    @property
    def forked(self) -> bool:
        """The parent belongs to another run: this run is a fork of it."""
        return self.parent is not None and self.parent[0] != self.run

    def metadata(self) -> dict[str, Any]:
        """The reference as flat JSON-able data (W&B metadata, MLflow tags as strings)."""
        meta: dict[str, Any] = {
            "safepoint.run": self.run, "safepoint.step": self.step, "safepoint.state": self.state,
            "safepoint.manifest_blake3": self.manifest_blake3, "safepoint.replicas": list(self.replicas),
            "safepoint.total_bytes": self.total_bytes, "safepoint.file_count": self.file_count,
        }
        if self.parent is not None:
            meta["safepoint.parent"] = f"{self.parent[0]}/{self.parent[1]}"
            meta["safepoint.parent_manifest_blake3"] = self.parent_manifest_blake3
            meta["safepoint.forked_from" if self.forked else "safepoint.resumed_from"] = meta["safepoint.parent"]
        return meta


def require(name: str) -> ModuleType:
    """Import a tracker library, or a usage error (exit 2) that names the extra to install."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise UsageError(f"exporting to {name} needs its library: pip install 'safepoint[{BACKENDS[name]}]'") from None
