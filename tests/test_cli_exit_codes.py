"""Exit codes never lie: every failure that is not a verdict exits 2 with one `safepoint: error:` line.

Each command family is driven through an injected infrastructure failure: a catalog database that
refuses connections, a Prefect server that does not start, an unexpected exception. Without `-v`
stderr holds exactly one line and no traceback; with `-v` the traceback is there too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import safepoint.cli.main as cli
from safepoint.cli.guard import guarded, one_line
from safepoint.core.errors import UsageError

DEAD_DB = "postgresql://127.0.0.1:1/nothing?connect_timeout=2"  # nothing listens on port 1


def sp(*args: object) -> int:
    return cli.main([str(a) for a in args])


def assert_one_error_line(capsys, code: int) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, captured.err
    assert "Traceback" not in captured.err and "Traceback" not in captured.out
    assert len(lines) == 1 and lines[0].startswith("safepoint: error: "), captured.err
    return lines[0]


@pytest.mark.parametrize("args", [
    ["ls"],                                     # core commands
    ["resume-point", "--run", "r"],
    ["verify", "file:///nonexistent/r/1"],
    ["prune", "--run", "r", "--keep-last", "2"],
    ["lineage", "r", "1"],                      # cli_catalog
    ["risk", "--run", "r"],
    ["pin", "r", "1"],
    ["show", "r", "1"],                         # cli_validation
    ["metrics"],                                # cli_events
    ["parts"],
    ["reconcile"],                              # cli_repair
    ["scrub"],
], ids=lambda a: a[0])
def test_catalog_database_down_exits_2_with_one_line(args, capsys):
    line = assert_one_error_line(capsys, sp("--catalog", DEAD_DB, *args))
    assert "OperationalError" in line or "connect" in line.lower()


def _prefect_down(**_kw):
    raise RuntimeError("Timed out while attempting to connect to ephemeral Prefect API server.\nstdout: ...")


@pytest.mark.parametrize("args", [
    ["ingest", "{ck}", "--to", "{durable}"],
    ["watch", "{root}", "--once", "--to", "{durable}"],
    ["watch", "{root}", "--once", "--emit", "--to", "{durable}"],
    ["serve", "--to", "{durable}"],
    ["demo", "--dir", "{root}/demo"],
], ids=lambda a: " ".join(x for x in a if x.startswith("-") and x != "--to") or a[0])
def test_prefect_start_failure_exits_2_with_one_line(args, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "ensure_api", _prefect_down)
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "w.bin").write_bytes(b"x" * 64)
    assert sp("commit", ck, "--run", "r", "--step", 1) == 0
    capsys.readouterr()
    fill = {"ck": str(ck), "durable": (tmp_path / "durable").as_uri(), "root": str(tmp_path)}
    line = assert_one_error_line(capsys, sp(*[a.format(**fill) for a in args]))
    assert line == ("safepoint: error: RuntimeError: "
                    "Timed out while attempting to connect to ephemeral Prefect API server.")


def test_unexpected_exception_exits_2_and_shows_traceback_only_with_v(monkeypatch, capsys):
    def boom(_args):
        raise KeyError("surprise")

    monkeypatch.setattr(cli, "_listing", boom)
    assert assert_one_error_line(capsys, sp("ls")) == "safepoint: error: KeyError: 'surprise'"
    assert sp("-v", "ls") == 2
    text = capsys.readouterr().err
    assert "Traceback" in text and text.rstrip().splitlines()[-1] == "safepoint: error: KeyError: 'surprise'"


def test_verdicts_keep_exit_1(tmp_path, capsys):
    """The boundary does not swallow verdicts: a corrupt local snapshot is still 1."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "w.bin").write_bytes(b"x" * 64)
    assert sp("commit", ck, "--run", "r", "--step", 1) == 0
    (ck / "w.bin").write_bytes(b"y" * 64)
    assert sp("verify", ck) == 1


