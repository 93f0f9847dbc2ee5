"""The one outcome rule (safepoint.rules.outcome), by table: every ingest outcome -> verdict, final
run state and exit code; and the flow's run state, the CLI's exit code and the operation's outcome
value all agree with it. The multi-node part whose copy read back corrupt (issue 37) is not
delivered: it exits 2 through the real `safepoint` CLI, and its flow run is Failed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from safepoint import commit
from safepoint.core.states import CheckpointState as CS
from safepoint.rules.outcome import Verdict, decide


def result(state: str, *replicas: tuple[str, str | None], message: str | None = None, part: str | None = None
           ) -> dict:
    return {"run": "r", "step": 7, "state": state, "message": message, "part": part,
            "replicas": [{"url": f"s3://b/{i}", "state": s, "error": e} for i, (s, e) in enumerate(replicas)]}


V, D, B, U = Verdict.VERIFIED, Verdict.DELIVERED, Verdict.BAD, Verdict.UNFINISHED


@pytest.mark.parametrize("res, verdict, completed, code, message", [
    # whole checkpoints
    (result("verified", ("verified", None)), V, True, 0, ""),
    (result("verified", ("verified", None), ("failed", "503")), V, True, 0, ""),   # one good copy is enough
    (result("corrupt", ("verified", None), message="model.pt: hash_mismatch"), B, False, 1,
     "r/7 corrupt: model.pt: hash_mismatch"),
    (result("invalid", ("verified", None), message="nan in w"), B, False, 1, "r/7 invalid: nan in w"),
    (result("incomplete", ("missing", None), message="2 files missing"), B, False, 1,
     "r/7 incomplete: 2 files missing"),
    (result("committed", ("failed", "S3 503 SlowDown")), U, False, 2, "r/7 committed: s3://b/0: S3 503 SlowDown"),
    (result("committed", ("corrupt", "read back wrong")), U, False, 2, "r/7 committed: s3://b/0: read back wrong"),
    (result("replicating", ("verified", None)), U, False, 2, "r/7 replicating"),    # left mid-way
    (result("validating", ("verified", None), message="killed"), U, False, 2, "r/7 validating: killed"),
    # a node's part of a multi-node checkpoint
    (result("replicating", ("pending", None), part="0-1"), D, True, 0, ""),         # others to come
    (result("replicating", ("verified", None), part="0-1"), D, True, 0, ""),
    (result("validating", ("verified", None), part="0-1"), D, True, 0, ""),         # another node assembles
    (result("verified", ("verified", None), part="2-3"), V, True, 0, ""),           # the last part: assembled
    (result("replicating", ("failed", "503"), part="0-1"), U, False, 2, "r/7 replicating: s3://b/0: 503"),
    (result("replicating", ("corrupt", "w.pt read back wrong"), part="0-1"), U, False, 2,   # issue 37
     "r/7 replicating: s3://b/0: w.pt read back wrong"),
    (result("replicating", ("pending", None), ("corrupt", None), part="0-1"), U, False, 2,
     "r/7 replicating: s3://b/1: corrupt"),
    (result("replicating", ("missing", None), part="0-1"), U, False, 2, "r/7 replicating: s3://b/0: missing"),
    (result("corrupt", ("failed", "hash"), part="0-1", message="part 0-1: w.pt"), B, False, 1,
     "r/7 corrupt: part 0-1: w.pt"),
    (result("incomplete", ("verified", None), part="0-1"), B, False, 1, "r/7 incomplete"),
    (result("invalid", ("verified", None), part="0-1"), B, False, 1, "r/7 invalid"),
])
def test_every_outcome_has_one_verdict_final_state_and_exit_code(res, verdict, completed, code, message):
    from safepoint.cli.common import _ingest_exit
    from safepoint.flows.ingest import run_state

    d = decide(res)
    assert (d.verdict, d.completed, d.exit_code, d.message) == (verdict, completed, code, message)
    assert _ingest_exit(res) == code                       # the CLI reads the rule
    state = run_state(res)                                 # and so does the flow
    if completed:
        assert state is res
    else:
        assert state.is_failed() and state.message == message and state.data is res


def test_the_failed_message_never_carries_a_secret():
    d = decide(result("corrupt", message="s3://AKIAIOSFODNN7EXAMPLE:topsecret@bucket/x: hash"))
    assert "topsecret" not in d.message and d.exit_code == 1


def test_the_operation_outcome_reads_the_same_rule():
    from safepoint.ops.steps import IngestOutcome

    part = IngestOutcome("r", 7, CS.REPLICATING, [{"url": "file:///d/r/7", "state": "corrupt", "error": "x"}],
                         part="0-1")
    assert part.exit_code == 2 and part.decision.verdict is Verdict.UNFINISHED
    assert IngestOutcome("r", 7, CS.REPLICATING, [{"url": "u", "state": "pending", "error": None}],
                         part="0-1").exit_code == 0
    whole = IngestOutcome("r", 7, CS.INVALID, [], "nan")
    assert whole.result() == {"run": "r", "step": 7, "state": "invalid", "replicas": [], "message": "nan",
                              "part": None}
    assert whole.exit_code == 1


# -- issue 37 through the real CLI: a part whose copy reads back corrupt exits 2 --------------------

def make_part(root: Path, run: str, step: int, node: str, ranks: tuple[int, ...]) -> Path:
    folder = root / node / f"{run}-{step}"
    folder.mkdir(parents=True)
    for r in ranks:
        torch.save({f"layer{r}.weight": torch.full((8, 8), float(r + 1))}, folder / f"rank{r:02d}.pt")
    commit(folder, run, step, world_size=4, ranks=ranks, node=node)
    return folder


def test_a_part_whose_copy_reads_back_corrupt_exits_2_and_is_not_delivered(tmp_path, prefect_api, sqlite_catalog_url,
                                                                         monkeypatch, capsys):
    """Every upload of the part lands with one byte flipped (a store that rots what it is sent): the read-back
    finds it twice, the replica is `corrupt`, and the node's ingest is no delivered part (it was exit 0)."""
    from safepoint.cli.main import main
    from safepoint.destinations.local import LocalDestination

    upload = LocalDestination.upload

    def rotting_upload(self, run, step, entry, source):
        url = upload(self, run, step, entry, source)
        stored = self._local(run, step, entry.path)
        data = bytearray(stored.read_bytes())
        data[len(data) // 2] ^= 0xFF
        stored.write_bytes(bytes(data))
        return url

    folder = make_part(tmp_path, "mn", 3, "n0", (0, 1))
    durable = (tmp_path / "durable").as_uri()
    monkeypatch.setattr(LocalDestination, "upload", rotting_upload)
    code = main(["--catalog", sqlite_catalog_url, "ingest", str(folder), "--to", durable, "--json"])
    monkeypatch.undo()
    printed = json.loads(capsys.readouterr().out)
    assert [r["state"] for r in printed["replicas"]] == ["corrupt"]
    assert printed["state"] == "replicating" and printed["part"] == "0"
    assert code == 2
    # The same part sent again to an honest store is delivered: exit 0, waiting for node n1.
    assert main(["--catalog", sqlite_catalog_url, "ingest", str(folder), "--to", durable]) == 0
