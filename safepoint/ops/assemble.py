"""Multi-node checkpoints in the catalog: replicate one part, assemble the set, time out lost ranks.

The rules (docs/format.md, "Multi-node checkpoints"):

- each node's ingest registers its part (catalog.record_commit merges files and ranks), replicates
  it under the part's own control folder (safepoint.destinations.parts), and then tries to assemble;
- assembling succeeds only when the catalog holds every expected rank *and* every part has
  committed at the destination; the ingest that succeeds records the BLAKE3 of the whole (merged)
  manifest in the catalog, which binds the checkpoint as one object (restore, verify and scrub hold
  every copy to it), moves the checkpoint to `replicated` and validates it. No ingest ever waits
  for another node: the last part to arrive finishes the set;
- a periodic check (`check_completeness`, run by the completeness flow and `safepoint parts --apply`;
  watchers run its cheap half, `apply_timeouts` without assembling) marks a set that stayed partial
  past its timeout `incomplete`, so resume points never wait on a dead rank, and assembles and
  validates a complete set whose last ingest died before doing so;
- a part that arrives after that re-opens the set (`incomplete` -> `replicating`) and, if it
  completes it, the checkpoint is assembled and validated like any other.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone

from safepoint.catalog.store import Catalog
from safepoint.catalog.views import CheckpointRow
from safepoint.core.config import Config
from safepoint.core.errors import FormatError
from safepoint.core.format import Manifest, digest_bytes
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.core.urls import local_path
from safepoint.destinations import open_destination
from safepoint.destinations.parts import Assembly, check_part, part_key
from safepoint.destinations.parts import assemble as assemble_parts
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.fetch import fetched_copy
from safepoint.ops.replicate import Progress, ReplicaResult
from safepoint.ops.runner import INLINE, StepRunner
from safepoint.ops.steps import replicate_to, walk
from safepoint.rules.completeness import Assessment, Completeness, assess
from safepoint.rules.restore import Outcome, Source
from safepoint.rules.settle import settle_replication

DEFAULT_TIMEOUT_S = 1800.0
IN_FLIGHT = (CS.COMMITTED, CS.REPLICATING)


def timeout_of(config: Config | None) -> timedelta:
    """`[multinode] timeout_s` in config.toml, or $SAFEPOINT_MULTINODE_TIMEOUT_S (wins)."""
    raw = os.environ.get("SAFEPOINT_MULTINODE_TIMEOUT_S")
    if raw is None and config is not None:
        raw = config.section("multinode").get("timeout_s")
    return timedelta(seconds=float(raw) if raw is not None else DEFAULT_TIMEOUT_S)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def delivered(catalog: Catalog, checkpoint_id: int) -> dict[int, datetime]:
    return {r["rank"]: r["delivered_at"] for r in catalog.ranks(checkpoint_id)}


def part_digests(catalog: Catalog, checkpoint_id: int) -> dict[str, str | None]:
    """Part key -> manifest BLAKE3 of every part the catalog holds (grouped by manifest)."""
    groups: dict[str | None, list[int]] = {}
    for r in catalog.ranks(checkpoint_id):
        groups.setdefault(r["manifest_blake3"], []).append(r["rank"])
    return {part_key(ranks): digest for digest, ranks in groups.items()}


def assessment(catalog: Catalog, row: CheckpointRow, config: Config | None, now: datetime | None = None
               ) -> Assessment:
    return assess(row.world_size, delivered(catalog, row.id), now or _now(), timeout_of(config))


def replicate_part_to(catalog: Catalog, checkpoint_id: int, snap: LocalSnapshot, url: str,
                      config: Config | None = None, *, progress: Progress | None = None,
                      attempts: int = 2) -> ReplicaResult:
    """Replicate this node's part into the shared snapshot folder and commit it as a part there.

    The one recorded replicate (safepoint.ops.steps.replicate_to) does it; this name says what the caller means.
    """
    check_part(snap.manifest)
    return replicate_to(catalog, checkpoint_id, snap, url, config, progress=progress, attempts=attempts)


@dataclass(frozen=True)
class Settled:
    state: CS
    won: bool = False            # this caller moved the checkpoint to `replicated`: it validates next
    message: str = ""


def try_assemble(catalog: Catalog, checkpoint_id: int, urls: list[str], config: Config | None = None,
                 *, now: datetime | None = None) -> Settled:
    """Assemble the checkpoint at each destination if the set is complete; never waits."""
    config = config or Config()
    row = catalog.get_by_id(checkpoint_id)
    a = assessment(catalog, row, config, now)
    if not a.complete:
        return Settled(row.state, message=a.summary())
    parts = part_digests(catalog, checkpoint_id)
    assembled, notes = False, []
    for url in dict.fromkeys(urls):
        dest = open_destination(url, config.storage_options(url))
        try:
            res = assemble_parts(dest, row.run, row.step, parts)
            if res.state is Assembly.COMMITTED and not _bind(catalog, checkpoint_id, res.manifest):
                error = f"{res.url}: its whole manifest is not the one the catalog recorded"
                catalog.set_replica(checkpoint_id, res.url, dest.url, RS.FAILED, error=error)
                notes.append(error)
            elif res.state is Assembly.COMMITTED:
                catalog.set_replica(checkpoint_id, res.url, dest.url, RS.VERIFIED, bytes=row.total_bytes)
                assembled = True
            elif res.state is Assembly.CONFLICT:
                catalog.set_replica(checkpoint_id, res.url, dest.url, RS.FAILED, error=res.error)
                notes.append(res.error or "conflict")
            else:
                notes.append(f"{res.url}: waiting for part(s) {', '.join(res.waiting_for) or '?'}")
        finally:
            dest.close()
    if not assembled:
        return Settled(catalog.get_by_id(checkpoint_id).state, message="; ".join(notes))
    # A set completed late (after the timeout, or after a failed part was re-sent) re-opens on the way.
    won = walk(catalog, checkpoint_id, CS.REPLICATED, start={*IN_FLIGHT, CS.INCOMPLETE},
               detail={"reason": "the set of parts completed", "parts": sorted(parts, key=int)})
    return Settled(catalog.get_by_id(checkpoint_id).state, won=won, message="all parts assembled")


def _bind(catalog: Catalog, checkpoint_id: int, whole: Manifest | None) -> bool:
    """Record the whole manifest's digest (the first assembly does); False if it is not the recorded one."""
    return whole is not None and catalog.record_whole_manifest(checkpoint_id, digest_bytes(whole.to_json_bytes()))


