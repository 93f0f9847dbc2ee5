"""Where a Safepoint process gets its Prefect API: the user's server, or one shared local server.

Without PREFECT_API_URL, Prefect starts a temporary server inside every process that runs a flow:
seconds of start-up each time (28 s on a loaded 2-core node with a fresh PREFECT_HOME, against a
20 s timeout), events no other process sees, and a noisy shutdown. Instead:

- PREFECT_API_URL set (environment, Prefect profile or settings context): that server, untouched;
- otherwise one `prefect server start` per PREFECT_HOME, started on first use as a detached
  process and reused by every later command, `watch --emit` and `serve`. Its port and pid are
  recorded in PREFECT_HOME/safepoint-server.json; a file lock makes concurrent first uses start
  it once; `/api/health` says when it is up. The start-up wait is
  max(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, 180 s), sized for a loaded node.
  Its UI is told its own API address (PREFECT_UI_API_URL), not Prefect's default port 4200.
- The recorded pid is a small keeper (`python -m safepoint.flows.local_server`, the session leader)
  whose child is the server. Every Safepoint process that uses the server registers its pid in
  PREFECT_HOME/safepoint-clients/; once none of them is alive for `[server] idle_stop_s` seconds
  (default 1800; SAFEPOINT_SERVER_IDLE_STOP_S; 0 = never) the keeper stops the server, unless
  `safepoint server start` pinned it. `safepoint server stop` ends it at any time.

This module imports Prefect only inside functions, so the CLI can import it cheaply.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from safepoint.core.errors import SafepointError
from safepoint.local.atomic import write_replace

STATE_NAME = "safepoint-server.json"
LOCK_NAME = "safepoint-server.lock"
LOG_NAME = "safepoint-server.log"
PIN_NAME = "safepoint-server.pinned"  # `safepoint server start`: never stopped for idleness
CLIENTS_DIR = "safepoint-clients"  # one file per Safepoint process using the server: PID-STARTTIME
MIN_STARTUP_S = 180.0
IDLE_STOP_S = 1800.0
IDLE_ENV = "SAFEPOINT_SERVER_IDLE_STOP_S"
HOST = "127.0.0.1"


class ServerError(SafepointError):
    """The local Prefect server could not be started or reached (an infrastructure failure, exit 2)."""


@dataclass(frozen=True)
class ServerState:
    pid: int
    port: int
    home: str
    started_at: float
    prefect_version: str

    @property
    def api_url(self) -> str:
        return f"http://{HOST}:{self.port}/api"

    @property
    def ui_url(self) -> str:
        return f"http://{HOST}:{self.port}"


def configured_api_url() -> str | None:
    """The API URL Prefect itself would use (env, active profile, settings context), if any."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or None


def prefect_home() -> Path:
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home).expanduser()


def startup_timeout_s() -> float:
    from prefect.settings import get_current_settings

    return max(float(get_current_settings().server.ephemeral.startup_timeout_seconds), MIN_STARTUP_S)


def idle_stop_s() -> float:
    """Seconds without a Safepoint client before an embedded server stops itself (0: never)."""
    text = os.environ.get(IDLE_ENV)
    if text is None:
        from safepoint.core.config import load_config

        text = load_config().section("server").get("idle_stop_s", IDLE_STOP_S)
    try:
        return max(float(text), 0.0)
    except (TypeError, ValueError):
        raise ServerError(f"[server] idle_stop_s / {IDLE_ENV} must be a number of seconds, got {text!r}") from None


def ensure_api(on_start: Callable[[str], None] | None = None) -> str:
    """The API URL this process uses from now on, starting the shared local server if needed."""
    url = configured_api_url()
    if url:
        return url
    state = ensure_server(prefect_home(), startup_timeout_s(), on_start=on_start)
    use_api(state.api_url)
    return state.api_url


def use_api(url: str) -> None:
    """Point this process (and the flow runs it starts) at `url`."""
    os.environ["PREFECT_API_URL"] = url
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()


# --- the server process ------------------------------------------------------------------------------------------

