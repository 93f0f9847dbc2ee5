"""Validations and their per-tensor statistics."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from safepoint.catalog.base import CatalogBase
from safepoint.catalog.models import TensorStat, Validation, utcnow
from safepoint.catalog.views import ValidationRow
from safepoint.core.errors import CatalogError
from safepoint.core.redact import redact

_STAT_KEYS = ("name", "dtype", "shape", "numel", "norm", "max_abs", "nan_count", "inf_count", "head", "digest", "value",
              "file", "role")


def _finite_or_none(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) else x


def _consistency_rules(report: dict[str, Any] | None) -> list[str]:
    """The rule of each consistency finding in a validation report (safepoint.rules.consistency)."""
    found = (((report or {}).get("checks") or {}).get("consistency") or {}).get("findings") or []
    return [str(f.get("rule")) for f in found if isinstance(f, dict) and f.get("rule")]


class Validations(CatalogBase):
    """Validation results of a checkpoint and the tensor stats behind them."""

    def record_validation(self, checkpoint_id: int, ok: bool, summary: str, report: dict[str, Any],
                          tensor_stats: list[dict[str, Any]], *, started_at: datetime | None = None,
                          finished_at: datetime | None = None) -> int:
        """Store one validation and its per-tensor stats (one executemany; 10k rows is fine)."""
        finished = finished_at or utcnow()
        with self._write() as s:
            v = Validation(checkpoint_id=checkpoint_id, ok=bool(ok), summary=redact(summary or "") or "",
                           report=report or {}, started_at=started_at or finished, finished_at=finished)
            s.add(v)
            try:
                s.flush()
            except IntegrityError as e:
                raise CatalogError(f"no checkpoint with id {checkpoint_id}") from e
            rows = [{
                "validation_id": v.id, "name": str(t["name"]), "dtype": str(t.get("dtype", "")),
                "shape": [int(x) for x in (t.get("shape") or ())], "numel": int(t.get("numel") or 0),
                "norm": _finite_or_none(t.get("norm")), "max_abs": _finite_or_none(t.get("max_abs")),
                "nan_count": int(t.get("nan_count") or 0), "inf_count": int(t.get("inf_count") or 0),
                "head": t.get("head"), "digest": t.get("digest"), "value": _finite_or_none(t.get("value")),
                "file": t.get("file"), "role": str(t["role"]) if t.get("role") else None,
            } for t in tensor_stats]
            if rows:
                s.execute(sa.insert(TensorStat.__table__), rows)
            detail = {"validation_id": v.id, "ok": bool(ok), "summary": v.summary, "tensors": len(rows)}
            rules = _consistency_rules(report)
            if rules:
                detail["consistency"] = rules  # for safepoint_consistency_findings_total (ops.metrics)
            self._event(s, "validation", checkpoint_id=checkpoint_id, detail=detail)
            return v.id

    def latest_validation(self, checkpoint_id: int) -> ValidationRow | None:
        with self._read() as s:
            v = s.execute(sa.select(Validation).where(Validation.checkpoint_id == checkpoint_id)
                          .order_by(Validation.id.desc()).limit(1)).scalar_one_or_none()
            if v is None:
                return None
            return ValidationRow(id=v.id, checkpoint_id=v.checkpoint_id, started_at=v.started_at,
                                 finished_at=v.finished_at, ok=bool(v.ok), summary=v.summary, report=dict(v.report))

    def tensor_stats(self, validation_id: int) -> list[dict[str, Any]]:
        t = TensorStat.__table__
        with self._read() as s:
            q = sa.select(*(t.c[k] for k in _STAT_KEYS)).where(t.c.validation_id == validation_id).order_by(t.c.id)
            return [dict(r._mapping) for r in s.execute(q)]
