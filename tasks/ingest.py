"""Thin Prefect tasks over safepoint.pipeline: retries and concurrency live here, logic does not."""

from __future__ import annotations

from prefect import task
from prefect.tasks import exponential_backoff

from catalog.store import open_catalog
from safepoint import pipeline
from safepoint.config import Config
from safepoint.replicate import ReplicaResult
from safepoint.snapshot import LocalSnapshot
from safepoint.states import CheckpointState


def _retry_on_infrastructure(task, task_run, state) -> bool:  # noqa: ANN001 - Prefect's signature
    """Retry I/O trouble (network resets, 5xx surfacing as OSError); never retry bad data."""
    try:
        state.result()
    except (OSError, TimeoutError, ConnectionError):
        return True
    except Exception:
        return False
    return False


@task(name="open-snapshot")
def open_snapshot(folder: str) -> LocalSnapshot:
    return LocalSnapshot.open(folder)


@task(name="register")
def register(catalog_url: str | None, snap: LocalSnapshot) -> int:
    return pipeline.register(open_catalog(catalog_url), snap).id


@task(
    name="replicate",
    retries=3,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_jitter_factor=0.5,
    retry_condition_fn=_retry_on_infrastructure,
)
def replicate(catalog_url: str | None, checkpoint_id: int, snap: LocalSnapshot, url: str,
              config: Config) -> ReplicaResult:
    return pipeline.replicate_to(open_catalog(catalog_url), checkpoint_id, snap, url, config)


@task(name="settle-replication")
def settle(catalog_url: str | None, checkpoint_id: int, results: list[ReplicaResult]) -> CheckpointState:
    return pipeline.settle_replication(open_catalog(catalog_url), checkpoint_id, results)


@task(name="validate")
def validate(catalog_url: str | None, checkpoint_id: int, snap: LocalSnapshot, model: str | None) -> CheckpointState:
    return pipeline.validate_checkpoint(open_catalog(catalog_url), checkpoint_id, snap, model=model)
