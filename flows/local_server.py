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
- The recorded process is a small keeper (`python -m safepoint.flows.local_server`, the session
  leader) whose child is the server; the child dies with it (PR_SET_PDEATHSIG). The state file names
  the keeper beyond doubt: pid, process start time, host and boot id (safepoint.local.processes),
  and its command line must be the keeper's of this PREFECT_HOME. A file that fails any of these
  (its keeper exited, the pid was reused, another node wrote it on a shared home) is stale: it is
  renamed to safepoint-server.json.stale with one line on stderr, nothing is signalled, and a new
  server is started at once. Every Safepoint process that uses the server registers its pid in
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
from safepoint.local import processes
from safepoint.local.atomic import write_replace
from safepoint.local.processes import ProcessId

STATE_NAME = "safepoint-server.json"
STALE_SUFFIX = ".stale"  # a state file that names no keeper of ours is renamed to this, never trusted
KEEPER_MODULE = "safepoint.flows.local_server"
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
    start_ticks: str  # the keeper's identity beyond its pid: safepoint.local.processes.ProcessId
    host: str
    boot_id: str

    @property
    def keeper(self) -> ProcessId:
        return ProcessId(self.pid, self.start_ticks, self.host, self.boot_id)

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
    """The recorded server; None if there is no file, or one this version cannot read (see stale_reason)."""
    try:
        return ServerState(**json.loads((home / STATE_NAME).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _write_state(home: Path, state: ServerState) -> None:
    write_replace(home / STATE_NAME, json.dumps(asdict(state)).encode())  # safepoint.local.atomic


def state_of(pid: int, port: int, home: Path) -> ServerState:
    """The state that names process `pid` (running now) as the keeper of `home`'s server on `port`."""
    from importlib.metadata import version  # not `import prefect`: seconds the keeper would add to every start

    ident = processes.identify(pid) or ProcessId(pid, "", "", "")
    return ServerState(pid=pid, port=port, home=str(home), started_at=time.time(),
                       prefect_version=version("prefect"), start_ticks=ident.start_ticks, host=ident.host,
                       boot_id=ident.boot_id)


def stale_reason(state: ServerState | None, here: ProcessId, now: ProcessId | None, running: bool,
                 argv: list[str]) -> str | None:
    """Why a state file names no running keeper of its server (None: it does). Pure: the caller reads /proc.

    `here`: this process (its host and boot id); `now`: the identity that `state.pid` has on this
    host now (None: no such process); `running`: it is no zombie; `argv`: its command line.
    """
    if state is None:
        return "unreadable, or written by an older Safepoint (no process start time)"
    if state.host != here.host:
        return f"written on host {state.host!r}, not this one ({here.host!r})"
    if state.boot_id != here.boot_id:
        return f"written before this host last booted (boot id {state.boot_id or 'unknown'})"
    if now is None:
        return f"its keeper (pid {state.pid}) has exited"
    if state.start_ticks != now.start_ticks:
        return f"pid {state.pid} is another process now (its keeper has exited)"
    if not running:
        return f"its keeper (pid {state.pid}) has exited"
    if KEEPER_MODULE not in argv or state.home not in argv:
        return f"pid {state.pid} is not a Safepoint server keeper of {state.home} ({' '.join(argv)[:80]!r})"
    return None


def judge(state: ServerState | None, home: Path | None = None) -> str | None:
    """stale_reason for `state` against this host's processes now; with `home`, a file found there that
    names another PREFECT_HOME's keeper (a copied home) is stale too: never that keeper's to stop."""
    here = processes.identify() or ProcessId(os.getpid(), "", "", "")
    if state is None:
        return stale_reason(None, here, None, False, [])
    if home is not None and os.path.realpath(state.home) != os.path.realpath(home):
        return f"it names the server of PREFECT_HOME {state.home}, not of {home} (a copied home?)"
    now = processes.identify(state.pid)
    return stale_reason(state, here, now, now is not None and processes.alive(now), processes.cmdline(state.pid))


def running(state: ServerState) -> bool:
    """The keeper `state` names is running: same pid, start time, host, boot and command line."""
    return judge(state) is None


def set_aside(home: Path, reason: str) -> Path | None:
    """Rename a stale state file out of the way (one line on stderr): never trusted, never signalled, kept to read."""
    path = home / STATE_NAME
    aside = path.with_name(STATE_NAME + STALE_SUFFIX)
    if aside.is_dir() and not aside.is_symlink():  # an earlier stale entry that was a folder: keep it, beside
        aside = path.with_name(f"{STATE_NAME}{STALE_SUFFIX}.{os.getpid()}.{time.time_ns()}")
    try:
        path.replace(aside)
    except FileNotFoundError:
        return None
    print(f"safepoint: set aside a stale server file as {aside}: {reason}", file=sys.stderr, flush=True)
    return aside


def current(home: Path) -> ServerState | None:
    """The recorded server if its keeper runs; a state file that names none is set aside (call under the lock)."""
    if not (home / STATE_NAME).exists():
        return None
    state = read_state(home)
    reason = judge(state, home)
    if reason is None:
        return state
    set_aside(home, reason)
    return None


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
        if not running(state) or time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    home.mkdir(parents=True, exist_ok=True)  # removed under a running keeper: made again, not a crash
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
    port = chosen_port()
    log = open(home / LOG_NAME, "ab")  # noqa: SIM115 - handed to the child
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", KEEPER_MODULE, str(home), str(port), str(idle_stop_s())],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=_server_env(home, port),
            cwd=home, start_new_session=True,  # outlives this command, not killed by its Ctrl-C
        )
    finally:
        log.close()
    return state_of(proc.pid, port, home)  # Popen returns after the exec: the command line is the keeper's


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
        state = current(home)  # a stale or foreign file is set aside here: no wait, nothing signalled
        if state is not None:
            if wait_healthy(state, deadline):
                return state
            stop_server(home)  # alive but never answered within the whole wait: replace it
        if on_start is not None:
            on_start(f"starting a local Prefect server for {home} (first use; `safepoint server stop` ends it)")
        state = _spawn(home)
        _write_state(home, state)
        if wait_healthy(state, deadline):
            return state
        alive = running(state)
        stop_server(home)
        raise ServerError(
            f"the local Prefect server {'did not answer within' if alive else 'exited before'} "
            f"{timeout_s:.0f} s; see {home / LOG_NAME}, or set PREFECT_API_URL to a running server")


def stop_server(home: Path, grace_s: float = 30.0) -> ServerState | None:
    """Stop the local server of `home` (its keeper's whole process group); None if there was none.

    Only a keeper that `running` recognises is signalled; a stale file is set aside. Raises
    ServerError if the server still runs (or still answers) afterwards: never a false "stopped".
    """
    if not (home / STATE_NAME).exists():
        return None
    state = read_state(home)
    reason = judge(state, home)
    if reason is not None:
        port = _recorded_port(home)
        set_aside(home, reason)
        if port is not None and healthy(f"http://{HOST}:{port}/api", timeout=1):
            raise ServerError(f"a server still answers at http://{HOST}:{port}, but its state file names no keeper "
                              f"of ours ({reason}); nothing was signalled")
        return None
    gone = processes.stop_group(state.keeper, grace_s)
    if not gone or healthy(state.api_url, timeout=1):
        raise ServerError(f"the local Prefect server (pid {state.pid}, {state.ui_url}) still runs after SIGTERM "
                          "and SIGKILL")
    _forget(home, state)
    with contextlib.suppress(FileNotFoundError):
        (home / PIN_NAME).unlink()
    return state


def _recorded_port(home: Path) -> int | None:
    """The port a state file names, in any version's form (to see whether something still answers there)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        port = json.loads((home / STATE_NAME).read_text()).get("port")
        return port if isinstance(port, int) and 0 < port < 65536 else None
    return None


def _forget(home: Path, state: ServerState) -> None:
    """Remove the state file if it still names `state`'s keeper (not one a later command started)."""
    recorded = read_state(home)
    if recorded is not None and recorded.keeper == state.keeper:
        with contextlib.suppress(FileNotFoundError):
            (home / STATE_NAME).unlink()


def stop(home: Path) -> ServerState | None:
    """`safepoint server stop`: as stop_server, under the lock so no command starts one meanwhile."""
    if not home.is_dir():
        return None
    with _locked(home):
        return stop_server(home)


# --- clients and the keeper ----------------------------------------------------------------------------------------

def register_client(home: Path, pid: int | None = None) -> None:
    pid = pid or os.getpid()
    ident = processes.identify(pid)
    clients = home / CLIENTS_DIR
    clients.mkdir(exist_ok=True)
    (clients / f"{pid}-{(ident and ident.start_ticks) or 0}").touch()


def live_clients(home: Path) -> list[int]:
    """Pids of the registered clients still running; the entries of finished ones are removed.

    An entry is PID-STARTTIME (a reused pid is no client); anything else there (a directory, a
    file of another name) is no client and is left alone.
    """
    alive = []
    try:
        entries = list((home / CLIENTS_DIR).iterdir())
    except OSError:  # no folder (PREFECT_HOME removed), or not a folder: no clients
        return alive
    for entry in entries:
        pid_text, _, ticks = entry.name.partition("-")
        if not pid_text.isdigit() or not ticks.isdigit() or not entry.is_file():
            continue
        now = processes.identify(int(pid_text))
        if now is not None and processes.alive(now) and (now.start_ticks or "0") == ticks:
            alive.append(now.pid)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
    return alive


def keep(home: Path, port: int, idle_s: float, command: list[str] | None = None) -> int:
    """The keeper: run `prefect server start` (or `command`) as a child; stop it after `idle_s` without a client.

    It is the process the state file names and the leader of the process group that
    `safepoint server stop` signals. Its child never outlives it: the kernel signals the child
    when the keeper dies (PR_SET_PDEATHSIG), and every way out of here stops the child and
    removes the state file if it still names this keeper. A removed PREFECT_HOME is made again
    with the state file in it, so later commands and `server stop` still find this server.
    """
    command = command or [sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(port)]
    me = state_of(os.getpid(), port, home)
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=processes.dies_with_this_process())  # noqa: PLW1509 - one thread
    try:
        return _serve(home, me, proc, idle_s)
    finally:
        _end_child(proc)
        with contextlib.suppress(OSError):
            _forget(home, me)


def _end_child(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _serve(home: Path, me: ServerState, proc: subprocess.Popen, idle_s: float) -> int:
    """Wait on the child, stopping it after `idle_s` without a client or pin; its exit code (0 for an idle stop)."""
    poll_s = min(5.0, max(idle_s / 4, 0.2)) if idle_s > 0 else 5.0
    last_used = time.monotonic()
    while True:
        try:
            return proc.wait(poll_s) or 0
        except subprocess.TimeoutExpired:
            pass
        if not (home / STATE_NAME).exists():
            _reclaim(home, me)
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
            _end_child(proc)
            _forget(home, me)
        return 0


def _reclaim(home: Path, me: ServerState) -> None:
    """The state file is gone (PREFECT_HOME removed, say): name this keeper again unless a new server was started."""
    with contextlib.suppress(OSError), _locked(home):
        if not (home / STATE_NAME).exists():
            _write_state(home, me)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a plain kill runs keep's clean-up too
    sys.exit(keep(Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
