"""Hostile stores, round four (issue 37): attestation is earned.

A store (here: tests/faultproxy.py in front of SeaweedFS, playing the store's part) that checks the
CRC32 sent with small bodies only, and keeps a flipped byte of every large one while it reports the
checksum that was sent, once got a corrupt replica recorded `verified`: the probe was a 4-byte
object sent once per process. Now the probe looks like the requests that follow (a part of the real
part size, a PUT of the size class that goes next, random bytes and key) and comes again at random,
and attested objects are read back in full until the store has earned trust, then at random.
Each defence is shown alone, and the whole through the CLI.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import zlib
from pathlib import Path

import pytest

import safepoint.cli.main as cli
from safepoint.catalog.store import open_catalog
from safepoint.core.format import MARKER_NAME
from safepoint.core.states import CheckpointState, ReplicaState
from safepoint.destinations import attestation, open_destination
from safepoint.local.commit import commit
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.replicate import replicate
from tests.faultproxy import FaultProxy

pytestmark = pytest.mark.s3

MiB = 1024 * 1024
SMALL_BODY = 64 * 1024
PARTS = {"part_size": 5 * MiB, "max_parts_in_flight": 3, "read_window": 2, "retry_attempts": 3, "retry_base_s": 0.01}
CRC = "x-amz-checksum-crc32"


def _crc(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


class LyingStore:
    """Plays a store that keeps a flipped byte of every PUT body above 64 KiB and reports, on HeadObject,
    the CRC32 the client sent (composite over the parts too). `checks_large`: whether it still
    refuses a wrong checksum on those bodies (it checks, then lies), or takes any (checks small
    bodies only). `lying` turns it on and off."""

    def __init__(self, proxy: FaultProxy, *, checks_large: bool):
        self.checks_large, self.lying = checks_large, True
        self.sent: dict[str, str] = {}                  # object path -> the CRC32 the client sent
        self.parts: dict[str, dict[int, str]] = {}      # object path -> part number -> the CRC32 sent
        self.kept: dict[str, dict[int, str]] = {}       # object path -> part number -> the CRC32 of what it kept
        self.flipped = 0
        proxy.on_request, proxy.on_response = self.request, self.response

    def request(self, method: str, target: str, headers: list, body: bytes) -> tuple[list, bytes]:
        sent = next((v for k, v in headers if k.lower() == CRC), None)
        if self.lying and method == "POST" and "uploadId=" in target:
            return self._complete(target.partition("?")[0], headers, body)
        if not self.lying or method != "PUT" or len(body) <= SMALL_BODY:
            return headers, body  # the store's own check applies
        if self.checks_large and sent is not None and sent != _crc(body):
            return headers, body  # refused, as a checking store does
        flipped = bytearray(body)
        flipped[len(body) // 2] ^= 0xFF
        path, _, query = target.partition("?")
        part = re.search(r"partNumber=(\d+)", query)
        if sent is not None and part:
            self.parts.setdefault(path, {})[int(part.group(1))] = sent
            self.kept.setdefault(path, {})[int(part.group(1))] = _crc(bytes(flipped))
        elif sent is not None:
            self.sent[path] = sent
        self.flipped += 1
        return [(k, _crc(bytes(flipped)) if k.lower() == CRC else v) for k, v in headers], bytes(flipped)

    def _complete(self, path: str, headers: list, body: bytes) -> tuple[list, bytes]:
        """CompleteMultipartUpload names the parts' checksums as sent: swap in those of what it kept."""
        kept = self.kept.get(path, {})

        def swap(m: re.Match) -> str:
            n = int(re.search(r"<PartNumber>(\d+)</PartNumber>", m.group(0)).group(1))
            return re.sub(r"<ChecksumCRC32>[^<]*</ChecksumCRC32>",
                          f"<ChecksumCRC32>{kept[n]}</ChecksumCRC32>", m.group(0)) if n in kept else m.group(0)

        body = re.sub(r"<Part>.*?</Part>", swap, body.decode(), flags=re.S).encode()
        md5 = base64.b64encode(hashlib.md5(body).digest()).decode()
        return [(k, md5 if k.lower() == "content-md5" else v) for k, v in headers], body

    def response(self, method: str, target: str, status: str, headers: list) -> list:
        path = target.partition("?")[0]
        if method != "HEAD" or not self.lying:
            return headers
        out = []
        for k, v in headers:
            if k.lower() == CRC and "-" in v and path in self.parts:
                raw = b"".join(base64.b64decode(c) for _n, c in sorted(self.parts[path].items()))
                v = f"{_crc(raw)}-{len(self.parts[path])}"
            elif k.lower() == CRC and path in self.sent:
                v = self.sent[path]
            out.append((k, v))
        return out


