"""The real trainers' checkpoints through the command line: `commit` (or the integration's seal),
`ingest --to file://...`, then `ls --json` and `show --json`. As written: verified (exit 0); with a
planted NaN in a parameter or an optimizer moment: invalid (exit 1), the tensor named; with an inf in
callback metadata: verified, with a warning."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from safepoint.cli.main import main
from safepoint.core.format import CONTROL_FILES
from safepoint.integrations.huggingface import SafepointCallback
from safepoint.integrations.lightning import SafepointCheckpointIO
from tests.helpers_trainers import (
    accelerate_save_state,
    hf_trainer_run,
    lightning_run,
    plant_in_safetensors,
    plant_in_torch_file,
    torchtitan_style_dcp,
    tracker_callback,
)


def sp(*args) -> int:
    return main([str(a) for a in args])


@pytest.fixture
def env(tmp_path, prefect_api, sqlite_catalog_url):
    """(durable URL, catalog URL): SQLite; the catalog's backends are covered by tests/test_catalog.py."""
    return (tmp_path / "durable").as_uri(), sqlite_catalog_url


def ingest(env, folder: Path) -> int:
    durable, cat = env
    return sp("--catalog", cat, "ingest", folder, "--to", durable)


def state_of(env, capsys, run: str, step: int) -> str:
    capsys.readouterr()
    assert sp("--catalog", env[1], "ls", "--run", run, "--json") == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    return rows[step]["state"]


def show(env, capsys, run: str, step: int) -> tuple[int, dict]:
    capsys.readouterr()
    code = sp("--catalog", env[1], "show", run, step, "--json")
    return code, json.loads(capsys.readouterr().out)["report"]


def planted_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*CONTROL_FILES))
    return dst


def test_hf_trainer_through_the_cli(env, capsys, tmp_path: Path, prefect_api: str) -> None:
    cks = hf_trainer_run(tmp_path / "out", steps=4, save_steps=2, callbacks=[SafepointCallback(run="hf")])
    # the first checkpoint in a real `python -m safepoint.cli` process
    environ = {**os.environ, "PREFECT_API_URL": prefect_api}
    r = subprocess.run([sys.executable, "-m", "safepoint.cli", "--catalog", env[1], "ingest", cks[0], "--to", env[0],
                        "--json"], env=environ, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] == "verified"
    assert ingest(env, cks[1]) == 0
    assert state_of(env, capsys, "hf", 2) == state_of(env, capsys, "hf", 4) == "verified"
    code, report = show(env, capsys, "hf", 4)
    assert code == 0 and report["not_loaded"]["training_args.bin"].startswith("not loaded: opaque pickle")
    assert report["checks"]["audit"]["against"] == "hf/2" and report["checks"]["audit"]["flagged"] == 0

    # planted NaN in a parameter, then in an Adam moment: invalid, the tensor named. Each is a copy of
    # step 4 with one tensor changed, so the consistency rules see the other half as stale (vs hf/4).
    for step, (where, name), stale in ((6, ("model.safetensors", "transformer.wte.weight"), "stale_optimizer"),
                                       (8, ("optimizer.pt", "state.2.exp_avg"), "stale_weights")):
        folder = planted_copy(cks[1], tmp_path / f"checkpoint-{step}")
        data = json.loads((folder / "trainer_state.json").read_text())
        (folder / "trainer_state.json").write_text(json.dumps({**data, "global_step": step}))
        if where.endswith(".safetensors"):
            plant_in_safetensors(folder / where, name, math.nan)
        else:
            plant_in_torch_file(folder / where, name, math.nan)
        assert sp("commit", folder, "--run", "hf", "--step", step) == 0
        assert ingest(env, folder) == 1
        assert state_of(env, capsys, "hf", step) == "invalid"
        code, report = show(env, capsys, "hf", step)
        nan, consistency = report["findings"]
        assert code == 1 and (nan["problem"], nan["tensor"], nan["file"]) == ("nan", name, where)
        assert consistency["problem"] == stale and f"of step {step} are byte-identical to step 4" in consistency[
            "message"]


