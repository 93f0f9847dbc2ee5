"""What a user reads and types: help that names arguments and exit codes, global options anywhere,
close matches for mistyped runs, whole values when output goes to a pipe or a file."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

import safepoint.cli.main as cli
from safepoint.cli.registry import COMMANDS
from safepoint.rules.suggest import close_matches, did_you_mean
from tests.helpers_catalog import seed


def sp(*args: object) -> int:
    return cli.main([str(a) for a in args])


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    _parser, commands = cli.build_parser()
    commands.load_all()
    return dict(commands.choices)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_help_describes_it_and_names_its_exit_codes(name, capsys):
    assert sp(name, "--help") == 0
    text = capsys.readouterr().out
    assert f"usage: safepoint {name}" in text
    exits = text[text.index("exit codes:"):]
    assert "\n  0  " in exits and "\n  2  " in exits, exits
    description = text.split("\n\n")[1]  # usage, then the description paragraph
    assert len(description.split()) >= 4, text


def test_every_argument_has_help():
    missing = [(name, a.option_strings or a.dest) for name, p in _subparsers().items()
               for a in p._actions if not a.help]
    assert not missing


def test_json_flags_say_what_they_do(capsys):
    for name, p in _subparsers().items():
        for a in p._actions:
            if "--json" in a.option_strings:
                assert "JSON" in a.help, name


@pytest.mark.parametrize("where", ["before", "after"])
def test_global_options_before_or_after_the_command(where, sqlite_catalog, tmp_path, capsys, monkeypatch):
    seed(sqlite_catalog, tmp_path, "my-run", 1)
    monkeypatch.delenv("SAFEPOINT_CATALOG_URL", raising=False)
    monkeypatch.setenv("SAFEPOINT_HOME", str(tmp_path / "elsewhere"))  # the default catalog is empty
    capsys.readouterr()
    args = (["--catalog", sqlite_catalog.url, "-v", "ls", "--json"] if where == "before"
            else ["ls", "--json", "--catalog", sqlite_catalog.url, "-v"])
    assert sp(*args) == 0
    assert '"run": "my-run"' in capsys.readouterr().out


def test_an_option_after_the_command_does_not_undo_one_before(sqlite_catalog, tmp_path, capsys, monkeypatch):
    seed(sqlite_catalog, tmp_path, "my-run", 1)
    monkeypatch.setenv("SAFEPOINT_HOME", str(tmp_path / "elsewhere"))
    monkeypatch.delenv("SAFEPOINT_CATALOG_URL", raising=False)
    capsys.readouterr()
    assert sp("--catalog", sqlite_catalog.url, "ls", "--json") == 0
    assert '"my-run"' in capsys.readouterr().out


@pytest.mark.parametrize("word, known, want", [
    ("my-rnu", ["my-run", "other"], ["my-run"]),
    ("llama-7", ["llama-7b", "llama-13b", "gpt2"], ["llama-7b", "llama-13b"]),
    ("zzz", ["my-run"], []),
    ("my-run", ["my-run"], []),  # the word itself is no suggestion
    ("x", [], []),
])
def test_close_matches(word, known, want):
    assert close_matches(word, known) == want


def test_did_you_mean_text():
    assert did_you_mean("my-rnu", ["my-run"]) == " (did you mean 'my-run'?)"
    assert did_you_mean("a-b", ["a-bc", "a-bd"]) == " (did you mean 'a-bc' or 'a-bd'?)"
    assert did_you_mean("zzz", ["my-run"]) == ""


@pytest.mark.parametrize("args, code", [
    (["resume-point", "--run", "my-rnu"], 1),
    (["restore", "--run", "my-rnu", "--into", "{tmp}/into"], 1),
    (["risk", "--run", "my-rnu"], 1),
    (["lineage", "my-rnu", "1"], 1),
    (["show", "my-rnu", "1"], 1),
    (["pin", "my-rnu", "1"], 2),
    (["ls", "--run", "my-rnu"], 0),
], ids=lambda a: a[0] if isinstance(a, list) else str(a))
def test_mistyped_run_gets_a_close_match(args, code, sqlite_catalog, tmp_path, capsys):
    seed(sqlite_catalog, tmp_path, "my-run", 1)
    capsys.readouterr()
    assert sp("--catalog", sqlite_catalog.url, *[a.format(tmp=tmp_path) for a in args]) == code
    assert "did you mean 'my-run'?" in capsys.readouterr().err


def test_a_known_run_gets_no_suggestion(sqlite_catalog, tmp_path, capsys):
    seed(sqlite_catalog, tmp_path, "my-run", 1, state="invalid")
    capsys.readouterr()
    assert sp("--catalog", sqlite_catalog.url, "resume-point", "--run", "my-run") == 1
    assert "did you mean" not in capsys.readouterr().err


def test_ls_to_a_pipe_keeps_whole_urls_and_states(sqlite_catalog, tmp_path):
    deep = tmp_path / ("a-rather-long-folder-name-" * 4)
    seed(sqlite_catalog, deep, "a-run-with-a-long-name", 10, replicas=("verified", "corrupt"),
         tags=("best", "release"), pinned=True)
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    env["COLUMNS"] = "40"
    got = subprocess.run([sys.executable, "-m", "safepoint.cli", "ls", "--catalog", sqlite_catalog.url],
                         capture_output=True, text=True, env=env, check=True)
    lines = got.stdout.splitlines()
    assert lines[0].split() == ["run", "step", "state", "bytes", "replicas", "local", "parent", "pin/tags"]
    assert len(lines) == 2  # one line per checkpoint
    for i, state in enumerate(("verified", "corrupt")):
        assert f"{(deep / f'durable{i}').as_uri()}/a-run-with-a-long-name/10 ({state})" in lines[1]
    assert str(deep / "nvme" / "a-run-with-a-long-name" / "step-10") in lines[1]
    assert lines[1].split()[:3] == ["a-run-with-a-long-name", "10", "verified"]
    assert lines[1].endswith("pinned best release")
    assert "…" not in got.stdout


def test_rich_tables_to_a_pipe_keep_whole_values(sqlite_catalog, tmp_path):
    """`risk` prints a rich table; piped, no column is cut at 80 characters."""
    seed(sqlite_catalog, tmp_path, "r" * 90, 1)
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    got = subprocess.run([sys.executable, "-m", "safepoint.cli", "risk", "--run", "r" * 90, "--catalog",
                          sqlite_catalog.url], capture_output=True, text=True, env=env, check=True)
    assert "r" * 90 in got.stdout and "…" not in got.stdout


@pytest.mark.parametrize("argv, name", [
    (["verify", "x"], "verify"),
    (["--catalog", "sqlite:///c.db", "ls"], "ls"),           # a global option's value is not the command
    (["--catalog=sqlite:///c.db", "-v", "ls", "--json"], "ls"),
    (["-v", "resume-point", "--run", "verify"], "resume-point"),
    (["--help"], None),
    ([], None),
    (["nosuch", "ls"], None),                                # the first word decides; argparse then refuses it
])
def test_the_chosen_command_is_the_first_positional_word(argv, name):
    from safepoint.cli.registry import chosen

    assert chosen(argv) == name


def test_a_command_imports_only_its_own_modules():
    """`safepoint verify --help` loads the verify command's module, not the catalog or event commands'."""
    code = ("import sys, safepoint.cli.main as m\n"
            "try:\n    m._dispatch(['verify', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(n for n in sys.modules if n.startswith('safepoint.cli.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = out.strip().splitlines()[-1]
    assert "safepoint.cli.main" in loaded
    for other in ("catalog_cmds", "events_cmds", "repair_cmds", "restore_cmds", "validation_cmds"):
        assert f"safepoint.cli.{other}" not in loaded, loaded
