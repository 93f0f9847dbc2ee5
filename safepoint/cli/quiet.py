"""Prefect's console output, off unless `-v`: a successful command ends with Safepoint's own lines.

Only environment defaults are set (Prefect reads them when it is imported), so a user's own
PREFECT_LOGGING_* settings win. Flow-run logs still reach the Prefect API (its `api` handler), so
the UI shows them; only the console handlers are raised to CRITICAL.
"""

from __future__ import annotations

import logging
import os
import warnings

QUIET_ENV = {
    "PREFECT_LOGGING_LEVEL": "WARNING",
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
