"""Restore on the real S3 server (SeaweedFS) and file://: the way back to training, verified.

Every test ingests real checkpoints to real replicas, loses the node's copy, and restores: bit-equal
tensors and the same next loss; a flipped or truncated object in one replica (read from the other,
the bad one marked corrupt); every copy of the newest bad (fall back, or exit 1 with --step); kill -9
in the middle, then a rerun that reuses what verifies; a non-empty folder; a full disk; a 2-rank
DCP checkpoint loaded by 1 rank.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from safepoint import commit
from safepoint.cli.main import main as cli
from safepoint.core.config import Config, load_config
from safepoint.core.format import MARKER_NAME, TMP_PREFIX
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.ingest import ingest
from safepoint.ops.restore import NothingToRestore, TargetNotEmpty, restore
from tests.helpers_disk import mount_tmpfs

MiB = 1024 * 1024
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def s3_config(s3_env, safepoint_home):
    """Small parts, so a few-MiB file is read back as several ranged GETs."""
    (safepoint_home / "config.toml").write_text(
        f'[storage."s3://{s3_env.bucket}"]\npart_size = {5 * MiB}\nmax_parts_in_flight = 4\nread_window = 2\n'
        'retry_attempts = 4\nretry_base_s = 0.02\nretry_cap_s = 0.2\n')
    return load_config()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 8))  # ~2 MiB of weights, 6 MiB saved


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(64, 512, generator=g), torch.randn(64, 8, generator=g)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> float:
    x, y = _batch(i)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def _save(folder: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int, run: str,
          extra_mib: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, folder / "model.pt")
    if extra_mib:
        g = torch.Generator().manual_seed(step)
        torch.save({"extra": torch.randn(extra_mib * MiB // 4, generator=g)}, folder / "extra.pt")
    commit(folder, run, step, parent=(run, step - 1) if step > 1 else None)
    return folder


def _checkpoints(tmp_path: Path, run: str, steps: int, urls: list[str], catalog, config: Config,
                 extra_mib: int = 0) -> list[Path]:
    """Train, save and ingest a checkpoint after each of `steps` steps; all verified."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    folders = []
    for step in range(1, steps + 1):
        _train_step(model, opt, step)
        folder = _save(tmp_path / "nvme" / run / str(step), model, opt, step, run, extra_mib)
        assert ingest(folder, urls, catalog, config).state is CS.VERIFIED
        folders.append(folder)
    return folders


def _tamper(s3_env, url: str, relpath: str, how: str) -> None:
    """Change one stored object behind Safepoint's back: flip a byte, or cut it short."""
    bucket, key = url[len("s3://"):].split("/", 1)
    c = s3_env.server.client()
    data = bytearray(c.get_object(Bucket=bucket, Key=f"{key}/{relpath}")["Body"].read())
    if how == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        data = data[: len(data) - 4096]
    c.put_object(Bucket=bucket, Key=f"{key}/{relpath}", Body=bytes(data))


def _flip_file(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))


def _replica(catalog, run: str, step: int, prefix: str):
    row = catalog.get(run, step)
    return next(r for r in catalog.replicas(row.id) if r.url.startswith(prefix))


# -- the way back, end to end ---------------------------------------------------------------------

