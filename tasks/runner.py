"""The Prefect step runner: each step of a Safepoint operation becomes a task, with its retries.

Operations (safepoint.ops) are plain Python that call `runner.run(name, fn, ...)`; a flow passes
`PrefectSteps()` so that the same composition shows every step in the UI, retries what is worth
retrying and runs `map` steps concurrently. Retry settings live here, in one table, by step name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from prefect import Task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from safepoint.tasks.host_slot import host_slot
from safepoint.tasks.retry import retry_on_infrastructure

T = TypeVar("T")

#: Prefect task options by step name; steps not listed run once
STEP_OPTIONS: dict[str, dict[str, Any]] = {
    "replicate": {"retries": 3, "retry_delay_seconds": exponential_backoff(backoff_factor=2),
                  "retry_jitter_factor": 0.5, "retry_condition_fn": retry_on_infrastructure},
    "replicate+verify": {"retries": 3, "retry_delay_seconds": exponential_backoff(backoff_factor=2),
                         "retry_jitter_factor": 0.5, "retry_condition_fn": retry_on_infrastructure},
    "prune-run": {"retries": 2, "retry_delay_seconds": exponential_backoff(backoff_factor=5),
                  "retry_condition_fn": retry_on_infrastructure},
    "evict-root": {"retries": 2, "retry_delay_seconds": 10, "retry_condition_fn": retry_on_infrastructure},
    "verify-batch": {"retries": 2, "retry_delay_seconds": 5, "retry_condition_fn": retry_on_infrastructure},
}


class PrefectSteps:
    """A `safepoint.ops.runner.StepRunner` whose steps are Prefect tasks (never cached: steps act)."""

    def __init__(self, options: dict[str, dict[str, Any]] | None = None):
        self.options = STEP_OPTIONS if options is None else options
        self._tasks: dict[tuple[str, Callable[..., Any]], Task] = {}

    def task(self, name: str, fn: Callable[..., T]) -> Task:
        key = (name, fn)
        if key not in self._tasks:
            self._tasks[key] = Task(fn, name=name, cache_policy=NO_CACHE, **self.options.get(name, {}))
        return self._tasks[key]

    def run(self, name: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        return self.task(name, fn)(*args, **kwargs)

    def map(self, name: str, fn: Callable[..., T], calls: Sequence[tuple[Any, ...]], /) -> list[T | BaseException]:
        t = self.task(name, fn)
        futures = [t.submit(*args) for args in calls]
        out: list[T | BaseException] = []
        for f in futures:
            try:
                out.append(f.result())
            except Exception as e:  # noqa: BLE001 - returned in its slot, the composition decides
                out.append(e)
        return out

    def host_limit(self, name: str, slots: int, wait_s: float) -> Any:
        """One slot of Prefect's global concurrency limit `name` (created or resized to `slots`), which the
        UI shows (tasks.host_slot); None without a real server (a temporary one forgets it), so the
        catalog lease serves."""
        from prefect.settings import get_current_settings

        if not get_current_settings().api.url:
            return None
        return host_slot(name, slots, wait_s)
