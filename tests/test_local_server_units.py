"""flows/local_server.py without a real Prefect server: state file, stop, and a server that never answers."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from safepoint.flows import local_server as ls


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
