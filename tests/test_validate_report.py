"""The validation report: `safepoint show RUN STEP` in the terminal, and the Prefect artifacts of the
validate task (markdown + table) through the real ingest flow, with `--model` for the strict load."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from safepoint.catalog.store import open_catalog
from safepoint.cli.main import main
from safepoint.local.commit import commit
from safepoint.ops.ingest import ingest
from safepoint.validation.report import artifact_key, finding_rows, markdown, tensor_rows
from tests.helpers_ckpt import make_torch_save_ckpt


def sp(*args: object) -> int:
    return main([str(a) for a in args])


def _text(captured: str) -> str:
    return re.sub(r"\s+", " ", captured)


@pytest.fixture
def two_checkpoints(tmp_path: Path, sqlite_catalog_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run "rep": step 1 verified; step 2 with NaN in optimizer state and a x100 norm jump."""
    monkeypatch.setenv("COLUMNS", "250")
    catalog = open_catalog(sqlite_catalog_url)
    durable = (tmp_path / "durable").as_uri()
    for step in (1, 2):
        folder = tmp_path / "nvme" / str(step)
        path = make_torch_save_ckpt(folder, nan_in_optimizer=step == 2, seed=0)  # one model, planted changes
        if step == 2:
            sd = torch.load(path, weights_only=True)
            sd["model"]["0.bias"] *= 100
            torch.save(sd, path)
        commit(folder, "rep", step)
        ingest(folder, [durable], catalog)
    return sqlite_catalog_url


def test_show_names_each_failing_tensor_and_why(two_checkpoints: str, capsys: pytest.CaptureFixture) -> None:
    assert sp("--catalog", two_checkpoints, "show", "rep", 2) == 1
    text = _text(capsys.readouterr().out)
    assert "rep/2: invalid" in text
    assert "optimizer.state.0.exp_avg_sq │ nan │ model.pt │ optimizer.state.0.exp_avg_sq: 3 NaN values" in text
    assert "model.0.bias │ norm_jump │ model.pt │ model.0.bias: norm grew x100 since rep/1" in text
    assert "norm audit: against rep/1" in text

    assert sp("--catalog", two_checkpoints, "show", "rep", 1, "--tensors", "3") == 0
    text = _text(capsys.readouterr().out)
    assert "rep/1: verified" in text and "Tensors (3 of 16)" in text


def test_show_json_and_unknown(two_checkpoints: str, capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    assert sp("--catalog", two_checkpoints, "show", "rep", 2, "--json", "--tensors", "1") == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["state"] == "invalid" and not doc["ok"] and len(doc["stats"]) == 16
    assert {f["problem"] for f in doc["report"]["findings"]} == {"nan", "norm_jump"}
    assert sp("--catalog", two_checkpoints, "show", "rep", 9) == 1
    assert "no checkpoint rep/9" in capsys.readouterr().err


def test_report_views_are_consistent(two_checkpoints: str) -> None:
    catalog = open_catalog(two_checkpoints)
    row = catalog.get("rep", 2)
    v = catalog.latest_validation(row.id)
    stats = catalog.tensor_stats(v.id)
    md = markdown(row.run, row.step, str(row.state), v.report, stats)
    assert md.startswith("# Validation of rep step 2: **invalid**")
    assert ("| `optimizer.state.0.exp_avg_sq` | nan | `model.pt` | optimizer.state.0.exp_avg_sq: 3 NaN values "
            "(optimizer_state) |") in md
    rows = tensor_rows(v.report, stats)
    assert [r["tensor"] for r in rows[:2]] == ["model.0.bias", "optimizer.state.0.exp_avg_sq"]
    assert rows[0]["verdict"] == "fail: norm_jump" and rows[1]["nan"] == 3 and rows[-1]["verdict"] == "ok"
    # each row says where the tensor was read from and what it is
    assert (rows[0]["file"], rows[0]["role"]) == ("model.pt", "parameter")
    assert (rows[1]["file"], rows[1]["role"]) == ("model.pt", "optimizer_state")
    assert {r["file"] for r in rows} == {"model.pt"} and "-" not in {r["role"] for r in rows}
    assert [r["severity"] for r in finding_rows(v.report)] == ["fail", "fail"]
    assert artifact_key("validation", "My_Run.v2", 10) == "validation-my-run-v2-10"


# ---------------------------------------------------------------------------------------- Prefect

def _artifacts(key: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def test_flow_publishes_report_artifacts_and_runs_the_harness(tmp_path: Path, prefect_api: str,
                                                               sqlite_catalog_url: str) -> None:
    durable = (tmp_path / "durable").as_uri()
    bad = tmp_path / "nvme" / "art" / "7"
    make_torch_save_ckpt(bad, nan_in_optimizer=True)
    assert sp("commit", bad, "--run", "art", "--step", 7) == 0
    assert sp("--catalog", sqlite_catalog_url, "ingest", bad, "--to", durable) == 1

    [md] = _artifacts("validation-art-7")
    assert md.type == "markdown" and "**invalid**" in md.data
    assert "`optimizer.state.0.exp_avg_sq` | nan" in md.data and "3 NaN values" in md.data
    [table] = _artifacts("validation-tensors-art-7")
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert rows[0]["tensor"] == "optimizer.state.0.exp_avg_sq" and rows[0]["verdict"] == "fail: nan"
    assert (rows[0]["file"], rows[0]["role"]) == ("model.pt", "optimizer_state")
    assert len(rows) == 16

    # --model: the strict dry-run load runs in the flow; the helper records "step": 2.
    good = tmp_path / "nvme" / "art" / "2"
    make_torch_save_ckpt(good)
    assert sp("commit", good, "--run", "art", "--step", 2) == 0
    assert sp("--catalog", sqlite_catalog_url, "ingest", good, "--to", durable,
              "--model", "tests.test_harness:model_and_adamw") == 0
    v = open_catalog(sqlite_catalog_url).latest_validation(open_catalog(sqlite_catalog_url).get("art", 2).id)
    assert v.report["checks"]["harness"]["optimizer"] == "AdamW"
    [md] = _artifacts("validation-art-2")
    assert "strict load | `tests.test_harness:model_and_adamw`" in md.data

    # A factory that cannot be built is a usage error (exit 2), not a verdict on the checkpoint.
    other = tmp_path / "nvme" / "art" / "3"
    make_torch_save_ckpt(other)
    assert sp("commit", other, "--run", "art", "--step", 3) == 0
    assert sp("--catalog", sqlite_catalog_url, "ingest", other, "--to", durable, "--model", "tests.nope:f") == 2
    assert open_catalog(sqlite_catalog_url).get("art", 3).state.value == "replicated"
