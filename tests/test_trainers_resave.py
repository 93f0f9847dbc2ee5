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
import torch

import safepoint
from safepoint.cli.main import main
from safepoint.core import resumed
from safepoint.core.config import Config
from safepoint.core.format import digest_bytes
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.integrations import dcp as sp_dcp
from safepoint.integrations.accelerate import load_state, save_state
from safepoint.integrations.huggingface import SafepointCallback
from safepoint.integrations.lightning import SafepointCheckpointIO, sealed_checkpoint
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.ingest import ingest
from tests.helpers_trainers import (
    accelerate_train,
    hf_trainer_run,
    lightning_fit,
    lightning_two_optimizers_module,
)


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


@pytest.mark.parametrize("precision", [{}, {"bf16": True, "gradient_accumulation_steps": 2}],
                         ids=["fp32", "bf16-accumulation"])
def test_hf_resumed_into_its_output_dir_reseals_and_catalogs_a_new_version(tmp_path: Path, sqlite_catalog,
                                                                           sqlite_catalog_url, capsys, precision):
    out, durable = tmp_path / "hf", (tmp_path / "durable").as_uri()
    first = hf_trainer_run(out, steps=6, save_steps=2, callbacks=[SafepointCallback(run="hf")], **precision)
    _ingest_all(first, durable, sqlite_catalog)
    old = {f.name: digest_bytes(LocalSnapshot.open(f).manifest_bytes) for f in first}

    shutil.rmtree(out / "checkpoint-2")                         # the node lost it: restore it in place
    point = safepoint.restore("hf", out / "checkpoint-2", step=2, catalog=sqlite_catalog, config=Config())
    assert os.fspath(point) == str(point) == str(out / "checkpoint-2") and (point / "trainer_state.json").is_file()

    cb = SafepointCallback(run="hf")
    again = hf_trainer_run(out, steps=6, save_steps=2, callbacks=[cb], resume_from=point, max_grad_norm=0.01,
                           **precision)
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
    capsys.readouterr()
    assert main(["--catalog", sqlite_catalog_url, "lineage", "hf", "4"]) == 0   # the branch, as a user sees it
    text = capsys.readouterr().out
    assert "<- resumed from hf/2 (verified)" in text and "-> resumed as hf/6" in text
    assert f"abandoned branch's hf/4 (manifest {old['checkpoint-4'][:12]}, parent none)" in text

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


def _resealed(folder: Path, old: str, parent: tuple[str, int]) -> None:
    m = LocalSnapshot.open(folder).manifest
    assert LocalSnapshot.open(folder).verify().outcome is CS.VERIFIED
    assert m.meta["supersedes"] == old and m.parent == parent


def _digest(folder: Path) -> str:
    return digest_bytes(LocalSnapshot.open(folder).manifest_bytes)


def test_lightning_two_optimizers_resumed_into_its_dirpath_reseals(tmp_path: Path, sqlite_catalog):
    root, durable = tmp_path / "pl", (tmp_path / "durable").as_uri()
    io = SafepointCheckpointIO(run="pl2")
    dirpath = lightning_fit(root, lightning_two_optimizers_module(), steps=8, every=4, plugins=[io])
    assert [p.name for p in io.sealed] == ["step-4", "step-8"]
    _ingest_all(io.sealed, durable, sqlite_catalog)
    old = _digest(dirpath / "step-8")

    point = safepoint.restore("pl2", tmp_path / "restored", step=4, catalog=sqlite_catalog, config=Config())
    io2 = SafepointCheckpointIO(run="pl2")
    lightning_fit(root, lightning_two_optimizers_module(shift=0.5), steps=8, every=4, plugins=[io2],
                  ckpt_path=sealed_checkpoint(point))
    assert [p.name for p in io2.sealed] == ["step-8"]
    assert sorted(p.name for p in dirpath.iterdir()) == ["step-4", "step-8"]   # nothing unsealed beside them
    _resealed(dirpath / "step-8", old, ("pl2", 4))
    _ingest_all(io2.sealed, durable, sqlite_catalog)
    for folder in (dirpath / "step-4", dirpath / "step-8"):
        _assert_sealed_and_cataloged(folder, sqlite_catalog, "pl2")


