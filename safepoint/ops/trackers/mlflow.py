"""MLflow: each verified checkpoint as a model version whose `source` is its replica, tagged with its digest.

Where it lands:
- the MLflow run tagged `safepoint.run = RUN` in the experiment (default `safepoint`): a training
  script that sets that tag on its own run (`mlflow.set_tag("safepoint.run", RUN)`) gets the references
  beside its metrics; otherwise a run named RUN is made once and found again by the tag. Its tags name
  the latest verified checkpoint, and a forked run's tags name its parent (`safepoint.forked_from`);
- a model version of the registered model (default RUN) per checkpoint: `source` = the replica URL
  (nothing is uploaded or copied), `run_id` = that run, tags = `CheckpointRef.metadata()`. Found again
  by step and digest, so an export run twice records nothing twice; a checkpoint whose state changed
  (a scrub found it corrupt) gets its `safepoint.state` tag updated.
"""

from __future__ import annotations

import json
from typing import Any

from safepoint.ops.trackers import CheckpointRef, require

__all__ = ["record"]

RUN_TAG = "safepoint.run"


#: what a model version's tags carry (the run and model name already say the run; sizes are in the description)
VERSION_TAGS = ("safepoint.step", "safepoint.state", "safepoint.manifest_blake3", "safepoint.replicas",
                "safepoint.parent", "safepoint.parent_manifest_blake3", "safepoint.forked_from")


def _tags(ref: CheckpointRef) -> dict[str, str]:
    return {k: (json.dumps(v) if isinstance(v, (list, dict)) else str(v)) for k, v in ref.metadata().items()
            if v is not None and k in VERSION_TAGS}


def _find_run(client: Any, experiment_id: str, run: str) -> str:
    """The MLflow run of Safepoint run `run` (tagged), made once if there is none."""
    safe = run.replace("\\", "\\\\").replace("'", "\\'")
    found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{safe}'",
                               order_by=["attributes.start_time ASC"], max_results=1)
    if found:
        return found[0].info.run_id
    made = client.create_run(experiment_id, run_name=run, tags={RUN_TAG: run})
    client.set_terminated(made.info.run_id)  # a record of references, not a live training run
    return made.info.run_id


def record(refs: list[CheckpointRef], *, tracking_uri: str | None = None, registry_uri: str | None = None,
           experiment: str = "safepoint", model: str | None = None) -> list[dict[str, Any]]:
    """Record `refs` (one run's checkpoints) in MLflow; returns what each became: run id, model, version."""
    if not refs:
        return []
    require("mlflow")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri or tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    experiment_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
    run = refs[0].run
    run_id = _find_run(client, experiment_id, run)
    name = model or run
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, tags={RUN_TAG: run},
                                       description=f"Checkpoints of {run}, recorded by Safepoint (references only)")
    have = {(mv.tags.get("safepoint.step"), mv.tags.get("safepoint.manifest_blake3")): mv
            for mv in client.search_model_versions("name = '{}'".format(name.replace("'", "\\'")))}
    done = []
    for ref in sorted(refs, key=lambda r: r.step):
        tags = _tags(ref)
        mv = have.get((str(ref.step), ref.manifest_blake3))
        if not ref.recordable:  # never recorded unverified; what was recorded before gets its new state
            if mv is not None and mv.tags.get("safepoint.state") != ref.state:
                client.set_model_version_tag(name, mv.version, "safepoint.state", ref.state)
                done.append({"step": ref.step, "run_id": run_id, "model": name, "version": str(mv.version),
                             "source": mv.source, "state": ref.state})
            continue
        if mv is None:
            mv = client.create_model_version(
                name, ref.url, run_id=run_id, tags=tags,
                description=f"{ref.run} step {ref.step}: {ref.state}, {ref.file_count} files, {ref.total_bytes} bytes, "
                            f"manifest BLAKE3 {ref.manifest_blake3}, at {ref.url}")
        elif mv.tags.get("safepoint.state") != ref.state:
            client.set_model_version_tag(name, mv.version, "safepoint.state", ref.state)
        if ref.parent is not None and ref.forked:
            client.set_tag(run_id, "safepoint.forked_from", tags["safepoint.forked_from"])
        done.append({"step": ref.step, "run_id": run_id, "model": name, "version": str(mv.version),
                     "source": ref.url, "state": ref.state})
    verified = [r for r in refs if r.recordable]
    if verified:
        latest = max(verified, key=lambda r: r.step)
        for key, value in (("latest_verified_step", str(latest.step)), ("latest_verified_url", latest.url),
                           ("latest_verified_blake3", latest.manifest_blake3)):
            client.set_tag(run_id, f"safepoint.{key}", value)
    return done
