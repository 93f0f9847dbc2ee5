"""What every trainer integration does after a save: seal, then (optionally) the committed event,
with the same deterministic id `safepoint watch --emit` would send; a failed send never stops training."""

from __future__ import annotations

from pathlib import Path

import pytest

from safepoint.core.errors import CommitError
from safepoint.events.markers import EVENT, Marker
from safepoint.integrations.sealing import SealOptions, seal_and_announce, step_of_folder
from safepoint.local.snapshot import LocalSnapshot


class FakeGateway:
    sent: list[Marker] = []
    fail = False

    def __init__(self, timeout_s: float = 10.0) -> None:
        pass

    def emit(self, marker: Marker) -> None:
        if FakeGateway.fail:
            raise ConnectionError("server down")
        FakeGateway.sent.append(marker)


@pytest.fixture
def gateway(monkeypatch):
    FakeGateway.sent, FakeGateway.fail = [], False
    monkeypatch.setattr("safepoint.flows.gateway.PrefectGateway", FakeGateway)
    return FakeGateway


def _folder(tmp_path: Path) -> Path:
    d = tmp_path / "checkpoint-7"
    d.mkdir()
    (d / "w.bin").write_bytes(b"x" * 100)
    return d


def test_seal_then_emit_the_watchers_event(tmp_path: Path, gateway) -> None:
    folder = _folder(tmp_path)
    m = seal_and_announce(folder, 7, SealOptions("r", emit_to=("file:///durable",), node="n1"))
    assert (m.run, m.step) == ("r", 7)
    [marker] = gateway.sent
    assert marker == Marker.of(LocalSnapshot.open(folder), ["file:///durable"], "n1", now=marker.seen_at)
    assert marker.payload()["to"] == ["file:///durable"] and EVENT == "safepoint.checkpoint.committed"


def test_no_event_unless_asked_and_a_failed_send_does_not_raise(tmp_path: Path, gateway, caplog) -> None:
    seal_and_announce(_folder(tmp_path), 7, SealOptions("r"))
    assert gateway.sent == []
    gateway.fail = True
    other = tmp_path / "b"
    other.mkdir()
    (other / "w.bin").write_bytes(b"y")
    assert seal_and_announce(other, 8, SealOptions("r", emit_to=("file:///d",))) is not None
    assert "could not send the committed event" in caplog.text


def test_a_failed_seal_raises_unless_not_strict(tmp_path: Path, gateway) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(CommitError):
        seal_and_announce(missing, 1, SealOptions("r"))
    assert seal_and_announce(missing, 1, SealOptions("r", strict=False)) is None


@pytest.mark.parametrize("name,step", [("step-100", 100), ("checkpoint-4", 4), ("step_3", 3), ("latest", None),
                                       ("step-", None)])
def test_step_of_folder(name: str, step: int | None) -> None:
    assert step_of_folder(Path("/x") / name) == step
