"""What a reconcile pass found and did (or would do, with dry_run): steps and errors, for the CLI and events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from safepoint.core.redact import redact

__all__ = ["ReconcileReport", "Step"]


@dataclass
class Step:
    """One thing reconcile found, and what it did (or would do, with dry_run)."""

    action: str
    run: str | None
    step: int | None
    where: str
    detail: str = ""
    done: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "run": self.run, "step": self.step, "where": self.where,
                "detail": self.detail, "done": self.done}


@dataclass
class ReconcileReport:
    steps: list[Step] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    dry_run: bool = False

    def add(self, action: Any, run: str | None, step: int | None, where: str, detail: str = "",
            done: bool = False) -> Step:
        s = Step(str(action), run, step, redact(where) or "", redact(detail) or "", done)
        self.steps.append(s)
        return s

    def count(self, action: Any) -> int:
        return sum(1 for s in self.steps if s.action == str(action))

    def actions(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.steps:
            out[s.action] = out.get(s.action, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "steps": [s.to_dict() for s in self.steps], "errors": list(self.errors),
                "actions": self.actions()}
