"""Weights & Biases: each verified checkpoint as a version of a reference artifact, nothing uploaded.

The artifact `safepoint-RUN` (type `checkpoint`) gets one version per checkpoint, aliased `step-N`
(and `latest-verified` on the newest). Its one entry references the replica's MANIFEST.json
(`add_reference(..., checksum=False)`: no object is listed, read or uploaded; W&B's own digest of the
entry is then an md5 of the path, or the URL itself, never of the bytes), and its metadata holds
`CheckpointRef.metadata()`: the BLAKE3 digest of that manifest, the state, the step, every verified
replica and, for a fork, the parent. W&B's own reference
record is an ETag and a size; the digest and the state say whether the bytes were verified.

The W&B run is `safepoint-RUN` (id derived from RUN, resumed by each export, group RUN, job type
`safepoint-export`); `WANDB_MODE=offline` works as with any W&B run (`wandb sync` later).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from safepoint.core.format import MANIFEST_NAME
from safepoint.ops.trackers import CheckpointRef, require

__all__ = ["artifact_name", "record", "run_id"]


def run_id(run: str) -> str:
    """A W&B run id for Safepoint run `run`: stable, in W&B's alphabet, unique per run name."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run.lower()).strip("-")[:40] or "run"
    return f"safepoint-{slug}-{hashlib.blake2s(run.encode(), digest_size=4).hexdigest()}"


def artifact_name(run: str) -> str:
    """The artifact of `run`'s checkpoints (W&B names: letters, digits, '-', '_', '.')."""
    return "safepoint-" + (re.sub(r"[^A-Za-z0-9._-]+", "-", run).strip("-") or "run")


def _manifest_url(replica: str) -> str:
    return replica.rstrip("/") + "/" + MANIFEST_NAME


def record(refs: list[CheckpointRef], *, project: str | None = None, entity: str | None = None,
           mode: str | None = None, dir: str | None = None) -> list[dict[str, Any]]:
    """Log one reference artifact version per checkpoint of `refs` (one run's); returns name and aliases."""
    refs = [r for r in refs if r.recordable]  # a logged artifact version is immutable: verified ones only
    if not refs:
        return []
    wandb = require("wandb")
    run = refs[0].run
    parent = next((r.parent for r in refs if r.forked), None)
    config = {"safepoint.run": run} | ({"safepoint.forked_from": f"{parent[0]}/{parent[1]}"} if parent else {})
    kwargs: dict[str, Any] = {"project": project, "entity": entity, "id": run_id(run), "resume": "allow",
                              "name": f"safepoint-{run}", "group": run, "job_type": "safepoint-export",
                              "config": config, "dir": dir, "mode": mode}
    done = []
    with wandb.init(**{k: v for k, v in kwargs.items() if v is not None}) as wrun:
        newest = max(r.step for r in refs)
        for ref in sorted(refs, key=lambda r: r.step):
            meta = ref.metadata()
            art = wandb.Artifact(artifact_name(run), type="checkpoint", metadata=meta,
                                 description=f"{ref.run} step {ref.step}: {ref.state}, BLAKE3 {ref.manifest_blake3}")
            art.add_reference(_manifest_url(ref.url), name=MANIFEST_NAME, checksum=False)
            aliases = [f"step-{ref.step}"] + (["latest-verified"] if ref.step == newest else [])
            wrun.log_artifact(art, aliases=aliases)
            done.append({"step": ref.step, "artifact": artifact_name(run), "aliases": aliases,
                         "reference": _manifest_url(ref.url), "run_id": wrun.id})
    return done
