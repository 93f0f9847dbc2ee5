"""Fixtures for the fault-injection suite (tests/faults): a fork server, a checkpoint template.

Every test here breaks something on purpose and then checks Safepoint's invariants against the
real bytes (tests/faults/world.py). Figures (iterations, kills, bytes lost, time) are printed with
a `FAULTS` prefix so CI logs carry them: run with `-s` to see them live, or read the `-ra` summary.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.faults.world import ForkServer, make_template


def pytest_configure(config):
    config.addinivalue_line("markers", "faults: fault injection and hostile inputs (tests/faults)")


def pytest_collection_modifyitems(items):
    here = str(Path(__file__).parent)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.faults)


@pytest.fixture(scope="session")
def template(tmp_path_factory) -> Path:
    return make_template(tmp_path_factory.mktemp("faults-template") / "ckpt")


@pytest.fixture
def fork_server(tmp_path, safepoint_home):
    """Start a fork server on a catalog URL: `fork_server(url)`; stopped at teardown."""
    servers: list[ForkServer] = []

    def start(catalog_url: str) -> ForkServer:
        s = ForkServer(catalog_url, tmp_path / f"driver-{len(servers)}",
                       env={"SAFEPOINT_HOME": str(safepoint_home), "SAFEPOINT_CATALOG_URL": catalog_url})
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()


@pytest.fixture(scope="session")
def shared_fork_server(tmp_path_factory):
    """One fork server for the session (children open whatever catalog URL they are given)."""
    s = ForkServer(None, tmp_path_factory.mktemp("fork-server"))
    yield s
    s.close()


def figures(name: str, **values) -> str:
    """One line of figures for the CI log and docs/reliability.md."""
    line = "FAULTS " + name + ": " + ", ".join(f"{k}={v}" for k, v in values.items())
    print(line)
    out = os.environ.get("SAFEPOINT_FAULTS_FIGURES")
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
    return line
