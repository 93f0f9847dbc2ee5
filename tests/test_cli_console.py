"""The CLI's lazy consoles print exactly what rich's Console prints, with or without rich loaded."""

from __future__ import annotations

import pytest
from rich.console import Console

from safepoint.cli.console import LazyConsole

LINES = [
    "/tmp/ck: verified: 1 files verified (4096 bytes)",
    "committed r/1: 3 files, 12 bytes",
    "ünïcode ✓ path/日本",
    "trailing spaces   ",
    "",
    "[red]corrupt[/red] /tmp/ck: bad",  # markup: rich's
    "/data/[run]/ck: verified",  # looks like markup: rich's
    "a :smile: emoji code",  # the CLI's Console has emoji codes off: `:name:` in a name is data
    "a/b::c: d",
    "tab\tseparated",  # rich expands tabs
    "bell\x07 and \r return",  # rich strips control codes
    "two\nlines",
]


@pytest.mark.parametrize("stderr", [False, True])
@pytest.mark.parametrize("text", LINES)
def test_print_matches_rich_on_a_non_terminal(text, stderr, capsys, monkeypatch):
    for key in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(key, raising=False)
    Console(stderr=stderr, highlight=False, soft_wrap=True, emoji=False).print(text)
    want = capsys.readouterr()
    lazy = LazyConsole(stderr=stderr)
    lazy.print(text)
    assert capsys.readouterr() == want
    assert not lazy.is_terminal


def test_plain_lines_leave_rich_unmade_and_the_rest_makes_it(capsys):
    lazy = LazyConsole()
    lazy.print("plain line")
    assert lazy._rich is None
    lazy.print("[bold]x[/bold]")
    assert lazy._rich is not None
    assert capsys.readouterr().out == "plain line\nx\n"


def test_force_color_goes_to_rich(capsys, monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")
    lazy = LazyConsole()
    lazy.print("coloured")
    assert lazy._rich is not None and lazy.is_terminal
