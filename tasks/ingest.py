"""Thin Prefect tasks over safepoint.pipeline: retries and concurrency live here, logic does not."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect import task
from prefect.tasks import exponential_backoff

from safepoint.catalog.store import Catalog, open_catalog
from safepoint.core.config import Config
from safepoint.core.errors import DestinationError
from safepoint.core.format import digest_bytes
from safepoint.core.redact import redact, redact_url
from safepoint.core.states import CheckpointState, ReplicaState
from safepoint.destinations.parts import is_part, part_key
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops import assemble, leases
from safepoint.ops import ingest as pipeline
from safepoint.ops import progress as progress_
from safepoint.ops.replicate import ReplicaResult
from safepoint.tasks.retry import retry_on_infrastructure


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
    retry_condition_fn=retry_on_infrastructure,
)
def replicate(catalog_url: str | None, checkpoint_id: int, snap: LocalSnapshot, url: str,
              config: Config) -> ReplicaResult:
    """Replicate a whole snapshot, or this node's part of a multi-node one, under the leases."""
    catalog = open_catalog(catalog_url)
    with exclusive(catalog, snap, url, config):
        if is_part(snap.manifest):
            return assemble.replicate_part_to(catalog, checkpoint_id, snap, url, config,
                                              progress=progress_.hook())
        try:
            return pipeline.replicate_to(catalog, checkpoint_id, snap, url, config, progress=progress_.hook())
        except DestinationError as e:
            # The destination's own bounded retries gave up (and the replica is recorded failed):
            # a result, not a crash, so the other destinations still settle the checkpoint.
            return ReplicaResult(url=url, destination=redact_url(url), state=ReplicaState.FAILED,
                                 error=f"{redact_url(url)}: {redact(str(e))}")


def limits(config: Config) -> tuple[int, float, float]:
    """`[limits]`: uploads_per_host (4), lease_ttl_s (60), lease_wait_s (3600)."""
    sec = config.section("limits")
    return (int(sec.get("uploads_per_host", 4)), float(sec.get("lease_ttl_s", 60)),
            float(sec.get("lease_wait_s", 3600)))


@contextmanager
def exclusive(catalog: Catalog, snap: LocalSnapshot, url: str, config: Config) -> Iterator[None]:
    """Never two ingests of one checkpoint (part) into one destination at once; at most N uploads per host.

    Both are catalog leases (safepoint.leases), so they hold across processes and hosts, with or
    without a Prefect server, and expire if a holder dies.
    """
    m = snap.manifest
    part = part_key(m.held_ranks) if is_part(m) else "all"
    slots, ttl, wait = limits(config)
    name = f"ingest:{m.run}/{m.step}/{part}@{digest_bytes(redact_url(url).encode())[:16]}"
    with leases.held(catalog, name, ttl_s=ttl, wait_s=wait), \
            leases.slot(catalog, f"uploads:{leases.this_host()}", slots, ttl_s=ttl, wait_s=wait):
        yield


@task(name="settle-replication")
def settle(catalog_url: str | None, checkpoint_id: int, results: list[ReplicaResult]) -> CheckpointState:
    return pipeline.settle_replication(open_catalog(catalog_url), checkpoint_id, results)


@task(name="settle-part")
def settle_part(catalog_url: str | None, checkpoint_id: int, snap: LocalSnapshot, results: list[ReplicaResult],
                to: list[str], config: Config) -> assemble.Settled:
    """A multi-node part: assemble the checkpoint if this part completed the set; never waits."""
    return assemble.settle_part(open_catalog(catalog_url), checkpoint_id, snap, results, to, config)


@task(name="apply-timeouts")
def apply_timeouts(catalog_url: str | None, config: Config, run: str | None = None) -> list[assemble.TimeoutAction]:
    return assemble.apply_timeouts(open_catalog(catalog_url), config, run=run)


@task(name="record-ingest")
def record_done(catalog_url: str | None, checkpoint_id: int, detail: dict[str, Any]) -> None:
    """The `ingest.done` catalog event: what watchers wait for to drop a marker from their spool."""
    open_catalog(catalog_url).add_event("ingest.done", checkpoint_id=checkpoint_id, detail=detail)


@task(name="validate")
def validate(catalog_url: str | None, checkpoint_id: int, snap: LocalSnapshot, model: str | None) -> CheckpointState:
    """Dry-run load validation, then the validation report as Prefect artifacts (markdown and a table)."""
    catalog = open_catalog(catalog_url)
    state = pipeline.validate_checkpoint(catalog, checkpoint_id, snap, model=model)
    publish_validation_report(catalog, checkpoint_id)
    return state


def publish_validation_report(catalog: Catalog, checkpoint_id: int) -> None:
    """The stored report as a markdown artifact and a per-tensor table artifact, readable in the Prefect UI.

    An artifact that cannot be created (no API reachable) is logged, never fatal: the report is
    already in the catalog (`safepoint show RUN STEP`).
    """
    import logging

    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from safepoint.validation import report as vr

    row = catalog.get_by_id(checkpoint_id)
    v = catalog.latest_validation(checkpoint_id)
    if row is None or v is None:
        return
    stats = catalog.tensor_stats(v.id)
    try:
        create_markdown_artifact(key=vr.artifact_key("validation", row.run, row.step),
                                 markdown=vr.markdown(row.run, row.step, str(row.state), v.report, stats),
                                 description=f"Safepoint validation of {row.run}/{row.step}: {row.state}")
        create_table_artifact(key=vr.artifact_key("validation-tensors", row.run, row.step),
                              table=vr.tensor_rows(v.report, stats),
                              description=f"Tensors of {row.run}/{row.step}: verdict and stats (flagged first)")
    except Exception as e:  # noqa: BLE001 - artifacts are a view; the catalog holds the report
        logging.getLogger("safepoint").warning("validation artifacts for %s/%s not created: %s", row.run, row.step, e)
