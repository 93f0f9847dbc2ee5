"""config.toml is read and parsed once per process while it is unchanged, and again once edited."""

from __future__ import annotations

import os

import pytest
import tomllib

from safepoint.cli.main import main
from safepoint.core import config
from tests.helpers_ckpt import make_torch_save_ckpt


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """Every tomllib.loads call the config module makes."""
    seen: list[str] = []
    real = tomllib.loads

    def counting(text, *a, **kw):
        seen.append(text)
        return real(text, *a, **kw)

    monkeypatch.setattr(tomllib, "loads", counting)
    config._parsed.clear()
    return seen


def test_an_unchanged_file_is_parsed_once_and_an_edited_one_again(tmp_path, parses):
    path = tmp_path / "config.toml"
    path.write_text('[runs.a]\nmodel = "m:one"\n')
    first = config.load_config(path)
    assert config.load_config(path).run_setting("a", "model") == "m:one"
    assert len(parses) == 1
    first.runs["a"]["model"] = "changed by a caller"          # callers get their own copy
    assert config.load_config(path).run_setting("a", "model") == "m:one"
    path.write_text('[runs.a]\nmodel = "m:two"\n')
    os.utime(path, ns=(1, 1))                                  # a different mtime even within one tick
    assert config.load_config(path).run_setting("a", "model") == "m:two"
    assert len(parses) == 2


def test_a_broken_file_is_refused_every_time(tmp_path, parses):
    path = tmp_path / "config.toml"
    path.write_text("[runs\n")
    for _ in range(2):
        with pytest.raises(config.UsageError, match="not valid TOML"):
            config.load_config(path)


def test_one_cli_ingest_parses_the_config_once(tmp_path, prefect_api, sqlite_catalog_url, safepoint_home,
                                               parses):
    text = '[validation]\nmax_tensor_bytes = 0\n'
    (safepoint_home / "config.toml").write_text(text)
    folder = tmp_path / "nvme" / "r" / "step-1"
    make_torch_save_ckpt(folder)
    assert main(["commit", str(folder), "--run", "r", "--step", "1"]) == 0
    parses.clear()
    assert main(["ingest", str(folder), "--to", (tmp_path / "durable").as_uri()]) == 0
    ours = [t for t in parses if t == text]              # not other TOML (Prefect reads its own settings)
    assert len(ours) == 1, f"config.toml parsed {len(ours)} times in one ingest"
