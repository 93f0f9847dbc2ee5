"""`safepoint verify` of a local folder: the catalog probe decides whether the catalog must be opened."""

from __future__ import annotations

from pathlib import Path

import pytest

from safepoint.catalog.probe import knows_local, sqlite_file
from safepoint.catalog.store import open_catalog
from safepoint.cli.main import main
from safepoint.core.format import digest_bytes
from safepoint.local.snapshot import LocalSnapshot
from tests.helpers_ckpt import make_torch_save_ckpt


@pytest.mark.parametrize("url, path", [
    ("sqlite:////abs/cat.db", Path("/abs/cat.db")),
    ("sqlite:///rel/cat.db", Path("rel/cat.db")),
    ("sqlite+pysqlite:////abs/cat.db?timeout=5", Path("/abs/cat.db")),
    ("sqlite://", None),
    ("sqlite:///:memory:", None),  # no file: the fast path must not read one named ":memory:"
    ("postgresql://host/db", None),
    ("not a url", None),
])
def test_sqlite_file(url, path):
    assert sqlite_file(url) == path


def test_sqlite_file_default_follows_safepoint_home(safepoint_home, monkeypatch):
    monkeypatch.delenv("SAFEPOINT_CATALOG_URL", raising=False)
    assert sqlite_file(None) == safepoint_home / "catalog.db"


def test_knows_local(tmp_path, sqlite_catalog_url):
    folder = tmp_path / "ck"
    make_torch_save_ckpt(folder)
    assert main(["commit", str(folder), "--run", "p", "--step", "1"]) == 0
    assert knows_local(f"sqlite:///{tmp_path / 'missing.db'}", str(folder), []) is False
    assert knows_local("postgresql://h/db", str(folder), []) is None
    cat = open_catalog(sqlite_catalog_url)
    assert knows_local(sqlite_catalog_url, str(folder), ["file:///elsewhere/p/1"]) is False
    snap = LocalSnapshot.open(folder)
    cat.record_commit(snap.manifest, digest_bytes(snap.manifest_bytes), local_path=folder)
    assert knows_local(sqlite_catalog_url, str(folder), []) is True
    (tmp_path / "garbage.db").write_bytes(b"not sqlite at all" * 100)
    assert knows_local(f"sqlite:///{tmp_path / 'garbage.db'}", str(folder), []) is None


def test_verify_of_a_known_folder_is_still_recorded(tmp_path, sqlite_catalog_url, prefect_api):
    folder = tmp_path / "nvme" / "ck"
    make_torch_save_ckpt(folder)
    assert main(["commit", str(folder), "--run", "k", "--step", "1"]) == 0
    assert main(["--catalog", sqlite_catalog_url, "ingest", str(folder), "--to", (tmp_path / "d").as_uri()]) == 0
    cat = open_catalog(sqlite_catalog_url)
    before = len(cat.events(kind="verify.local"))
    assert main(["--catalog", sqlite_catalog_url, "verify", str(folder)]) == 0
    assert len(cat.events(kind="verify.local")) == before + 1


def test_verify_json_names_each_bad_file(tmp_path, sqlite_catalog_url, capsys):
    import json

    folder = tmp_path / "ck"
    make_torch_save_ckpt(folder)
    assert main(["commit", str(folder), "--run", "j", "--step", "1"]) == 0
    capsys.readouterr()
    assert main(["verify", str(folder), "--json"]) == 0
    good = json.loads(capsys.readouterr().out)
    assert good["state"] == "verified" and set(good["files"].values()) == {"ok"}
    victim = sorted(good["files"])[0]
    data = bytearray((folder / victim).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / victim).write_bytes(bytes(data))
    assert main(["verify", str(folder), "--json"]) == 1
    bad = json.loads(capsys.readouterr().out)
    assert bad["state"] == "corrupt" and bad["files"][victim] == "hash_mismatch"