@pytest.fixture(autouse=True)
def fresh_process():
    """Each test is a process that has learnt nothing about any store yet."""
    attestation.forget()
    yield
    attestation.forget()


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.endpoint) as p:
        yield p


def _snapshot(root: Path, run: str, step: int) -> Path:
    """A multipart file (3 parts), a single-PUT file above 64 KiB, and a tiny one."""
    d = root / run / str(step)
    d.mkdir(parents=True)
    (d / "big.bin").write_bytes(os.urandom(12 * MiB + 7))
    (d / "mid.bin").write_bytes(os.urandom(3 * MiB))
    (d / "meta.json").write_bytes(b'{"step": %d}' % step)
    commit(d, run, step)
    return d


def _through(proxy: FaultProxy, s3_env, home: Path) -> None:
    (home / "config.toml").write_text(
        f'[storage."s3://{s3_env.bucket}"]\nendpoint_url = "{proxy.endpoint}"\n'
        + "".join(f"{k} = {v}\n" for k, v in PARTS.items()))


def _dest(proxy: FaultProxy, s3_env, sub: str):
    return open_destination(s3_env.url(sub), {**PARTS, "endpoint_url": proxy.endpoint})


@pytest.mark.parametrize("checks_large", [False, True], ids=["checks-small-bodies-only", "checks-then-lies"])
def test_a_lying_store_never_gets_a_replica_recorded_verified_through_the_cli(
        s3_env, proxy, prefect_api, sqlite_catalog_url, tmp_path, safepoint_home, capsys, checks_large):
    """The case of the issue, through `safepoint ingest` (default settings: checksum "auto")."""
    store = LyingStore(proxy, checks_large=checks_large)
    _through(proxy, s3_env, safepoint_home)
    folder = _snapshot(tmp_path / "nvme", "lie", 1)
    code = cli.main(["--catalog", sqlite_catalog_url, "ingest", str(folder), "--to", s3_env.url("ckpt"), "--json"])
    out = capsys.readouterr()
    assert store.flipped >= 2, "the store never lied: the test proves nothing"
    assert code == 2, out.out + out.err  # the checkpoint is good, its replica is not: not delivered
    result = json.loads(out.out)
    assert result["state"] != "verified"
    assert [r["state"] for r in result["replicas"]] == ["corrupt"]
    catalog = open_catalog(sqlite_catalog_url)
    (row,) = catalog.list_checkpoints("lie")
    assert row.state is not CheckpointState.VERIFIED
    assert [r.state for r in catalog.replicas(row.id)] == [ReplicaState.CORRUPT]
    assert open_destination(s3_env.url("ckpt")).read_control("lie", 1, MARKER_NAME) is None  # nothing committed
    # The local copy is the only good one, and nothing may evict it.
    assert cli.main(["--catalog", sqlite_catalog_url, "resume-point", "--run", "lie"]) == 1
    assert (folder / "big.bin").exists()


def test_the_probe_alone_catches_a_store_that_checks_small_bodies_only(s3_env, proxy, tmp_path, monkeypatch):
    """No read-back at all once trusted (the audit off): the probe of the real part size is taken,
    so nothing is attested, and the read-back finds the flipped bytes."""
    monkeypatch.setattr(attestation, "TRUST_BYTES", 0)
    monkeypatch.setattr(attestation, "AUDIT_FRACTION", 0.0)
    store = LyingStore(proxy, checks_large=False)
    snap = LocalSnapshot.open(_snapshot(tmp_path, "probe", 1))
    result = replicate(snap, _dest(proxy, s3_env, "probe"))
    assert store.flipped >= 2
    assert result.state is ReplicaState.CORRUPT
    assert result.proofs["meta.json"] == "read-back"  # the store was not trusted with anything
    # A probe under a random key that names no checkpoint: a part, or a single PUT when the >64 KiB
    # file's probe (uploaded in parallel) caught the store first and no part probe was needed.
    probes = [t for m, t in proxy.requests if m == "PUT" and "/probe/1/" not in t]
    assert probes


