"""Shared fixtures: an isolated SAFEPOINT_HOME per test, one Prefect test server per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_LOGGING_TO_API_ENABLED", "false")

pytest_plugins = ["tests.conftest_catalog", "tests.conftest_s3"]


def pytest_collection_modifyitems(config, items):
    """Modules holding `slow` tests first, in their own order: with `-n 2 --dist loadfile` (.ci/run)
    each worker starts on a long module, and the short ones fill in around them instead of a long one
    starting last and running alone."""
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow_modules)


@pytest.fixture(autouse=True)
def safepoint_home(tmp_path, monkeypatch):
    home = tmp_path / "sp-home"
    home.mkdir()
    monkeypatch.setenv("SAFEPOINT_HOME", str(home))
    monkeypatch.delenv("SAFEPOINT_CATALOG_URL", raising=False)
    monkeypatch.delenv("SAFEPOINT_CONFIG", raising=False)
    return home


@pytest.fixture(scope="session")
def prefect_api():
    """A Prefect server for the whole session (starting one takes ~10 s on 2 cores)."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()
