"""The destination contract on file:// and memory://."""

import uuid

import pytest

from tests.destinations_contract import *  # noqa: F403


@pytest.fixture(params=["file", "memory"])
def dest_url(request, tmp_path):
    if request.param == "file":
        return (tmp_path / "durable").as_uri()
    return f"memory://safepoint-{uuid.uuid4().hex}"


def test_capabilities_say_which_exclusive_create_is_atomic(dest_url):
    from safepoint.destinations import open_destination

    caps = open_destination(dest_url).capabilities
    assert caps.atomic_exclusive_create is dest_url.startswith("file://")  # a hard link; memory looks first
    assert caps.folders is dest_url.startswith("file://")
    assert not caps.multipart_uploads


def test_a_fifo_in_a_file_replica_is_refused_without_blocking(tmp_path):
    """A FIFO where a stored file should be would block a reader forever: refused at once."""
    import os
    import threading

    from safepoint.core.errors import FormatError
    from safepoint.destinations import open_destination

    dest = open_destination((tmp_path / "d").as_uri())
    (tmp_path / "d" / "r" / "1").mkdir(parents=True)
    os.mkfifo(tmp_path / "d" / "r" / "1" / "w.bin")
    errors: list[BaseException] = []

    def fetch():
        try:
            dest.fetch("r", 1, "w.bin", tmp_path / "got", size=0)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            errors.append(e)

    t = threading.Thread(target=fetch, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "fetch blocked on a FIFO"
    assert len(errors) == 1 and isinstance(errors[0], FormatError), errors
    assert dest.size("r", 1, "w.bin") is None
