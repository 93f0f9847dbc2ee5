"""Checkpoint references in MLflow and W&B (safepoint.ops.export): what each tracker really holds, read back
through its own API (MLflow, a SQLite store) or its own files (W&B, offline), after `safepoint export` and
after an ingest with `[export.*]` configured."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

from safepoint.catalog.store import open_catalog
from safepoint.cli.main import main
from safepoint.core.format import MANIFEST_NAME, digest_bytes
from safepoint.core.states import CheckpointState as C
from safepoint.core.states import ReplicaState as R
from tests.helpers_catalog import seed
from tests.helpers_wandb import artifacts, run_config

pytest.importorskip("mlflow")


@pytest.fixture
def catalog_url(tmp_path):
    """base/1..3 verified (base/3 later found corrupt in one test), base/4 invalid, base/5 verified with no
    verified replica; fork/7 forked from base/2."""
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    cat = open_catalog(url)
    for step in (1, 2, 3):
        seed(cat, tmp_path, "base", step, parent=("base", step - 1) if step > 1 else None)
    seed(cat, tmp_path, "base", 4, state=C.INVALID)
    seed(cat, tmp_path, "base", 5, replicas=(R.CORRUPT,))
    seed(cat, tmp_path, "fork", 7, parent=("base", 2))
    return url


def _replica_digest(url: str) -> str:
    """BLAKE3 of the MANIFEST.json the replica URL holds (a file:// replica), read from the replica."""
    return digest_bytes((Path(urlparse(url).path) / MANIFEST_NAME).read_bytes())


@pytest.fixture(scope="module")
def mlflow_template(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store, its schema made once (MLflow migrates a new one in ~5 s)."""
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("mlflow") / "template.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def mlflow_db(mlflow_template, tmp_path) -> Path:
    db = tmp_path / "mlflow.db"
    shutil.copyfile(mlflow_template, db)
    return db


def _mlflow(db: Path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{db}"
    return uri, MlflowClient(tracking_uri=uri, registry_uri=uri)


def test_mlflow_export_records_a_model_version_per_verified_checkpoint(mlflow_db, catalog_url, tmp_path, capsys):
    uri, client = _mlflow(mlflow_db)
    assert main(["--catalog", catalog_url, "export", "mlflow", "base", "--tracking-uri", uri]) == 0
    cat = open_catalog(catalog_url)
    versions = {mv.tags["safepoint.step"]: mv for mv in client.search_model_versions("name = 'base'")}
    assert sorted(versions) == ["1", "2", "3"]  # not 4 (invalid), not 5 (no verified replica)
    for step, mv in versions.items():
        row = cat.get("base", int(step))
        [replica] = [r.url for r in cat.replicas(row.id) if r.state is R.VERIFIED]
        assert mv.source == replica                      # a reference to the replica: nothing copied
        assert mv.tags["safepoint.manifest_blake3"] == row.manifest_blake3 == _replica_digest(replica)
        assert mv.tags["safepoint.state"] == "verified"
    assert versions["2"].tags["safepoint.parent"] == "base/1" and "safepoint.forked_from" not in versions["2"].tags
    assert f"at {versions['2'].source}" in versions["2"].description
    run = client.get_run(versions["1"].run_id)
    assert run.data.tags["safepoint.run"] == "base" and run.data.tags["safepoint.latest_verified_step"] == "3"
    assert run.data.tags["safepoint.latest_verified_blake3"] == cat.get("base", 3).manifest_blake3

    # Twice records nothing twice; a checkpoint a scrub found corrupt since is tagged corrupt.
    assert cat.transition(cat.get("base", 3).id, C.CORRUPT)
    assert main(["--catalog", catalog_url, "export", "mlflow", "base", "--tracking-uri", uri]) == 0
    again = {mv.tags["safepoint.step"]: mv for mv in client.search_model_versions("name = 'base'")}
    assert sorted(again) == ["1", "2", "3"] and len(client.search_model_versions("name = 'base'")) == 3
    assert again["3"].tags["safepoint.state"] == "corrupt" and again["2"].tags["safepoint.state"] == "verified"
    assert client.get_run(versions["1"].run_id).data.tags["safepoint.latest_verified_step"] == "2"
    assert "base/2: model base version" in capsys.readouterr().out


def test_mlflow_a_forked_run_names_its_parent(mlflow_db, catalog_url, tmp_path):
    uri, client = _mlflow(mlflow_db)
    assert main(["--catalog", catalog_url, "export", "mlflow", "fork", "--tracking-uri", uri,
                 "--experiment", "lineage", "--model", "fork-ckpts"]) == 0
    [mv] = client.search_model_versions("name = 'fork-ckpts'")
    base2 = open_catalog(catalog_url).get("base", 2)
    assert mv.tags["safepoint.forked_from"] == "base/2" == mv.tags["safepoint.parent"]
    assert mv.tags["safepoint.parent_manifest_blake3"] == base2.manifest_blake3
    run = client.get_run(mv.run_id)
    assert run.data.tags["safepoint.forked_from"] == "base/2"
    assert client.get_experiment(run.info.experiment_id).name == "lineage"


def test_mlflow_references_land_in_the_training_run_linked_to_the_run(mlflow_db, catalog_url, monkeypatch):
    """A training script that links its MLflow run (`safepoint.integrations.mlflow.link`) gets the references
    there; `export` from Python is the CLI's export."""
    import mlflow

    from safepoint.integrations import mlflow as sp_mlflow

    uri, client = _mlflow(mlflow_db)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_experiment("safepoint")
    with mlflow.start_run(run_name="my-training") as training:
        sp_mlflow.link("base")
        mlflow.log_metric("loss", 0.5, step=2)
    done = sp_mlflow.export("base", catalog_url=catalog_url, steps=[2], tracking_uri=uri)
    [mv] = client.search_model_versions("name = 'base'")
    assert [d["version"] for d in done] == [str(mv.version)]
    assert mv.run_id == training.info.run_id and mv.tags["safepoint.step"] == "2"
    assert client.get_run(training.info.run_id).data.tags["safepoint.latest_verified_step"] == "2"


def test_wandb_offline_export_logs_reference_artifacts(catalog_url, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    assert main(["--catalog", catalog_url, "export", "wandb", "fork", "--project", "sp-test"]) == 0
    assert main(["--catalog", catalog_url, "export", "wandb", "base", "--project", "sp-test"]) == 0
    cat = open_catalog(catalog_url)
    held = sorted(artifacts(tmp_path), key=lambda a: (a["name"], a["metadata"]["safepoint.step"]))
    assert [(a["name"], a["metadata"]["safepoint.step"]) for a in held] == [
        ("safepoint-base", 1), ("safepoint-base", 2), ("safepoint-base", 3), ("safepoint-fork", 7)]
    for a in held:
        row = cat.get(a["metadata"]["safepoint.run"], a["metadata"]["safepoint.step"])
        [replica] = [r.url for r in cat.replicas(row.id) if r.state is R.VERIFIED]
        assert a["type"] == "checkpoint" and a["project"] == "sp-test"
        assert a["metadata"]["safepoint.manifest_blake3"] == row.manifest_blake3 == _replica_digest(replica)
        assert a["metadata"]["safepoint.state"] == "verified" and a["metadata"]["safepoint.replicas"] == [replica]
        # One reference entry: the replica's manifest, not read (checksum=False), its bytes not in the artifact.
        [entry] = a["manifest"]
        manifest = Path(urlparse(replica).path) / MANIFEST_NAME
        assert entry["ref"] == manifest.as_uri() and entry["size"] == manifest.stat().st_size
        assert f"step-{row.step}" in a["aliases"]
    assert "latest-verified" in held[2]["aliases"] and "latest-verified" not in held[1]["aliases"]
    assert held[3]["metadata"]["safepoint.forked_from"] == "base/2"
    assert "safepoint.forked_from" not in held[1]["metadata"]
    runs = {r["config"]["safepoint.run"]: r for r in run_config(tmp_path)}
    assert runs["fork"]["config"]["safepoint.forked_from"] == "base/2" and runs["base"]["group"] == "base"
    assert runs["base"]["job_type"] == "safepoint-export"
    assert not list(tmp_path.glob("wandb/offline-run-*/files/**/*.bin"))  # nothing of the checkpoint copied


def test_export_errors_are_one_line(catalog_url, tmp_path, monkeypatch, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["--catalog", catalog_url, "export", "mlflow", "nope", "--tracking-uri", uri]) == 1
    assert "no verified checkpoint of nope" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "mlflow", None)  # not installed
    assert main(["--catalog", catalog_url, "export", "mlflow", "base", "--tracking-uri", uri]) == 2
    assert "pip install 'safepoint[mlflow]'" in capsys.readouterr().err
    (tmp_path / "config.toml").write_text('[export.mlflow]\ntracking_url = "x"\n')
    monkeypatch.setenv("SAFEPOINT_CONFIG", str(tmp_path / "config.toml"))
    assert main(["--catalog", catalog_url, "export", "mlflow", "base"]) == 2
    assert "unknown option(s) tracking_url" in capsys.readouterr().err


def test_an_ingest_records_what_it_verified_in_the_configured_tracker(mlflow_db, tmp_path, monkeypatch, caplog):
    """[export.mlflow] and [export.wandb] in config.toml: the ingest records the checkpoint once verified in
    both; an invalid one is not recorded, and a tracker that fails leaves the ingest's verdict alone."""
    from safepoint.core.config import load_config
    from safepoint.local.commit import commit
    from safepoint.ops.ingest import ingest
    from tests.helpers_ckpt import make_torch_save_ckpt

    uri, client = _mlflow(mlflow_db)
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[export.mlflow]\ntracking_uri = "{uri}"\nmodel = "m"\n'
                   f'[export.wandb]\nproject = "p"\nmode = "offline"\ndir = "{tmp_path}"\n')
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("SAFEPOINT_CONFIG", str(cfg))
    cat = open_catalog(f"sqlite:///{tmp_path / 'catalog.db'}")
    dest = (tmp_path / "durable").as_uri()
    for step, bad in ((1, False), (2, True)):
        make_torch_save_ckpt(tmp_path / f"s{step}", nan_in_optimizer=bad)
        commit(tmp_path / f"s{step}", "ing", step)
        assert ingest(tmp_path / f"s{step}", [dest], cat, load_config()).state is (C.INVALID if bad else C.VERIFIED)
    [mv] = client.search_model_versions("name = 'm'")
    assert mv.tags["safepoint.step"] == "1" and mv.source == f"{dest}/ing/1"
    assert mv.tags["safepoint.manifest_blake3"] == cat.get("ing", 1).manifest_blake3
    [art] = artifacts(tmp_path)  # and W&B, offline: step 1 only
    assert art["metadata"]["safepoint.step"] == 1 and art["project"] == "p"
    assert art["metadata"]["safepoint.manifest_blake3"] == mv.tags["safepoint.manifest_blake3"]

    cfg.write_text('[export.mlflow]\ntracking_uri = "nowhere://tracker"\n')  # MLflow refuses it at once
    make_torch_save_ckpt(tmp_path / "s3")
    commit(tmp_path / "s3", "ing", 3)
    with caplog.at_level("WARNING", logger="safepoint"):
        assert ingest(tmp_path / "s3", [dest], cat, load_config()).state is C.VERIFIED
    assert "ing/3 not recorded in mlflow" in caplog.text and "safepoint export mlflow ing" in caplog.text
    assert len(client.search_model_versions("name = 'm'")) == 1
