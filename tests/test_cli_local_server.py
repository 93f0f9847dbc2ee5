"""The embedded default as a new user meets it: no PREFECT_API_URL, a fresh PREFECT_HOME and SAFEPOINT_HOME.

Deliberately not the session-wide test server (that would hide start-up failures): each process
here finds or starts the one local Prefect server of its PREFECT_HOME (flows/local_server.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from safepoint.flows import local_server
from tests.helpers_ckpt import make_torch_save_ckpt

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory):
    """Environment of a new user: no PREFECT_* at all; the server is stopped afterwards."""
    base = tmp_path_factory.mktemp("newuser")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SAFEPOINT_"))}
    env.update(PREFECT_HOME=str(base / "prefect-home"), SAFEPOINT_HOME=str(base / "sp-home"),
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    yield env, base
    local_server.stop(Path(env["PREFECT_HOME"]))


def safepoint(env, *args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "safepoint.cli", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_demo_ends_with_table_and_resume_point_and_cleans_up(fresh_env):
    env, base = fresh_env
    tmp = base / "tmp"
    tmp.mkdir()
    r = safepoint(dict(env, TMPDIR=str(tmp)), "demo")  # no --dir: a temporary folder, removed at the end
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    workdir = lines[0].removeprefix("Safepoint demo, working in ").removesuffix(" (removed at the end)")
    assert Path(workdir).parent == tmp and Path(workdir).name.startswith("safepoint-demo-"), lines[0]
    assert [line.split(" and committed")[0] for line in lines[1:4]] == [
        f"Trained a tiny model to step {s}" for s in (10, 20, 30)]
    assert lines[4].startswith("Flipped one bit in nvme/demo-run/step-30/model.pt after it was committed")
    assert [line.split(":")[0] for line in lines[5:8]] == [f"Ingested step-{s}" for s in (10, 20, 30)]
    assert "verified" in lines[5] and "verified" in lines[6] and "corrupt" in lines[7], r.stdout
    assert any(line.strip().startswith("The catalog") for line in lines)
    # the table and resume point, then the way back (issue 12): restored and loaded, then the clean-up
    back = next(i for i, line in enumerate(lines) if line.startswith("Resume point: demo-run step 20, at file://"))
    assert lines[back - 1].startswith("Passed over step 30: "), r.stdout
    assert lines[back + 1].startswith("Deleted the local copies (nvme/), as if the node were lost."), r.stdout
    assert lines[back + 2].startswith("Restored step 20 from file://"), r.stdout
    assert " into restored/: " in lines[back + 2] and "each checked against its BLAKE3 hash" in lines[back + 2]
    assert lines[back + 3].startswith("Loaded it into the model:") and "at step 20." in lines[back + 3]
    assert lines[-1] == f"Removed the demo folder {workdir}." and len(lines) == back + 5, r.stdout
    assert list(tmp.glob("safepoint-demo-*")) == []  # nothing of ours left behind (torch may cache there)
    # stderr: at most the one note that the local server was started, nothing from Prefect's teardown
    assert "Traceback" not in r.stderr and "ERROR" not in r.stderr and "Error" not in r.stderr, r.stderr
    assert [line for line in r.stderr.splitlines() if line.strip()] == [
        f"starting a local Prefect server for {env['PREFECT_HOME']} (first use; `safepoint server stop` ends it)"]


def flow_runs(api_url: str) -> dict:
    """The server's flow runs by name: (state type, state message), and each run's log messages."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs()
        logs = {r.id: [log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id])))]
                for r in runs}
        return {r.name: (r.state.type.value, r.state.message, logs[r.id]) for r in runs}


def test_demo_runs_are_named_and_the_corrupt_one_failed(fresh_env):
    """In the server the demo used: runs named ingest-RUN-STEP, the corrupt step Failed with its verdict,
    and Safepoint's own log lines in each run's logs (a run with logs, not 'This run didn't generate logs')."""
    env, _base = fresh_env
    state = local_server.read_state(Path(env["PREFECT_HOME"]))
    runs = flow_runs(state.api_url)
    assert {"ingest-demo-run-10", "ingest-demo-run-20", "ingest-demo-run-30"} <= set(runs), sorted(runs)
    kind, message, _logs = runs["ingest-demo-run-30"]
    assert kind == "FAILED" and message.startswith("demo-run/30 corrupt"), (kind, message)
    kind, _message, logs = runs["ingest-demo-run-20"]
    assert kind == "COMPLETED"
    assert "demo-run/20 ended verified" in logs, logs  # safepoint.ops.ingest's INFO line
    assert any(line.startswith("Finished in state Completed") for line in logs), logs  # Prefect's own


