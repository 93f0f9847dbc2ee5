"""s3:// against a real SeaweedFS server: the destination contract, plus what object stores add
(multipart, leftovers, conditional commit, retries through a fault-injecting proxy, credentials
from the environment or Safepoint's config, never leaked)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from safepoint import commit
from safepoint.core.errors import DestinationError, UsageError
from safepoint.core.format import MARKER_NAME
from safepoint.core.states import CheckpointState, ReplicaState
from safepoint.core.verify import FileStatus
from safepoint.destinations import open_destination, retry
from safepoint.destinations.retry import RetryPolicy
from safepoint.destinations.s3 import S3Destination
from safepoint.destinations.s3_options import client_settings, parse_s3_url, plan_parts, split_options
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.replicate import replicate
from safepoint.ops.verify import verify_replica
from tests.destinations_contract import *  # noqa: F403
from tests.faultproxy import Fault
from tests.helpers_ckpt import make_torch_save_ckpt

pytestmark = pytest.mark.s3

MiB = 1024 * 1024
SMALL_PARTS = {"part_size": 5 * MiB, "max_parts_in_flight": 3, "read_window": 2}
FAST_RETRY = {"retry_attempts": 6, "retry_base_s": 0.02, "retry_cap_s": 0.2}


@pytest.fixture
def dest_url(s3_env):
    """The shared contract (tests/destinations_contract.py) runs on this: credentials from AWS_*."""
    return s3_env.url("contract")


@pytest.fixture
def big_snapshot(tmp_path):
    """Two multipart-sized files (with a partial last part) and a small one."""
    d = tmp_path / "local" / "big"
    d.mkdir(parents=True)
    rnd = os.urandom(MiB)
    (d / "shard-0.bin").write_bytes(rnd * 12 + b"tail-0")
    (d / "shard-1.bin").write_bytes(bytes(reversed(rnd)) * 11)
    (d / "meta.json").write_bytes(b'{"step": 7}')
    commit(d, "big", 7)
    return LocalSnapshot.open(d)


def s3dest(env, prefix: str, **options) -> S3Destination:
    dest = open_destination(env.url(prefix), {**SMALL_PARTS, **options})
    assert isinstance(dest.inner, S3Destination)
    return dest


def test_open_destination_dispatches_s3(s3_env):
    dest = open_destination(s3_env.url("x"))
    assert isinstance(dest.inner, S3Destination)
    assert dest.url == s3_env.url("x") and dest.bucket == s3_env.bucket and dest.prefix == s3_env.key("x")


def test_multipart_upload_verifies_with_bounded_buffers(s3_env, big_snapshot):
    dest = s3dest(s3_env, "mp")
    result = replicate(big_snapshot, dest)
    assert result.state is ReplicaState.VERIFIED, result.error
    assert result.bytes_uploaded == big_snapshot.manifest.total_bytes
    # Never more part buffers than configured, however large the files.
    assert 1 <= dest.pool.high_water <= SMALL_PARTS["max_parts_in_flight"]
    assert dest.pending_uploads() == []
    head = s3_env.server.client().head_object(Bucket=s3_env.bucket, Key=s3_env.key("mp/big/7/shard-0.bin"))
    assert head["ETag"].strip('"').endswith("-3")  # really went as a 3-part multipart upload
    assert verify_replica(dest, "big", 7).outcome is CheckpointState.VERIFIED


# -- helpers for the end-to-end cases ----------------------------------------------------------------

def sp(*args) -> int:
    from safepoint.cli.main import main

    return main([str(a) for a in args])


def ls_json(cat: str, capsys) -> list[dict]:
    capsys.readouterr()
    assert sp("--catalog", cat, "ls", "--json") == 0
    return json.loads(capsys.readouterr().out)


def resume_step(cat: str, capsys, run: str) -> int | None:
    capsys.readouterr()
    code = sp("--catalog", cat, "resume-point", "--run", run, "--json")
    text = capsys.readouterr().out
    return json.loads(text)["step"] if code == 0 else None


def committed_ckpt(root: Path, run: str, step: int, *, big_mib: int = 0, seed: int = 0) -> Path:
    """A torch.save checkpoint (validates) plus, optionally, a big safetensors file (multipart-sized)."""
    folder = root / run / f"step-{step}"
    make_torch_save_ckpt(folder, seed=seed)
    if big_mib:
        import safetensors.torch
        import torch

        g = torch.Generator().manual_seed(seed)
        safetensors.torch.save_file({"big": torch.randn(big_mib * MiB // 4, generator=g)}, folder / "big.safetensors")
    assert sp("commit", folder, "--run", run, "--step", step) == 0
    return folder


def write_config(home: Path, text: str) -> None:
    (home / "config.toml").write_text(text)


def toml_value(v) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)  # strings, numbers and booleans are spelt alike


def storage_section(env, **options) -> str:
    body = "\n".join(f"{k} = {toml_value(v)}" for k, v in options.items())
    return f'[storage."s3://{env.bucket}"]\n{body}\n'


# -- end to end through the CLI ----------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "altered"])
def test_damaged_object_caught_by_verify_and_resume_point_falls_back(s3_env, prefect_api, sqlite_catalog_url,
                                                                     tmp_path, capsys, damage):
    cat, url = sqlite_catalog_url, s3_env.url("durable")
    for step in (1, 2):
        folder = committed_ckpt(tmp_path / "nvme", "dmg", step, seed=step)
        assert sp("--catalog", cat, "ingest", folder, "--to", url) == 0
    assert resume_step(cat, capsys, "dmg") == 2
    c, key = s3_env.server.client(), s3_env.key("durable/dmg/2/model.pt")
    data = c.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read()
    if damage == "truncated":
        bad = data[: len(data) // 2]
    else:  # same size, one byte different: only a content hash can tell
        bad = data[:100] + bytes([data[100] ^ 0xFF]) + data[101:]
    c.put_object(Bucket=s3_env.bucket, Key=key, Body=bad)

    capsys.readouterr()
    assert sp("--catalog", cat, "verify", f"{url}/dmg/2") == 1
    printed = capsys.readouterr()
    assert ("size_mismatch" if damage == "truncated" else "hash_mismatch") in printed.out + printed.err
    assert sp("--catalog", cat, "verify", f"{url}/dmg/1") == 0
    rows = {r["step"]: r for r in ls_json(cat, capsys)}
    assert rows[2]["replicas"] == [{"url": f"{url}/dmg/2", "state": "corrupt"}]
    assert resume_step(cat, capsys, "dmg") == 1


def test_several_destinations_each_recorded(s3_env, prefect_api, sqlite_catalog_url, tmp_path, capsys):
    cat, s3url, pfs = sqlite_catalog_url, s3_env.url("durable"), (tmp_path / "pfs").as_uri()
    folder = committed_ckpt(tmp_path / "nvme", "multi", 3)
    assert sp("--catalog", cat, "ingest", folder, "--to", s3url, "--to", pfs) == 0
    (row,) = ls_json(cat, capsys)
    assert row["state"] == "verified"
    assert sorted((r["url"], r["state"]) for r in row["replicas"]) == sorted(
        [(f"{s3url}/multi/3", "verified"), (f"{pfs}/multi/3", "verified")])
    dest = open_destination(s3url)
    assert dest.committed_snapshots() == [("multi", 3)]
    assert verify_replica(dest, "multi", 3).outcome is CheckpointState.VERIFIED


def test_options_from_config_and_secrets_never_leak(s3_env, prefect_api, sqlite_catalog_url, tmp_path, capsys,
                                                    monkeypatch, safepoint_home, fault_proxy):
    """Endpoint and keys from Safepoint's config (no AWS_* at all); the secret shows up nowhere."""
    secret = "Sup3rSecret/Key+" + os.urandom(6).hex()
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    write_config(safepoint_home, storage_section(s3_env, endpoint_url=s3_env.server.endpoint, key="cfg-key",
                                                 secret=secret))
    cat, url = sqlite_catalog_url, s3_env.url("cfg")
    folder = committed_ckpt(tmp_path / "nvme", "cfg", 1)
    assert sp("--catalog", cat, "ingest", folder, "--to", url) == 0
    assert ls_json(cat, capsys)[0]["state"] == "verified"

    # The same keys, through a proxy that answers every upload 503: a hard failure, recorded, redacted.
    fault_proxy.add(Fault("status", method="PUT", times=None))
    write_config(safepoint_home, storage_section(s3_env, endpoint_url=fault_proxy.endpoint, key="cfg-key",
                                                 secret=secret, retry_attempts=2, retry_base_s=0.01))
    folder2 = committed_ckpt(tmp_path / "nvme", "cfg", 2, seed=2)
    code = sp("--catalog", cat, "ingest", folder2, "--to", url)
    printed = capsys.readouterr()
    assert code != 0
    from safepoint.catalog.store import open_catalog

    catalog = open_catalog(cat)
    row = catalog.get("cfg", 2)
    (rep,) = catalog.replicas(row.id)
    assert rep.state is ReplicaState.FAILED and rep.error and "gave up" in rep.error
    assert row.state is not CheckpointState.VERIFIED
    assert LocalSnapshot.open(folder2).verify().outcome is CheckpointState.VERIFIED  # local copy untouched
    everything = json.dumps(catalog.events(), default=str) + printed.out + printed.err + repr(rep)
    assert secret not in everything and "Sup3rSecret" not in everything