def test_accelerate_resumed_into_the_same_root_reseals(tmp_path: Path, sqlite_catalog):
    root, durable = tmp_path / "acc", (tmp_path / "durable").as_uri()
    acc = accelerate_train(steps=2)
    first = [save_state(acc, root, run="acc", step=2)]
    model, opt, sched = acc._models[0], acc._optimizers[0], acc._schedulers[0]
    for _ in range(2):
        acc.backward(model(torch.randn(4, 4)).pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()
    first.append(save_state(acc, root, run="acc", step=4))
    _ingest_all(first, durable, sqlite_catalog)
    old = _digest(root / "step-4")

    shutil.rmtree(root / "step-2")
    point = safepoint.restore("acc", root / "step-2", step=2, catalog=sqlite_catalog, config=Config())
    again = accelerate_train(steps=0)
    load_state(again, point)
    model, opt, sched = again._models[0], again._optimizers[0], again._schedulers[0]
    for _ in range(2):
        again.backward(model(torch.randn(4, 4) + 1.0).pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()
    save_state(again, root, run="acc", step=4)
    _resealed(root / "step-4", old, ("acc", 2))
    _ingest_all([root / "step-4"], durable, sqlite_catalog)
    for step in (2, 4):
        _assert_sealed_and_cataloged(root / f"step-{step}", sqlite_catalog, "acc")
    assert [(x.run, x.step) for x in sqlite_catalog.lineage("acc", 4)] == [("acc", 4), ("acc", 2)]


def _dcp_ranks(rank: int, world: int, init: str, root: str, resume: str, shift: float) -> None:
    """Two gloo ranks: each holds its own shard of a DTensor and the replicated model and optimizer."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def state(step: int) -> dict:
            return {"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "sharded": distribute_tensor(model.weight.detach().clone() * step, mesh, [Shard(0)]),
                    "train_state": {"step": torch.tensor(step)}}

        def train(n: int) -> None:
            for _ in range(n):
                model(torch.randn(4, 4) + shift).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()

        start = 0
        if resume:
            opt.step()  # creates the state entries dcp.load fills in
            loaded = state(2)
            sp_dcp.load(loaded, resume)
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optimizer"])
            start = 2
        for step in (2, 4):
            if step <= start:
                continue
            train(2)
            sp_dcp.save(state(step), root, run="dcp2", step=step)
    finally:
        dist.destroy_process_group()


def _spawn_dcp(tmp_path: Path, root: Path, resume: str = "", shift: float = 0.0) -> None:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
        mp.spawn(_dcp_ranks, args=(2, f"file://{tmp}/pg", str(root), resume, shift), nprocs=2, join=True)


def test_dcp_on_two_gloo_ranks_resumed_into_the_same_root_reseals(tmp_path: Path, sqlite_catalog):
    root, durable = tmp_path / "dcp", (tmp_path / "durable").as_uri()
    _spawn_dcp(tmp_path, root)
    first = [root / "step-2", root / "step-4"]
    assert sorted(p.name for p in first[1].glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    _ingest_all(first, durable, sqlite_catalog)
    old = _digest(root / "step-4")

    shutil.rmtree(root / "step-2")
    point = safepoint.restore("dcp2", root / "step-2", step=2, catalog=sqlite_catalog, config=Config())
    _spawn_dcp(tmp_path, root, resume=os.fspath(point), shift=1.0)
    _resealed(root / "step-4", old, ("dcp2", 2))
    _ingest_all([root / "step-4"], durable, sqlite_catalog)
    for folder in first:
        _assert_sealed_and_cataloged(folder, sqlite_catalog, "dcp2")


def test_consistency_compares_with_the_checkpoints_own_parent_not_the_abandoned_branch(tmp_path: Path,
                                                                                        sqlite_catalog):
    """Resumed from step 2 and saved next at step 6: the new step 6 follows step 2, while the abandoned
    branch's step 4 (newer than 2, older than 6) is still cataloged."""
    from transformers import TrainerCallback

    class NoSaveAt4(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:
                control.should_save = False

    out, durable = tmp_path / "hf", (tmp_path / "durable").as_uri()
    _ingest_all(hf_trainer_run(out, steps=6, save_steps=2, callbacks=[SafepointCallback(run="hf")]), durable,
                sqlite_catalog)
    shutil.rmtree(out / "checkpoint-2")
    point = safepoint.restore("hf", out / "checkpoint-2", step=2, catalog=sqlite_catalog, config=Config())
    cb = SafepointCallback(run="hf")
    hf_trainer_run(out, steps=6, save_steps=2, callbacks=[NoSaveAt4(), cb], resume_from=point, max_grad_norm=0.01)
    assert [p.name for p in cb.sealed] == ["checkpoint-6"]
    _ingest_all(cb.sealed, durable, sqlite_catalog)
    six = sqlite_catalog.get("hf", 6)
    report = sqlite_catalog.latest_validation(six.id).report
    assert report["checks"]["consistency"]["against"] == "hf/2"       # main: hf/4, the abandoned branch
    assert [(x.run, x.step) for x in sqlite_catalog.lineage("hf", 6)] == [("hf", 6), ("hf", 2)]
    assert sqlite_catalog.get("hf", 4).parent is None                  # still there, on its own branch
