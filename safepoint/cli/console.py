"""The CLI's two consoles (stdout, stderr): rich, but only imported when the output needs it.

Importing rich costs about as much as `safepoint verify` may spend beyond hashing, and most runs
print a line or two to a pipe or a log. A plain line to a non-terminal is exactly its text (markup,
control characters, tabs and terminals go to rich), so it is written directly; anything
else (tables, JSON, markup, a terminal, a progress bar) makes the rich Console on first use.

Names are data. A folder, file or tensor name (or a URL) comes from whoever wrote the checkpoint:
`inert(name)` is how one enters a line that may carry markup (its `[` escaped, its control
characters visible), text printed with `markup=False` has its control characters made visible
here, and the plain table does the same. Emoji codes are off: `:name:` in a name stays as it is.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from safepoint.core.text import visible

if TYPE_CHECKING:
    from rich.console import Console

#: what rich would change in a str: markup tags (non-printables are checked apart; emoji codes are off)
_RICH_SYNTAX = re.compile(r"\[")
#: environment variables that make rich treat a pipe as a terminal (or otherwise change its output)
_RICH_ENV = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")
#: the width of rich output that goes to a file or a pipe: wide enough that no table cuts a value
WIDE = 100_000


class LazyConsole:
    """A stand-in for `rich.console.Console(stderr=..., highlight=False, soft_wrap=True)`."""

    def __init__(self, *, stderr: bool = False) -> None:
        self.stderr = stderr
        self._rich: Console | None = None

    @property
    def rich(self) -> Console:
        """The rich Console itself, made on first use."""
        if self._rich is None:
            from rich.console import Console

            # Not a terminal (a pipe, a file, a log): no 80-column limit, so tables keep whole values.
            wide = {} if self._isatty() else {"width": WIDE}
            self._rich = Console(stderr=self.stderr, highlight=False, soft_wrap=True, emoji=False, **wide)
        return self._rich

    @property
    def file(self) -> TextIO:
        return sys.stderr if self.stderr else sys.stdout  # looked up per call, as rich does (pytest swaps them)

    def _isatty(self) -> bool:
        isatty = getattr(self.file, "isatty", None)
        try:
            return bool(isatty and isatty())
        except ValueError:  # a closed file
            return False

    def _plain_target(self) -> bool:
        """Output rich would leave undecorated: not a terminal, no environment override, no notebook."""
        if self._rich is not None or any(k in os.environ for k in _RICH_ENV) or "IPython" in sys.modules:
            return False
        isatty = getattr(self.file, "isatty", None)
        try:
            return isatty is not None and not isatty()
        except ValueError:  # a closed file: rich calls that no terminal either
            return True

    @property
    def is_terminal(self) -> bool:
        return False if self._plain_target() else self.rich.is_terminal

    def print(self, *objects: Any, **kwargs: Any) -> None:
        data = kwargs.get("markup") is False  # text that is data through and through: nothing in it acts
        if data:
            objects = tuple(visible(o) if isinstance(o, str) else o for o in objects)
        text = objects[0] if len(objects) == 1 else None
        plain = set(kwargs) <= {"markup", "highlight"} if data else not kwargs
        if (isinstance(text, str) and plain and text.isprintable() and (data or not _RICH_SYNTAX.search(text))
                and self._plain_target()):
            f = self.file
            f.write(text + "\n")
            f.flush()
            return
        self.rich.print(*objects, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rich, name)  # print_json, status, ... : rich's own


def inert(value: object) -> str:
    """A user-controlled name (folder, file, tensor, URL) for a console line that may carry markup:
    rich markup escaped, control characters visible (`\\x1b`), so it prints as exactly what it is."""
    text = visible(str(value))
    if "[" not in text:
        return text
    from rich.markup import escape

    return escape(text)


class VisibleFormatter(logging.Formatter):
    """Log lines as data: control characters in a message (a newline too: no forged lines) visible;
    a traceback keeps its own lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        return visible(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:  # noqa: N802 - logging's name
        return visible(super().formatException(ei), keep="\n")

    def formatStack(self, stack_info: str) -> str:  # noqa: N802 - logging's name
        return visible(super().formatStack(stack_info), keep="\n")


def plain_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Rows as aligned text columns, every value whole and visible: the table for a pipe or a file."""
    table = [list(headers)] + [[visible(str(v)) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(headers))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in table)
