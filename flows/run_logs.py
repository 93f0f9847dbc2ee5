"""Safepoint's own log lines (the `safepoint` logger) in the logs of the Prefect run they belong to.

Prefect sends only its own run loggers to the API; `PREFECT_LOGGING_EXTRA_LOGGERS` would add ours,
but its handler also warns for every line logged outside a run (most CLI commands). So one
APILogHandler, with a filter that passes only records made inside a flow or task run, is added to
the `safepoint` logger once per process, and that logger is set to INFO if it was higher. What the
terminal shows is the CLI's business (safepoint/cli/quiet.py: its handler stays at WARNING).
"""

from __future__ import annotations

import logging

LOGGER = "safepoint"
_installed: list[logging.Handler] = []


def _in_a_run(_record: logging.LogRecord) -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def route_to_run_logs(level: int = logging.INFO) -> None:
    """Called at the start of each flow: idempotent, cheap after the first call."""
    if _installed:
        return
    from prefect.logging.handlers import APILogHandler

    handler = APILogHandler(level=level)
    handler.addFilter(_in_a_run)
    logger = logging.getLogger(LOGGER)
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    _installed.append(handler)