def test_kill9_mid_upload_then_resume(s3_env, prefect_api, sqlite_catalog_url, tmp_path, capsys, fault_proxy,
                                      safepoint_home):
    """kill -9 while a part is in flight; the next ingest aborts the leftover, reuses what is done."""
    write_config(safepoint_home, storage_section(s3_env, **SMALL_PARTS) + "[limits]\nlease_ttl_s = 2\n")
    cat, url = sqlite_catalog_url, s3_env.url("kill")
    folder = committed_ckpt(tmp_path / "nvme", "kill", 5, big_mib=12)
    stall = fault_proxy.add(Fault("stall", method="PUT", match="partNumber=2", where="request", delay=120))
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "AWS_ENDPOINT_URL": fault_proxy.endpoint}
    proc = subprocess.Popen([sys.executable, "-m", "safepoint.cli", "--catalog", cat, "ingest", str(folder),
                             "--to", url], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert stall.engaged.wait(120), "the upload never reached part 2"
        client = s3_env.server.client()
        small_key = s3_env.key("kill/kill/5/model.pt")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the small file goes in parallel; let it land
            try:
                client.head_object(Bucket=s3_env.bucket, Key=small_key)
                break
            except client.exceptions.ClientError:
                time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    dest = open_destination(url, {**SMALL_PARTS})
    assert dest.pending_uploads("kill", 5), "a multipart upload should be left behind by the kill"
    assert dest.read_control("kill", 5, MARKER_NAME) is None

    assert sp("--catalog", cat, "ingest", folder, "--to", url) == 0  # straight to the server this time
    (row,) = ls_json(cat, capsys)
    assert row["state"] == "verified" and row["replicas"][0]["state"] == "verified"
    assert dest.pending_uploads() == []
    assert verify_replica(dest, "kill", 5).outcome is CheckpointState.VERIFIED
    from safepoint.catalog.store import open_catalog

    (done,) = open_catalog(cat).events(kind="ingest.done")  # only the second run finished
    assert done["detail"]["bytes_reused"] >= (folder / "model.pt").stat().st_size  # landed before the kill


# -- faults injected between Safepoint and the server ------------------------------------------------

def test_reset_and_503_storm_is_retried_then_verified(s3_env, fault_proxy, big_snapshot):
    p = fault_proxy
    faults = [
        p.add(Fault("status", method="PUT", match="partNumber", times=4)),                 # 503 SlowDown
        p.add(Fault("status", method="PUT", status=500, code="InternalError", times=1, skip=1)),
        p.add(Fault("reset", method="PUT", match="partNumber=3", where="request", at=0.3)),  # reset mid-upload
        p.add(Fault("status", method="HEAD", times=2)),
        p.add(Fault("truncate", method="GET", match="shard-0", at=0.5, times=2)),          # cut read-back body
        p.add(Fault("reset", method="GET", match="shard-1", at=0.2)),                      # reset mid-download
        p.add(Fault("stall", method="GET", match="shard-1", at=0.5, delay=20, skip=1)),    # read timeout
        p.add(Fault("status", method="POST", match="uploadId", times=1)),                  # complete: 503
    ]
    dest = open_destination(s3_env.url("storm"), {**SMALL_PARTS, **FAST_RETRY, "endpoint_url": p.endpoint,
                                                  "read_timeout": 2})
    result = replicate(big_snapshot, dest)
    assert result.state is ReplicaState.VERIFIED, result.error
    assert all(f.hits for f in faults), [(f.kind, f.method, f.match, f.hits) for f in faults]
    direct = open_destination(s3_env.url("storm"))
    assert verify_replica(direct, "big", 7).outcome is CheckpointState.VERIFIED
    assert direct.pending_uploads() == []


def test_endless_503_fails_cleanly_and_is_recorded(s3_env, fault_proxy, big_snapshot, sqlite_catalog):
    from safepoint.core.config import Config
    from safepoint.ops import steps

    fault_proxy.add(Fault("status", method="PUT", times=None))  # every upload, forever
    url = s3_env.url("down")
    config = Config(storage={f"s3://{s3_env.bucket}": {**SMALL_PARTS, **FAST_RETRY,
                                                        "endpoint_url": fault_proxy.endpoint}})
    row = steps.register(sqlite_catalog, big_snapshot)
    with pytest.raises(DestinationError, match="SlowDown"):
        steps.replicate_to(sqlite_catalog, row.id, big_snapshot, url, config)
    (rep,) = sqlite_catalog.replicas(row.id)
    assert rep.state is ReplicaState.FAILED and "SlowDown" in rep.error and "gave up after 6 attempts" in rep.error
    direct = open_destination(url)
    assert direct.read_control("big", 7, MARKER_NAME) is None
    assert direct.pending_uploads() == []  # what did start was aborted
    assert big_snapshot.verify().outcome is CheckpointState.VERIFIED


@pytest.mark.parametrize("checksum", ["none", "auto"])
@pytest.mark.parametrize("times", [1, None])
def test_bytes_damaged_in_flight_are_never_verified(s3_env, fault_proxy, big_snapshot, sqlite_catalog, times,
                                                    checksum, monkeypatch):
    """A flipped byte on the way up, sent again once (then verified) or every time (never verified).
    Without a checksum the read-back catches it (corrupt); by default ("auto", CRC32 on SeaweedFS) the
    store refuses the part as it arrives (BadDigest), and only that part is resent."""
    from safepoint.core.config import Config
    from safepoint.destinations import attestation
    from safepoint.ops import steps

    monkeypatch.setattr(attestation, "TRUST_BYTES", 0)  # a store that has earned its trust: no audit read-back
    monkeypatch.setattr(attestation, "AUDIT_FRACTION", 0.0)

    fault = fault_proxy.add(Fault("corrupt", method="PUT", match=r"shard-1\.bin\?.*partNumber=2", where="request",
                                  times=times))
    url = s3_env.url(f"flip-{checksum}")
    config = Config(storage={f"s3://{s3_env.bucket}": {**SMALL_PARTS, **FAST_RETRY, "checksum": checksum,
                                                        "endpoint_url": fault_proxy.endpoint}})
    row = steps.register(sqlite_catalog, big_snapshot)
    if times is None and checksum == "auto":  # refused at every try: a failure to store, raised and recorded
        with pytest.raises(DestinationError, match="BadDigest"):
            steps.replicate_to(sqlite_catalog, row.id, big_snapshot, url, config)
        result = None
    else:
        result = steps.replicate_to(sqlite_catalog, row.id, big_snapshot, url, config)
    assert fault.hits >= 1
    (rep,) = sqlite_catalog.replicas(row.id)
    direct = open_destination(url)
    if result is None:
        assert rep.state is ReplicaState.FAILED and "BadDigest" in rep.error
        assert fault.hits == FAST_RETRY["retry_attempts"]  # never stored: every try refused as it arrived
    elif times == 1:
        assert result.state is ReplicaState.VERIFIED and rep.state is ReplicaState.VERIFIED
        assert rep.proof == ("read-back" if checksum == "none" else "s3-crc32")
        assert verify_replica(direct, "big", 7).outcome is CheckpointState.VERIFIED
    else:
        assert result.state is ReplicaState.CORRUPT and rep.state is ReplicaState.CORRUPT
        assert result.remote["shard-1.bin"] is FileStatus.HASH_MISMATCH
    if times is None:
        assert direct.read_control("big", 7, MARKER_NAME) is None


def test_leftover_uploads_are_aborted_before_commit(s3_env, big_snapshot):
    dest = s3dest(s3_env, "left")
    c = s3_env.server.client()
    for name in ("shard-0.bin", "gone.bin"):  # one the replica will rewrite, one nobody will
        c.create_multipart_upload(Bucket=s3_env.bucket, Key=s3_env.key(f"left/big/7/{name}"))
    assert len(dest.pending_uploads("big", 7)) == 2
    assert replicate(big_snapshot, dest).state is ReplicaState.VERIFIED
    assert dest.pending_uploads() == []
    assert dest.abort_stale_uploads(older_than_s=0) == 0


def test_commit_marker_is_conditional(s3_env):
    dest = s3dest(s3_env, "cond")
    assert dest.write_control("r", 1, MARKER_NAME, b"first", exclusive=True)
    assert not dest.write_control("r", 1, MARKER_NAME, b"second", exclusive=True)
    assert dest.read_control("r", 1, MARKER_NAME) == b"first"


def test_changed_local_file_multipart_is_not_committed(s3_env, big_snapshot):
    p = big_snapshot.path_of("shard-0.bin")
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    dest = s3dest(s3_env, "chg")
    result = replicate(big_snapshot, dest)
    assert result.state is ReplicaState.FAILED and result.local["shard-0.bin"] is FileStatus.HASH_MISMATCH
    assert dest.read_control("big", 7, MARKER_NAME) is None and dest.pending_uploads() == []


# -- pure parts --------------------------------------------------------------------------------------

@pytest.mark.parametrize("size,part,expected", [
    (0, 5 * MiB, [(0, 0)]),
    (1, 5 * MiB, [(0, 1)]),
    (5 * MiB, 5 * MiB, [(0, 5 * MiB)]),
    (5 * MiB + 1, 5 * MiB, [(0, 5 * MiB), (5 * MiB, 1)]),
    (12 * MiB, 5 * MiB, [(0, 5 * MiB), (5 * MiB, 5 * MiB), (10 * MiB, 2 * MiB)]),
])
def test_plan_parts(size, part, expected):
    assert plan_parts(size, part) == expected


def test_plan_parts_never_exceeds_10000_parts():
    parts = plan_parts(100 * 1024 * 1024 * MiB, 5 * MiB)  # 100 TiB
    assert len(parts) <= 10_000 and sum(n for _, n in parts) == 100 * 1024 * 1024 * MiB
    assert all(n == parts[0][1] for _, n in parts[:-1]) and parts[0][1] % MiB == 0


def test_options_split_and_map():
    tuning, rest = split_options({"part_size": 8 * MiB, "retry_attempts": 3, "key": "K", "secret": "S",
                                  "endpoint_url": "http://h:1", "client_kwargs": {"region_name": "eu-x-1"},
                                  "config_kwargs": {"read_timeout": 7}, "connect_timeout": 2})
    assert tuning.part_size == 8 * MiB and tuning.retry.attempts == 3 and tuning.connect_timeout == 2
    assert "part_size" not in rest and "connect_timeout" not in rest and rest["key"] == "K"
    assert rest["config_kwargs"] == {"connect_timeout": 2, "read_timeout": 7}  # for s3fs, user's value wins
    s = client_settings(rest, tuning)
    assert s.client == {"region_name": "eu-x-1", "aws_access_key_id": "K", "aws_secret_access_key": "S",
                        "endpoint_url": "http://h:1"}
    assert s.config["read_timeout"] == 7 and s.config["connect_timeout"] == 2
    assert s.config["s3"] == {"payload_signing_enabled": False}
    assert client_settings({"anon": True, "key": "K"}, tuning).client == {}
    with pytest.raises(UsageError):
        split_options({"part_size": 1024})
    with pytest.raises(UsageError):
        split_options({"checksum": "MD5"})
    assert parse_s3_url("s3://b/p/q/") == ("b", "p/q") and parse_s3_url("s3://b") == ("b", "")


@pytest.mark.parametrize("given, expected", [
    (..., "AUTO"), ("auto", "AUTO"), ("crc32", "CRC32"), ("SHA256", "SHA256"), (" sha256 ", "SHA256"),
    ("none", None), ("off", None), ("", None), (False, None), (None, None),
])
def test_the_checksum_option(given, expected):
    """Absent: "auto" (CRC32 where the store checks it); "none", "off", false: nothing sent, read back."""
    tuning, _ = split_options({} if given is ... else {"checksum": given})
    assert tuning.checksum == expected


def test_streamed_puts_turn_the_automatic_checksum_off():
    assert split_options({"stream_put_max": 64 * MiB})[0].checksum is None  # a streamed PUT carries none
    assert split_options({"stream_put_max": 64 * MiB, "checksum": "CRC32"})[0].checksum == "CRC32"


def test_retry_policy_is_bounded_and_classifies():
    from botocore.exceptions import ClientError, EndpointConnectionError

    policy = RetryPolicy(attempts=4, base_s=0.5, cap_s=2.0)
    assert [policy.delay(n, rand=lambda: 1.0) for n in (1, 2, 3, 4, 10)] == [0.5, 1.0, 2.0, 2.0, 2.0]
    assert policy.delay(3, rand=lambda: 0.0) == 0.0

    def err(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                           "PutObject")

    assert retry.is_retryable(err("SlowDown", 503)) and retry.is_retryable(err("InternalError", 500))
    assert not retry.is_retryable(err("AccessDenied", 403)) and not retry.is_retryable(err("NoSuchBucket", 404))
    assert retry.is_retryable(EndpointConnectionError(endpoint_url="http://x"))
    assert retry.is_retryable(ConnectionResetError()) and not retry.is_retryable(ValueError())

    calls, slept = [], []

    def flaky():
        calls.append(1)
        raise err("SlowDown", 503)

    with pytest.raises(DestinationError, match="gave up after 4 attempts"):
        retry.call(flaky, policy, "PUT s3://b/k?X-Amz-Signature=abcdef", sleep=slept.append)
    assert len(calls) == 4 and len(slept) == 3 and all(0 <= s <= 2.0 for s in slept)
    with pytest.raises(ClientError):  # final at once
        retry.call(lambda: (_ for _ in ()).throw(err("AccessDenied", 403)), policy, "x", sleep=slept.append)


def test_buffer_pool_bounds_memory():
    from safepoint.destinations.buffers import BufferPool

    pool = BufferPool(2, 1024)
    a, b = pool.acquire(), pool.acquire()
    assert pool.try_acquire() is None and pool.try_acquire(4096) is None  # no slot left, whatever the size
    pool.release(a)
    big = pool.try_acquire(4096)  # an oversized part takes a slot and is not pooled
    assert big is not None and len(big) == 4096 and pool.try_acquire() is None
    pool.release(big)
    pool.release(b)
    assert pool.in_use == 0 and pool.high_water == 2 and pool._allocated <= 2
    again = pool.acquire()
    assert len(again) == 1024
    pool.release(again)
    pool.drain()
    assert pool._allocated == 0


def test_failed_s3_destination_does_not_sink_the_others(s3_env, prefect_api, sqlite_catalog_url, tmp_path, capsys,
                                                        safepoint_home, fault_proxy):
    """S3 gives up (endless 503), the parallel-filesystem copy verifies: each is recorded on its own,
    and the checkpoint goes on to validation on the strength of the good one."""
    fault_proxy.add(Fault("status", method="PUT", times=None))
    write_config(safepoint_home, storage_section(s3_env, endpoint_url=fault_proxy.endpoint, **FAST_RETRY))
    cat, s3url, pfs = sqlite_catalog_url, s3_env.url("half"), (tmp_path / "pfs").as_uri()
    folder = committed_ckpt(tmp_path / "nvme", "half", 4)
    assert sp("--catalog", cat, "ingest", folder, "--to", s3url, "--to", pfs) == 0
    (row,) = ls_json(cat, capsys)
    assert row["state"] == "verified"
    assert {r["url"]: r["state"] for r in row["replicas"]} == {f"{s3url}/half/4": "failed", f"{pfs}/half/4": "verified"}
    from safepoint.catalog.store import open_catalog

    catalog = open_catalog(cat)
    failed = next(r for r in catalog.replicas(catalog.get("half", 4).id) if r.url.startswith("s3://"))
    assert "SlowDown" in failed.error and "gave up" in failed.error
    assert open_destination(s3url).read_control("half", 4, MARKER_NAME) is None


def test_lost_answer_to_complete_is_not_a_failure(s3_env, fault_proxy, big_snapshot):
    """The server completed the upload but the answer never arrived, and the retry is told the upload
    is gone (as S3 may say): the object is there, so the file goes on to its read-back."""
    match = r"shard-0\.bin\?uploadId"
    lost = fault_proxy.add(Fault("reset", method="POST", match=match, where="response", at=0.0))
    gone = fault_proxy.add(Fault("status", method="POST", match=match, status=404, code="NoSuchUpload"))
    dest = open_destination(s3_env.url("lost"), {**SMALL_PARTS, **FAST_RETRY, "endpoint_url": fault_proxy.endpoint})
    result = replicate(big_snapshot, dest)
    assert lost.hits == 1 and gone.hits == 1
    assert result.state is ReplicaState.VERIFIED, result.error
    assert open_destination(s3_env.url("lost")).pending_uploads() == []


@pytest.mark.parametrize("how", ["AWS_PROFILE", "profile option"])
def test_credentials_and_endpoint_from_an_aws_profile(s3_env, monkeypatch, tmp_path, snapshot, how):
    """No AWS_* keys or endpoint in the environment: a named profile in ~/.aws provides them."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    creds, conf = tmp_path / "aws-credentials", tmp_path / "aws-config"
    creds.write_text("[ckpt]\naws_access_key_id = profile-key\naws_secret_access_key = profile-secret\n")
    conf.write_text(f"[profile ckpt]\nregion = us-east-1\nendpoint_url = {s3_env.server.endpoint}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(conf))
    options = {}
    if how == "AWS_PROFILE":
        monkeypatch.setenv("AWS_PROFILE", "ckpt")
    else:
        options["profile"] = "ckpt"
    dest = open_destination(s3_env.url("prof"), options)
    assert replicate(snapshot, dest).state is ReplicaState.VERIFIED
    assert dest.committed_snapshots() == [("run-x", 42)]


def test_streamed_put_reads_once_and_resends_whole(s3_env, fault_proxy, big_snapshot):
    """stream_put_max: one PUT per file through one buffer; a reset mid-body resends it, re-hashed."""
    cut = fault_proxy.add(Fault("reset", method="PUT", match=r"shard-1\.bin$", where="request", at=0.6))
    dest = open_destination(s3_env.url("stream"), {**SMALL_PARTS, **FAST_RETRY, "stream_put_max": 64 * MiB,
                                                   "endpoint_url": fault_proxy.endpoint})
    result = replicate(big_snapshot, dest)
    assert result.state is ReplicaState.VERIFIED, result.error
    assert cut.hits == 1 and dest.pool.high_water <= SMALL_PARTS["max_parts_in_flight"]
    assert not any("partNumber" in target for _, target in fault_proxy.requests)  # no multipart at all
    head = s3_env.server.client().head_object(Bucket=s3_env.bucket, Key=s3_env.key("stream/big/7/shard-0.bin"))
    assert "-" not in head["ETag"]


def test_streamed_put_of_a_file_that_shrank_is_never_committed(s3_env, big_snapshot):
    p = big_snapshot.path_of("shard-0.bin")
    dest = open_destination(s3_env.url("shrink"), {**SMALL_PARTS, "stream_put_max": 64 * MiB})
    entry = big_snapshot.manifest.file("shard-0.bin")
    p.write_bytes(p.read_bytes()[: 7 * MiB])  # after the manifest: the stream runs dry mid-body
    assert dest.upload("big", 7, entry, p) != entry.blake3
    assert dest.size("big", 7, "shard-0.bin") is None  # the PUT never completed


def test_sha256_checksum_catches_damage_in_flight_per_part(s3_env, fault_proxy, big_snapshot):
    """checksum = SHA256: the server refuses a damaged part (BadDigest) and only that part is resent."""
    flip = fault_proxy.add(Fault("corrupt", method="PUT", match=r"shard-1\.bin\?.*partNumber=2", where="request"))
    dest = open_destination(s3_env.url("sha"), {**SMALL_PARTS, **FAST_RETRY, "checksum": "SHA256",
                                                "endpoint_url": fault_proxy.endpoint})
    result = replicate(big_snapshot, dest)
    assert flip.hits == 1 and result.state is ReplicaState.VERIFIED, result.error
    parts2 = [t for m, t in fault_proxy.requests if m == "PUT" and re.search(r"shard-1\.bin\?.*partNumber=2", t)]
    assert len(parts2) == 2  # the damaged part went twice, nothing else was resent
    head = s3_env.server.client().head_object(Bucket=s3_env.bucket, Key=s3_env.key("sha/big/7/shard-1.bin"),
                                              ChecksumMode="ENABLED")
    assert head.get("ChecksumSHA256", "").endswith("-3")  # the server kept the per-part checksums


@pytest.fixture
def dest_options():
    """The contract's fetch tests on S3 read in 5 MiB ranges: a large file takes several ranged GETs."""
    return dict(SMALL_PARTS)


def test_capabilities_of_s3(s3_env):
    caps = open_destination(s3_env.url("caps")).capabilities
    assert caps.atomic_exclusive_create and caps.multipart_uploads and not caps.folders


def test_one_client_per_destination(s3_env, snapshot, tmp_path):
    """Listing, fetch, upload and commit all go through the one botocore client: no s3fs filesystem."""
    dest = open_destination(s3_env.url("one"))
    replicate(snapshot, dest)
    client = dest.client
    assert dest.listing("run-x", 42) and dest.client is client
    assert not hasattr(dest, "fs")


def test_reconcile_reports_an_unusable_destination_and_reconciles_the_others(s3_env, sqlite_catalog, snapshot,
                                                                             tmp_path, monkeypatch):
    """No credentials for one destination: it is named in the errors (exit 2), the file:// one is still adopted."""
    from safepoint.core.config import Config
    from safepoint.ops.reconcile import reconcile

    good = (tmp_path / "good").as_uri()
    assert replicate(snapshot, open_destination(good)).state is ReplicaState.VERIFIED
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    report = reconcile(sqlite_catalog, [s3_env.url("nocreds"), good], Config(), finish=False)
    assert report.count("adopt") == 1 and report.count("replica_verified") == 1, report.to_dict()
    assert len(report.errors) == 1 and report.errors[0].startswith(s3_env.url("nocreds")), report.errors
