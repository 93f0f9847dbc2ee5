"""Hostile inputs, round four, through the real command line (issue 37): output that cannot be
written, names that carry markup or terminal control sequences, catalog URL forms, steps past int64.

Each case runs `python -m safepoint.cli` as a process where the behaviour is the process's own (its
exit code, its stdout): a lost answer is exit 2 with one line, never 0 or a verdict.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from safepoint.catalog import db, open_catalog
from tests.helpers_catalog import local_folder, seed

ONE_LINE = "safepoint: error: could not write output: "


def _env(home: Path, catalog_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # Python's own buffering, as users run it
    return {**env, "SAFEPOINT_HOME": str(home), "SAFEPOINT_CATALOG_URL": catalog_url}


@pytest.fixture(scope="module")
def seeded(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """Two verified checkpoints r/5 <- r/6 in a SQLite catalog, and the environment that names it."""
    root = tmp_path_factory.mktemp("round4")
    url = f"sqlite:///{root / 'catalog.db'}"
    cat = open_catalog(url)
    seed(cat, root, "r", 5, tags=("a",))
    seed(cat, root, "r", 6, parent=("r", 5))
    db.dispose(url)
    return root, _env(root / "home", url)


def safepoint(env: dict[str, str], *args: object, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "safepoint.cli", *map(str, args)], env=env, text=True,
                          timeout=120, **kwargs)


def _close_stdout() -> None:
    os.close(1)  # `safepoint ... >&-`: the process starts without a stdout


def assert_output_lost(p: subprocess.CompletedProcess) -> str:
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
    assert lines and lines[-1].startswith(ONE_LINE), p.stderr
    assert sum(line.startswith("safepoint: error:") for line in lines) == 1, p.stderr
    return lines[-1]


# ------------------------------------------------------------------------------------ output errors

def _reads(root: Path) -> list[tuple[str, ...]]:
    folder = str(local_folder(root, "r", 5))
    return [("ls",), ("ls", "--json"), ("resume-point", "--run", "r"), ("resume-point", "--run", "r", "--json"),
            ("show", "r", "5", "--json"), ("lineage", "r", "6"), ("lineage", "r", "6", "--json"),
            ("verify", folder), ("verify", folder, "--json"), ("validate", folder, "--json"),
            ("risk", "--run", "r", "--json"), ("metrics",), ("--help",)]


def test_every_read_command_with_its_output_lost_exits_2_in_one_line(seeded) -> None:
    """stdout on a full disk (/dev/full) or closed (`>&-`): the answer is lost, so the exit is 2,
    never 0 (a success nobody saw) nor 1 (a verdict), with one line and no traceback."""
    root, env = seeded
    for args in _reads(root):
        shown = safepoint(env, *args, capture_output=True)
        assert shown.stdout.strip() and shown.returncode in (0, 1), (args, shown.stderr)  # there is an answer
        with open(os.devnull if not Path("/dev/full").exists() else "/dev/full", "w") as full:
            lost = safepoint(env, *args, stdout=full, stderr=subprocess.PIPE)
        assert "No space left on device" in assert_output_lost(lost), args
        closed = safepoint(env, *args, stderr=subprocess.PIPE, preexec_fn=_close_stdout)
        assert assert_output_lost(closed).endswith("stdout is closed"), args


def test_a_verdict_printed_only_on_stderr_keeps_its_code_with_stdout_closed(seeded) -> None:
    """Nothing was lost when a command writes nothing to stdout: `show` of a never-validated
    checkpoint is still the verdict 1, its line on stderr."""
    _root, env = seeded
    p = safepoint(env, "show", "r", "5", stderr=subprocess.PIPE, preexec_fn=_close_stdout)
    assert (p.returncode, p.stderr.strip()) == (1, "r/5: verified; never validated")


def test_a_reader_that_goes_away_is_still_141_not_an_output_error(seeded) -> None:
    _root, env = seeded
    p = subprocess.run(f"{sys.executable} -m safepoint.cli ls --json | head -c 1 >/dev/null; "
                       "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", env=env, text=True,
                       capture_output=True, timeout=120)
    assert p.returncode in (0, 141) and "error" not in p.stderr, p.stderr  # 0: it was all written first


# ------------------------------------------------------------------------------------ steps past int64

BIG = 2**64


@pytest.mark.parametrize("args", [
    ("show", "r", BIG), ("lineage", "r", BIG), ("pin", "r", BIG), ("tag", "r", BIG, "t"),
    ("metric", "r", BIG, "loss=1"), ("restore", "--run", "r", "--into", "{tmp}/x", "--step", BIG),
    ("commit", "{tmp}", "--run", "r", "--step", BIG), ("commit", "{tmp}", "--run", "r", "--step", 7, "--parent",
                                                        f"r:{BIG}"),
    ("resume-point", "--run", "r", "--max-step", BIG), ("reconcile", "--run", "r", "--step", BIG),
    ("show", "r", -1), ("show", "r", 2**63), ("show", "r", "1e3"), ("commit", "{tmp}", "--run", "r", "--step", "-5"),
])
def test_a_step_outside_int64_is_a_usage_error_in_every_argument(seeded, tmp_path: Path, args) -> None:
    _root, env = seeded
    work = tmp_path / "work"
    work.mkdir()
    p = safepoint(env, *(str(a).format(tmp=work) for a in args), capture_output=True)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith("safepoint: error: invalid step ") and "[0, 2**63 - 1]" in lines[0], p.stderr
    assert not list(work.iterdir()), "nothing is written for a refused command"


def test_the_largest_step_is_accepted(seeded, tmp_path: Path) -> None:
    _root, env = seeded
    p = safepoint(env, "show", "r", 2**63 - 1, capture_output=True)
    assert (p.returncode, p.stderr.strip()) == (1, f"no checkpoint r/{2**63 - 1} in the catalog")


# ------------------------------------------------------------------------------------ names are data

#: a name that would set the terminal's title, move the cursor home and turn the text red, and markup
HOSTILE = "\x1b]0;pwned\x07\r\x1b[31m[bold]"
SEEN = r"\x1b]0;pwned\x07\r\x1b[31m[bold]"  # what the user sees instead


def _prefect_env(env: dict[str, str], api: str, tmp_path: Path) -> dict[str, str]:
    return {**env, "PREFECT_API_URL": api, "SAFEPOINT_HOME": str(tmp_path / "home"),
            "SAFEPOINT_CATALOG_URL": f"sqlite:///{tmp_path / 'catalog.db'}"}


def _assert_inert(*texts: str) -> None:
    """No byte of a hostile name reached the console raw: no escape, bell or carriage return."""
    for text in texts:
        assert not {"\x1b", "\x07", "\r"} & set(text), repr(text)
        assert "MarkupError" not in text and "Traceback" not in text, text


def test_watch_ingests_a_folder_whose_name_is_markup(seeded, prefect_api, tmp_path: Path) -> None:
    """`exp[/]` under a watched root: ingested (exit 0), its name printed as it is."""
    import numpy as np
    from safetensors.numpy import save_file

    from safepoint.local.commit import commit

    _root, env = seeded
    env = _prefect_env(env, prefect_api, tmp_path)
    folder = tmp_path / "nvme" / "exp[" / "]"  # the path reads nvme/exp[/]
    folder.mkdir(parents=True)
    save_file({"w": np.ones(4, np.float32)}, str(folder / "model.safetensors"))
    commit(folder, "markup", 1)
    p = safepoint(env, "watch", tmp_path / "nvme", "--to", (tmp_path / "durable").as_uri(), "--once",
                  capture_output=True)
    assert p.returncode == 0, p.stderr
    assert "markup/1: verified" in p.stdout
    assert f"ingesting {folder.resolve()}" in p.stderr  # exp[/] itself, not markup
    ls = safepoint(env, "ls", "--json", capture_output=True)
    assert [(c["run"], c["step"], c["state"]) for c in json.loads(ls.stdout)] == \
        [("markup", 1, "verified")]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, prefect_api) -> tuple[Path, dict[str, str], subprocess.CompletedProcess]:
    """A checkpoint in a folder whose name is an escape sequence and markup, with NaN in a tensor
    named `layer[/b].weight` and in one named with escape sequences; ingested through the CLI."""
    import numpy as np
    from safetensors.numpy import save_file

    from safepoint.local.commit import commit

    tmp = tmp_path_factory.mktemp("hostile")
    env = _prefect_env(_env(tmp, ""), prefect_api, tmp)
    folder = tmp / "nvme" / f"exp{HOSTILE}x" / "step-3"
    folder.mkdir(parents=True)
    save_file({"layer[/b].weight": np.array([1.0, np.nan], np.float32),
               f"evil{HOSTILE}.weight": np.array([np.nan], np.float32), "ok": np.ones(3, np.float32)},
              str(folder / "model.safetensors"))
    commit(folder, "evil", 3)
    return folder, env, safepoint(env, "ingest", folder, "--to", (tmp / "durable").as_uri(), capture_output=True)


def test_ingest_reports_a_hostile_checkpoint_with_its_names_visible(hostile) -> None:
    _folder, _env, p = hostile
    assert p.returncode == 1, p.stderr  # a verdict: NaN in a parameter
    assert "evil/3: invalid" in p.stdout
    assert "layer[/b].weight: 1 NaN values" in p.stdout and f"evil{SEEN}.weight: 1 NaN values" in p.stdout
    _assert_inert(p.stdout, p.stderr)


def test_show_prints_the_report_of_a_tensor_named_with_markup(hostile) -> None:
    _folder, env, _ingest = hostile
    for extra in ((), ("--tensors", "5")):
        p = safepoint(env, "show", "evil", 3, *extra, capture_output=True)
        assert p.returncode == 1, p.stderr  # the verdict, not exit 2
        assert "Failures (2)" in p.stdout and "layer[/b].weight" in p.stdout and f"evil{SEEN}.weight" in p.stdout
        _assert_inert(p.stdout, p.stderr)


def test_validate_prints_each_finding_of_a_hostile_name_visibly(hostile) -> None:
    folder, env, _ingest = hostile
    p = safepoint(env, "validate", folder, capture_output=True)
    assert p.returncode == 1, p.stderr
    assert "layer[/b].weight: nan: " in p.stderr and f"evil{SEEN}.weight: nan: " in p.stderr
    assert f"exp{SEEN}x" in p.stderr
    _assert_inert(p.stdout, p.stderr)


@pytest.mark.parametrize("terminal", [False, True], ids=["plain", "rich"])
def test_ls_shows_a_hostile_folder_name_visibly(hostile, terminal: bool) -> None:
    """Piped, `ls` writes plain lines; with FORCE_COLOR it is rich's table: neither passes the name raw."""
    folder, env, _ingest = hostile
    p = safepoint({**env, "FORCE_COLOR": "1"} if terminal else env, "ls", capture_output=True)
    assert p.returncode == 0, p.stderr
    assert f"exp{SEEN}x" in p.stdout.replace("\n", "")  # a rich table may wrap nothing: WIDE
    if terminal:  # rich's own colours are escapes; the name's are not among them
        assert "\x1b]" not in p.stdout and "\x07" not in p.stdout and "\r" not in p.stdout
        assert "\x1b[31m" not in p.stdout
    else:
        _assert_inert(p.stdout, p.stderr)


