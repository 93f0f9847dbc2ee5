"""file:// URLs are parsed in one place (safepoint.core.urls), percent-decoding included."""

from __future__ import annotations

from pathlib import Path

import pytest

from safepoint.core.urls import local_path, path_url, scheme_of
from safepoint.destinations import open_destination


@pytest.mark.parametrize(("url", "path"), [
    ("file:///a/b", "/a/b"),
    ("file:///a%20b", "/a b"),
    ("file:///data/run%2525", "/data/run%25"),
    ("file:///caf%C3%A9/x", "/café/x"),
    ("file://localhost/x", "/x"),
    ("file://", "/"),
    ("file:/abs/x", "/abs/x"),
    ("local:///a%20b", "/a b"),
    ("FILE:///upper", "/upper"),
    ("file://rel/x", "rel/x"),        # what Safepoint has always read it as: relative, not host `rel`
    ("file://./ck", "ck"),
    ("/plain/a b", "/plain/a b"),     # a plain path is a path, never decoded
    ("plain%20rel", "plain%20rel"),
    ("s3://bucket/a%20b", None),
    ("memory://x/y", None),
    ("gs://b/k", None),
])
def test_local_path(url: str, path: str | None) -> None:
    assert local_path(url) == (None if path is None else Path(path))


@pytest.mark.parametrize(("path", "url"), [
    ("/a/b", "file:///a/b"),
    ("/a b", "file:///a%20b"),
    ("/100%", "file:///100%25"),
    ("/q?x#y", "file:///q%3Fx%23y"),
    ("/café", "file:///caf%C3%A9"),
    ("/keep:@+,=~", "file:///keep:@+,=~"),
])
def test_path_url_quotes_and_round_trips(path: str, url: str) -> None:
    assert path_url(path) == url
    assert local_path(url) == Path(path)


def test_path_url_of_a_relative_path_is_absolute(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert path_url("x y") == path_url(tmp_path / "x y")
    assert local_path(path_url("x y")) == tmp_path / "x y"


@pytest.mark.parametrize(("url", "scheme"), [("S3://b", "s3"), ("/x", "file"), ("file:///x", "file"), ("x", "file")])
def test_scheme_of(url: str, scheme: str) -> None:
    assert scheme_of(url) == scheme


def test_a_file_destination_with_a_space_writes_into_the_decoded_folder(tmp_path: Path) -> None:
    folder = tmp_path / "my dest"
    dest = open_destination("file://" + str(tmp_path) + "/my%20dest")
    try:
        dest.write_control("r", 1, "probe.json", b"{}")
        assert dest.url == path_url(folder)
    finally:
        dest.close()
    assert (folder / "r").is_dir()
    assert not (tmp_path / "my%20dest").exists()
    assert open_destination(str(folder)).url == dest.url  # one spelling per folder
