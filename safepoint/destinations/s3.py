"""s3:// destinations: verified, resumable, parallel uploads to any S3-compatible object store.

The data path, per file (docs/format.md, "Replica layout"):

- each local byte is read once, into a pooled part buffer, BLAKE3-hashed there, and sent from
  there; large files go as multipart uploads whose parts are sent in parallel while the next part
  is read and hashed, with at most `max_parts_in_flight` buffers per destination (bounded memory);
- `upload()` returns the BLAKE3 of what it read and sent; the replicator compares it with the
  manifest, so bytes that changed on the local disk never get committed (a file found shorter
  than the manifest says is not sent at all);
- `digest()` reads the object back with parallel ranged GETs, pinned to one version with
  `If-Match`, and BLAKE3-hashes it in order. That read-back is the verification; an ETag is never
  taken for a content hash;
- every request also carries a checksum of the very buffer the upload BLAKE3-hashed (by default
  CRC32, on a store seen to check it; `checksum = "SHA256"` or `"none"` in the settings), which the
  store checks on arrival (it refuses a wrong one: bench/s3_checksums.py). `attest()` then reads
  the object's stored checksum (full, or composite over the parts) with one HeadObject; when it is
  the one sent, the replica needs no read-back (proof "s3-crc32" or "s3-sha256"). That holds only
  for a store that checks what arrives, and the trust is earned (safepoint.destinations.attestation):
  a PUT or part of the size about to be sent, with a wrong checksum, must be refused (asked again
  at random), and attested objects are still read back in full until enough of them agreed, then
  at random. A store that keeps no checksum answers nothing; either way the object is read back;
- `MANIFEST.json`, then `COMMITTED` are written last, `COMMITTED` with `If-None-Match: *`, so only
  one writer can commit a replica. Multipart uploads left behind by an interrupted run (kill -9,
  a network that went away) are aborted before the manifest is written, and before a file's new
  multipart upload starts;
- every request is retried with bounded, jittered backoff on 5xx, SlowDown, resets, timeouts and
  truncated bodies (safepoint.destinations.retry); what still fails raises DestinationError, and
  the replica is recorded failed by the pipeline.

Why botocore's synchronous client in threads, and not s3fs's aiobotocore client, for the bytes:
on this project's 2-core machines the aiohttp send path measured 2-4 s of client CPU per GiB
(the event loop copies each unsent body into its write buffer), against 0.25 s for urllib3's
`sendall` from a reused buffer; with the server on the same cores, that CPU is throughput. The
storage options stay s3fs's (safepoint/destinations/s3_options.py). The destination keeps one
client for everything, listing included (`listing`, for reconcile).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import secrets
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safepoint.core.errors import DestinationError, FormatError
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME, MAX_MANIFEST_BYTES, FileEntry, check_run
from safepoint.core.hashing import new_hasher
from safepoint.core.naming import snapshot_key
from safepoint.core.redact import redact, split_userinfo
from safepoint.destinations import attestation, retry
from safepoint.destinations.base import (
    Capabilities,
    Destination,
    SnapshotListing,
    StoredObject,
    check_size,
    group_listing,
)
from safepoint.destinations.buffers import BufferPool
from safepoint.destinations.s3_options import client_settings, parse_s3_url, plan_parts, split_options
from safepoint.local.credentials import reveal_credentials
from safepoint.local.durable_write import FileWriter

log = logging.getLogger(__name__)

SMALL = 1024 * 1024  # files up to this size are read into plain bytes, without a pool buffer
NOT_FOUND = frozenset({"404", "NoSuchKey", "NotFound", "NoSuchUpload"})


def _code(e: BaseException) -> str | None:
    return retry.error_code(e)


def _is_not_found(e: BaseException) -> bool:
    return _code(e) in NOT_FOUND or retry.http_status(e) == 404


#: what stores answer to a wrong checksum or Content-MD5
REFUSED = frozenset({"BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch", "InvalidRequest"})

_loader_lock = threading.Lock()
_loader: Any = None


def _session(kwargs: dict[str, Any]) -> Any:
    """A botocore session that shares one data loader with every other session of this process.

    Each new session parses botocore's JSON service models again (about 0.1 s of CPU per S3
    client, measured; a restore opens one per source, before its first byte). The loader only
    caches those read-only models: credentials, profile and endpoint stay per session.
    """
    global _loader
    import botocore.session

    session = botocore.session.Session(**kwargs)
    with _loader_lock:
        if _loader is None:
            _loader = session.get_component("data_loader")
        else:
            session.register_component("data_loader", _loader)
    return session


def _client_error() -> type[Exception]:
    from botocore.exceptions import ClientError

    return ClientError


def _direct_readinto(body: Any) -> Any:
    """The fastest `readinto` of a botocore StreamingBody.

    http.client's own readinto receives straight into our buffer; going through urllib3 and
    botocore costs an extra allocation and copy per read (about 0.4 s of CPU per GiB read back,
    measured). A body cut short still raises (http.client.IncompleteRead) or comes up short,
    and both are retried by the caller.
    """
    raw = getattr(getattr(body, "_raw_stream", None), "_fp", None)
    if raw is not None and hasattr(raw, "readinto"):
        return raw.readinto
    if hasattr(body, "readinto"):
        return body.readinto

    def via_read(view: memoryview) -> int:  # older botocore
        chunk = body.read(len(view))
        view[: len(chunk)] = chunk
        return len(chunk)

    return via_read


class _LocalChanged(Exception):
    """The local file ended before the manifest's size: it changed after the pre-check."""


