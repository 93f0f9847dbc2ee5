"""The validation step: a dry-run load of verified bytes, recorded in the catalog.

The load reads the local files, hashing each against the manifest as it goes
(safepoint.validation.validate), so its verdict is on the bytes the replicas hold: a file rewritten
while the ingest runs makes the checkpoint corrupt, never verified on other bytes.

Apart from safepoint.ops.steps because it imports torch (through safepoint.validation), which
commands that never validate (verify, ls, resume-point) should not pay for.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from safepoint.catalog.store import Catalog
from safepoint.core.config import Config, load_config
from safepoint.core.states import CheckpointState as CS
from safepoint.local.snapshot import LocalSnapshot
from safepoint.validation.judge import ValidationReport
from safepoint.validation.settings import ValidationSettings
from safepoint.validation.stats import baseline_from_catalog, stat_rows
from safepoint.validation.validate import validate_snapshot


@dataclass(frozen=True)
class Judged:
    """A dry-run load's report, not yet recorded, with when it started."""

    report: ValidationReport
    settings: ValidationSettings
    started: datetime


def _prepared(snap: LocalSnapshot, model: str | None, config: Config | None) -> tuple[ValidationSettings, Any]:
    """The settings, and the model harness when a factory is set: built first, so that a factory that
    cannot be built is a usage error (HarnessError) before anything reads or records."""
    settings = ValidationSettings.from_config(config or load_config(), snap.manifest.run, model=model)
    if not settings.model:
        return settings, None
    from safepoint.validation.harness import build_harness  # imports torch: only with a model factory

    return settings, build_harness(settings.model, settings.device)


def _judge(catalog: Catalog, checkpoint_id: int, snap: LocalSnapshot, settings: ValidationSettings, harness: Any,
           options: dict[str, Any] | None) -> Judged:
    m = snap.manifest
    started = datetime.now(timezone.utc)
    row = catalog.get_by_id(checkpoint_id)
    baseline = baseline_from_catalog(catalog, m.run, m.step, parent=row.parent if row is not None else m.parent)
    report = validate_snapshot(snap.root, [f.path for f in m.files], model=harness, settings=settings, step=m.step,
                               baseline=baseline, digests={f.path: f.blake3 for f in m.files}, **(options or {}))
    return Judged(report, settings, started)


def judge(catalog: Catalog, checkpoint_id: int, snap: LocalSnapshot, *, model: str | None = None,
          options: dict[str, Any] | None = None, config: Config | None = None) -> Judged:
    """The dry-run load of the local bytes, recording nothing: an ingest runs it while it replicates
    (validation reads the bytes from the page cache the upload is reading), and hands the result to
    `validate_checkpoint` once the replicas are verified."""
    settings, harness = _prepared(snap, model, config)
    return _judge(catalog, checkpoint_id, snap, settings, harness, options)


def validate_checkpoint(
    catalog: Catalog, checkpoint_id: int, snap: LocalSnapshot, *, model: str | None = None,
    options: dict[str, Any] | None = None, config: Config | None = None, judged: Future[Judged] | None = None,
) -> CS:
    """Dry-run load of the (verified) local bytes; record the report, the tensor stats and the final state.

    Settings come from `[validation]` and `[runs.RUN]` of `config` (default: the config file);
    `model` (--model, the flow parameter) overrides the run's factory. The numerical audit and the
    consistency rules compare with the checkpoint this one follows: its lineage parent (as the catalog
    has it now) where that is verified, else the newest verified checkpoint of the run before this
    step (audit.baseline_from_catalog). A model factory that cannot be built raises HarnessError (a
    UsageError) before the checkpoint changes state. `judged`: the load already running (`judge`,
    started by an ingest beside its upload); only its result is recorded here.
    """
    if judged is not None:
        result = judged.result()  # its HarnessError, too, comes before the state changes
        if not catalog.transition(checkpoint_id, CS.VALIDATING, expect={CS.REPLICATED, CS.VERIFIED}):
            return catalog.get_by_id(checkpoint_id).state
    else:
        settings, harness = _prepared(snap, model, config)
        if not catalog.transition(checkpoint_id, CS.VALIDATING, expect={CS.REPLICATED, CS.VERIFIED}):
            return catalog.get_by_id(checkpoint_id).state
        result = _judge(catalog, checkpoint_id, snap, settings, harness, options)
    report = result.report
    catalog.record_validation(checkpoint_id, report.ok, report.summary(), report.to_dict(),
                              stat_rows(report.stats, result.settings.rules.role), started_at=result.started)
    # corrupt: a file read was not the manifest's (rewritten during the ingest): no verdict on its content
    state = {"verified": CS.VERIFIED, "incomplete": CS.INCOMPLETE, "corrupt": CS.CORRUPT}.get(str(report.outcome),
                                                                                          CS.INVALID)
    catalog.transition(checkpoint_id, state, expect={CS.VALIDATING},
                       error=None if state is CS.VERIFIED else report.summary())
    return state