def test_restore_after_node_loss_is_bit_equal_and_resumes_with_the_same_loss(tmp_path, s3_env, s3_config,
                                                                             sqlite_catalog):
    run = "train"
    s3, nfs = s3_env.url(), (tmp_path / "nfs").as_uri()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(3):
        _train_step(model, opt, i)
    folder = _save(tmp_path / "nvme" / run / "3", model, opt, 3, run)
    saved = torch.load(folder / "model.pt", weights_only=True)
    assert ingest(folder, [s3, nfs], sqlite_catalog, s3_config).state is CS.VERIFIED
    uninterrupted = _train_step(model, opt, 3)            # the run as if nothing had happened

    shutil.rmtree(tmp_path / "nvme")                      # the node and its NVMe are gone
    result = restore(run, tmp_path / "restored")
    assert (result.step, result.path) == (3, tmp_path / "restored")
    assert result.sources == [f"{s3}/{run}/3"]            # the local copy is gone: the first replica
    assert result.bytes_fetched == LocalSnapshot.open(result.path).manifest.total_bytes and not result.failed
    assert LocalSnapshot.open(result.path).verify().outcome is CS.VERIFIED

    # The trainer's own loader: every tensor bit-equal, and the next step's loss is the same.
    loaded = torch.load(result.path / "model.pt", weights_only=True)
    for key, tensor in saved["model"].items():
        assert torch.equal(loaded["model"][key], tensor), key
    for pid, st in saved["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(loaded["optimizer"]["state"][pid][k], v), (pid, k)
    resumed = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 8))
    resumed.load_state_dict(loaded["model"])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    resumed_opt.load_state_dict(loaded["optimizer"])
    assert _train_step(resumed, resumed_opt, 3) == uninterrupted

    # The catalog has the restore; a later checkpoint resumed from it shows in the lineage.
    (event,) = sqlite_catalog.events(kind="restore")
    assert event["detail"]["sources"] == [f"{s3}/{run}/3"] and event["detail"]["bytes_fetched"] > 0
    later = _save(tmp_path / "nvme" / run / "4", resumed, resumed_opt, 4, run)
    assert ingest(later, [nfs], sqlite_catalog, s3_config).state is CS.VERIFIED
    assert [(k.run, k.step, k.relation) for k in sqlite_catalog.children(run, 3)] == [(run, 4, "resumed")]

    # file:// works the same way, and a second restore into the same folder has nothing to fetch.
    again = restore(run, tmp_path / "from-nfs", 3, sources=[nfs])
    assert again.sources == [f"{nfs}/{run}/3"]
    assert (tmp_path / "from-nfs" / "model.pt").read_bytes() == (result.path / "model.pt").read_bytes()
    same = restore(run, tmp_path / "restored", 3)
    assert (same.bytes_fetched, same.bytes_reused) == (0, result.bytes_fetched)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_bad_object_in_one_replica_is_read_from_the_other_and_marked(how, tmp_path, s3_env, s3_config,
                                                                        sqlite_catalog):
    s3, nfs = s3_env.url(), (tmp_path / "nfs").as_uri()
    _checkpoints(tmp_path, "r", 1, [s3, nfs], sqlite_catalog, s3_config, extra_mib=11)
    shutil.rmtree(tmp_path / "nvme")
    _tamper(s3_env, f"{s3}/r/1", "extra.pt", how)

    code = cli(["restore", "--run", "r", "--into", str(tmp_path / "dir"), "--json"])
    assert code == 0
    assert LocalSnapshot.open(tmp_path / "dir").verify().outcome is CS.VERIFIED
    bad = _replica(sqlite_catalog, "r", 1, s3)
    assert bad.state is RS.CORRUPT and "extra.pt" in bad.error
    assert ("size" in bad.error) if how == "truncate" else ("BLAKE3 mismatch" in bad.error)
    assert _replica(sqlite_catalog, "r", 1, nfs).state is RS.VERIFIED
    assert sqlite_catalog.get("r", 1).state is CS.VERIFIED     # one good copy is left
    (event,) = sqlite_catalog.events(kind="restore")
    assert event["detail"]["failed"][0]["url"] == f"{s3}/r/1"
    assert set(event["detail"]["sources"]) == {f"{s3}/r/1", f"{nfs}/r/1"}  # model.pt from S3, extra.pt from nfs


def test_only_replica_truncated_is_nothing_to_restore(tmp_path, s3_env, s3_config, sqlite_catalog, capsys):
    s3 = s3_env.url()
    _checkpoints(tmp_path, "r", 1, [s3], sqlite_catalog, s3_config)
    shutil.rmtree(tmp_path / "nvme")
    _tamper(s3_env, f"{s3}/r/1", "model.pt", "truncate")
    assert cli(["restore", "--run", "r", "--into", str(tmp_path / "dir")]) == 1
    assert "no whole copy" in capsys.readouterr().err
    assert not (tmp_path / "dir" / MARKER_NAME).exists()
    assert _replica(sqlite_catalog, "r", 1, s3).state is RS.CORRUPT
    assert sqlite_catalog.get("r", 1).state is CS.CORRUPT     # no verified copy left


