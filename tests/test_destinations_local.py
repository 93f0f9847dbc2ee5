"""The destination contract on file:// and memory://."""

import uuid

import pytest

from tests.destinations_contract import *  # noqa: F403


@pytest.fixture(params=["file", "memory"])
def dest_url(request, tmp_path):
    if request.param == "file":
        return (tmp_path / "durable").as_uri()
    return f"memory://safepoint-{uuid.uuid4().hex}"
