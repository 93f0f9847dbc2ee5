"""When Prefect retries a Safepoint task: I/O trouble yes, bad data never."""

from __future__ import annotations


def retry_on_infrastructure(task, task_run, state) -> bool:  # noqa: ANN001 - Prefect's signature
    """Retry network resets, timeouts and 5xx surfacing as OSError; a corrupt or invalid result is final."""
    try:
        state.result()
    except (OSError, TimeoutError, ConnectionError):
        return True
    except Exception:
        return False
    return False