def test_every_copy_of_the_newest_bad_falls_back_one_step(tmp_path, s3_env, s3_config, sqlite_catalog, capsys):
    s3, nfs = s3_env.url(), (tmp_path / "nfs").as_uri()
    for run in ("a", "b"):
        folders = _checkpoints(tmp_path, run, 2, [s3, nfs], sqlite_catalog, s3_config)
        _flip_file(folders[-1] / "model.pt")              # the local copy of step 2 too
        _tamper(s3_env, f"{s3}/{run}/2", "model.pt", "flip")
        _flip_file(tmp_path / "nfs" / run / "2" / "model.pt")

    # Without --step: step 2 has no whole copy anywhere, so step 1 is restored, and it says so.
    assert cli(["restore", "--run", "a", "--into", str(tmp_path / "a"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step"] == 1 and doc["fell_back_from"] == [{"step": 2, "reason": "no whole copy"}]
    assert {f["url"] for f in doc["failed"]} >= {f"{s3}/a/2", f"{nfs}/a/2"}
    snap = LocalSnapshot.open(tmp_path / "a")
    assert snap.manifest.step == 1 and snap.verify().outcome is CS.VERIFIED
    assert sqlite_catalog.get("a", 2).state is CS.CORRUPT
    assert {r.state for r in sqlite_catalog.replicas(sqlite_catalog.get("a", 2).id)} == {RS.CORRUPT}

    # With --step 2: exit 1, nothing committed.
    assert cli(["restore", "--run", "b", "--into", str(tmp_path / "b"), "--step", "2"]) == 1
    assert "no whole copy" in capsys.readouterr().err
    assert not (tmp_path / "b" / MARKER_NAME).exists()
    with pytest.raises(NothingToRestore):
        restore("b", tmp_path / "b2", 2)                  # now the catalog knows: corrupt
    with pytest.raises(NothingToRestore):
        restore("nobody", tmp_path / "c")


def test_kill9_in_the_middle_then_a_rerun_finishes_reusing_what_verifies(tmp_path, s3_env, s3_config,
                                                                         sqlite_catalog_url, sqlite_catalog,
                                                                         fault_proxy, safepoint_home):
    from tests.faultproxy import Fault

    s3 = s3_env.url()
    folder = tmp_path / "nvme" / "r" / "1"
    folder.mkdir(parents=True)
    from safetensors.torch import save_file

    for i in range(4):
        save_file({"w": torch.randn(2 * MiB // 4, generator=torch.Generator().manual_seed(i))},
                  str(folder / f"shard-{i}.safetensors"))
    commit(folder, "r", 1)
    assert ingest(folder, [s3], sqlite_catalog, s3_config).state is CS.VERIFIED
    shutil.rmtree(tmp_path / "nvme")

    # The restore reads through the proxy, which holds shard-3's bytes: kill -9 while it waits.
    stall = fault_proxy.add(Fault("stall", method="GET", match="shard-3", at=0.5, delay=60))
    conf = tmp_path / "proxy.toml"
    conf.write_text(f'[storage."s3://{s3_env.bucket}"]\nendpoint_url = "{fault_proxy.endpoint}"\n'
                    'read_timeout = 120\nretry_attempts = 1\n')
    into = tmp_path / "dir"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SAFEPOINT_CONFIG": str(conf),
           "SAFEPOINT_CATALOG_URL": sqlite_catalog_url}
    proc = subprocess.Popen([sys.executable, "-m", "safepoint.cli.main", "restore", "--run", "r", "--into", str(into),
                             "--files", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert stall.engaged.wait(60), "the restore never reached shard-3"
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert not (into / MARKER_NAME).exists()
    done = sorted(p.name for p in into.iterdir())
    assert {"shard-0.safetensors", "shard-1.safetensors", "shard-2.safetensors"} <= set(done)
    size = (into / "shard-1.safetensors").stat().st_size
    _flip_file(into / "shard-1.safetensors")                # and one finished file rots meanwhile

    fault_proxy.clear()
    result = restore("r", into)
    assert result.bytes_reused == 2 * size and result.bytes_fetched == 2 * size  # shard-0 and -2 kept
    assert LocalSnapshot.open(into).verify().outcome is CS.VERIFIED
    assert not [p for p in into.iterdir() if p.name.startswith(TMP_PREFIX)]


def test_a_non_empty_folder_is_refused_unless_forced(tmp_path, sqlite_catalog, capsys):
    nfs = (tmp_path / "nfs").as_uri()
    _checkpoints(tmp_path, "r", 2, [nfs], sqlite_catalog, Config())
    into = tmp_path / "dir"
    into.mkdir()
    (into / "notes.txt").write_text("mine")
    assert cli(["restore", "--run", "r", "--into", str(into)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in into.iterdir()] == ["notes.txt"]
    with pytest.raises(TargetNotEmpty):
        restore("r", into)

    # Another checkpoint committed there is "something else" too; --force replaces it.
    assert restore("r", tmp_path / "one", 1).step == 1
    with pytest.raises(TargetNotEmpty):
        restore("r", tmp_path / "one")
    assert cli(["restore", "--run", "r", "--into", str(into), "--force"]) == 0
    assert sorted(p.name for p in into.iterdir()) == ["COMMITTED", "MANIFEST.json", "model.pt"]
    assert LocalSnapshot.open(into).manifest.step == 2


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    mount_tmpfs(mnt, "4m")  # skips here without root, fails in CI (SAFEPOINT_REQUIRE_DISKFULL=1)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_while_restoring_is_a_clean_error_without_a_marker(tmp_path, s3_env, s3_config,
                                                                     sqlite_catalog, small_disk, capsys):
    s3 = s3_env.url()
    _checkpoints(tmp_path, "r", 1, [s3], sqlite_catalog, s3_config, extra_mib=6)  # ~12 MiB on a 4 MiB disk
    shutil.rmtree(tmp_path / "nvme")
    into = small_disk / "dir"
    assert cli(["restore", "--run", "r", "--into", str(into)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("safepoint: error: could not write into") and "No space left" in err
    assert not (into / MARKER_NAME).exists()
    assert not [p for p in into.iterdir() if p.name.startswith(TMP_PREFIX) and p.name != ".safepoint-tmp-restore.json"]
    assert _replica(sqlite_catalog, "r", 1, s3).state is RS.VERIFIED   # a full disk says nothing of the replica
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True, capture_output=True)
    assert restore("r", into).step == 1
    assert LocalSnapshot.open(into).verify().outcome is CS.VERIFIED


def test_a_two_rank_dcp_checkpoint_restored_and_loaded_by_one_rank(tmp_path, s3_env, s3_config, sqlite_catalog):
    import torch.distributed.checkpoint as dcp

    from tests.helpers_ckpt import dcp_sharded_reference, make_dcp_ckpt, trained_model_and_optimizer

    folder = make_dcp_ckpt(tmp_path / "nvme" / "dcp" / "2", world_size=2, seed=0)
    commit(folder, "dcp", 2, world_size=2)
    assert ingest(folder, [s3_env.url()], sqlite_catalog, s3_config).state is CS.VERIFIED
    shutil.rmtree(tmp_path / "nvme")

    result = restore("dcp", tmp_path / "restored")
    assert sorted(p.name for p in result.path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    model, _opt = trained_model_and_optimizer(0)
    # One process, no process group: DCP reshards the two ranks' shards into full tensors.
    state = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()},
             "extra": {"sharded": torch.zeros(8, 6), "sharded_weight": torch.zeros_like(model[0].weight)}}
    dcp.load(state, checkpoint_id=str(result.path))
    assert torch.equal(state["extra"]["sharded"], dcp_sharded_reference())
    assert torch.equal(state["extra"]["sharded_weight"], model.state_dict()["0.weight"])
    for k, v in model.state_dict().items():
        assert torch.equal(state["model"][k], v), k


def test_a_fifo_in_the_local_copy_does_not_hang_restore(tmp_path, sqlite_catalog):
    """An empty file of the local copy replaced by a FIFO (size 0, as the manifest says) is refused at once
    and read from the replica; restore never blocks on it."""
    import threading

    nfs = (tmp_path / "nfs").as_uri()
    folder = tmp_path / "nvme" / "r" / "1"
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(os.urandom(64 * 1024))
    (folder / "done.flag").write_bytes(b"")
    commit(folder, "r", 1)
    assert ingest(folder, [nfs], sqlite_catalog, Config()).state is CS.VERIFIED
    (folder / "done.flag").unlink()
    os.mkfifo(folder / "done.flag")
    out: list = []
    t = threading.Thread(target=lambda: out.append(restore("r", tmp_path / "dir", catalog=sqlite_catalog)),
                         daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "restore blocked on a FIFO in the local copy"
    (result,) = out
    assert result.sources == [str(folder), f"{nfs}/r/1"]  # weights.bin from the local copy, done.flag from nfs
    assert any(f["url"] == str(folder) and "not a regular file" in f["reason"] for f in result.failed), result.failed
    assert LocalSnapshot.open(tmp_path / "dir").verify().outcome is CS.VERIFIED
