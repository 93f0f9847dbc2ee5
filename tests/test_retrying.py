"""Retries are one layer over every destination (safepoint.destinations.retrying): a transient
failure of a file://, memory:// or S3 call is tried again, a final one surfaces at once."""

from __future__ import annotations

import errno
import uuid
from pathlib import Path

import pytest

from safepoint.core.errors import DestinationError, FormatError
from safepoint.core.format import FileEntry
from safepoint.core.hashing import hash_path
from safepoint.destinations import open_destination, retry
from safepoint.destinations.retrying import RetryingDestination


class _Status(Exception):
    def __init__(self, status: int):
        super().__init__(f"HTTP {status}")
        self.status = status


@pytest.mark.parametrize(("exc", "transient"), [
    (ConnectionResetError(errno.ECONNRESET, "reset"), True),
    (ConnectionError("dropped"), True),
    (TimeoutError("read timed out"), True),
    (OSError(errno.ESTALE, "stale NFS file handle"), True),
    (OSError(errno.ETIMEDOUT, "timed out"), True),
    (_Status(503), True),
    (_Status(429), True),
    (PermissionError(errno.EACCES, "permission denied"), False),
    (FileNotFoundError(errno.ENOENT, "no such file"), False),
    (OSError(errno.ENOSPC, "no space left"), False),
    (OSError(errno.EIO, "input/output error"), False),
    (_Status(403), False),
    (DestinationError("gave up after 8 attempts"), False),
    (FormatError("longer than 3 bytes"), False),
    (ValueError("bad"), False),
])
def test_file_and_fsspec_failures_are_classified(exc: BaseException, transient: bool) -> None:
    assert retry.is_transient(exc) is transient


def _client_error(code: str, status: int):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


def _flaky(fn, failures: list[BaseException], calls: list[int]):
    """`fn`, raising each of `failures` on the first calls; counts every call."""
    def call(*args, **kwargs):
        calls.append(1)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return fn(*args, **kwargs)
    return call


def test_a_memory_destination_that_fails_twice_uploads(tmp_path: Path, monkeypatch) -> None:
    source = tmp_path / "w.bin"
    source.write_bytes(b"weights" * 1000)
    size, digest = hash_path(source)
    dest = open_destination(f"memory://flaky-{uuid.uuid4().hex}/base")
    assert isinstance(dest, RetryingDestination)
    calls: list[int] = []
    reset = ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
    monkeypatch.setattr(dest.fs, "open", _flaky(dest.fs.open, [reset, reset], calls))
    assert dest.upload("r", 1, FileEntry("w.bin", size, digest), source) == digest
    assert len(calls) == 3
    assert dest.digest("r", 1, "w.bin") == digest and dest.size("r", 1, "w.bin") == size


def test_a_file_destination_retries_a_stale_handle(tmp_path: Path, monkeypatch) -> None:
    dest = open_destination(str(tmp_path / "dest"))
    assert dest.write_control("r", 1, "MANIFEST.json", b"{}")
    calls: list[int] = []
    stale = OSError(errno.ESTALE, "stale file handle")
    monkeypatch.setattr(dest.inner, "read_control", _flaky(dest.inner.read_control, [stale, stale], calls))
    assert dest.read_control("r", 1, "MANIFEST.json") == b"{}"
    assert len(calls) == 3


@pytest.mark.parametrize("url", ["memory://perm-{}/base", "{}/dest"])
def test_permission_denied_is_not_retried(url: str, tmp_path: Path, monkeypatch) -> None:
    dest = open_destination(url.format(uuid.uuid4().hex if "memory" in url else tmp_path))
    calls: list[int] = []
    denied = PermissionError(errno.EACCES, "permission denied")
    monkeypatch.setattr(dest.inner, "write_control", _flaky(dest.inner.write_control, [denied] * 5, calls))
    with pytest.raises(PermissionError):
        dest.write_control("r", 1, "COMMITTED", b"x")
    assert len(calls) == 1


def test_a_failure_that_stays_ends_as_one_destination_error(tmp_path: Path, monkeypatch) -> None:
    inner = open_destination(str(tmp_path / "dest")).inner
    waits: list[float] = []
    dest = RetryingDestination(inner, sleep=waits.append)
    calls: list[int] = []
    reset = ConnectionResetError(errno.ECONNRESET, "reset")
    monkeypatch.setattr(inner, "listing", _flaky(inner.listing, [reset] * 100, calls))
    with pytest.raises(DestinationError, match=r"list file://.*: gave up after 8 attempts: .*reset"):
        dest.listing()
    assert len(calls) == inner.retry_policy.attempts == 8
    assert len(waits) == 7 and all(0 <= w <= inner.retry_policy.cap_s for w in waits)


def test_s3_retries_slow_down_and_not_no_such_bucket(monkeypatch) -> None:
    dest = open_destination("s3://no-such-bucket/p", {"retry_base_s": 0.001, "retry_attempts": 4})
    assert dest.inner.transient is retry.is_retryable and dest.inner.retry_policy.attempts == 4
    calls: list[int] = []
    slow = _client_error("SlowDown", 503)
    monkeypatch.setattr(dest.inner, "read_control", _flaky(lambda *a: b"m", [slow, slow], calls))
    assert dest.read_control("r", 1, "MANIFEST.json") == b"m"
    assert len(calls) == 3
    calls.clear()
    missing = _client_error("NoSuchBucket", 404)
    monkeypatch.setattr(dest.inner, "read_control", _flaky(lambda *a: b"m", [missing] * 5, calls))
    with pytest.raises(Exception, match="NoSuchBucket"):
        dest.read_control("r", 1, "MANIFEST.json")
    assert len(calls) == 1
    calls.clear()
    monkeypatch.setattr(dest.inner, "read_control", _flaky(lambda *a: b"m", [DestinationError("gave up")] * 5, calls))
    with pytest.raises(DestinationError):  # what the backend already gave up on is not tried again
        dest.read_control("r", 1, "MANIFEST.json")
    assert len(calls) == 1
