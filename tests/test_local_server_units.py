"""flows/local_server.py without a real Prefect server: state file, stop, and a server that never answers."""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from safepoint.flows import local_server as ls
from safepoint.local import processes
from safepoint.local.processes import ProcessId


def keeper_like(home: Path, seconds: float = 60) -> subprocess.Popen:
    """A process whose command line is a keeper's of `home` (so it may be signalled) that never serves."""
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})", ls.KEEPER_MODULE, str(home)],
                            start_new_session=True)


def sleeper(home: Path) -> ls.ServerState:
    """A stand-in keeper that never answers /api/health."""
    return ls.state_of(keeper_like(home).pid, ls.free_port(), home)


@pytest.mark.parametrize("text", ["", "not json", "{}", '{"pid": 1}', "[1, 2]"])
def test_unreadable_state_is_no_state(tmp_path, text):
    (tmp_path / ls.STATE_NAME).write_text(text)
    assert ls.read_state(tmp_path) is None


def test_stop_kills_the_process_group_and_forgets_it(tmp_path):
    state = sleeper(tmp_path)
    ls._write_state(tmp_path, state)
    assert ls.read_state(tmp_path) == state and ls.running(state)
    assert ls.stop(tmp_path) == state
    assert not ls.running(state) and ls.read_state(tmp_path) is None
    assert ls.stop(tmp_path) is None  # nothing left: still fine


def test_a_server_that_never_answers_is_stopped_and_reported(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(ls, "_spawn", lambda home: started.append(sleeper(home)) or started[-1])
    with pytest.raises(ls.ServerError, match="did not answer within 1 s; see .*safepoint-server.log"):
        ls.ensure_server(tmp_path, 1.0)
    assert not ls.running(started[0]) and ls.read_state(tmp_path) is None


def test_a_dead_recorded_server_is_replaced(tmp_path, monkeypatch):
    dead = sleeper(tmp_path)
    ls._write_state(tmp_path, dead)
    ls.stop_server(tmp_path)
    ls._write_state(tmp_path, dead)  # recorded, but its process is gone
    spawned = []
    monkeypatch.setattr(ls, "_spawn", lambda home: spawned.append(sleeper(home)) or spawned[-1])
    monkeypatch.setattr(ls, "healthy", lambda url, timeout=5.0: bool(spawned) and url == spawned[-1].api_url)
    state = ls.ensure_server(tmp_path, 5.0)
    assert state == spawned[0] != dead and ls.read_state(tmp_path) == state
    assert ls.ensure_server(tmp_path, 5.0) == state and len(spawned) == 1  # reused, not started again
    monkeypatch.undo()  # the real health check: the stand-in never answered
    assert ls.stop(tmp_path) == state and not ls.running(state)


def test_startup_wait_follows_prefect_but_never_below_the_floor(monkeypatch):
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 20}):
        assert ls.startup_timeout_s() == ls.MIN_STARTUP_S
    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 600}):
        assert ls.startup_timeout_s() == 600


def _keeper(home: Path, idle_s: float):
    """keep() in a thread, with `sleep` standing in for the server: (thread, result list)."""
    import threading

    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(ls.keep(home, 0, idle_s, ["sleep", "60"])), daemon=True)
    t.start()
    return t, result


def test_keeper_stops_the_server_only_when_no_client_is_alive_and_it_is_not_pinned(tmp_path):
    client = subprocess.Popen(["sleep", "60"])
    try:
        ls.register_client(tmp_path, client.pid)
        ls.register_client(tmp_path, 999_999_999)  # a pid that cannot exist: its entry is dropped
        (tmp_path / ls.PIN_NAME).touch()
        thread, result = _keeper(tmp_path, 0.4)
        time.sleep(1.5)  # idle_s passed several times over: the live client and the pin keep it
        assert thread.is_alive() and ls.live_clients(tmp_path) == [client.pid]
        (tmp_path / ls.PIN_NAME).unlink()
        time.sleep(1.0)
        assert thread.is_alive()  # still a client
    finally:
        client.kill()
        client.wait()
    thread.join(10)
    assert not thread.is_alive() and result == [0]
    assert list((tmp_path / ls.CLIENTS_DIR).iterdir()) == []


def test_a_reused_pid_is_not_a_client(tmp_path):
    import os

    ls.register_client(tmp_path)
    (entry,) = (tmp_path / ls.CLIENTS_DIR).iterdir()
    entry.rename(entry.with_name(f"{os.getpid()}-1"))  # our pid, another process's start time
    assert ls.live_clients(tmp_path) == []


def test_idle_stop_reads_the_environment_then_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("SAFEPOINT_HOME", str(tmp_path))
    monkeypatch.delenv(ls.IDLE_ENV, raising=False)
    assert ls.idle_stop_s() == ls.IDLE_STOP_S == 1800
    (tmp_path / "config.toml").write_text("[server]\nidle_stop_s = 60\n")
    assert ls.idle_stop_s() == 60
    monkeypatch.setenv(ls.IDLE_ENV, "0")
    assert ls.idle_stop_s() == 0
    monkeypatch.setenv(ls.IDLE_ENV, "soon")
    with pytest.raises(ls.ServerError, match="must be a number of seconds"):
        ls.idle_stop_s()


