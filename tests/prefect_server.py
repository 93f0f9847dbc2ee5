"""A real `prefect server start` on loopback for integration tests (SQLite or PostgreSQL, its own PREFECT_HOME).

Started in its own process group and always stopped (SIGTERM, then SIGKILL). It can be stopped and
started again on the same port and database, to test what happens while the server is down.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from safepoint.local import processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it lingers (safepoint.local.processes); reap the leader."""
    stop_groups([proc], grace_s)


def stop_groups(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """`stop_group` for several at once: each is stopped in its own thread, so they share one grace
    period and a teardown waits for the slowest process, not for the sum of them."""
    from concurrent.futures import ThreadPoolExecutor

    idents = [processes.identify(p.pid) for p in procs if p.poll() is None]
    idents = [i for i in idents if i is not None]
    if idents:
        with ThreadPoolExecutor(len(idents)) as pool:
            list(pool.map(lambda i: processes.stop_group(i, grace_s), idents))
    for proc in procs:
        proc.wait(timeout=10)


# Services the tests do not need: fewer loops competing for two cores.
QUIET_SERVICES = ("LATE_RUNS", "FOREMAN", "PAUSE_EXPIRATIONS", "CANCELLATION_CLEANUP", "DB_VACUUM",
                  "REPOSSESSOR", "EVENT_LOGGER")


class PrefectServer:
    def __init__(self, home: Path, port: int | None = None, *, database_url: str | None = None,
                 settings: dict[str, str] | None = None):
        """`database_url`: Prefect's own database (default: SQLite in `home`); `settings`: more
        PREFECT_* variables for the server process (e.g. service loop intervals)."""
        self.home = Path(home)
        self.database_url = database_url or f"sqlite+aiosqlite:///{self.home / 'prefect.db'}"
        self.settings = dict(settings or {})
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.proc: subprocess.Popen | None = None
        self.log = self.home / "server.log"

    def env(self) -> dict[str, str]:
        """The environment a client of this server needs (merged into os.environ)."""
        return {
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": self.url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOGGING_TO_API_ENABLED": "false",
        }

    def start(self, timeout_s: float = 120.0) -> None:
        env = dict(os.environ, **self.env())
        env.update({
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": self.database_url,
            "PREFECT_SERVER_UI_ENABLED": "false",
            "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
            # New scheduled runs are created soon after a deployment is made.
            "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
        })
        for name in QUIET_SERVICES:
            env[f"PREFECT_SERVER_SERVICES_{name}_ENABLED"] = "false"
        env.update(self.settings)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                 str(self.port), "--no-ui", "--analytics-off"],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited: {self.log.read_text()[-3000:]}")
            if self.healthy():
                return
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"prefect server not healthy after {timeout_s}s: {self.log.read_text()[-3000:]}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)
            self.proc = None