def test_ui_settings_name_the_servers_own_api(fresh_env):
    """The UI reads its API address from /ui-settings; Prefect's default (port 4200) is not this server."""
    env, _base = fresh_env
    state = local_server.read_state(Path(env["PREFECT_HOME"]))
    with urllib.request.urlopen(f"{state.ui_url}/ui-settings", timeout=10) as r:  # noqa: S310 - loopback
        assert json.load(r)["api_url"] == state.api_url


def test_later_commands_reuse_the_server_concurrently(fresh_env):
    env, base = fresh_env
    before = local_server.read_state(Path(env["PREFECT_HOME"]))
    assert before is not None and local_server.healthy(before.api_url)
    runs = []
    for i in range(2):
        folder = base / f"ck{i}"
        make_torch_save_ckpt(folder, seed=i)  # two steps of one run: the same bytes would be a duplicate
        assert safepoint(env, "commit", folder, "--run", "reuse", "--step", i).returncode == 0
        runs.append(folder)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda f: safepoint(env, "ingest", f, "--to", (base / "durable").as_uri()), runs))
    for r in results:
        assert r.returncode == 0 and "verified" in r.stdout, r.stdout + r.stderr
        assert r.stderr.strip() == "", r.stderr  # no start-up note, no Prefect lines
    after = local_server.read_state(Path(env["PREFECT_HOME"]))
    assert after == before  # the same server, not a second one
    status = safepoint(env, "server", "status")
    assert status.returncode == 0 and before.ui_url in status.stdout


def test_user_api_url_is_used_exactly(fresh_env):
    """PREFECT_API_URL set: that server (here, a dead one) and no local server; a failure is exit 2, one line."""
    env, base = fresh_env
    dead = dict(env, PREFECT_API_URL="http://127.0.0.1:1/api", PREFECT_HOME=str(base / "other-home"),
                PREFECT_CLIENT_MAX_RETRIES="0")
    folder = base / "ck-dead"
    make_torch_save_ckpt(folder)
    assert safepoint(dead, "commit", folder, "--run", "dead", "--step", 1).returncode == 0
    r = safepoint(dead, "ingest", folder, "--to", (base / "durable").as_uri(), timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    err_lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err_lines) == 1 and err_lines[0].startswith("safepoint: error: "), r.stderr
    assert local_server.read_state(base / "other-home") is None


def test_server_stop_ends_it(fresh_env):
    env, _base = fresh_env
    state = local_server.read_state(Path(env["PREFECT_HOME"]))
    r = safepoint(env, "server", "stop")
    assert r.returncode == 0 and f"pid {state.pid}" in r.stdout
    assert not local_server.running(state) and not local_server.healthy(state.api_url, timeout=1)
    assert safepoint(env, "server", "status").returncode == 1


def wait_for_state(home: Path, timeout_s: float) -> local_server.ServerState | None:
    end = time.monotonic() + timeout_s
    while (state := local_server.read_state(home)) is None and time.monotonic() < end:
        time.sleep(0.1)
    return state


def test_an_idle_embedded_server_stops_itself(tmp_path):
    """Started by `ingest` (not `server start`), the server is gone once no Safepoint client was alive
    for `idle_stop_s` (here 2 s through SAFEPOINT_SERVER_IDLE_STOP_S): its pid, port and state file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SAFEPOINT_"))}
    home = tmp_path / "prefect-home"
    env.update(PREFECT_HOME=str(home), SAFEPOINT_HOME=str(tmp_path / "sp-home"), SAFEPOINT_SERVER_IDLE_STOP_S="2",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    folder = tmp_path / "ck"
    make_torch_save_ckpt(folder)
    try:
        assert safepoint(env, "commit", folder, "--run", "idle", "--step", 1).returncode == 0
        with ThreadPoolExecutor(1) as pool:  # the state is read while the ingest runs: once it has exited (a
            # zombie counts as exited while `run` still reads the pipes its children hold), 2 s may be up
            started = pool.submit(wait_for_state, home, 600)
            r = safepoint(env, "ingest", folder, "--to", (tmp_path / "durable").as_uri())
            state = started.result()
        assert r.returncode == 0, r.stdout + r.stderr
        assert state is not None
        deadline = time.monotonic() + 45  # 2 s idle, a poll of 0.5 s, then the server's own shutdown
        while local_server.running(state) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not local_server.running(state)
        assert not local_server.healthy(state.api_url, timeout=1)
        assert local_server.read_state(home) is None
        assert "no Safepoint client for 2 s" in (home / local_server.LOG_NAME).read_text()
    finally:
        local_server.stop(home)


# --- stale and foreign state files (issue 37): nothing signalled, set aside, a new server at once -------------------

def own_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SAFEPOINT_"))}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), SAFEPOINT_HOME=str(tmp_path / "sp-home"),
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), **extra)
    return env


@pytest.fixture
def victim():
    """An unrelated live process in its own process group, with a child: what a stale pid may name now."""
    proc = subprocess.Popen(["sh", "-c", "sleep 300 & wait"], start_new_session=True)
    yield proc
    from tests.prefect_server import stop_group

    stop_group(proc, grace_s=5)


def stale_file(home: Path, victim_pid: int, kind: str) -> None:
    """A state file naming `victim_pid` and a dead port: as e023f1b wrote it (pid only), or in today's form with
    the victim's own start time, or with another host's name or boot id."""
    from safepoint.local.processes import identify

    home.mkdir(parents=True, exist_ok=True)
    record = {"pid": victim_pid, "port": local_server.free_port(), "home": str(home), "started_at": time.time(),
              "prefect_version": "3"}
    if kind != "pid-only":
        ident = identify(victim_pid)
        record.update(start_ticks=ident.start_ticks, host=ident.host, boot_id=ident.boot_id)
        if kind == "other-host":
            record["host"] = "node-b.cluster"
        if kind == "other-boot":
            record["boot_id"] = "00000000-0000-0000-0000-000000000000"
    (home / local_server.STATE_NAME).write_text(json.dumps(record))


def keeper_lookalike(home: Path) -> subprocess.Popen:
    """A live process whose command line is a keeper's of `home`: only its host or boot id can tell it apart."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", local_server.KEEPER_MODULE,
                             str(home)], start_new_session=True)