def test_the_read_back_catches_a_store_that_checks_and_then_lies(s3_env, proxy, tmp_path):
    """Every probe refused, every checksum reported as sent: only reading the bytes finds the lie,
    and the first attested bytes of a store are read back in full. Then it is never trusted again."""
    store = LyingStore(proxy, checks_large=True)
    dest = _dest(proxy, s3_env, "audit")
    result = replicate(LocalSnapshot.open(_snapshot(tmp_path, "audit", 1)), dest)
    assert store.flipped >= 2
    assert result.state is ReplicaState.CORRUPT
    store.lying = False  # honest from now on: this process has stopped believing it anyway
    result = replicate(LocalSnapshot.open(_snapshot(tmp_path, "audit", 2)), dest)
    assert result.state is ReplicaState.VERIFIED and result.proof == "read-back"


def test_a_trusted_store_is_still_read_back_at_random(s3_env, proxy, tmp_path, monkeypatch):
    """Trust earned (an honest first replica), the store starts lying: an audited read-back catches it."""
    monkeypatch.setattr(attestation, "TRUST_BYTES", 1)
    dest = _dest(proxy, s3_env, "later")
    first = replicate(LocalSnapshot.open(_snapshot(tmp_path, "later", 1)), dest)
    assert first.state is ReplicaState.VERIFIED and "read-back" in first.proof
    monkeypatch.setattr(attestation, "AUDIT_FRACTION", 1.0)  # every draw audits (a random share in earnest)
    LyingStore(proxy, checks_large=True)
    assert replicate(LocalSnapshot.open(_snapshot(tmp_path, "later", 2)), dest).state is ReplicaState.CORRUPT


def test_a_trusted_store_is_probed_again(s3_env, proxy, tmp_path, monkeypatch):
    """A `watch` that trusted a store keeps probing it: once the (random) countdown runs out, a store
    that now takes a wrong checksum on large bodies is not trusted with the next upload."""
    monkeypatch.setattr(attestation, "TRUST_BYTES", 0)
    monkeypatch.setattr(attestation, "AUDIT_FRACTION", 0.0)
    dest = _dest(proxy, s3_env, "again")
    first = replicate(LocalSnapshot.open(_snapshot(tmp_path, "again", 1)), dest)
    assert first.state is ReplicaState.VERIFIED and first.proof == "s3-crc32"
    store = LyingStore(proxy, checks_large=False)
    with attestation.lock:
        for trust in attestation._stores.values():
            trust.probe_in = 1  # the countdown (drawn at random) runs out with the next upload
    assert replicate(LocalSnapshot.open(_snapshot(tmp_path, "again", 2)), dest).state is ReplicaState.CORRUPT
    assert store.flipped >= 2


@pytest.mark.parametrize(("body", "part", "expected"), [
    (0, 5 * MiB, 64 * 1024), (11, 5 * MiB, 64 * 1024), (64 * 1024 + 1, 5 * MiB, 128 * 1024),
    (3 * MiB, 5 * MiB, 4 * MiB), (5 * MiB, 5 * MiB, 5 * MiB), (5 * MiB + 1, 5 * MiB, 5 * MiB),
    (32 * MiB, 32 * MiB, 32 * MiB),
])
def test_probe_size_is_the_size_class_of_the_body(body, part, expected):
    assert attestation.probe_size(body, part) == expected


@pytest.mark.parametrize(("confirmed", "draw", "expected"), [
    (0, 0.99, True), (attestation.TRUST_BYTES - 1, 0.99, True), (attestation.TRUST_BYTES, 0.99, False),
    (attestation.TRUST_BYTES, 0.0, True), (attestation.TRUST_BYTES, attestation.AUDIT_FRACTION, False),
])
def test_audit_reads_back_until_trusted_then_at_random(confirmed, draw, expected):
    assert attestation.audit(confirmed, draw) is expected


def test_the_probe_countdown_is_random_with_a_floor():
    part = 5 * MiB
    assert attestation.next_probe_in(part, 0.0) == part
    mean = sum(attestation.next_probe_in(part, i / 1000) for i in range(1000)) / 1000
    assert 0.8 * attestation.PROBE_MEAN_PARTS * part < mean < 1.2 * attestation.PROBE_MEAN_PARTS * part