class _StreamBody:
    """A request body that reads the local file into one pooled buffer, hashes it there and hands
    the same bytes to the socket: one PUT of any size, each byte read once, memory one buffer.

    http.client sends whatever `read()` returns, so chunks are buffer-sized, not 16 KiB. A rewind
    (`seek(0)`, for a resend) starts the hash over with the bytes read again.
    """

    def __init__(self, fd: int, size: int, buf: bytearray, new_hasher: Any):
        self._fd, self._size, self._buf, self._new_hasher = fd, size, buf, new_hasher
        self._pos = 0
        self.hasher = new_hasher()
        self.ran_dry = False  # the file ended early; botocore wraps what read() raises, so say it here

    def __len__(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        target = {0: pos, 1: self._pos + pos, 2: self._size + pos}[whence]
        if target != 0 and target != self._size:
            raise OSError("a streamed body rewinds to its start only")
        if target == 0:
            self.hasher = self._new_hasher()
        self._pos = target
        return target

    def read(self, n: int = -1) -> memoryview | bytes:
        if self._pos >= self._size:
            return b""
        k = min(len(self._buf), self._size - self._pos)
        view = memoryview(self._buf)[:k]
        got = 0
        while got < k:
            r = os.preadv(self._fd, [view[got:]], self._pos + got)
            if r == 0:
                self.ran_dry = True
                raise _LocalChanged
            got += r
        self.hasher.update(view)
        self._pos += k
        return view


class S3Destination(Destination):
    """`s3://bucket/prefix` through botocore, with s3fs's storage options.

    Exclusive create is a conditional PUT (If-None-Match: *), atomic on stores that honour it (AWS,
    SeaweedFS: docs/reliability.md); a store that answers 501 gets look-then-write.
    """

    capabilities = Capabilities(atomic_exclusive_create=True, multipart_uploads=True)
    transient = staticmethod(retry.is_retryable)  # botocore's errors (safepoint.destinations.retrying)

    @property
    def retry_policy(self) -> retry.RetryPolicy:  # type: ignore[override]
        return self.tuning.retry

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        url = reveal_credentials(url) or url
        _clean, user, password = split_userinfo(url)
        if user is not None and password is not None:  # s3://KEY:SECRET@bucket/p: the URL's keys win
            storage_options = {**(storage_options or {}), "key": user, "secret": password}
        self.url = redact(url.rstrip("/")) or url
        self.bucket, self.prefix = parse_s3_url(url)
        self.tuning, self._fs_options = split_options(storage_options)
        self._settings = client_settings(self._fs_options, self.tuning)
        self.pool = BufferPool(self.tuning.max_parts_in_flight, self.tuning.part_size)
        self._lock = threading.Lock()
        self._client_obj: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._fetch_pool: BufferPool | None = None
        self._sent: dict[str, _Sent] = {}  # key -> what its upload sent, and the checksum it implies

    # -- plumbing ----------------------------------------------------------------------------------
    @property
    def client(self) -> Any:
        """One botocore S3 client (thread-safe), created on first use."""
        with self._lock:
            if self._client_obj is None:
                from botocore.config import Config

                s = self._settings
                session = _session(s.session)
                self._client_obj = session.create_client("s3", config=Config(**s.config), **s.client)
            return self._client_obj

    def _pool_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.tuning.max_parts_in_flight,
                                                    thread_name_prefix="safepoint-s3")
            return self._executor

    def close(self) -> None:
        with self._lock:
            ex, self._executor = self._executor, None
            client, self._client_obj = self._client_obj, None
        if ex is not None:
            ex.shutdown(wait=True)
        if client is not None and hasattr(client, "close"):
            client.close()
        self.pool.drain()
        if self._fetch_pool is not None:
            self._fetch_pool.drain()

    def _key(self, run: str, step: int, relpath: str = "") -> str:
        """Object key of a file of a snapshot (its folder, without a trailing '/', for relpath="")."""
        return "/".join(p.strip("/") for p in (self.prefix, snapshot_key(run, step), relpath) if p)

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _call(self, op: str, what: str, **params: Any) -> Any:
        """One S3 request with Safepoint's retries; non-retryable errors come back as ClientError."""
        fn = getattr(self.client, op)
        return retry.call(lambda: fn(**params), self.tuning.retry, what)

    def _fail(self, e: BaseException, what: str) -> DestinationError:
        return DestinationError(redact(f"{what}: {retry.describe(e)}") or what)

    # -- Destination verbs -------------------------------------------------------------------------
    def size(self, run: str, step: int, relpath: str) -> int | None:
        head = self._head(self._key(run, step, relpath))
        return None if head is None else int(head["ContentLength"])

    def _head(self, key: str, **extra: Any) -> dict[str, Any] | None:
        try:
            return self._call("head_object", f"HEAD {self._where(key)}", Bucket=self.bucket, Key=key, **extra)
        except _client_error() as e:
            if _is_not_found(e):
                return None
            raise self._fail(e, f"HEAD {self._where(key)}") from e

    def upload(self, run: str, step: int, entry: FileEntry, source: Path) -> str:
        key = self._key(run, step, entry.path)
        self._remember(key, None)  # what an earlier upload of this key implied holds no more
        single = entry.size <= max(self.tuning.part_size, SMALL)
        kind, body = ("put", entry.size) if single else ("part", plan_parts(entry.size, self.tuning.part_size)[0][1])
        algo = self._algorithm(kind, body)
        if algo:
            with attestation.lock:
                self._trust(algo).spend(entry.size)
        if single:
            return self._upload_single(key, entry, source, algo)
        if entry.size <= self.tuning.stream_put_max and not algo:
            return self._upload_streamed(key, entry, source)
        return self._upload_multipart(key, entry, source, algo, body)

    def _algorithm(self, kind: str, body: int) -> str | None:
        """The checksum to send with a `kind` request ("put" or "part") of `body` bytes: the one asked
        for, or for "auto" CRC32 where the store is seen to refuse a wrong one, else none (read back)."""
        if self.tuning.checksum != "AUTO":
            return self.tuning.checksum
        return "CRC32" if self._store_checks("CRC32", kind, body) else None

    def _upload_streamed(self, key: str, entry: FileEntry, source: Path) -> str:
        """One PUT streamed from the file through one pooled buffer (see _StreamBody)."""
        where = self._where(key)
        fd = os.open(source, os.O_RDONLY)
        buf = self.pool.acquire()
        body: _StreamBody | None = None

        def put() -> Any:
            nonlocal body
            body = _StreamBody(fd, entry.size, buf, lambda: new_hasher(0))  # a resend reads and hashes anew
            try:
                return self.client.put_object(Bucket=self.bucket, Key=key, Body=body, **self._settings.extra_put)
            except Exception:
                if body.ran_dry:
                    raise _LocalChanged from None  # final: not a network failure to retry
                raise

        try:
            retry.call(put, self.tuning.retry, f"PUT {where}")
        except _LocalChanged:
            assert body is not None
            return body.hasher.hexdigest()  # shorter than the manifest says; the PUT never completed
        except _client_error() as e:
            raise self._fail(e, f"PUT {where}") from e
        finally:
            os.close(fd)
            self.pool.release(buf)
        assert body is not None
        return body.hasher.hexdigest()

    def _read_exact(self, fd: int, view: memoryview, offset: int) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                raise _LocalChanged
            got += n

    @staticmethod
    def _checksum(data: memoryview | bytes, algo: str | None) -> dict[str, str]:
        return {} if algo is None else {_FIELD[algo]: base64.b64encode(_RAW[algo](data)).decode()}

    def _upload_single(self, key: str, entry: FileEntry, source: Path, algo: str | None) -> str:
        hasher = new_hasher(0)
        fd = os.open(source, os.O_RDONLY)
        buf = None
        try:
            if entry.size <= SMALL:
                body: bytes | bytearray = os.pread(fd, entry.size, 0)
                hasher.update(body)
            else:
                buf = self.pool.acquire()
                view = memoryview(buf)[: entry.size]
                try:
                    self._read_exact(fd, view, 0)
                except _LocalChanged:
                    return hasher.hexdigest()  # shorter than the manifest says: changed, nothing sent
                hasher.update(view)
                body = buf if entry.size == len(buf) else bytearray(view)
            digest = hasher.hexdigest()
            params = {"Bucket": self.bucket, "Key": key, "Body": body, **self._checksum(memoryview(body), algo),
                      **self._settings.extra_put}
            try:
                self._call("put_object", f"PUT {self._where(key)}", **params)
            except _client_error() as e:
                raise self._fail(e, f"PUT {self._where(key)}") from e
            self._remember(key, _Sent(algo, params.get(_FIELD.get(algo or "", "")), digest, "put", entry.size))
            return digest
        finally:
            os.close(fd)
            if buf is not None:
                self.pool.release(buf)

    def _upload_multipart(self, key: str, entry: FileEntry, source: Path, algo: str | None, part: int) -> str:
        where = self._where(key)
        self._abort_uploads(key, exact=True)  # a leftover of an interrupted run of this very file
        create = {"Bucket": self.bucket, "Key": key, **self._settings.extra_put}
        if algo:
            create["ChecksumAlgorithm"] = algo
        try:
            upload_id = self._call("create_multipart_upload", f"start upload {where}", **create)["UploadId"]
        except _client_error() as e:
            raise self._fail(e, f"start upload {where}") from e
        hasher = new_hasher(0)
        futures: list[tuple[Future, bytearray]] = []
        completed = False
        fd = os.open(source, os.O_RDONLY)
        try:
            executor = self._pool_executor()
            for number, (offset, length) in enumerate(plan_parts(entry.size, self.tuning.part_size), 1):
                if any(f.done() and f.exception() for f, _ in futures):
                    break  # a part failed for good: stop reading, report it below
                buf = self.pool.acquire(length)
                try:
                    view = memoryview(buf)[:length]
                    self._read_exact(fd, view, offset)
                    hasher.update(view)
                    body = buf if length == len(buf) else bytearray(view)
                    extra = self._checksum(view, algo)
                except BaseException:
                    self.pool.release(buf)
                    raise
                futures.append((executor.submit(self._send_part, key, upload_id, number, buf, body, extra), buf))
            parts = [f.result() for f, _ in futures]  # the first failure raises here
            digest = hasher.hexdigest()
            composite = _composite(algo, parts)
            try:
                self._call("complete_multipart_upload", f"complete upload {where}", Bucket=self.bucket, Key=key,
                           UploadId=upload_id, MultipartUpload={"Parts": parts})
            except _client_error() as e:
                # A retry after a lost answer finds the upload gone because it did complete: the
                # object is there (and the read-back that follows is what vouches for it).
                head = self._head(key) if _is_not_found(e) else None
                if head is None or int(head["ContentLength"]) != entry.size:
                    raise self._fail(e, f"complete upload {where}") from e
            completed = True
            self._remember(key, _Sent(algo, composite, digest, "part", part))
            return digest
        except _LocalChanged:
            return hasher.hexdigest()  # shorter than the manifest says: changed, never stored
        finally:
            os.close(fd)
            for f, buf in futures:
                if f.cancel():
                    self.pool.release(buf)  # never started: its buffer is still ours
                else:
                    f.exception()  # wait: a running part gives its buffer back when it ends
            if not completed:
                self._abort(key, upload_id)

    def _send_part(self, key: str, upload_id: str, number: int, buf: bytearray, body: bytes | bytearray,
                   extra: dict[str, str]) -> dict[str, Any]:
        what = f"upload part {number} of {self._where(key)}"
        try:
            r = self._call("upload_part", what, Bucket=self.bucket, Key=key, UploadId=upload_id,
                           PartNumber=number, Body=body, **extra)
        except _client_error() as e:
            raise self._fail(e, what) from e
        finally:
            self.pool.release(buf)
        return {"PartNumber": number, "ETag": r["ETag"], **extra}

    def _remember(self, key: str, sent: _Sent | None) -> None:
        with self._lock:
            if sent is not None and sent.algo and sent.stored:
                self._sent[key] = sent
            else:
                self._sent.pop(key, None)

    def attest(self, run: str, step: int, relpath: str, size: int) -> str | None:
        """"s3-sha256" / "s3-crc32" when the object this destination just uploaded is stored with the
        checksum sent with it (checked by the store as the bytes arrived) and the right size, from a
        store that has earned it; "read-back" when it was read back in full all the same and found as
        sent (see safepoint.destinations.attestation); None: read it back."""
        key = self._key(run, step, relpath)
        with self._lock:
            sent = self._sent.pop(key, None)
        if sent is None or not self._store_checks(sent.algo, sent.kind, sent.body):
            return None
        head = self._head(key, ChecksumMode="ENABLED")
        if head is None or int(head["ContentLength"]) != size or head.get(_FIELD[sent.algo]) != sent.stored:
            return None
        with attestation.lock:
            trust = self._trust(sent.algo)
            check = trust.audit_next()
        if not check:
            return f"s3-{sent.algo.lower()}"
        found = self.digest(run, step, relpath)
        with attestation.lock:
            if found == sent.blake3:
                trust.confirmed += size
            else:
                trust.lax = True
        if found == sent.blake3:
            return "read-back"
        log.warning("%s attested its %s checksum of %s but holds other bytes: nothing it attests is taken "
                    "again by this process", self.url, sent.algo, self._where(key))
        return None

    def _trust(self, algo: str) -> attestation.StoreTrust:
        """What this process knows of this store for `algo` (call with attestation.lock held)."""
        return attestation.store((str(self.client.meta.endpoint_url), self.bucket, algo), self.tuning.part_size)

    def _store_checks(self, algo: str, kind: str, body: int) -> bool:
        """Whether this store refuses a wrong `algo` checksum on a `kind` request of `body` bytes.

        A store that kept whatever checksum it was sent, unchecked, would make attest() vouch for
        bytes nobody compared; this asks it to take a wrong one, as a request like the one that
        goes next (attestation.probe_size), and only a refusal counts. A store that gave no answer
        (a 503, a reset) is read back this time and asked again next time.
        """
        with attestation.lock:  # held while asking: the files uploaded in parallel wait for one answer
            trust = self._trust(algo)
            if trust.needs_probe(kind, body):
                size = attestation.probe_size(body, self.tuning.part_size)
                answer = self._ask_store(algo, kind, size)
                if answer is None:
                    return False
                if answer:
                    trust.refused[kind] = max(trust.refused.get(kind, 0), size)
                else:
                    trust.lax = True
            return not trust.lax

    def _ask_store(self, algo: str, kind: str, size: int) -> bool | None:
        """Send random bytes of `size` as a PUT or a part (`kind`) under a random key, with a wrong checksum."""
        key = "/".join(p for p in (self.prefix, secrets.token_hex(8)) if p)
        body = os.urandom(size)
        right = _RAW[algo](body)
        wrong = {_FIELD[algo]: base64.b64encode(bytes([right[0] ^ 1]) + right[1:]).decode()}
        # Plain client calls: Safepoint's retries would resend a refused checksum as damage in flight.
        if kind == "put":
            checks = self._refuses(lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=body, **wrong),
                                   key)
        else:
            upload_id = None
            try:
                upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=key,
                                                                ChecksumAlgorithm=algo)["UploadId"]
                checks = self._refuses(lambda: self.client.upload_part(
                    Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=body, **wrong), None)
            except Exception as e:  # noqa: BLE001 - a store that cannot even say: read back
                log.info("%s: could not ask whether it checks %s on parts: %s", self.url, algo, retry.describe(e))
                checks = None if retry.is_retryable(e) else False
            finally:
                if upload_id is not None:
                    self._abort(key, upload_id)
        if checks is None:
            log.info("%s gave no answer on whether it checks %s: read back, and asked again later", self.url, algo)
        elif not checks:  # a warning where the checksum was asked for; "auto" just reads back
            log.log(logging.INFO if self.tuning.checksum == "AUTO" else logging.WARNING,
                    "%s does not refuse a wrong %s checksum on a %d-byte %s: its replicas are read back, "
                    "not attested", self.url, algo, size, "part" if kind == "part" else "PUT")
        return checks

    def _refuses(self, call: Callable[[], Any], created: str | None) -> bool | None:
        """True: the store refused the call's wrong checksum; False: it took it (or cannot take a
        checksum at all); None: no answer (an error worth another try)."""
        try:
            call()
        except _client_error() as e:
            if _code(e) in REFUSED:
                return True
            return None if retry.is_retryable(e) else False
        except Exception as e:  # noqa: BLE001 - no answer is no refusal
            return None if retry.is_retryable(e) else False
        if created is not None:  # accepted: it kept an object we never wanted
            try:
                self.client.delete_object(Bucket=self.bucket, Key=created)
            except Exception as e:  # noqa: BLE001
                log.warning("could not delete probe object %s: %s", self._where(created), retry.describe(e))
        return False

    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self._call("abort_multipart_upload", f"abort upload {self._where(key)}", Bucket=self.bucket, Key=key,
                       UploadId=upload_id)
        except Exception as e:  # noqa: BLE001 - best effort; the next run's cleanup aborts it too
            if not _is_not_found(e):
                log.warning("could not abort upload of %s: %s", self._where(key), retry.describe(e))

    def digest(self, run: str, step: int, relpath: str) -> str:
        """Read the object back (parallel ranged GETs of one version) and BLAKE3 it in order."""
        return self._read_back(self._key(run, step, relpath), None, self.pool)

    def fetch(self, run: str, step: int, relpath: str, target: Path,
              on_bytes: Callable[[int], None] | None = None, *, size: int | None = None) -> str:
        """The read-back of `digest`, each part also written to `target` at its offset (direct I/O where
        the disk allows: the parts come from a page-aligned pool) and fsynced before returning.
        `size` is checked against the one HEAD that pins the version (no second round trip)."""
        with FileWriter(target) as out:
            def sink(offset: int, view: memoryview) -> None:
                out.write_at(offset, view)  # OSError (a full disk) is the caller's: not a network fault
                if on_bytes is not None:
                    on_bytes(len(view))

            digest = self._read_back(self._key(run, step, relpath), sink, self._read_pool, size)
            out.sync()
        return digest

    @property
    def _read_pool(self) -> BufferPool:
        """Page-aligned part buffers for restores, made on first use (a destination restores or replicates)."""
        with self._lock:
            if self._fetch_pool is None:
                self._fetch_pool = BufferPool(self.tuning.max_parts_in_flight, self.tuning.part_size, aligned=True)
            return self._fetch_pool

    def _read_back(self, key: str, sink: Callable[[int, memoryview], None] | None, pool: BufferPool,
                   expect_size: int | None = None) -> str:
        """Parallel ranged GETs of one version into pooled buffers, BLAKE3 in order.

        Each part is received, handed to `sink(offset, bytes)` (written at its offset) and hashed by
        the worker thread that fetched it, each after the part before it (BLAKE3 is sequential here).
        `read_window` bounds the GETs in flight; a part that waits for its turn to be hashed holds
        only its buffer, so the next GET starts as soon as one finishes (not when the oldest part
        has been hashed). Memory stays within the pool.
        """
        head = self._head(key)
        check_size(None if head is None else int(head["ContentLength"]), expect_size, self._where(key))
        assert head is not None
        size, etag = int(head["ContentLength"]), head.get("ETag")
        hasher = new_hasher(0)
        if size == 0:
            return hasher.hexdigest()
        gets = threading.Semaphore(max(1, self.tuning.read_window))
        failed = threading.Event()
        executor = self._pool_executor()
        parts: list[tuple[Future, bytearray, threading.Event]] = []
        before: threading.Event | None = None

        def part(offset: int, length: int, buf: bytearray, after: threading.Event | None,
                 hashed: threading.Event) -> None:
            try:
                try:
                    view = memoryview(buf)[:self._get_range(key, etag, offset, length, buf)]
                finally:
                    gets.release()
                if sink is not None:
                    sink(offset, view)  # a local disk's OSError passes through: it is not the store's
                if after is not None:
                    after.wait()
                if not failed.is_set():
                    hasher.update(view)
            except BaseException:
                failed.set()
                raise
            finally:
                hashed.set()
                pool.release(buf)

        try:
            for offset in range(0, size, pool.size):
                if failed.is_set():
                    break
                # Blocking is safe (see BufferPool): the buffers in use belong to parts that finish
                # and give them back without this thread.
                buf = pool.acquire()
                gets.acquire()
                hashed = threading.Event()
                fut = executor.submit(part, offset, min(pool.size, size - offset), buf, before, hashed)
                parts.append((fut, buf, hashed))
                before = hashed
            for fut, _buf, _hashed in parts:
                fut.result()
        except BaseException:
            failed.set()
            for fut, buf, hashed in parts:  # wait for the parts that started; free those that never did
                if fut.cancel():
                    pool.release(buf)
                    hashed.set()  # a running successor waits for it
            for fut, _buf, _hashed in parts:
                if not fut.cancelled():
                    fut.exception()
            raise
        return hasher.hexdigest()

    def _get_range(self, key: str, etag: str | None, offset: int, length: int, buf: bytearray) -> int:
        """GET bytes [offset, offset+length) into buf; a short or cut body is retried."""
        what = f"GET {self._where(key)} bytes {offset}-{offset + length - 1}"
        view = memoryview(buf)[:length]

        def fetch() -> int:
            params: dict[str, Any] = {"Bucket": self.bucket, "Key": key,
                                      "Range": f"bytes={offset}-{offset + length - 1}"}
            if etag:
                params["IfMatch"] = etag  # the same version as the HEAD: an ETag used as a version pin only
            r = self.client.get_object(**params)
            body = r["Body"]
            readinto = _direct_readinto(body)
            got = 0
            try:
                while got < length:
                    n = readinto(view[got:])
                    if not n:
                        break
                    got += n
            finally:
                body.close()
            if got != length:
                raise retry.ShortRead(f"{what}: got {got} bytes")
            return got

        try:
            got = retry.call(fetch, self.tuning.retry, what)
        except _client_error() as e:
            if _is_not_found(e):
                raise FileNotFoundError(self._where(key)) from None
            raise self._fail(e, what) from e
        return got

    def read_control(self, run: str, step: int, name: str) -> bytes | None:
        key = self._key(run, step, name)
        what = f"GET {self._where(key)}"

        def fetch() -> bytes:
            r = self.client.get_object(Bucket=self.bucket, Key=key)
            body = r["Body"]
            try:
                data = body.read(MAX_MANIFEST_BYTES + 1)
                if len(data) <= MAX_MANIFEST_BYTES:
                    body.read()  # checks the announced length: a cut body raises, and is retried
            finally:
                body.close()
            return data

        try:
            return retry.call(fetch, self.tuning.retry, what)
        except _client_error() as e:
            if _is_not_found(e):
                return None
            raise self._fail(e, what) from e

    def write_control(self, run: str, step: int, name: str, data: bytes, *, exclusive: bool = False) -> bool:
        """PUT a control file; `exclusive` uses If-None-Match: * (False when it already exists)."""
        if name == MANIFEST_NAME:
            self.abort_uploads(run, step)  # leftovers go before anything is committed
        key = self._key(run, step, name)
        what = f"PUT {self._where(key)}"
        params: dict[str, Any] = {
            "Bucket": self.bucket, "Key": key, "Body": data,
            "ContentMD5": base64.b64encode(hashlib.md5(data).digest()).decode(),  # integrity in flight
            **self._settings.extra_put,
        }
        if exclusive:
            params["IfNoneMatch"] = "*"
        try:
            self._call("put_object", what, **params)
        except _client_error() as e:
            status, code = retry.http_status(e), _code(e)
            if exclusive and (status == 412 or code == "PreconditionFailed"):
                return False
            if exclusive and (status == 501 or code == "NotImplemented"):
                # A store without conditional writes: the best we can do is look first.
                if self.read_control(run, step, name) is not None:
                    return False
                params.pop("IfNoneMatch")
                try:
                    self._call("put_object", what, **params)
                except _client_error() as e2:
                    raise self._fail(e2, what) from e2
                return True
            raise self._fail(e, what) from e
        return True

    def delete_files(self, run: str, step: int, relpaths: list[str]) -> None:
        keys = [self._key(run, step, p) for p in relpaths]
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            what = f"delete {len(batch)} objects under {self._where(self._key(run, step))}"
            try:
                r = self._call("delete_objects", what, Bucket=self.bucket,
                               Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            except _client_error() as e:
                raise self._fail(e, what) from e
            errors = [err for err in r.get("Errors", []) if err.get("Code") not in NOT_FOUND]
            if errors:
                first = errors[0]
                raise DestinationError(redact(f"{what}: {len(errors)} failed, e.g. {first.get('Key')}: "
                                              f"{first.get('Code')} {first.get('Message', '')}"))

    def delete_control(self, run: str, step: int, name: str) -> None:
        key = self._key(run, step, name)
        try:
            self._call("delete_object", f"DELETE {self._where(key)}", Bucket=self.bucket, Key=key)
        except _client_error() as e:
            if not _is_not_found(e):
                raise self._fail(e, f"DELETE {self._where(key)}") from e

    def delete_snapshot(self, run: str, step: int, relpaths: list[str]) -> None:
        super().delete_snapshot(run, step, relpaths)
        self.abort_uploads(run, step)

    def listing(self, run: str | None = None, step: int | None = None) -> dict[tuple[str, int], SnapshotListing]:
        base = f"{self.prefix}/" if self.prefix else ""
        prefix = base + "".join(f"{x}/" for x in (run, None if step is None else str(step)) if x is not None)
        what = f"list {self._where(prefix)}"

        def objects() -> list[tuple[str, StoredObject | None, float | None]]:
            from safepoint.destinations.fsspec_dest import info_mtime  # fsspec: not on a restore's path

            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            return [(o["Key"][len(base):], StoredObject(int(o.get("Size") or 0), info_mtime(o)), None)
                    for page in pages for o in page.get("Contents", []) or []]

        try:
            return group_listing(retry.call(objects, self.tuning.retry, what))
        except _client_error() as e:
            raise self._fail(e, what) from e

    def committed_snapshots(self) -> list[tuple[str, int]]:
        base = f"{self.prefix}/" if self.prefix else ""
        out = []
        for run_prefix in self._common_prefixes(base):
            run = run_prefix[len(base):].rstrip("/")
            try:
                check_run(run)
            except FormatError:
                continue
            for step_prefix in self._common_prefixes(run_prefix):
                step = step_prefix[len(run_prefix):].rstrip("/")
                if step.isdigit() and str(int(step)) == step and self.size(run, int(step), MARKER_NAME) is not None:
                    out.append((run, int(step)))
        return sorted(out)

    def _common_prefixes(self, prefix: str) -> list[str]:
        what = f"list {self._where(prefix)}"

        def listing() -> list[str]:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix, Delimiter="/")
            return [cp["Prefix"] for page in pages for cp in page.get("CommonPrefixes", [])]

        try:
            return retry.call(listing, self.tuning.retry, what)
        except _client_error() as e:
            raise self._fail(e, what) from e

    # -- multipart hygiene -------------------------------------------------------------------------
    def pending_uploads(self, run: str | None = None, step: int | None = None) -> list[tuple[str, str]]:
        """(key, upload id) of unfinished multipart uploads under the base, or under one snapshot."""
        prefix = self._key(run, step) + "/" if run is not None and step is not None else \
            (f"{self.prefix}/" if self.prefix else "")
        return self._list_uploads(prefix)

    def _list_uploads(self, prefix: str, *, older_than_s: float | None = None) -> list[tuple[str, str]]:
        what = f"list multipart uploads under {self._where(prefix)}"

        def listing() -> list[tuple[str, str]]:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix)
            return [(u["Key"], u["UploadId"]) for page in pages for u in page.get("Uploads", []) or []
                    if older_than_s is None or _age_s(u.get("Initiated")) >= older_than_s]

        try:
            return retry.call(listing, self.tuning.retry, what)
        except _client_error() as e:
            raise self._fail(e, what) from e

    def abort_stale_uploads(self, older_than_s: float) -> int:
        """Abort unfinished multipart uploads anywhere under the base started more than `older_than_s`
        ago (reconcile's sweep; younger ones may belong to an upload in flight)."""
        found = self._list_uploads(f"{self.prefix}/" if self.prefix else "", older_than_s=older_than_s)
        for key, upload_id in found:
            self._abort(key, upload_id)
        return len(found)

    def abort_uploads(self, run: str, step: int) -> int:
        """Abort every unfinished multipart upload under the snapshot; returns how many."""
        return self._abort_uploads(self._key(run, step) + "/", exact=False)

    def _abort_uploads(self, prefix: str, *, exact: bool) -> int:
        found = [(k, u) for k, u in self._list_uploads(prefix) if not exact or k == prefix]
        for key, upload_id in found:
            self._abort(key, upload_id)
        if found:
            log.info("aborted %d unfinished multipart upload(s) under %s", len(found), self._where(prefix))
        return len(found)


