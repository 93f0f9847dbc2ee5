"""How an operation runs its steps: inline by default, as Prefect tasks when a flow supplies a runner.

Every operation (ingest, scrub, retention, reconcile, restore) is written once, as plain Python
that calls `steps.run(name, fn, ...)` for each step worth showing, retrying or running in
parallel. The CLI and the tests use `INLINE`; the Prefect flows pass `safepoint.tasks.runner`'s
runner, which makes each step a task with its retries. The library never imports Prefect.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class StepRunner(Protocol):
    def run(self, name: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run one step and return its result (raising what it raised)."""

    def map(self, name: str, fn: Callable[..., T], calls: Sequence[tuple[Any, ...]], /) -> list[T | BaseException]:
        """Run `fn(*args)` for each args tuple, concurrently where the runner can. Each failure is
        returned in its slot, as the exception, so one failing call never hides the others' results."""


class Inline:
    """Steps run in this thread, one after the other; no retries (those are the flow's)."""

    def run(self, name: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        return fn(*args, **kwargs)

    def map(self, name: str, fn: Callable[..., T], calls: Sequence[tuple[Any, ...]], /) -> list[T | BaseException]:
        out: list[T | BaseException] = []
        for args in calls:
            try:
                out.append(fn(*args))
            except Exception as e:  # noqa: BLE001 - returned in its slot, the caller decides
                out.append(e)
        return out


INLINE = Inline()


def all_or_raise(answers: Sequence[T | BaseException]) -> list[T]:
    """A map's answers, or the first failure among them raised: for steps whose failure is an
    infrastructure error, not a verdict."""
    for a in answers:
        if isinstance(a, BaseException):
            raise a
    return list(answers)  # type: ignore[arg-type]