@pytest.mark.parametrize("kind", ["pid-only", "this-host", "other-host", "other-boot"])
def test_server_stop_never_signals_a_process_a_stale_file_names(tmp_path, victim, kind):
    env = own_env(tmp_path)
    home = Path(env["PREFECT_HOME"])
    target = victim
    if kind in ("other-host", "other-boot"):  # even a keeper's command line is not enough
        target = keeper_lookalike(home)
    try:
        stale_file(home, target.pid, kind)
        r = safepoint(env, "server", "stop", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert target.poll() is None and victim.poll() is None  # never signalled
        assert r.stdout.strip() == f"no local Prefect server for {home}", r.stdout
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("safepoint: set aside a stale server file as "), r.stderr
        assert not (home / local_server.STATE_NAME).exists()
        assert json.loads((home / (local_server.STATE_NAME + local_server.STALE_SUFFIX)).read_text())["pid"] == \
            target.pid  # kept to read
    finally:
        if target is not victim:
            target.kill()
            target.wait()


def test_ingest_sets_a_stale_file_aside_and_starts_a_server_at_once(tmp_path, victim):
    """e023f1b waited out 180 s on the dead port, then SIGTERMed and SIGKILLed the victim's process group."""
    env = own_env(tmp_path, SAFEPOINT_SERVER_IDLE_STOP_S="120")
    home = Path(env["PREFECT_HOME"])
    folder = tmp_path / "ck"
    make_torch_save_ckpt(folder)
    assert safepoint(env, "commit", folder, "--run", "stale", "--step", 1).returncode == 0
    stale_file(home, victim.pid, "pid-only")
    try:
        began = time.monotonic()
        r = safepoint(env, "ingest", folder, "--to", (tmp_path / "durable").as_uri(), timeout=170)
        took = time.monotonic() - began
        assert r.returncode == 0 and "verified" in r.stdout, r.stdout + r.stderr
        assert victim.poll() is None, "the victim's process group was signalled"
        assert took < local_server.MIN_STARTUP_S, took
        assert r.stderr.splitlines()[0].startswith("safepoint: set aside a stale server file as "), r.stderr
        state = local_server.read_state(home)
        assert (home / (local_server.STATE_NAME + local_server.STALE_SUFFIX)).exists()
        assert state is not None and state.pid != victim.pid and local_server.running(state)
    finally:
        local_server.stop(home)
    assert victim.poll() is None


def test_server_stop_exits_2_while_a_server_still_answers(tmp_path):
    """The recorded keeper is gone but its port still answers (a server that outlived it): never "stopped"."""
    from tests.test_local_server_units import health_answering

    env = own_env(tmp_path)
    home = Path(env["PREFECT_HOME"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    with health_answering() as port:
        stale_file(home, gone.pid, "pid-only")
        state = json.loads((home / local_server.STATE_NAME).read_text())
        (home / local_server.STATE_NAME).write_text(json.dumps(dict(state, port=port)))
        r = safepoint(env, "server", "stop", timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith("safepoint: set aside a stale server file as "), r.stderr
    assert len(lines) == 2 and lines[1].startswith("safepoint: error: a server still answers at "), r.stderr
    assert "stopped" not in r.stdout
