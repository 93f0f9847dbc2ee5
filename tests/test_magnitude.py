"""The absolute bound on parameters (safepoint.rules.magnitude) as a table, and in a first checkpoint."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from safepoint.core.format import CONTROL_FILES
from safepoint.rules.magnitude import out_of_bound
from safepoint.validation.settings import ValidationSettings
from safepoint.validation.validate import validate_snapshot
from tests.helpers_trainers import hf_trainer_run, plant_in_safetensors


def r(max_abs, role="parameter", dtype="float32"):
    return {"file": "m.safetensors", "name": "w", "dtype": dtype, "max_abs": max_abs, "role": role}


@pytest.mark.parametrize("row, limit, hit", [
    (r(7e36), 1e20, True),                          # one flipped exponent bit
    (r(3.0), 1e20, False),
    (r(7e36, dtype="bfloat16"), 1e20, True),
    (r(7e36, dtype="float16"), 1e20, False),        # float16 cannot hold it: not this rule's
    (r(7e36, role="optimizer_state"), 1e20, False),  # Adam's second moment may be large
    (r(7e36), 0, False),                            # off
    (r(None), 1e20, False),                         # all non-finite: the NaN/Inf rules'
    (r(50.0), 10.0, True),                          # configurable
])
def test_out_of_bound(row, limit, hit):
    assert bool(out_of_bound([row], limit)) is hit


def test_a_finite_blow_up_in_a_runs_first_checkpoint_is_invalid(tmp_path: Path):
    [first] = hf_trainer_run(tmp_path / "hf", steps=2, save_steps=2)
    assert validate_snapshot(first, step=2).outcome == "verified"   # no false alarm on the stock trainer
    bad = Path(shutil.copytree(first, tmp_path / "bad", ignore=shutil.ignore_patterns(*CONTROL_FILES)))
    name = "transformer.h.0.attn.c_attn.weight"
    plant_in_safetensors(bad / "model.safetensors", name, 6.8e36)
    assert math.isfinite(6.8e36)
    report = validate_snapshot(bad, step=2)   # no baseline: the norm audit has nothing to compare with
    assert report.outcome == "invalid"
    [f] = report.findings
    assert (f.problem.value, f.tensor, f.file) == ("magnitude", name, "model.safetensors")
    looser = ValidationSettings.from_mapping({"max_abs_parameter": 1e38})
    assert validate_snapshot(bad, step=2, settings=looser).outcome == "verified"