def test_lightning_through_the_cli(env, capsys, tmp_path: Path) -> None:
    io = SafepointCheckpointIO(run="pl")
    lightning_run(tmp_path / "pl", steps=4, every=2, callbacks=[tracker_callback()], plugins=[io])
    for folder in io.sealed:
        assert ingest(env, folder) == 0
    code, report = show(env, capsys, "pl", 4)
    assert code == 0 and state_of(env, capsys, "pl", 4) == "verified"
    assert {w["role"] for w in report["warnings"]} == {"trainer_metadata", "buffer"}  # kth_value inf, -inf mask

    inf = planted_copy(io.sealed[1], tmp_path / "inf" / "step-4")
    plant_in_torch_file(next(inf.glob("*.ckpt")), "callbacks.Tracker.best_loss", math.inf)
    assert sp("commit", inf, "--run", "pl-inf", "--step", 4) == 0
    assert ingest(env, inf) == 0
    code, report = show(env, capsys, "pl-inf", 4)
    assert code == 0 and "callbacks.Tracker.best_loss" in {w["tensor"] for w in report["warnings"]}

    nan = planted_copy(io.sealed[1], tmp_path / "nan" / "step-4")
    plant_in_torch_file(next(nan.glob("*.ckpt")), "optimizer_states.0.state.0.exp_avg_sq", math.nan)
    assert sp("commit", nan, "--run", "pl-nan", "--step", 4) == 0
    assert ingest(env, nan) == 1
    code, report = show(env, capsys, "pl-nan", 4)
    assert code == 1 and [f["tensor"] for f in report["findings"]] == ["optimizer_states.0.state.0.exp_avg_sq"]


def test_torchtitan_dcp_through_the_cli(env, capsys, tmp_path: Path) -> None:
    good = torchtitan_style_dcp(tmp_path / "tt" / "step-10", step=10)
    assert sp("commit", good, "--run", "tt", "--step", 10) == 0
    assert ingest(env, good) == 0 and state_of(env, capsys, "tt", 10) == "verified"

    def fault(state: dict) -> None:
        state["0.weight"].view(-1)[0] = math.nan

    bad = torchtitan_style_dcp(tmp_path / "tt" / "step-20", step=20, fault=fault)
    assert sp("commit", bad, "--run", "tt", "--step", 20) == 0
    assert ingest(env, bad) == 1
    code, report = show(env, capsys, "tt", 20)
    nan, stale = report["findings"]  # the same optimizer state as step 10: stale, too
    assert code == 1 and (nan["tensor"], nan.get("role")) == ("0.weight", "parameter")
    assert stale["problem"] == "stale_optimizer" and "of step 20 are byte-identical to step 10" in stale["message"]

    wrong = torchtitan_style_dcp(tmp_path / "tt" / "step-30", step=31)  # committed under another step
    assert sp("commit", wrong, "--run", "tt", "--step", 30) == 0
    assert ingest(env, wrong) == 1
    assert [f["problem"] for f in show(env, capsys, "tt", 30)[1]["findings"]] == ["duplicate", "step"]  # of step 10


def test_accelerate_through_the_cli(env, capsys, tmp_path: Path) -> None:
    good = accelerate_save_state(tmp_path / "acc" / "s3")
    assert sp("commit", good, "--run", "acc", "--step", 3) == 0
    assert ingest(env, good) == 0 and state_of(env, capsys, "acc", 3) == "verified"
    capsys.readouterr()
    assert sp("--catalog", env[1], "show", "acc", 3) == 0
    text = capsys.readouterr().out
    assert "model = ... under [runs.RUN])" in text and "random_states_0.pkl" in text

    bad = accelerate_save_state(tmp_path / "acc" / "s6", steps=6)
    plant_in_torch_file(bad / "optimizer.bin", "state.1.exp_avg", math.nan)
    assert sp("commit", bad, "--run", "acc", "--step", 6) == 0
    assert ingest(env, bad) == 1
    code, report = show(env, capsys, "acc", 6)
    assert code == 1 and [(f["tensor"], f["file"]) for f in report["findings"]] == [("state.1.exp_avg",
                                                                                     "optimizer.bin")]
