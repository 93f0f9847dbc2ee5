"""Progress of long operations (ingest, restore, verify, scrub, the demo) for the command line: rich bars.

Library code reports bytes through `hook(key)` (None when nobody watches, which is the normal case in
flows run by a server); the CLI installs bars around a long call with `bars(...)` / `bar(...)`, one
per destination where it knows them. The hooks are process-wide because Prefect runs tasks in worker
threads; rich's Progress is thread-safe. rich is imported only when a bar is shown, so a disabled
bar (not a terminal, or --json) costs nothing at start-up. A description names folders and URLs:
it is shown as data (core.text.visible, no markup), never acted on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from safepoint.core.text import visible

if TYPE_CHECKING:
    from rich.console import Console

Hook = Callable[[int], None]
_hooks: dict[str | None, Hook] = {}


def hook(key: str | None = None) -> Hook | None:
    """The active progress callback (bytes done since the last call) for `key` (a destination URL),
    else the one for every key; None when nobody watches."""
    return _hooks.get(key) or _hooks.get(None)


def _transfer_columns() -> tuple[Any, ...]:
    from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    return (TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn())


@contextmanager
def bars(rows: Sequence[tuple[str | None, str, int | None]], console: Console | Any | None = None, *,
         enabled: bool = True) -> Iterator[dict[str | None, Hook]]:
    """One transfer bar per (key, description, total bytes) for the block; `hook(key)` feeds that bar.

    `console` is a rich Console, or a stand-in that makes one on demand as its `rich` attribute (the
    CLI's consoles, which import rich only when output needs it). Disabled: no bars, no hooks, no rich.
    """
    if not enabled:
        yield {key: (lambda n: None) for key, _d, _t in rows}
        return
    from rich.progress import Progress

    with Progress(*_transfer_columns(), console=getattr(console, "rich", console), transient=True) as p:
        mine: dict[str | None, Hook] = {}
        for key, description, total in rows:
            task = p.add_task(visible(description), total=total)
            mine[key] = lambda n, task=task: p.advance(task, n)
        previous = dict(_hooks)
        _hooks.update(mine)
        try:
            yield mine
        finally:
            _hooks.clear()
            _hooks.update(previous)


@contextmanager
def bar(description: str, total_bytes: int | None, console: Console | Any | None = None, *,
        enabled: bool = True) -> Iterator[Hook]:
    """One transfer bar for the block, fed by `hook()` for every key; a no-op when disabled."""
    with bars([(None, description, total_bytes)], console, enabled=enabled) as hooks:
        yield hooks[None]


class Steps:
    """A bar of named steps (the demo's): `next("ingest step-10")` finishes one and names the next."""

    def __init__(self, progress: Any = None, task: Any = None) -> None:
        self._progress, self._task, self._started = progress, task, False

    def next(self, description: str) -> None:
        if self._progress is None:
            return
        if self._started:
            self._progress.advance(self._task)
        self._started = True
        self._progress.update(self._task, description=visible(description))


@contextmanager
def steps(total: int, console: Console | Any | None = None, *, enabled: bool = True) -> Iterator[Steps]:
    """A step bar for the block (on `console`, cleared at the end); what else is printed shows above it."""
    if not enabled:
        yield Steps()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=getattr(console, "rich", console), transient=True) as p:
        yield Steps(p, p.add_task("starting", total=total))


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