def test_the_spawned_server_is_told_its_own_ui_api_url(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_UI_API_URL", "http://127.0.0.1:4200/api")
    env = ls._server_env(tmp_path, 41234)
    assert env["PREFECT_UI_API_URL"] == env["PREFECT_SERVER_UI_API_URL"] == "http://127.0.0.1:41234/api"


# --- the keeper's identity, a stale file, the keeper's own survival (issue 37) ---------------------------------------

def _state(**changes) -> ls.ServerState:
    base = ls.ServerState(pid=4242, port=1, home="/h", started_at=0.0, prefect_version="3", start_ticks="100",
                          host="node-a", boot_id="boot-1")
    return dataclasses.replace(base, **changes)


KEEPER_ARGV = [sys.executable, "-m", ls.KEEPER_MODULE, "/h", "1", "1800"]


HERE = ProcessId(1, "1", "node-a", "boot-1")  # the process judging the file


@pytest.mark.parametrize("state, now, running, argv, reason", [
    (_state(), ProcessId(4242, "100", "node-a", "boot-1"), True, KEEPER_ARGV, None),
    (None, None, False, [], "unreadable, or written by an older Safepoint"),
    (_state(), None, False, [], "its keeper (pid 4242) has exited"),
    (_state(host="node-b"), ProcessId(4242, "100", "node-a", "boot-1"), True, KEEPER_ARGV,
     "written on host 'node-b', not this one ('node-a')"),
    (_state(host="node-b"), None, False, [], "written on host 'node-b'"),  # its pid means nothing here
    (_state(boot_id="boot-0"), ProcessId(4242, "100", "node-a", "boot-1"), True, KEEPER_ARGV,
     "written before this host last booted"),
    (_state(), ProcessId(4242, "999", "node-a", "boot-1"), True, KEEPER_ARGV, "pid 4242 is another process now"),
    (_state(), ProcessId(4242, "100", "node-a", "boot-1"), False, KEEPER_ARGV, "its keeper (pid 4242) has exited"),
    (_state(), ProcessId(4242, "100", "node-a", "boot-1"), True, ["sleep", "300"], "is not a Safepoint server keeper"),
    (_state(home="/other"), ProcessId(4242, "100", "node-a", "boot-1"), True, KEEPER_ARGV,
     "is not a Safepoint server keeper of /other"),
])
def test_a_state_file_is_trusted_only_if_pid_start_host_boot_and_command_line_match(state, now, running, argv,
                                                                                      reason):
    got = ls.stale_reason(state, HERE, now, running, argv)
    assert got is None if reason is None else reason in got, got


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the http.server name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def health_answering() -> Iterator[int]:
    """A port that answers /api/health, as a server that outlived its keeper would."""
    server = http.server.HTTPServer((ls.HOST, 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def answering_port():
    with health_answering() as port:
        yield port


def test_stop_never_reports_a_server_that_still_answers(tmp_path, answering_port):
    keeper = keeper_like(tmp_path)
    state = ls.state_of(keeper.pid, answering_port, tmp_path)
    ls._write_state(tmp_path, state)
    with pytest.raises(ls.ServerError, match=r"still runs after SIGTERM and SIGKILL"):
        ls.stop(tmp_path)
    assert keeper.wait(5) == -15  # its keeper was ours to stop, and was stopped
    with pytest.raises(ls.ServerError, match=r"still answers at .*names no keeper of ours .*nothing was signalled"):
        ls.stop(tmp_path)  # the file now names a dead keeper while the port still answers
    assert (tmp_path / (ls.STATE_NAME + ls.STALE_SUFFIX)).exists() and ls.stop(tmp_path) is None


def test_keeper_survives_odd_entries_in_its_clients_folder(tmp_path):
    clients = tmp_path / ls.CLIENTS_DIR
    (clients / "123-456").mkdir(parents=True)  # a directory named like a client
    (clients / "notes.txt").write_text("")
    thread, result = _keeper(tmp_path, 0.4)
    thread.join(15)
    assert not thread.is_alive() and result == [0]  # stopped for idleness, not by an exception
    assert sorted(p.name for p in clients.iterdir()) == ["123-456", "notes.txt"]  # not clients, left alone


def test_keeper_survives_a_removed_prefect_home_and_names_itself_again(tmp_path):
    home = tmp_path / "prefect-home"
    home.mkdir()
    thread, result = _keeper(home, 3.0)
    assert wait_for(lambda: (home / ls.STATE_NAME).exists())
    shutil.rmtree(home)
    assert wait_for(lambda: ls.read_state(home) is not None), "the keeper did not name itself again"
    assert ls.read_state(home).keeper == processes.identify()  # this test process runs keep()
    thread.join(30)
    assert not thread.is_alive() and result == [0] and ls.read_state(home) is None


def wait_for(predicate, timeout: float = 15.0) -> bool:
    end = time.monotonic() + timeout
    while not predicate() and time.monotonic() < end:
        time.sleep(0.05)
    return predicate()


def test_the_server_dies_with_its_keeper_even_on_sigkill(tmp_path):
    code = ("import sys; from pathlib import Path; from safepoint.flows import local_server as ls; "
            "ls.keep(Path(sys.argv[1]), 0, 0, ['sleep', '300'])")
    keeper = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)])
    children = Path(f"/proc/{keeper.pid}/task/{keeper.pid}/children")
    try:
        assert wait_for(lambda: children.read_text().split() != [])
        server = processes.identify(int(children.read_text().split()[0]))
        keeper.kill()
        keeper.wait()
        assert wait_for(lambda: not processes.alive(server)), "the server outlived its keeper"
    finally:
        keeper.kill()
        keeper.wait()


def test_a_keeper_whose_server_exits_forgets_itself_at_once(tmp_path):
    """A crashed server (OOM kill, say) leaves no state file naming a live keeper and a dead port."""
    ls._write_state(tmp_path, ls.state_of(os.getpid(), ls.free_port(), tmp_path))  # keep() runs in this process
    began = time.monotonic()
    assert ls.keep(tmp_path, 0, 1800, ["sh", "-c", "sleep 0.3; exit 3"]) == 3
    assert time.monotonic() - began < 4.0  # not after the 5 s poll
    assert ls.read_state(tmp_path) is None
