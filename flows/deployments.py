"""The deployments `safepoint serve` runs from one process: the same ones prefect.yaml declares.

- ingest: triggered by `safepoint.checkpoint.committed` events (parameters templated from the
  payload, see safepoint.events); with `node`, only that node's events, so each host ingests the
  files on its own disks;
- scrub: on an interval, one rotating slice of every replica (flows/scrub.py);
- completeness: on an interval, multi-node timeouts (flows/completeness.py).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from prefect import serve
from prefect.deployments.runner import EntrypointType
from prefect.events import DeploymentEventTrigger
from prefect.settings import PREFECT_API_URL

from safepoint.core.errors import UsageError
from safepoint.events import markers as events
from safepoint.flows.completeness import check_completeness
from safepoint.flows.ingest import ingest
from safepoint.flows.scrub import scrub_replicas


def api_url() -> str:
    """The Prefect server that triggers need (events are evaluated by a server, never in-process)."""
    url = os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value()
    if not url:
        raise UsageError("no Prefect server: set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api after "
                         "`prefect server start`); without a server use `safepoint watch` without --emit")
    return url


def serve_all(deployments: list[Any], **options: Any) -> None:
    """Run the deployments from this process until interrupted (Prefect's `serve`, no work pool)."""
    serve(*deployments, **options)


def build(to: list[str] | None = None, *, node: str | None = None, name: str = "ingest",
          scrub_every_s: float | None = 3600.0, scrub_subset: str = "16",
          completeness_every_s: float | None = 60.0) -> list[Any]:
    suffix = f"-{node}" if node else ""
    params = events.trigger_parameters()
    deployments = [ingest.to_deployment(
        name=f"{name}{suffix}", description="Replicate, verify, validate and catalog one committed snapshot.",
        parameters={"to": list(to or [])},
        triggers=[DeploymentEventTrigger(name=f"safepoint-marker{suffix}", expect={events.EVENT},
                                         match=events.trigger_match(node), parameters=params)],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )]
    if scrub_every_s:
        deployments.append(scrub_replicas.to_deployment(
            name=f"scrub{suffix}", interval=timedelta(seconds=scrub_every_s), parameters={"subset": scrub_subset},
            description="Re-verify a rotating slice of every verified replica.",
            entrypoint_type=EntrypointType.MODULE_PATH))
    if completeness_every_s:
        deployments.append(check_completeness.to_deployment(
            name=f"completeness{suffix}", interval=timedelta(seconds=completeness_every_s),
            description="Time out multi-node checkpoints whose ranks never arrived.",
            entrypoint_type=EntrypointType.MODULE_PATH))
    return deployments
