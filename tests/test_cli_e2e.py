"""The spine end to end through the CLI, on real torch.save, DCP and safetensors checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from safepoint.cli.main import main
from tests.helpers_ckpt import (
    make_dcp_ckpt,
    make_malicious_pickle,
    make_safetensors_ckpt,
    make_torch_save_ckpt,
)


def sp(*args: str) -> int:
    return main([str(a) for a in args])


def ls(catalog_url, capsys, run=None) -> list[dict]:
    capsys.readouterr()
    assert sp("--catalog", catalog_url, "ls", *(["--run", run] if run else []), "--json") == 0
    return json.loads(capsys.readouterr().out)


def resume(catalog_url, capsys, run) -> tuple[int, dict | None]:
    capsys.readouterr()
    code = sp("--catalog", catalog_url, "resume-point", "--run", run, "--json")
    text = capsys.readouterr().out
    return code, (json.loads(text) if code == 0 else None)


@pytest.fixture
def env(tmp_path, prefect_api, catalog_url):
    """(nvme root, durable base URL, catalog URL)."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    return nvme, (tmp_path / "durable").as_uri(), catalog_url


def committed_torch(nvme: Path, run: str, step: int, **kw) -> Path:
    folder = nvme / run / f"step-{step}"
    make_torch_save_ckpt(folder, **kw)
    assert sp("commit", folder, "--run", run, "--step", step) == 0
    return folder


def test_torch_save_verified_then_resume_point(env, capsys):
    nvme, durable, cat = env
    folder = committed_torch(nvme, "r1", 100)
    assert sp("--catalog", cat, "ingest", folder, "--to", durable) == 0
    rows = ls(cat, capsys)
    assert len(rows) == 1
    row = rows[0]
    assert (row["run"], row["step"], row["state"]) == ("r1", 100, "verified")
    assert row["local_path"] == str(folder.resolve())
    assert row["replicas"] == [{"url": f"{durable}/r1/100", "state": "verified"}]
    assert Path(durable[len("file://"):], "r1", "100", "COMMITTED").is_file()
    code, doc = resume(cat, capsys, "r1")
    assert code == 0 and doc["step"] == 100 and doc["url"] == f"{durable}/r1/100"

    # Re-running is safe and duplicates nothing.
    assert sp("--catalog", cat, "ingest", folder, "--to", durable) == 0
    assert ls(cat, capsys) == rows


def test_nan_in_optimizer_state_is_invalid(env, capsys):
    nvme, durable, cat = env
    folder = committed_torch(nvme, "r2", 1, nan_in_optimizer=True)
    assert sp("--catalog", cat, "ingest", folder, "--to", durable) == 1
    assert ls(cat, capsys)[0]["state"] == "invalid"
    assert resume(cat, capsys, "r2")[0] == 1