def read_state(home: Path) -> ServerState | None:
    try:
        return ServerState(**json.loads((home / STATE_NAME).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _write_state(home: Path, state: ServerState) -> None:
    write_replace(home / STATE_NAME, json.dumps(asdict(state)).encode())  # safepoint.local.atomic


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of this very process is not alive
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def healthy(api_url: str, timeout: float = 5.0) -> bool:
    import urllib.request  # here, not at the top: 20 ms that commands running no flow do not pay

    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout) as r:  # noqa: S310 - loopback URL
            return r.status == 200
    except (OSError, ValueError):  # URLError is an OSError
        return False


def wait_healthy(state: ServerState, deadline: float, poll_s: float = 0.25) -> bool:
    """True once the server answers; False if it died or `deadline` (monotonic) passed."""
    while True:
        if healthy(state.api_url):
            return True
        if not pid_alive(state.pid) or time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    with open(home / LOCK_NAME, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def chosen_port() -> int:
    """PREFECT_SERVER_API_PORT if the user set it in the environment, else a free port (4200 may be theirs)."""
    if os.environ.get("PREFECT_SERVER_API_PORT"):
        from prefect.settings import get_current_settings

        return int(get_current_settings().server.api.port)
    return free_port()


def _server_env(home: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(home)
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The UI asks /ui-settings where its API is; Prefect's default names port 4200, not this one.
    own = f"http://{HOST}:{port}/api"
    env["PREFECT_UI_API_URL"] = env["PREFECT_SERVER_UI_API_URL"] = own
    return env


def _spawn(home: Path) -> ServerState:
    import prefect

    port = chosen_port()
    log = open(home / LOG_NAME, "ab")  # noqa: SIM115 - handed to the child
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "safepoint.flows.local_server", str(home), str(port), str(idle_stop_s())],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=_server_env(home, port),
            cwd=home, start_new_session=True,  # outlives this command, not killed by its Ctrl-C
        )
    finally:
        log.close()
    return ServerState(pid=proc.pid, port=port, home=str(home), started_at=time.time(),
                       prefect_version=prefect.__version__)


def ensure_server(home: Path, timeout_s: float, on_start: Callable[[str], None] | None = None, *,
                  pin: bool = False) -> ServerState:
    """The running local server of `home`, started (once, under a lock) if there is none.

    The calling process is registered as a client under the lock, so the keeper never stops a
    server between a client finding it and using it. `pin` (from `safepoint server start`)
    exempts it from the idle stop until `safepoint server stop`.
    """
    home.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    with _locked(home):
        if pin:
            (home / PIN_NAME).touch()
        register_client(home)
        state = read_state(home)
        if state is not None and pid_alive(state.pid):
            if wait_healthy(state, deadline):
                return state
            stop_server(home)  # alive but never answered within the whole wait: replace it
        if on_start is not None:
            on_start(f"starting a local Prefect server for {home} (first use; `safepoint server stop` ends it)")
        state = _spawn(home)
        _write_state(home, state)
        if wait_healthy(state, deadline):
            return state
        alive = pid_alive(state.pid)
        stop_server(home)
        raise ServerError(
            f"the local Prefect server {'did not answer within' if alive else 'exited before'} "
            f"{timeout_s:.0f} s; see {home / LOG_NAME}, or set PREFECT_API_URL to a running server")


def stop_server(home: Path, grace_s: float = 30.0) -> ServerState | None:
    """Stop the local server of `home` (its whole process group); None if there was none."""
    state = read_state(home)
    if state is None:
        return None
    if pid_alive(state.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(state.pid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        while pid_alive(state.pid) and time.monotonic() < end:
            time.sleep(0.1)
        if pid_alive(state.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(state.pid, signal.SIGKILL)
    with contextlib.suppress(FileNotFoundError):
        (home / STATE_NAME).unlink()
    with contextlib.suppress(FileNotFoundError):
        (home / PIN_NAME).unlink()
    return state


def stop(home: Path) -> ServerState | None:
    """`safepoint server stop`: as stop_server, under the lock so no command starts one meanwhile."""
    if not home.is_dir():
        return None
    with _locked(home):
        return stop_server(home)


# --- clients and the keeper ----------------------------------------------------------------------------------------

def _start_ticks(pid: int) -> str:
    """The process's start time in clock ticks (/proc), so a reused pid is not taken for a client."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "0"


def register_client(home: Path, pid: int | None = None) -> None:
    pid = pid or os.getpid()
    clients = home / CLIENTS_DIR
    clients.mkdir(exist_ok=True)
    (clients / f"{pid}-{_start_ticks(pid)}").touch()


def live_clients(home: Path) -> list[int]:
    """Pids of the registered clients still running; the entries of finished ones are removed."""
    alive = []
    for entry in (home / CLIENTS_DIR).glob("*-*"):
        pid_text, _, ticks = entry.name.partition("-")
        pid = int(pid_text) if pid_text.isdigit() else 0
        if pid and pid_alive(pid) and _start_ticks(pid) == ticks:
            alive.append(pid)
        else:
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
    return alive


def keep(home: Path, port: int, idle_s: float, command: list[str] | None = None) -> int:
    """The keeper: run `prefect server start` (or `command`) as a child; stop it after `idle_s` without a client.

    It is the pid recorded in the state file and the leader of the process group that
    `safepoint server stop` signals, so stopping it stops the server too.
    """
    command = command or [sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(port)]
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    poll_s = min(5.0, max(idle_s / 4, 0.2)) if idle_s > 0 else 5.0
    last_used = time.monotonic()
    while proc.poll() is None:
        time.sleep(poll_s)
        busy = bool(live_clients(home)) or (home / PIN_NAME).exists()  # also prunes finished clients
        if busy or idle_s <= 0:
            last_used = time.monotonic()
            continue
        if time.monotonic() - last_used < idle_s:
            continue
        with _locked(home):  # a client that finds the server registers under this lock first
            if (home / PIN_NAME).exists() or live_clients(home):
                last_used = time.monotonic()
                continue
            print(f"safepoint: no Safepoint client for {idle_s:.0f} s; stopping the local Prefect server",
                  flush=True)
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            state = read_state(home)
            if state is not None and state.pid == os.getpid():
                with contextlib.suppress(FileNotFoundError):
                    (home / STATE_NAME).unlink()
        return 0
    return proc.returncode or 0


if __name__ == "__main__":
    sys.exit(keep(Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
