"""Stock trainers resumed into their own folder (the ordinary way): every re-saved step is sealed
again, ingested as a new version of that step (never the abandoned branch's bytes), and names the
checkpoint it follows; a restore of the resumed point comes back as a path the trainer takes as is.

The resumed run clips gradients harder (the usual kind of change when going back to an older step), so the
re-saved checkpoints really differ from the ones they replace."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import safepoint
from safepoint.core import resumed
from safepoint.core.config import Config
from safepoint.core.format import digest_bytes
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.integrations.huggingface import SafepointCallback
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.ingest import ingest
from tests.helpers_trainers import hf_trainer_run


@pytest.fixture(autouse=True)
def _fresh_process_lineage():
    resumed.forget()
    yield
    resumed.forget()


def _ingest_all(folders, durable: str, catalog) -> None:
    for folder in folders:
        out = ingest(folder, [durable], catalog, Config())
        assert out.state is CS.VERIFIED, (folder, out.message)


def _assert_sealed_and_cataloged(folder: Path, catalog, run: str) -> None:
    snap = LocalSnapshot.open(folder)
    assert snap.verify().outcome is CS.VERIFIED, snap.verify().summary()
    row = catalog.get(run, snap.manifest.step)
    assert row.state is CS.VERIFIED and row.manifest_blake3 == digest_bytes(snap.manifest_bytes)
    assert {(f.path, f.blake3) for f in catalog.files(row.id)} == {(f.path, f.blake3) for f in snap.manifest.files}


def test_hf_resumed_into_its_output_dir_reseals_and_catalogs_a_new_version(tmp_path: Path, sqlite_catalog):
    out, durable = tmp_path / "hf", (tmp_path / "durable").as_uri()
    first = hf_trainer_run(out, steps=6, save_steps=2, callbacks=[SafepointCallback(run="hf")])
    _ingest_all(first, durable, sqlite_catalog)
    old = {f.name: digest_bytes(LocalSnapshot.open(f).manifest_bytes) for f in first}

    shutil.rmtree(out / "checkpoint-2")                         # the node lost it: restore it in place
    point = safepoint.restore("hf", out / "checkpoint-2", step=2, catalog=sqlite_catalog, config=Config())
    assert os.fspath(point) == str(point) == str(out / "checkpoint-2") and (point / "trainer_state.json").is_file()

    cb = SafepointCallback(run="hf")
    again = hf_trainer_run(out, steps=6, save_steps=2, callbacks=[cb], resume_from=point, max_grad_norm=0.01)
    assert [p.name for p in cb.sealed] == ["checkpoint-4", "checkpoint-6"]
    for folder in again[1:]:
        snap = LocalSnapshot.open(folder)
        assert snap.verify().outcome is CS.VERIFIED                      # main: the old seal, broken
        assert snap.manifest.meta["supersedes"] == old[folder.name]
    assert LocalSnapshot.open(out / "checkpoint-4").manifest.parent == ("hf", 2)
    assert LocalSnapshot.open(out / "checkpoint-6").manifest.parent == ("hf", 4)

    _ingest_all(again[1:], durable, sqlite_catalog)
    for folder in again:
        _assert_sealed_and_cataloged(folder, sqlite_catalog, "hf")
    row = sqlite_catalog.get("hf", 6)
    assert row.version > 1 and [r.state for r in sqlite_catalog.replicas(row.id)] == [RS.VERIFIED]
    [ev] = sqlite_catalog.events(row.id, kind="resealed")
    assert ev["detail"]["old_manifest_blake3"] == old["checkpoint-6"]
    chain = [(x.run, x.step) for x in sqlite_catalog.lineage("hf", 6)]
    assert chain == [("hf", 6), ("hf", 4), ("hf", 2)]

    # the durable copy of step 6 is the new branch's, byte for byte
    restored = safepoint.restore("hf", tmp_path / "back", catalog=sqlite_catalog, config=Config())
    assert restored.step == 6
    assert (restored / "model.safetensors").read_bytes() == (out / "checkpoint-6" / "model.safetensors").read_bytes()


def test_hf_save_total_limit_is_warned_about_once_with_what_to_set(tmp_path: Path, caplog):
    cb = SafepointCallback(run="hf")
    with caplog.at_level("WARNING", logger="safepoint.integrations"):
        hf_trainer_run(tmp_path / "hf", steps=4, save_steps=1, callbacks=[cb], save_total_limit=1)
    warned = [r.getMessage() for r in caplog.records if "save_total_limit" in r.getMessage()]
    assert len(warned) == 1 and "save_total_limit=None" in warned[0]