@pytest.mark.parametrize("exc, line", [
    (UsageError("give --run"), "safepoint: error: give --run"),
    (ConnectionRefusedError(111, "Connection refused"),
     "safepoint: error: ConnectionRefusedError: [Errno 111] Connection refused"),
    (RuntimeError("first line\nsecond line"), "safepoint: error: RuntimeError: first line"),
    (RuntimeError(""), "safepoint: error: RuntimeError"),
    (ValueError("x" * 1000), "safepoint: error: ValueError: " + "x" * (400 - 3 - len("ValueError: ")) + "..."),
    (OSError("s3://AKIAIOSFODNN7EXAMPLE:secret@bucket"), None),
])
def test_one_line(exc, line):
    got = one_line(exc)
    assert "\n" not in got and got.startswith("safepoint: error: ")
    if line is not None:
        assert got == line
    else:
        assert "secret" not in got


@pytest.mark.parametrize("exc, code", [
    (SystemExit(0), 0), (SystemExit(2), 2), (SystemExit(1), 2), (SystemExit("msg"), 2),
    (KeyboardInterrupt(), 130), (MemoryError(), 2), (Exception("x"), 2),
])
def test_guarded_codes(exc, code, capsys):
    def command():
        raise exc

    assert guarded(command, verbose=False, stderr=__import__("sys").stderr) == code
    assert "Traceback" not in capsys.readouterr().err


def test_reader_gone_is_quiet_141_but_a_broken_socket_is_an_error(tmp_path, capsys):
    """`safepoint ls --json | head -1`: the closed pipe is the reader's choice, not an error; a
    BrokenPipeError from anything else (a storage connection) still exits 2 with its line."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "SAFEPOINT_HOME": str(tmp_path / "home")}
    code = ("import sys, safepoint.cli.guard as g\n"
            "def chatty():\n    for _ in range(10**5):\n        print('x' * 99)\n    return 0\n"
            "sys.exit(g.guarded(chatty, verbose=False, stderr=sys.stderr))")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.readline()
    p.stdout.close()
    assert p.wait(timeout=60) == 141
    assert p.stderr.read() == b""

    def socket_broke():
        raise BrokenPipeError(32, "Broken pipe")

    assert guarded(socket_broke, verbose=False, stderr=sys.stderr) == 2  # captured stdout: not a pipe
    assert "BrokenPipeError" in capsys.readouterr().err


def _exit_now_child(body: str, tmp_path) -> subprocess.CompletedProcess:
    code = ("import atexit, sys, threading\nfrom safepoint.cli.guard import exit_now\n"
            "atexit.register(lambda: print('exit handler ran'))\n" + body)
    env = {**os.environ, "SAFEPOINT_HOME": str(tmp_path / "home")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


def test_exit_now_keeps_the_code_the_output_and_the_exit_handlers(tmp_path):
    """The fast end of a finished command: what it printed to a pipe (still in Python's buffer)
    arrives whole, the exit handlers run, the exit code is the command's."""
    p = _exit_now_child("sys.stdout.write('x' * 200_000)\nexit_now(3)\nprint('not reached')", tmp_path)
    assert p.returncode == 3
    assert p.stdout == "x" * 200_000 + "exit handler ran\n"


@pytest.mark.parametrize("setup", [
    "threading.Thread(target=__import__('time').sleep, args=(0.5,)).start()",  # the interpreter would wait for it
    "sys.modules['prefect'] = sys",                                            # Prefect's services end their own way
])
def test_exit_now_returns_where_a_full_teardown_is_needed(setup, tmp_path):
    p = _exit_now_child(f"{setup}\nexit_now(3)\nprint('returned')\nsys.exit(4)", tmp_path)
    assert p.returncode == 4
    assert p.stdout == "returned\nexit handler ran\n"


def test_the_command_line_exits_fast_with_its_own_code(tmp_path):
    """`python -m safepoint.cli` ends through exit_now: the code and the output are the command's."""
    env = {**os.environ, "SAFEPOINT_HOME": str(tmp_path / "home")}
    ok = subprocess.run([sys.executable, "-m", "safepoint.cli", "ls", "--json"], capture_output=True, text=True,
                        env=env, timeout=120)
    assert (ok.returncode, json.loads(ok.stdout)) == (0, [])
    bad = subprocess.run([sys.executable, "-m", "safepoint.cli", "verify", str(tmp_path / "nothing-here")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("safepoint: error: "), bad.stderr