@dataclass(frozen=True)
class _Sent:
    """What one upload sent: the checksum algorithm and the stored checksum it implies, the BLAKE3
    of the bytes, and the kind and size of its requests (what a probe must look like)."""

    algo: str | None
    stored: str | None
    blake3: str
    kind: str
    body: int


#: the additional checksums Safepoint sends (`checksum` option): request field, and the raw digest
_FIELD = {"SHA256": "ChecksumSHA256", "CRC32": "ChecksumCRC32"}
_RAW: dict[str, Callable[[Any], bytes]] = {
    "SHA256": lambda data: hashlib.sha256(data).digest(),
    "CRC32": lambda data: zlib.crc32(data).to_bytes(4, "big"),
}


def _composite(algo: str | None, parts: list[dict[str, Any]]) -> str | None:
    """The checksum S3 stores for a multipart object (composite): the checksum of the parts' raw checksums, "-N"."""
    if algo is None or not parts or not all(p.get(_FIELD[algo]) for p in parts):
        return None
    joined = b"".join(base64.b64decode(p[_FIELD[algo]]) for p in parts)
    return f"{base64.b64encode(_RAW[algo](joined)).decode()}-{len(parts)}"


def _age_s(initiated: Any) -> float:
    """Seconds since a multipart upload's `Initiated` time (0 when unknown: treated as young)."""
    from datetime import datetime, timezone

    if not isinstance(initiated, datetime):
        return 0.0
    if initiated.tzinfo is None:
        initiated = initiated.replace(tzinfo=timezone.utc)
    return (datetime.now(timezone.utc) - initiated).total_seconds()
