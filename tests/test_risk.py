"""Corruption risk: P = 1 - (1 - ε)^(8·S), computed stably, per checkpoint and per run, against
what scrubs found; and `safepoint risk` on both backends."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone
from decimal import Decimal, getcontext

import pytest

from safepoint.cli.main import main
from safepoint.core.states import CheckpointState as C
from safepoint.core.states import ReplicaState as R
from safepoint.rules.risk import assess, findings_from_events, p_corrupt, suggest_cadence
from tests.helpers_catalog import durable, seed

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def exact(size: int, ber: float) -> float:
    """1 - (1 - ε)^(8S) in 60-digit decimal arithmetic: the reference."""
    getcontext().prec = 60
    e = Decimal(ber)
    return float(1 - (1 - e) ** (8 * size))


@pytest.mark.parametrize("size", [1, 1000, 10**9, 125 * 10**9, 10**12, 10**15])
@pytest.mark.parametrize("ber", [1e-18, 1e-15, 1e-12, 1e-9])
def test_p_corrupt_matches_exact_arithmetic(size, ber):
    assert p_corrupt(size, ber) == pytest.approx(exact(size, ber), rel=1e-12)


def test_naive_formula_loses_the_answer():
    """Why log1p/expm1: in doubles 1 - 1e-18 == 1, so the literal formula says 'no risk' at all."""
    size, ber = 10**9, 1e-18
    assert 1 - (1 - ber) ** (8 * size) == 0.0
    assert p_corrupt(size, ber) == pytest.approx(8e-9, rel=1e-9)
    # And where it is not zero it is off in the 4th digit: 1 - 1e-15 rounds ε by ~0.08%.
    naive = 1 - (1 - 1e-15) ** (8 * 10**6)
    assert abs(naive - exact(10**6, 1e-15)) / exact(10**6, 1e-15) > 1e-4
    assert p_corrupt(10**6, 1e-15) == pytest.approx(exact(10**6, 1e-15), rel=1e-12)


def test_p_corrupt_edges():
    assert p_corrupt(0, 0.5) == 0.0 and p_corrupt(10, 0.0) == 0.0 and p_corrupt(10, 1.0) == 1.0
    assert p_corrupt(10**18, 1e-9) == 1.0
    assert p_corrupt(100, 1e-15) < p_corrupt(101, 1e-15) < p_corrupt(101, 2e-15)
    for bad in (-1e-15, 1.5):
        with pytest.raises(ValueError):
            p_corrupt(1, bad)
    with pytest.raises(ValueError):
        p_corrupt(-1)


def test_assess_run_so_far():
    cks = [{"step": s, "state": "verified", "total_bytes": 125 * 10**9, "copies": 2,
            "created_at": T0 + timedelta(hours=s)} for s in range(10)]
    r = assess("r", cks, [], ber=1e-15)
    p1 = p_corrupt(125 * 10**9, 1e-15)
    assert p1 == pytest.approx(1e-3, rel=1e-3)                       # 8·125e9·1e-15 = 1e-3
    assert r.expected_corrupted == pytest.approx(10 * p1, rel=1e-12)
    assert r.expected_corrupted_copies == pytest.approx(20 * p1, rel=1e-12)
    assert r.p_any == pytest.approx(1 - (1 - p1) ** 10, rel=1e-9)
    assert r.span == timedelta(hours=9)
    # model rate 20·p1 per 9 h; keep E[undetected] under 0.01 -> every 0.01 / (20e-3 / 9) = 4.5 h
    assert r.cadence.total_seconds() / 3600 == pytest.approx(0.01 / (20 * p1 / 9), rel=1e-9)
    assert r.cadence_basis.startswith("model")
    assert "no scrub or verify results" in r.notes[0]


def test_findings_and_observed_rate_tighten_the_cadence():
    events = [
        {"kind": "replica", "detail": {"state": "pending", "from": None}, "checkpoint_id": 1},
        {"kind": "replica", "detail": {"state": "verified", "from": "pending"}, "checkpoint_id": 1},
        {"kind": "replica", "detail": {"state": "corrupt", "from": "verified"}, "checkpoint_id": 1},
        {"kind": "replica", "detail": {"state": "corrupt", "from": "corrupt"}, "checkpoint_id": 1},  # same finding
        {"kind": "replica", "detail": {"state": "corrupt", "from": "verified"}, "checkpoint_id": 2},
        {"kind": "replica", "detail": {"state": "corrupt", "from": "verified"}, "checkpoint_id": 2},
        {"kind": "scrub.replica", "detail": {}, "checkpoint_id": 2},
        {"kind": "verify.local", "detail": {}, "checkpoint_id": 2},
    ]
    f = findings_from_events(events, ["corrupt", "verified", "missing", "deleted"])
    assert (f.detections, f.checkpoints_affected, f.scrub_events, f.corrupt_now, f.missing_now) == (3, 2, 2, 1, 1)
    cks = [{"step": s, "state": "verified", "total_bytes": 10**6, "copies": 1, "created_at": T0 + timedelta(hours=s)}
           for s in range(25)]
    r = assess("r", cks, events, ["corrupt"], ber=1e-15)
    assert r.cadence_basis.startswith("observed") and r.cadence == timedelta(hours=1)  # clamped at the minimum
    assert "worse than" in r.notes[0]


def test_suggest_cadence_bounds():
    assert suggest_cadence(0, 0)[0] == timedelta(days=30)
    assert suggest_cadence(1e-9, 0)[0] == timedelta(days=30)
    assert suggest_cadence(1.0, 0)[0] == timedelta(hours=1)
    assert suggest_cadence(0.001, 0)[0] == timedelta(hours=10)
    assert suggest_cadence(0.001, 0.002)[0] == timedelta(hours=5)


@pytest.mark.catalog_backends
def test_cli_risk(catalog, catalog_url, tmp_path, capsys):
    for s in (1, 2, 3):
        seed(catalog, tmp_path, "k", s, size=10_000)
    row = seed(catalog, tmp_path, "k", 4, state=C.CORRUPT, replicas=(R.CORRUPT,), size=10_000)
    assert row.total_bytes == 10_000
    capsys.readouterr()
    assert main(["--catalog", catalog_url, "risk", "--run", "k", "--ber", "1e-12", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    p = p_corrupt(10_000, 1e-12)
    assert [c["p"] for c in doc["per_checkpoint"]] == [p] * 4
    assert doc["expected_corrupted"] == pytest.approx(4 * p)
    assert doc["p_any"] == pytest.approx(-math.expm1(8 * 40_000 * math.log1p(-1e-12)))
    assert doc["found"]["corrupt_now"] == 1 and doc["found"]["detections"] == 1
    assert doc["suggested_scrub_every_hours"] == 1.0  # one real finding within the hour beats the model
    assert main(["--catalog", catalog_url, "risk", "--run", "k"]) == 0
    text = capsys.readouterr().out
    assert "P(at least one corrupted)" in text and "suggested scrub cadence" in text and durable(tmp_path)
    assert main(["--catalog", catalog_url, "risk", "--run", "nobody"]) == 1