def settle_part(catalog: Catalog, checkpoint_id: int, snap: LocalSnapshot, results: list[ReplicaResult],
                urls: list[str], config: Config | None = None) -> Settled:
    """After this node replicated its part: a bad local part spoils the checkpoint; else try to assemble."""
    key = part_key(snap.manifest.held_ranks)
    settlement = settle_replication(results)
    if settlement.state in (CS.CORRUPT, CS.INCOMPLETE):
        catalog.transition(checkpoint_id, settlement.state, expect={CS.REPLICATING},
                           error=f"part {key}: {settlement.error}")
        return Settled(catalog.get_by_id(checkpoint_id).state, message=settlement.error or str(settlement.state))
    if settlement.state is not CS.REPLICATED:
        # Nothing to assemble from this part; the set stays partial and the timeout decides.
        errors = "; ".join(r.error or str(r.state) for r in results) or "no destination"
        return Settled(catalog.get_by_id(checkpoint_id).state, message=f"part {key} not replicated: {errors}")
    return try_assemble(catalog, checkpoint_id, urls, config)


@dataclass(frozen=True)
class TimeoutAction:
    checkpoint_id: int
    run: str
    step: int
    state: CS                 # the state after the check
    assessment: Assessment
    validate: bool = False    # the check assembled the set: the caller validates it next


