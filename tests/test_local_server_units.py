"""flows/local_server.py without a real Prefect server: state file, stop, and a server that never answers."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from safepoint.flows import local_server as ls


def sleeper(home: Path) -> ls.ServerState:
    """A stand-in 'server' process that never answers /api/health."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    return ls.ServerState(pid=proc.pid, port=ls.free_port(), home=str(home), started_at=time.time(),
                          prefect_version="test")


@pytest.mark.parametrize("text", ["", "not json", "{}", '{"pid": 1}', "[1, 2]"])
def test_unreadable_state_is_no_state(tmp_path, text):
    (tmp_path / ls.STATE_NAME).write_text(text)
    assert ls.read_state(tmp_path) is None


def test_stop_kills_the_process_group_and_forgets_it(tmp_path):
    state = sleeper(tmp_path)
    ls._write_state(tmp_path, state)
    assert ls.read_state(tmp_path) == state and ls.pid_alive(state.pid)
    assert ls.stop(tmp_path) == state
    assert not ls.pid_alive(state.pid) and ls.read_state(tmp_path) is None
    assert ls.stop(tmp_path) is None  # nothing left: still fine


def test_a_server_that_never_answers_is_stopped_and_reported(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(ls, "_spawn", lambda home: started.append(sleeper(home)) or started[-1])
    with pytest.raises(ls.ServerError, match="did not answer within 1 s; see .*safepoint-server.log"):
        ls.ensure_server(tmp_path, 1.0)
    assert not ls.pid_alive(started[0].pid) and ls.read_state(tmp_path) is None


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
    ls.stop(tmp_path)


def test_startup_wait_follows_prefect_but_never_below_the_floor(monkeypatch):
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 20}):
        assert ls.startup_timeout_s() == ls.MIN_STARTUP_S
    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 600}):
        assert ls.startup_timeout_s() == 600
