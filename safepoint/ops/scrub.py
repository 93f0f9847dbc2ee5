"""Scrubbing: re-read a rotating slice of every verified replica, like `restic check --read-data-subset`.

Bit rot on a remote disk is silent until someone reads the bytes. Reading every replica in full
on every pass is too expensive, so each pass reads one slice `i` of `n` of every replica's files
(a file's slice is a hash of run, step and path: stable across passes and hosts), and the next pass
reads slice `i+1`. After `n` passes every byte was read once. A slice that finds a problem is
followed at once by a full verification through `safepoint.ops.verify.verify`, which records
the replica as corrupt or missing and settles the checkpoint (the last good copy is never dropped);
then what rot damaged is re-replicated from a copy that still verifies (safepoint.ops.reconcile).

The choice of what to read is pure (safepoint.rules.scrub). `scrub_pass` is the one composition:
the CLI runs it inline, the scrub flow (flows/scrub.py) with a runner that fans the `verify-batch`
steps out (threads or Dask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from safepoint.catalog.store import Catalog
from safepoint.core.config import Config, fanout_settings
from safepoint.core.errors import FormatError
from safepoint.core.format import FileEntry, digest_bytes, load_committed
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.destinations import open_destination
from safepoint.destinations.base import Destination
from safepoint.destinations.replica_commit import read_committed
from safepoint.ops.reconcile import repair as repair_checkpoints
from safepoint.ops.runner import INLINE, StepRunner, all_or_raise
from safepoint.ops.verify import bound_problem, merge_reports, verify, verify_batch
from safepoint.rules.batching import batch_limits, batches
from safepoint.rules.scrub import next_slice, parse_subset, select

SCRUB_EVENT = "scrub"


@dataclass(frozen=True)
class Target:
    checkpoint_id: int
    run: str
    step: int
    url: str            # the replica (snapshot URL)
    destination: str    # its base URL


def targets(catalog: Catalog, run: str | None = None) -> list[Target]:
    """Every verified replica of every verified checkpoint."""
    out = []
    for v in catalog.list_checkpoints(run, states=[CS.VERIFIED]):
        for r in v.replicas:
            if r.state is RS.VERIFIED:
                out.append(Target(v.id, v.run, v.step, r.url, r.destination))
    return out


def last_pass(catalog: Catalog) -> dict[str, Any] | None:
    """Detail of the most recent scrub pass (a `scrub` catalog event with `pass: true`)."""
    for e in reversed(catalog.events(kind=SCRUB_EVENT)):
        if e["detail"].get("pass"):
            return e["detail"]
    return None


def slice_plan(dest: Destination, target: Target, index: int, of: int, catalog: Catalog | None = None
               ) -> tuple[list[FileEntry], str | None]:
    """The files of the slice for one replica, or an error when its control files are unusable or (with
    `catalog`) bind another manifest than the checkpoint the catalog recorded (stale, forged, a rank short)."""
    manifest_bytes, marker = read_committed(dest, target.run, target.step)
    try:
        manifest = load_committed(manifest_bytes, marker)
    except FormatError as e:
        return [], f"{target.url}: {e}"
    row = catalog.get_by_id(target.checkpoint_id) if catalog is not None else None
    problem = (bound_problem(catalog, row, manifest, digest_bytes(manifest_bytes or b""))
               if catalog is not None and row else None)
    if problem:
        return [], f"{target.url}: {problem}"
    return select(manifest, index, of), None


def scrub_pass(catalog: Catalog, config: Config, *, subset: str = "16", run: str | None = None,
               repair: bool = True, runner: StepRunner = INLINE) -> dict[str, Any]:
    """One scrub pass: slice i of n of every verified replica, full verification where it found a
    problem, then repairs. Records one `scrub` event per replica and one for the pass."""
    index, of = parse_subset(subset)
    if index is None:
        index = next_slice(last_pass(catalog), of)
    size, count = batch_limits(fanout_settings(config))
    calls: list[tuple[str, str, int, list[FileEntry], Config]] = []
    planned: list[tuple[Target, int, list[int]]] = []   # target, files, indexes of its batches in `calls`
    unusable: list[tuple[Target, str]] = []
    for target in targets(catalog, run):
        dest = open_destination(target.destination, config.storage_options(target.destination))
        try:
            files, error = slice_plan(dest, target, index, of, catalog)
        finally:
            dest.close()
        if error:
            unusable.append((target, error))
            continue
        mine = batches(files, size, count)
        planned.append((target, len(files), list(range(len(calls), len(calls) + len(mine)))))
        calls += [(target.destination, target.run, target.step, b, config) for b in mine]
    answers = all_or_raise(runner.map("verify-batch", verify_batch, calls)) if calls else []
    rows: list[dict[str, Any]] = []
    damaged: set[int] = set()
    for target, n, slots in planned:
        rep = merge_reports([answers[i] for i in slots])
        outcome = "ok"
        if rep.problems:
            # A slice found rot: verify the whole replica now, which records it and settles the checkpoint.
            full = verify(catalog, target.url, config, runner=runner).report
            outcome = str(full.outcome)
            damaged.add(target.checkpoint_id)
        catalog.add_event(SCRUB_EVENT, checkpoint_id=target.checkpoint_id, detail={
            "url": target.url, "index": index, "of": of, "files": n, "bytes": rep.bytes_checked,
            "problems": {p: str(s) for p, s in rep.problems.items()}, "outcome": outcome})
        rows.append({"url": target.url, "files": n, "bytes": rep.bytes_checked, "outcome": outcome})
    for target, error in unusable:
        full = verify(catalog, target.url, config, runner=runner).report
        damaged.add(target.checkpoint_id)
        catalog.add_event(SCRUB_EVENT, checkpoint_id=target.checkpoint_id, detail={
            "url": target.url, "index": index, "of": of, "files": 0, "bytes": 0, "error": error,
            "outcome": str(full.outcome)})
        rows.append({"url": target.url, "files": 0, "bytes": 0, "outcome": f"{full.outcome}: {error}"})
    summary: dict[str, Any] = {"pass": True, "index": index, "of": of, "replicas": len(rows),
                               "files": sum(r["files"] for r in rows), "bytes": sum(r["bytes"] for r in rows),
                               "problems": len(damaged)}
    catalog.add_event(SCRUB_EVENT, detail=summary)
    summary["rows"] = rows
    if repair and damaged:  # re-replicate what rot damaged from a copy that still verifies
        summary["repair"] = runner.run("repair", repair_checkpoints, catalog, damaged, config).to_dict()
    found = {r["url"]: catalog.find_replica(r["url"]) for r in rows if r["outcome"] != "ok"}
    summary["unrepaired"] = sorted(u for u, f in found.items() if f is None or f[1].state is not RS.VERIFIED)
    return summary
