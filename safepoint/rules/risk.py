"""Corruption risk from the seeds' model, set against what scrubs actually found.

Model: each bit of a checkpoint of S bytes is independently corrupted with probability ε (the
bit error rate), so

    P(checkpoint corrupted) = 1 - (1 - ε)^(8·S)

ε is tiny (1e-15) and 8·S is huge (1e12 bits for 125 GB): evaluated literally, 1 - ε rounds and
the power loses every significant digit. The stable form is

    P = -expm1(8·S · log1p(-ε))

which is accurate to the last bit for any ε in [0, 1]. For the run so far, P(at least one
corrupted) uses the total bits the same way, and the expected number of corrupted checkpoints is
the sum of the per-checkpoint probabilities.

The suggested scrub cadence bounds the expected number of corrupted copies that can sit
undetected between two scrubs: with corruption arriving at rate λ per hour (the model's, or the
observed rate when scrubs found more than the model predicts), scrubbing every `target / λ`
hours keeps that expectation under `target`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from safepoint.core.states import CheckpointState as CS

DEFAULT_BER = 1e-15
MIN_CADENCE = timedelta(hours=1)
MAX_CADENCE = timedelta(days=30)


def p_corrupt(size_bytes: int, ber: float = DEFAULT_BER) -> float:
    """1 - (1 - ber)^(8·size), computed stably."""
    if not 0.0 <= ber <= 1.0:
        raise ValueError(f"bit error rate must be in [0, 1], got {ber}")
    if size_bytes < 0:
        raise ValueError("size must be >= 0")
    if size_bytes == 0 or ber == 0.0:
        return 0.0
    if ber == 1.0:
        return 1.0
    return -math.expm1(8.0 * size_bytes * math.log1p(-ber))


@dataclass(frozen=True)
class CheckpointRisk:
    step: int
    state: CS
    total_bytes: int
    copies: int          # replicas recorded and not deleted
    p: float             # probability this checkpoint's bytes are corrupted


@dataclass(frozen=True)
class Findings:
    """What verification and scrubs have recorded for the run."""

    corrupt_now: int = 0                 # replicas whose current state is corrupt
    missing_now: int = 0                 # replicas whose current state is missing
    detections: int = 0                  # replica transitions into corrupt (all time)
    checkpoints_affected: int = 0        # distinct checkpoints with a corrupt detection
    scrub_events: int = 0                # scrub/verify events recorded


@dataclass(frozen=True)
class RunRisk:
    run: str
    ber: float
    checkpoints: tuple[CheckpointRisk, ...]
    p_any: float                         # P(at least one checkpoint corrupted), run so far
    expected_corrupted: float            # E[# corrupted checkpoints]
    expected_corrupted_copies: float     # E[# corrupted replica copies]
    findings: Findings
    span: timedelta                      # first to last checkpoint
    cadence: timedelta                   # suggested scrub interval
    cadence_basis: str
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(c.total_bytes for c in self.checkpoints)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run, "ber": self.ber, "checkpoints": len(self.checkpoints), "total_bytes": self.total_bytes,
            "p_any": self.p_any, "expected_corrupted": self.expected_corrupted,
            "expected_corrupted_copies": self.expected_corrupted_copies,
            "found": vars(self.findings),
            "span_hours": self.span.total_seconds() / 3600,
            "suggested_scrub_every_hours": self.cadence.total_seconds() / 3600,
            "cadence_basis": self.cadence_basis,
            "per_checkpoint": [{"step": c.step, "state": str(c.state), "bytes": c.total_bytes, "copies": c.copies,
                                "p": c.p} for c in self.checkpoints],
            "notes": self.notes,
        }


def findings_from_events(events: Sequence[dict[str, Any]], replica_states: Sequence[str] = ()) -> Findings:
    """Count corruption findings from catalog events (kind 'replica' carries detail.state/from)."""
    detections = 0
    affected: set[int] = set()
    scrubs = 0
    for e in events:
        kind, d = e["kind"], e.get("detail") or {}
        if kind == "replica" and d.get("state") == "corrupt" and d.get("from") != "corrupt":
            detections += 1
            if e.get("checkpoint_id") is not None:
                affected.add(e["checkpoint_id"])
        elif kind.startswith("scrub") or kind.startswith("verify"):
            scrubs += 1
    return Findings(
        corrupt_now=sum(1 for s in replica_states if s == "corrupt"),
        missing_now=sum(1 for s in replica_states if s == "missing"),
        detections=detections, checkpoints_affected=len(affected), scrub_events=scrubs,
    )


def suggest_cadence(expected_per_hour: float, observed_per_hour: float, *, target: float = 0.01,
                    lo: timedelta = MIN_CADENCE, hi: timedelta = MAX_CADENCE) -> tuple[timedelta, str]:
    """Scrub interval keeping E[undetected corrupted copies between scrubs] under `target`."""
    rate = max(expected_per_hour, observed_per_hour)
    basis = "observed" if observed_per_hour > expected_per_hour else "model"
    if rate <= 0:
        return hi, "no corruption expected or seen: the longest interval"
    hours = target / rate
    cadence = min(hi, max(lo, timedelta(hours=hours)))
    return cadence, (f"{basis} rate {rate:.3g}/h, target {target:g} undetected corrupted copies between scrubs"
                     + (" (clamped)" if cadence != timedelta(hours=hours) else ""))


def assess(run: str, checkpoints: Sequence[dict[str, Any]], events: Sequence[dict[str, Any]],
           replica_states: Sequence[str] = (), *, ber: float = DEFAULT_BER, target: float = 0.01) -> RunRisk:
    """Risk of `run` from its checkpoints (step, state, total_bytes, created_at, copies) and events."""
    rows = tuple(CheckpointRisk(int(c["step"]), CS(c["state"]), int(c["total_bytes"]), int(c.get("copies", 0)),
                                p_corrupt(int(c["total_bytes"]), ber)) for c in checkpoints)
    total_bits = 8.0 * sum(r.total_bytes for r in rows)
    p_any = 0.0 if not rows or ber == 0 else (1.0 if ber == 1 else -math.expm1(total_bits * math.log1p(-ber)))
    expected = math.fsum(r.p for r in rows)
    expected_copies = math.fsum(r.p * r.copies for r in rows)
    findings = findings_from_events(events, replica_states)
    times = [c["created_at"] for c in checkpoints if isinstance(c.get("created_at"), datetime)]
    span = (max(times) - min(times)) if len(times) >= 2 else timedelta(0)
    hours = max(span.total_seconds() / 3600, 1.0)
    # Copies are what a scrub reads; fall back to checkpoints when no replica is recorded.
    model_rate = (expected_copies if expected_copies > 0 else expected) / hours
    cadence, basis = suggest_cadence(model_rate, findings.detections / hours, target=target)
    notes = []
    if findings.detections > max(1.0, 3 * expected_copies):
        notes.append(f"scrubs found {findings.detections} corrupt copies where the model expects "
                     f"{expected_copies:.3g}: the storage is worse than ε={ber:g}, or corruption is not random")
    if findings.scrub_events == 0 and findings.detections == 0:
        notes.append("no scrub or verify results recorded for this run yet")
    return RunRisk(run, ber, rows, p_any, expected, expected_copies, findings, span, cadence, basis, notes)
