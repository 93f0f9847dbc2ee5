"""The validation step: a dry-run load of verified bytes, recorded in the catalog.

Apart from safepoint.ops.steps because it imports torch (through safepoint.validation), which
commands that never validate (verify, ls, resume-point) should not pay for.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from safepoint.catalog.store import Catalog
from safepoint.core.config import Config, load_config
from safepoint.core.states import CheckpointState as CS
from safepoint.local.snapshot import LocalSnapshot
from safepoint.validation.settings import ValidationSettings
from safepoint.validation.stats import baseline_from_catalog, stat_rows
from safepoint.validation.validate import validate_snapshot


def validate_checkpoint(
    catalog: Catalog, checkpoint_id: int, snap: LocalSnapshot, *, model: str | None = None,
    options: dict[str, Any] | None = None, config: Config | None = None,
) -> CS:
    """Dry-run load of the (verified) local bytes; record the report, the tensor stats and the final state.

    Settings come from `[validation]` and `[runs.RUN]` of `config` (default: the config file);
    `model` (--model, the flow parameter) overrides the run's factory. The numerical audit and the
    consistency rules compare with the checkpoint this one follows: its lineage parent (as the catalog
    has it now) where that is verified, else the newest verified checkpoint of the run before this
    step (audit.baseline_from_catalog). A model factory that cannot be built raises HarnessError (a
    UsageError) before the checkpoint changes state.
    """

    m = snap.manifest
    settings = ValidationSettings.from_config(config or load_config(), m.run, model=model)
    harness = None
    if settings.model:  # built here, before the state changes: a factory that cannot be built is a usage error
        from safepoint.validation.harness import build_harness  # imports torch: only with a model factory

        harness = build_harness(settings.model, settings.device)
    if not catalog.transition(checkpoint_id, CS.VALIDATING, expect={CS.REPLICATED, CS.VERIFIED}):
        return catalog.get_by_id(checkpoint_id).state
    started = datetime.now(timezone.utc)
    row = catalog.get_by_id(checkpoint_id)
    baseline = baseline_from_catalog(catalog, m.run, m.step, parent=row.parent if row is not None else m.parent)
    report = validate_snapshot(snap.root, [f.path for f in m.files], model=harness, settings=settings, step=m.step,
                               baseline=baseline, **(options or {}))
    catalog.record_validation(checkpoint_id, report.ok, report.summary(), report.to_dict(),
                              stat_rows(report.stats, settings.rules.role), started_at=started)
    state = {"verified": CS.VERIFIED, "incomplete": CS.INCOMPLETE}.get(str(report.outcome), CS.INVALID)
    catalog.transition(checkpoint_id, state, expect={CS.VALIDATING},
                       error=None if state is CS.VERIFIED else report.summary())
    return state
