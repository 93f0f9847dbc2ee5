"""Credentials by reference (safepoint.local.credentials) and URL userinfo as S3 keys: no server needed."""

from __future__ import annotations

import stat

import pytest

from safepoint.core.config import Config
from safepoint.core.errors import UsageError
from safepoint.core.redact import redact_url, split_userinfo
from safepoint.destinations.s3 import S3Destination
from safepoint.local.credentials import hide_credentials, hides_credentials, reveal_credentials


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SAFEPOINT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_sealed_url_holds_no_secret_and_reads_back(home):
    url = "s3://AKIAX:se/cr+et@bucket/p"
    sealed = hide_credentials(url)
    assert "se/cr+et" not in sealed and "AKIAX" not in sealed and sealed.startswith("s3://safepoint-ref-")
    assert redact_url(sealed) == "s3://bucket/p" and hides_credentials(sealed)
    assert reveal_credentials(sealed) == url and hide_credentials(url) == sealed and hide_credentials(sealed) == sealed
    files = list((home / "credentials").iterdir())
    assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}
    assert stat.S_IMODE((home / "credentials").stat().st_mode) == 0o700


def test_urls_without_a_secret_are_left_alone():
    for url in ("s3://bucket/p", "/tmp/x", "file:///tmp/x", None):
        assert hide_credentials(url) == url and reveal_credentials(url) == url


def test_a_reference_from_another_host_is_one_clear_error(home, tmp_path, monkeypatch):
    sealed = hide_credentials("postgresql://u:pw@db/cat")
    monkeypatch.setenv("SAFEPOINT_HOME", str(tmp_path / "elsewhere"))
    with pytest.raises(UsageError, match="sealed on another host") as e:
        reveal_credentials(sealed)
    assert "pw" not in str(e.value).replace("postgresql", "")


def test_url_userinfo_is_the_s3_keys_and_storage_options_still_match():
    assert split_userinfo("s3://K%2B:S%2F@b/p") == ("s3://b/p", "K+", "S/")
    config = Config(storage={"s3://b": {"endpoint_url": "http://127.0.0.1:1"}})
    assert config.storage_options("s3://K:S@b/p") == {"endpoint_url": "http://127.0.0.1:1"}
    dest = S3Destination("s3://K:S@b/p", config.storage_options("s3://K:S@b/p"))
    assert dest.url == "s3://b/p" and (dest.bucket, dest.prefix) == ("b", "p")
    assert dest._settings.client["aws_access_key_id"] == "K"
    assert dest._settings.client["aws_secret_access_key"] == "S"
    assert dest._settings.client["endpoint_url"] == "http://127.0.0.1:1"
    sealed = S3Destination(hide_credentials("s3://K2:S2@b/p"))
    assert sealed._settings.client["aws_secret_access_key"] == "S2" and sealed.url == "s3://b/p"


def test_the_flow_resolves_references_into_plain_urls_and_storage_options():
    from safepoint.flows.credentials import resolve_destinations

    config = Config(storage={"s3://b": {"endpoint_url": "http://127.0.0.1:1"}})
    urls, resolved = resolve_destinations([hide_credentials("s3://K:S@b/p"), "file:///x", "s3://b/q"], config)
    assert urls == ["s3://b/p", "file:///x", "s3://b/q"]
    assert resolved.storage_options("s3://b/p") == {"endpoint_url": "http://127.0.0.1:1", "key": "K", "secret": "S"}
    assert resolved.storage_options("s3://b/q") == {"endpoint_url": "http://127.0.0.1:1"}  # no keys of another URL