def apply_timeouts(catalog: Catalog, config: Config | None = None, *, now: datetime | None = None,
                   run: str | None = None, assemble: bool = True) -> list[TimeoutAction]:
    """The periodic check: assemble complete sets nobody finished, give up on sets past their timeout.

    A set with ranks missing past `timeout` (from its first delivery) becomes `incomplete`. A set
    whose ranks are all registered but that no destination could assemble within `timeout` of its
    *last* delivery (a part never finished replicating) becomes `incomplete` as well. With
    `assemble=False` (watchers: cheap, no I/O at destinations) only missing ranks are timed out.
    """
    config = config or Config()
    now = now or _now()
    timeout = timeout_of(config)
    actions: list[TimeoutAction] = []
    for row in catalog.list_checkpoints(run, states=IN_FLIGHT):  # the listing holds what is used: no query per row
        if row.world_size <= 1:
            continue
        got = delivered(catalog, row.id)
        a = assess(row.world_size, got, now, timeout)
        if a.status is Completeness.INCOMPLETE:
            if catalog.transition(row.id, CS.INCOMPLETE, expect=set(IN_FLIGHT), error=a.summary(),
                                  detail={"missing_ranks": list(a.missing), "timeout_s": timeout.total_seconds()}):
                actions.append(TimeoutAction(row.id, row.run, row.step, CS.INCOMPLETE, a))
            continue
        if not a.complete or not assemble:
            continue
        urls = [r.destination for r in catalog.replicas(row.id)]
        settled = try_assemble(catalog, row.id, urls, config, now=now) if urls else Settled(row.state)
        if settled.won:
            actions.append(TimeoutAction(row.id, row.run, row.step, settled.state, a, validate=True))
        elif settled.state in IN_FLIGHT and got and now >= max(got.values()) + timeout:
            msg = f"all {row.world_size} ranks registered but not assembled within the timeout: {settled.message}"
            if catalog.transition(row.id, CS.INCOMPLETE, expect=set(IN_FLIGHT), error=msg):
                actions.append(TimeoutAction(row.id, row.run, row.step, CS.INCOMPLETE, a))
    return actions


def check_completeness(catalog: Catalog, config: Config | None = None, *, run: str | None = None,
                       now: datetime | None = None, runner: StepRunner = INLINE) -> list[TimeoutAction]:
    """The completeness check wherever it runs (`safepoint parts --apply`, the completeness flow):
    `apply_timeouts`, then the dry-run validation of every set it assembled, so an assembled
    checkpoint leaves verified (or invalid), never `replicated` waiting for someone to validate it.
    Each action's `state` is the state after all of it."""
    config = config or Config()
    actions = runner.run("apply-timeouts", apply_timeouts, catalog, config, run=run, now=now)
    return [replace(a, state=runner.run("validate", validate_assembled, catalog, a.checkpoint_id, config,
                                        config.run_setting(a.run, "model"))) if a.validate else a
            for a in actions]


def validate_assembled(catalog: Catalog, checkpoint_id: int, config: Config, model: str | None) -> CS:
    """Validate the assembled checkpoint from its replica: no single node holds every shard."""
    # Imported here: watchers time out sets through this module and never validate.
    from safepoint.ops.validation import validate_checkpoint

    with assembled_snapshot(catalog, checkpoint_id, config) as merged:
        return validate_checkpoint(catalog, checkpoint_id, merged, model=model, config=config)


@contextmanager
def assembled_snapshot(catalog: Catalog, checkpoint_id: int, config: Config | None = None
                       ) -> Iterator[LocalSnapshot]:
    """The assembled checkpoint as a local folder, to validate it (no node holds every shard).

    A file:// replica is opened in place; otherwise the verified replicas are fetched, best first,
    through the one verified fetch (safepoint.ops.fetch: hashed as the bytes arrive, healed file by
    file from the next replica) into a temporary folder under $SAFEPOINT_HOME/tmp, removed afterwards.
    FormatError when no replica comes back whole.
    """
    config = config or Config()
    row = catalog.get_by_id(checkpoint_id)
    reps = [r for r in catalog.replicas(checkpoint_id) if r.state is RS.VERIFIED]
    if not reps:
        raise FileNotFoundError(f"{row.run}/{row.step}: no assembled replica to validate from")
    local = [path for r in reps if (path := local_path(r.url)) is not None]
    if local:
        yield LocalSnapshot.open(local[0])
        return
    sources = [Source(r.destination.rstrip("/"), r.url.rstrip("/")) for r in reps]
    with fetched_copy(row.run, row.step, sources, config, expect_manifest=row.manifest_blake3,
                      label="assembled") as (snap, result):
        if snap is None:
            why = "; ".join(f"{a.source.url}: {path}: {a.reason}" for path, tries in result.attempts.items()
                            for a in tries if a.outcome is not Outcome.OK)
            raise FormatError(f"{row.run}/{row.step}: no assembled replica came back whole ({why[:300]})")
        yield snap
