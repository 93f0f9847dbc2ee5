"""Hostile inputs, round four: control files are parsed within bounds (docs/format.md, "Bounds").

A manifest's size, its entry count and every path's length and depth are checked in one linear pass
before anything else reads it, so a small hostile manifest (one path of 60,000 segments: 117 KB that
made the parse quadratic, gigabytes and tens of seconds) is refused at once as corrupt: exit 1, a
verdict on that copy, through every command that reads one (verify, restore --from).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import safepoint.cli.main as cli
from safepoint.catalog.store import open_catalog
from safepoint.core.errors import FormatError
from safepoint.core.format import (
    MANIFEST_NAME,
    MARKER_NAME,
    MAX_FILES,
    MAX_MANIFEST_BYTES,
    MAX_PATH_DEPTH,
    digest_bytes,
    parse_manifest,
)
from safepoint.local.commit import commit
from safepoint.ops.ingest import ingest

DIGEST = "0" * 64
FAST_S = 3.0  # the refusal takes milliseconds; the old parse took 26 s and ran out of 1.5 GiB


def sp(*args: object) -> int:
    return cli.main([str(a) for a in args])


def _manifest(files: list) -> bytes:
    return json.dumps({"format": "safepoint.manifest", "format_version": 1, "run": "r", "step": 1,
                       "created": "2026-12-04T00:00:00.000000Z", "hash": "blake3", "files": files,
                       "meta": {}}).encode()


def _deep_path(segments: int = 60_000) -> str:
    return "/".join(["a"] * segments)


def _plant(replica: Path, manifest: bytes) -> None:
    """Control files at a replica folder: the hostile manifest and a marker that binds it."""
    replica.mkdir(parents=True, exist_ok=True)
    (replica / MANIFEST_NAME).write_bytes(manifest)
    (replica / MARKER_NAME).write_text(json.dumps({"format": "safepoint.marker", "format_version": 1,
                                                   "manifest_blake3": digest_bytes(manifest), "run": "r",
                                                   "step": 1}))


HOSTILE = {
    "deep path": (_manifest([{"path": _deep_path(), "size": 1, "blake3": DIGEST}]), "longer than 4096 bytes"),
    "deep short path": (_manifest([{"path": _deep_path(MAX_PATH_DEPTH + 1), "size": 1, "blake3": DIGEST}]),
                        f"deeper than {MAX_PATH_DEPTH} segments"),
    "many entries": (_manifest([{}] * (MAX_FILES + 1)), f"over the {MAX_FILES} limit"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_manifest_is_refused_at_once_by_the_parser(case: str) -> None:
    data, why = HOSTILE[case]
    t0 = time.perf_counter()
    with pytest.raises(FormatError, match=why):
        parse_manifest(data)
    assert time.perf_counter() - t0 < FAST_S


def test_the_file_and_directory_rule_still_holds_without_every_prefix() -> None:
    entry = {"size": 1, "blake3": DIGEST}
    with pytest.raises(FormatError, match="both a file and a directory"):
        parse_manifest(_manifest([{"path": "a/b", **entry}, {"path": "a/b-x", **entry}, {"path": "a/b/c", **entry}]))
    m = parse_manifest(_manifest([{"path": "a/b", **entry}, {"path": "a/bc", **entry},
                                  {"path": _deep_path(MAX_PATH_DEPTH), **entry}]))
    assert len(m.files) == 3   # the deepest path allowed is fine


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_verify_refuses_a_hostile_replica_manifest_fast_as_corrupt(tmp_path: Path, sqlite_catalog_url, capsys,
                                                                   case: str) -> None:
    data, why = HOSTILE[case]
    replica = tmp_path / "durable" / "r" / "1"
    _plant(replica, data)
    t0 = time.perf_counter()
    code = sp("--catalog", sqlite_catalog_url, "verify", replica.as_uri())
    took = time.perf_counter() - t0
    captured = capsys.readouterr()
    assert code == 1, captured.err   # a verdict on that copy: corrupt
    assert "Traceback" not in captured.err + captured.out
    assert "corrupt" in captured.err and why in captured.err
    assert took < FAST_S


def test_verify_refuses_an_oversize_manifest_without_reading_past_the_limit(tmp_path: Path, sqlite_catalog_url,
                                                                            capsys) -> None:
    replica = tmp_path / "durable" / "r" / "1"
    pad = b" " * (MAX_MANIFEST_BYTES + 1 - len(_manifest([])))
    _plant(replica, _manifest([])[:-1] + pad + b"}")
    code = sp("--catalog", sqlite_catalog_url, "verify", replica.as_uri())
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert "Traceback" not in captured.err and "corrupt" in captured.err
    assert f"larger than {MAX_MANIFEST_BYTES} bytes" in captured.err


def test_restore_from_a_replica_with_a_hostile_manifest_refuses_it_fast(tmp_path: Path, sqlite_catalog_url,
                                                                        capsys) -> None:
    folder = tmp_path / "local" / "step-1"
    folder.mkdir(parents=True)
    (folder / "w.bin").write_bytes(b"w" * 64)
    commit(folder, "r", 1)
    durable = tmp_path / "durable"
    assert str(ingest(folder, [durable.as_uri()], open_catalog(sqlite_catalog_url)).state) == "verified"
    _plant(durable / "r" / "1", HOSTILE["deep path"][0])   # the replica tampered with
    into = tmp_path / "into"
    t0 = time.perf_counter()
    code = sp("--catalog", sqlite_catalog_url, "restore", "--run", "r", "--step", 1, "--into", into,
              "--from", durable.as_uri())
    took = time.perf_counter() - t0
    captured = capsys.readouterr()
    assert code == 1 and "Traceback" not in captured.err + captured.out  # no whole copy: a verdict
    assert "longer than 4096 bytes" in captured.err
    assert not (into / MARKER_NAME).exists()
    assert took < FAST_S
