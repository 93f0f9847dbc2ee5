"""Prefect's console output, off unless `-v`: a successful command ends with Safepoint's own lines.

Only environment defaults are set (Prefect reads them when it is imported), so a user's own
PREFECT_LOGGING_* settings win. Log levels are left alone: Prefect's run loggers and Safepoint's
own (flows/run_logs.py) keep sending INFO lines to the Prefect API, so the UI shows each flow
run's logs. Only what reaches the terminal is cut: Prefect's console handlers are raised to
CRITICAL, and the CLI's own handler shows WARNING and up, and no Prefect record below CRITICAL
(a Failed flow run is reported by Safepoint's own lines and exit code, not Prefect's).
"""

from __future__ import annotations

import logging
import os
import warnings

from safepoint.cli.console import VisibleFormatter

QUIET_ENV = {
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "CRITICAL",  # prefect's console handler (root logger)
    "PREFECT_LOGGING_HANDLERS_DEBUG_LEVEL": "CRITICAL",  # prefect._internal
}


def quiet_prefect(verbose: bool) -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if verbose:
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    warnings.filterwarnings("ignore", module=r"prefect(\..*)?$")
    # Prefect's runner (`serve`) exits on SIGTERM by sys.exit inside its event loop; asyncio then logs
    # the cancelled control-channel task as an ERROR with two tracebacks. Shutdown noise, not a failure.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def _not_prefect(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.CRITICAL or not (record.name == "prefect" or record.name.startswith("prefect."))


def console_logging(verbose: bool) -> None:
    """The CLI's stderr handler: INFO with `-v`, else WARNING and no Prefect lines.

    The level is the handler's, not only the root logger's: records of loggers set lower for the
    API (Prefect's run loggers, `safepoint` inside a flow run) propagate to it regardless.
    """
    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler:  # basicConfig's, not pytest's capture
            handler.setLevel(level)
            handler.setFormatter(VisibleFormatter("%(levelname)s %(name)s: %(message)s"))  # names are data
            if not verbose:
                handler.addFilter(_not_prefect)
