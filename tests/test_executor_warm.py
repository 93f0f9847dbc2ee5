"""The warm lane's watcher sink (safepoint.events.watch.IngestHere), without Prefect: a delivered part
waiting for the other nodes is offered again only after `recheck_s`, not once per pass (each offer
is a flow run); a failed copy on the next pass; a finished folder costs a stat, not a catalog query."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from safepoint.core.exits import EXIT_ERROR, EXIT_OK
from safepoint.core.states import CheckpointState as CS
from safepoint.events.watch import IngestHere


class FakeCatalog:
    def __init__(self):
        self.state: dict[str, CS] = {}
        self.queries = 0

    def find_by_local_path(self, path: str):
        self.queries += 1
        return SimpleNamespace(state=self.state[path]) if path in self.state else None


def folder_with_marker(tmp_path: Path, name: str) -> Path:
    f = tmp_path / name
    f.mkdir()
    (f / "COMMITTED").write_text("x")
    return f


def test_a_waiting_part_is_rechecked_later_a_failed_one_at_once(tmp_path):
    cat, now = FakeCatalog(), [0.0]
    waiting, failing = folder_with_marker(tmp_path, "a"), folder_with_marker(tmp_path, "b")
    codes = {waiting: EXIT_OK, failing: EXIT_ERROR}

    def ingest(folder: Path, _snap: object) -> int:
        cat.state[str(folder)] = CS.REPLICATING  # registered; the set is not complete
        return codes[folder]

    sink = IngestHere(cat, ingest, recheck_s=30.0, clock=lambda: now[0])
    for f in (waiting, failing):
        assert sink.wants(f)
        assert sink.offer(f, None, lambda _t: None).settle is False
    now[0] = 29.0
    assert not sink.wants(waiting)  # delivered, waiting: not a flow run per pass
    assert sink.wants(failing)      # a failed copy: again on the next pass
    now[0] = 30.0
    assert sink.wants(waiting)      # the safety net, should the set never assemble elsewhere
    assert sink.worst == EXIT_ERROR


def test_a_finished_folder_is_remembered_by_its_marker(tmp_path):
    cat = FakeCatalog()
    f = folder_with_marker(tmp_path, "done")
    cat.state[str(f)] = CS.VERIFIED
    sink = IngestHere(cat, lambda *_: EXIT_OK)
    assert not sink.wants(f)
    asked = cat.queries
    for _ in range(5):
        assert not sink.wants(f)
    assert cat.queries == asked  # a stat per pass, no catalog query
    (f / "COMMITTED").unlink()
    (f / "COMMITTED").write_text("sealed again")  # a new marker: asked again
    assert not sink.wants(f) and cat.queries == asked + 1