def test_flipped_byte_after_commit_is_corrupt_and_not_replicated(env, capsys):
    nvme, durable, cat = env
    folder = committed_torch(nvme, "r3", 1)
    p = folder / "model.pt"
    data = bytearray(p.read_bytes())
    data[len(data) // 3] ^= 0x10
    p.write_bytes(bytes(data))
    assert sp("--catalog", cat, "ingest", folder, "--to", durable) == 1
    row = ls(cat, capsys)[0]
    assert row["state"] == "corrupt"
    assert not Path(durable[len("file://"):], "r3", "1", "COMMITTED").exists()


def test_malicious_pickle_never_runs(env, capsys, tmp_path):
    nvme, durable, cat = env
    sentinel = tmp_path / "PWNED"
    folder = nvme / "evil" / "s1"
    make_malicious_pickle(folder / "model.pt", sentinel)
    assert sp("commit", folder, "--run", "evil", "--step", 1) == 0
    assert sp("--catalog", cat, "ingest", folder, "--to", durable) == 1
    assert ls(cat, capsys)[0]["state"] == "invalid"
    assert sp("validate", folder) == 1
    assert not sentinel.exists()


def test_safetensors_verified(env, capsys):
    nvme, durable, cat = env
    folder = nvme / "st" / "s5"
    make_safetensors_ckpt(folder)
    assert sp("commit", folder, "--run", "st", "--step", 5) == 0
    assert sp("--catalog", cat, "ingest", folder, "--to", durable) == 0
    assert ls(cat, capsys)[0]["state"] == "verified"


def test_dcp_two_ranks_and_missing_rank_file(env, capsys):
    nvme, durable, cat = env
    good = make_dcp_ckpt(nvme / "dcp" / "s10")
    assert sp("commit", good, "--run", "dcp", "--step", 10) == 0
    assert sp("--catalog", cat, "ingest", good, "--to", durable) == 0

    # A rank file lost before the commit: the manifest is consistent, DCP metadata is not.
    bad = make_dcp_ckpt(nvme / "dcp" / "s20", seed=1)
    (bad / "__1_0.distcp").unlink()
    assert sp("commit", bad, "--run", "dcp", "--step", 20) == 0
    assert sp("--catalog", cat, "ingest", bad, "--to", durable) == 1

    # A rank file lost after the commit.
    late = make_dcp_ckpt(nvme / "dcp" / "s30", seed=2)
    assert sp("commit", late, "--run", "dcp", "--step", 30) == 0
    (late / "__0_0.distcp").unlink()
    assert sp("--catalog", cat, "ingest", late, "--to", durable) == 1

    states = {r["step"]: r["state"] for r in ls(cat, capsys)}
    assert states == {10: "verified", 20: "incomplete", 30: "incomplete"}
    assert resume(cat, capsys, "dcp")[1]["step"] == 10


def test_corrupted_replica_falls_back(env, capsys):
    nvme, durable, cat = env
    for step in (1, 2):
        assert sp("--catalog", cat, "ingest", committed_torch(nvme, "r4", step, seed=step), "--to", durable) == 0
    assert resume(cat, capsys, "r4")[1]["step"] == 2
    replica_file = Path(durable[len("file://"):], "r4", "2", "model.pt")
    data = bytearray(replica_file.read_bytes())
    data[100] ^= 0xFF
    replica_file.write_bytes(bytes(data))
    assert sp("--catalog", cat, "verify", f"{durable}/r4/2") == 1
    assert sp("--catalog", cat, "verify", f"{durable}/r4/1") == 0
    rows = {r["step"]: r for r in ls(cat, capsys)}
    assert rows[2]["replicas"][0]["state"] == "corrupt"
    assert resume(cat, capsys, "r4")[1]["step"] == 1


def test_verify_local_snapshot(env, capsys):
    nvme, durable, cat = env
    folder = committed_torch(nvme, "r5", 1)
    assert sp("--catalog", cat, "verify", folder) == 0
    (folder / "model.pt").write_bytes(b"short")
    assert sp("--catalog", cat, "verify", folder) == 1


def test_watch_once_ingests_committed_only(env, capsys):
    nvme, durable, cat = env
    committed_torch(nvme, "w", 1)
    half = nvme / "w" / "step-2"
    make_torch_save_ckpt(half)  # no marker: still being written
    assert sp("--catalog", cat, "watch", nvme, "--to", durable, "--once") == 0
    rows = ls(cat, capsys)
    assert [(r["step"], r["state"]) for r in rows] == [(1, "verified")]
    # A second pass has nothing to do.
    assert sp("--catalog", cat, "watch", nvme, "--to", durable, "--once") == 0
    assert len(ls(cat, capsys)) == 1


def test_prune_keeps_newest_verified(env, capsys):
    nvme, durable, cat = env
    folders = [committed_torch(nvme, "p", s, seed=s) for s in (1, 2, 3)]
    for f in folders:
        assert sp("--catalog", cat, "ingest", f, "--to", durable) == 0
    assert sp("--catalog", cat, "prune", "--run", "p", "--keep-last", "1", "--dry-run") == 0
    assert all(f.exists() for f in folders)
    assert sp("--catalog", cat, "prune", "--run", "p", "--keep-last", "2") == 0
    states = {r["step"]: r["state"] for r in ls(cat, capsys)}
    assert states[1] == "pruned" and states[2] == "verified" and states[3] == "verified"
    assert not folders[0].exists() and folders[1].exists()
    assert not Path(durable[len("file://"):], "p", "1").joinpath("model.pt").exists()
    assert resume(cat, capsys, "p")[1]["step"] == 3


def test_usage_errors_exit_2(env, tmp_path):
    nvme, durable, cat = env
    empty = tmp_path / "not-committed"
    empty.mkdir()
    assert sp("--catalog", cat, "ingest", empty, "--to", durable) == 2
    assert sp("commit", tmp_path / "nope", "--run", "r", "--step", 1) == 2
    assert sp("commit", empty, "--run", "../bad", "--step", 1) == 2
    assert sp("bogus-command") == 2


def test_cli_as_a_real_process(env, tmp_path, prefect_api):
    """The installed `safepoint` entry point, in its own process, against the session's Prefect server."""
    nvme, durable, cat = env
    folder = nvme / "proc" / "s1"
    make_torch_save_ckpt(folder)
    environ = {**os.environ, "PREFECT_API_URL": prefect_api}
    exe = [sys.executable, "-m", "safepoint.cli"]
    subprocess.run([*exe, "commit", folder, "--run", "proc", "--step", "1"], check=True, env=environ)
    r = subprocess.run([*exe, "--catalog", cat, "ingest", folder, "--to", durable, "--json"],
                       env=environ, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] == "verified"