# ------------------------------------------------------------------------------------ catalog URL forms

URL_FORMS = [
    "sqlite:////abs/cat.db", "sqlite:///rel/cat.db", "sqlite+pysqlite:////abs/cat.db", "SQLite:////abs/cat.db",
    "sqlite:////abs/a%20b.db", "sqlite:////abs/cat.db?timeout=5", "sqlite:////abs/cat.db?check_same_thread=false",
    "sqlite:///file:/abs/cat.db?uri=true", "sqlite:///file:/abs/cat.db?mode=ro&uri=true",
    "sqlite:///file:cat.db?uri=true&immutable=1", "sqlite:////abs/cat.db?mode=ro", "sqlite:////abs/cat.db#x",
    "sqlite:///~/cat.db", "sqlite://", "sqlite:///:memory:", "sqlite://host/abs/cat.db", "sqlite+aiosqlite:////a.db",
    "sqlite+pysqlcipher://:key@//abs/cat.db", "postgresql://host/db",
]


@pytest.mark.parametrize("url", URL_FORMS)
def test_the_fast_path_reads_exactly_the_file_sqlalchemy_opens_or_leaves_the_url_to_it(url: str) -> None:
    """ls (catalog.listing), restore and resume-point (catalog.lite) and verify (catalog.probe) read a
    SQLite catalog with sqlite3 alone through `sqlite_file`: its answer must be SQLAlchemy's file."""
    from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
    from sqlalchemy.engine import make_url

    from safepoint.catalog.probe import sqlite_file

    fast = sqlite_file(url)
    if fast is None:
        return  # left to the catalog proper: SQLAlchemy reads it, or refuses it (exit 2, one line)
    args, kwargs = SQLiteDialect_pysqlite().create_connect_args(make_url(url))
    assert not kwargs.get("uri") and args[0] != ":memory:"
    assert os.path.abspath(fast) == args[0]


def test_ls_of_a_uri_catalog_url_lists_what_resume_point_finds(seeded, tmp_path: Path) -> None:
    root, env = seeded
    env = {**env, "SAFEPOINT_CATALOG_URL": f"sqlite:///file:{root / 'catalog.db'}?uri=true"}
    found = safepoint(env, "resume-point", "--run", "r", capture_output=True, cwd=tmp_path)
    assert (found.returncode, found.stdout.split(":")[0]) == (0, "r step 6")
    listed = safepoint(env, "ls", "--json", capture_output=True, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert [(c["run"], c["step"]) for c in json.loads(listed.stdout)] == [("r", 5), ("r", 6)]
    assert listed.stderr == ""
    assert not list(tmp_path.glob("file:*"))  # the URI is sqlite3's to open: no `./file:/...` folder made
