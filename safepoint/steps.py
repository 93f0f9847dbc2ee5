"""Step runners: how an operation runs its steps. Inline by default; a Prefect flow supplies its own.

An operation is plain Python that calls `run_step(name, fn, *args, **kw)` for each step worth
observing or retrying on its own; with `run_inline` that is just `fn(*args, **kw)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class StepRunner(Protocol):
    def __call__(self, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any: ...


def run_inline(name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Run the step here and now."""
    return fn(*args, **kwargs)
