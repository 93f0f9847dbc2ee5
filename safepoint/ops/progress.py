"""Progress of long operations (ingest, verify) for the command line: one rich bar fed by byte counts.

Library code reports bytes through `hook()` (None when nobody watches, which is the normal case in
flows run by a server); the CLI installs a bar around a long call with `bar(...)`. The hook is
process-wide because Prefect runs tasks in worker threads; rich's Progress is thread-safe. rich is
imported only when a bar is shown, so a disabled bar (not a terminal) costs nothing at start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

Hook = Callable[[int], None]
_hook: Hook | None = None


def hook() -> Hook | None:
    """The active progress callback (bytes done since the last call), or None."""
    return _hook


@contextmanager
def bar(description: str, total_bytes: int | None, console: Console | Any | None = None, *,
        enabled: bool = True) -> Iterator[Hook]:
    """Show a transfer bar for the block and route `hook()` to it; a no-op bar when disabled.

    `console` is a rich Console, or a stand-in that makes one on demand as its `rich` attribute (the
    CLI's consoles, which import rich only when output needs it).
    """
    global _hook
    if not enabled:
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    console = getattr(console, "rich", console)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as p:
        task = p.add_task(description, total=total_bytes)

        def advance(n: int) -> None:
            p.advance(task, n)

        previous, _hook = _hook, advance
        try:
            yield advance
        finally:
            _hook = previous


class CountingDestination:
    """A destination proxy that reports each file's size to `hook` once it has been hashed back."""

    def __init__(self, inner: object, hook: Hook):
        self._inner = inner
        self._hook = hook

    def digest(self, run: str, step: int, relpath: str) -> str:
        out = self._inner.digest(run, step, relpath)  # type: ignore[attr-defined]
        size = self._inner.size(run, step, relpath)  # type: ignore[attr-defined]
        self._hook(size or 0)
        return out

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)
