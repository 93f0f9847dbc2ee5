"""The ingest flow's run state and name (flows/ingest.py), without a server: what the UI will show."""

from __future__ import annotations

import pytest
from prefect.states import State

from safepoint.cli.common import _ingest_exit
from safepoint.flows.ingest import run_name, run_state
from safepoint.local.commit import commit
from tests.helpers_ckpt import make_torch_save_ckpt


def result(state: str, *replicas: tuple[str, str | None], message: str | None = None, part: str | None = None
           ) -> dict:
    return {"run": "r", "step": 7, "state": state, "message": message, "part": part,
            "replicas": [{"url": f"s3://b/{i}", "state": s, "error": e} for i, (s, e) in enumerate(replicas)]}


def test_verified_and_a_waiting_part_complete_with_their_result():
    ok = result("verified", ("verified", None))
    assert run_state(ok) is ok
    waiting = result("replicating", ("verified", None), part="0")
    assert run_state(waiting) is waiting  # its part delivered; the other nodes' are to come


def test_a_verdict_fails_the_run_with_the_verdict_and_keeps_the_result():
    bad = result("corrupt", ("failed", "hash mismatch"), message="model.pt: hash_mismatch")
    state = run_state(bad)
    assert isinstance(state, State) and state.is_failed()
    assert state.message == "r/7 corrupt: model.pt: hash_mismatch"
    assert state.data is bad  # the CLI reads it back for its exit code (1)
    for verdict in ("invalid", "incomplete"):
        assert run_state(result(verdict, ("verified", None), part="0")).is_failed()


def test_a_failed_replica_fails_the_run_naming_the_destination():
    down = result("replicating", ("verified", None), ("failed", "S3 503 SlowDown"))
    state = run_state(down)
    assert state.is_failed() and state.message == "r/7 replicating: s3://b/1: S3 503 SlowDown"
    assert run_state({**down, "part": "0"}).is_failed()  # a part whose upload failed is not "waiting"


def test_runs_are_named_from_the_commit_marker(tmp_path):
    folder = tmp_path / "abs" / "path" / "ck"
    make_torch_save_ckpt(folder)
    commit(folder, "llama-7b", 1200)
    assert run_name(str(folder)) == "ingest-llama-7b-1200"
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "COMMITTED").write_text("{not json")
    assert run_name(str(tmp_path / "junk")) == "ingest-junk"  # unreadable marker: the folder's name
    assert run_name(str(tmp_path / "missing")) == "ingest-missing"


@pytest.mark.parametrize("res, code", [
    (result("verified", ("verified", None)), 0),
    (result("replicating", ("verified", None), part="0"), 0),             # a part delivered, others to come
    (result("replicating", ("verified", None)), 2),                        # a whole checkpoint left mid-way
    (result("replicating", ("failed", "503"), part="0"), 2),               # the part's upload failed
    (result("corrupt", ("failed", "hash"), part="0"), 1),
    (result("invalid", ("verified", None)), 1),
    (result("incomplete", ("verified", None), part="0-1"), 1),
])
def test_the_cli_exit_code_agrees_with_the_run_state(res, code):
    """Exit 0 exactly when the run is Completed; a Failed run is 1 for a verdict, else 2."""
    assert _ingest_exit(res) == code
    assert (code == 0) == (run_state(res) is res)


@pytest.mark.parametrize("env, heartbeat", [
    ({}, None),                                              # not set: off for the run (no 1 s join at its end)
    ({"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "60"}, 60),       # the user's setting is kept
    ({"PREFECT_RUNNER_HEARTBEAT_FREQUENCY": "90"}, 90),      # and its legacy name
])
def test_an_in_process_ingest_turns_the_heartbeat_off_unless_the_user_set_it(monkeypatch, env, heartbeat):
    from prefect.settings import Settings, get_current_settings, temporary_settings

    from safepoint.flows.ingest import heartbeat_updates

    for k in ("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "PREFECT_RUNNER_HEARTBEAT_FREQUENCY"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    flows = Settings().flows  # read afresh from the environment, as a new process would
    with temporary_settings(updates=heartbeat_updates(flows)):
        assert get_current_settings().flows.heartbeat_frequency == heartbeat
    assert flows.heartbeat_frequency == (heartbeat or 180)  # Prefect's default stays what it was
