"""Export checkpoint references to MLflow or W&B: after each verified ingest, and on demand.

Two ways in, one code path (`export_run`):
- automatic: with an `[export.mlflow]` and/or `[export.wandb]` table in config.toml, the ingest calls
  `after_ingest` once its record step is done, and each checkpoint it verified is recorded there. A
  tracker that is down or misconfigured is logged, never fails the ingest: the catalog holds the truth
  and `safepoint export` can record it again later (an export twice records nothing twice);
- on demand: `safepoint export mlflow|wandb RUN` (or `export_run` from Python) records every verified
  checkpoint of RUN that is already in the catalog.

config.toml:

    [export.mlflow]
    tracking_uri = "sqlite:////data/mlflow.db"   # default: MLflow's own ($MLFLOW_TRACKING_URI)
    experiment = "safepoint"                       # default "safepoint"
    model = "my-model"                             # registered model; default: the run's name

    [export.wandb]
    project = "my-project"                         # entity, mode ("offline"), dir are optional
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from safepoint.core.errors import UsageError
from safepoint.core.redact import redact
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.ops.trackers import BACKENDS, CheckpointRef

if TYPE_CHECKING:
    from safepoint.catalog.store import Catalog
    from safepoint.core.config import Config

log = logging.getLogger("safepoint")

__all__ = ["after_ingest", "export_run", "options_for", "reference", "references"]

#: the options each backend's `record` takes (anything else in its config table is a usage error)
OPTIONS = {"mlflow": ("tracking_uri", "registry_uri", "experiment", "model"),
           "wandb": ("project", "entity", "mode", "dir")}


def reference(catalog: Catalog, checkpoint_id: int, *, verified: bool = True) -> CheckpointRef | None:
    """The reference of one checkpoint: None without a manifest digest, and (`verified`) unless it is
    verified with a verified replica. `verified=False` also answers for a checkpoint that went bad
    since, so a tracker can mark what it recorded before."""
    row = catalog.get_by_id(checkpoint_id)
    if row is None or not row.manifest_blake3:
        return None
    urls = tuple(r.url for r in catalog.replicas(row.id) if r.state is RS.VERIFIED)
    if verified and (row.state is not CS.VERIFIED or not urls):
        return None
    parent_digest = None
    if row.parent is not None:
        p = catalog.get(*row.parent)
        parent_digest = p.manifest_blake3 if p is not None else None
    return CheckpointRef(run=row.run, step=row.step, state=str(row.state), manifest_blake3=row.manifest_blake3,
                         replicas=urls, total_bytes=row.total_bytes, file_count=row.file_count, parent=row.parent,
                         parent_manifest_blake3=parent_digest)


def references(catalog: Catalog, run: str, steps: list[int] | None = None, *,
               verified: bool = True) -> list[CheckpointRef]:
    """The references of `run`'s verified checkpoints (or of `steps` among them), oldest first;
    `verified=False`: of every checkpoint with a manifest digest, whatever its state."""
    views = catalog.list_checkpoints(run, [CS.VERIFIED] if verified else None)
    wanted = set(steps) if steps is not None else None
    refs = [reference(catalog, v.id, verified=verified) for v in views if wanted is None or v.step in wanted]
    return [r for r in refs if r is not None]


def options_for(backend: str, config: Config | None, **given: Any) -> dict[str, Any]:
    """The backend's options: `[export.BACKEND]` of config.toml, overridden by `given` (not None)."""
    if backend not in BACKENDS:
        raise UsageError(f"unknown tracker {backend!r}: one of {', '.join(BACKENDS)}")
    table = (config.section("export").get(backend) if config is not None else None) or {}
    if not isinstance(table, dict):
        raise UsageError(f"[export.{backend}] must be a table")
    unknown = sorted(set(table) - set(OPTIONS[backend]))
    if unknown:
        raise UsageError(f"[export.{backend}]: unknown option(s) {', '.join(unknown)} "
                         f"(known: {', '.join(OPTIONS[backend])})")
    return {**table, **{k: v for k, v in given.items() if v is not None}}


def _record(backend: str, refs: list[CheckpointRef], options: dict[str, Any]) -> list[dict[str, Any]]:
    if backend == "mlflow":
        from safepoint.ops.trackers import mlflow as tracker
    else:
        from safepoint.ops.trackers import wandb as tracker
    return tracker.record(refs, **options)


def export_run(catalog: Catalog, run: str, backend: str, options: dict[str, Any] | None = None, *,
               steps: list[int] | None = None) -> list[dict[str, Any]]:
    """Record `run`'s verified checkpoints (or `steps`) in `backend`; returns what each became. The
    others are passed along too: a backend records only verified ones, and updates the state of what it
    recorded before (MLflow: a checkpoint a scrub found corrupt is tagged corrupt)."""
    if backend not in BACKENDS:
        raise UsageError(f"unknown tracker {backend!r}: one of {', '.join(BACKENDS)}")
    return _record(backend, references(catalog, run, steps, verified=False), dict(options or {}))


def after_ingest(catalog: Catalog, checkpoint_id: int | None, config: Config) -> dict[str, Any]:
    """The ingest's hook: record a checkpoint it verified in every tracker of `[export]`.

    A no-op without an `[export]` table or for a checkpoint not verified. Never raises: a tracker's
    failure is logged and returned (`safepoint export` records it again later).
    """
    section = config.section("export")
    if checkpoint_id is None or not section:
        return {}
    ref = reference(catalog, checkpoint_id)
    if ref is None or ref.state != CS.VERIFIED:
        return {}
    done: dict[str, Any] = {}
    for backend in (b for b in BACKENDS if b in section):
        try:
            done[backend] = _record(backend, [ref], options_for(backend, config))
            log.info("%s/%s recorded in %s", ref.run, ref.step, backend)
        except Exception as e:  # noqa: BLE001 - a tracker's failure never fails an ingest
            done[backend] = {"error": redact(str(e))}
            log.warning("%s/%s not recorded in %s: %s (safepoint export %s %s records it later)",
                        ref.run, ref.step, backend, redact(str(e)), backend, ref.run)
    return done
