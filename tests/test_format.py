"""Unit tests of the manifest and marker format (docs/format.md)."""

import json

import pytest

from safepoint.core.errors import FormatError
from safepoint.core.format import (
    FileEntry,
    build_manifest,
    digest_bytes,
    load_committed,
    marker_for,
    parse_manifest,
    safe_relpath,
)

H = "0" * 64


def manifest_doc(**over):
    doc = json.loads(build_manifest("r", 1, [FileEntry("a.pt", 3, H)]).to_json_bytes())
    doc.update(over)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("path", ["a", "a/b.pt", "deep/er/x.distcp", ".metadata", "a/.metadata"])
def test_safe_paths(path):
    assert safe_relpath(path) == path


@pytest.mark.parametrize("path", ["", "/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a/.", "C:/x",
                                  "a\\b", "MANIFEST.json", "COMMITTED", ".safepoint-tmp-x", "a\x00b"])
def test_unsafe_paths(path):
    with pytest.raises(FormatError):
        safe_relpath(path)


def test_roundtrip_is_sorted_and_exact():
    m = build_manifest("run-1", 7, [FileEntry("b", 1, H), FileEntry("a/x", 2, "f" * 64)],
                       parent=("run-0", 3), world_size=2, ranks=(1,), node="n1", meta={"tag": "x"})
    again = parse_manifest(m.to_json_bytes())
    assert [f.path for f in again.files] == ["a/x", "b"]
    assert again.parent == ("run-0", 3) and again.world_size == 2 and again.held_ranks == (1,)
    assert again.to_json_bytes() == m.to_json_bytes()


@pytest.mark.parametrize("over", [
    {"format": "other"}, {"format_version": 2}, {"run": "../x"}, {"step": -1}, {"step": True},
    {"files": [{"path": "../x", "size": 1, "blake3": H}]},
    {"files": [{"path": "/abs", "size": 1, "blake3": H}]},
    {"files": [{"path": "a", "size": -1, "blake3": H}]},
    {"files": [{"path": "a", "size": 1, "blake3": "zz"}]},
    {"files": [{"path": "a", "size": 1, "blake3": H}, {"path": "a", "size": 1, "blake3": H}]},
    {"files": [{"path": "a", "size": 1, "blake3": H}, {"path": "a/b", "size": 1, "blake3": H}]},
    {"world_size": 0}, {"ranks": [3]},
])
def test_bad_manifests_are_refused(over):
    with pytest.raises(FormatError):
        parse_manifest(manifest_doc(**over))


@pytest.mark.parametrize("data", [b"", b"[]", b"\xff\xfe", b"{" * 100000, b"null"])
def test_garbage_is_refused(data):
    with pytest.raises(FormatError):
        parse_manifest(data)


def test_marker_binds_manifest():
    m = build_manifest("r", 1, [FileEntry("a", 1, H)])
    mb = m.to_json_bytes()
    marker = marker_for(mb, m).to_json_bytes()
    assert load_committed(mb, marker) == parse_manifest(mb)
    assert json.loads(marker)["manifest_blake3"] == digest_bytes(mb)
    with pytest.raises(FormatError, match="without MANIFEST"):
        load_committed(None, marker)
    with pytest.raises(FormatError, match="no COMMITTED"):
        load_committed(mb, None)
    with pytest.raises(FormatError, match="does not match"):
        load_committed(mb.replace(b'"step": 1', b'"step": 2'), marker)
