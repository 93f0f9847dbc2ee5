"""Bounded retries for object-store calls: which failures are worth another try, and how long to wait.

Object stores answer 503 SlowDown under load, drop connections, cut bodies short and stall. Those
are retried with capped exponential backoff and full jitter; everything else (access denied, no
such bucket, a precondition that failed) is final and surfaces at once. A call that keeps failing
ends as one `DestinationError` whose message names the operation and the last error, redacted.

Each backend classifies its own failures: `is_retryable` reads botocore's errors (S3), `is_transient`
the errno, timeout or HTTP status of a file or fsspec call (a dropped NFS handle, a reset
connection, a 503). A refusal (EACCES, NoSuchBucket), a missing path, a full disk or EIO is final:
a local read error (EIO from the snapshot's disk) is never retried here, it is the caller's business.
The layer that applies them to every destination is safepoint.destinations.retrying.
"""

from __future__ import annotations

import errno
import http.client
import logging
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from safepoint.core.errors import DestinationError
from safepoint.core.redact import redact

log = logging.getLogger(__name__)

T = TypeVar("T")

#: S3 error codes that mean "try again later" (throttling, transient server trouble, a body that
#: arrived damaged or incomplete, a conditional write that raced another one).
RETRYABLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "TooManyRequestsException", "ServiceUnavailable", "InternalError", "InternalServerError",
    "RequestTimeout", "RequestTimeoutException", "BadDigest", "IncompleteBody",
    "XAmzContentSHA256Mismatch", "ConditionalRequestConflict", "OperationAborted",
    "500", "502", "503", "504",
})
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """At most `attempts` tries; waits grow as base * 2**n, capped, with full jitter."""

    attempts: int = 8
    base_s: float = 0.2
    cap_s: float = 10.0

    def delay(self, failures: int, rand: Callable[[], float] = random.random) -> float:
        """Seconds to wait after the `failures`-th failure (1-based): uniform in [0, min(cap, base*2**(n-1))]."""
        return rand() * min(self.cap_s, self.base_s * (2 ** max(0, failures - 1)))


def error_code(exc: BaseException) -> str | None:
    """The S3 error code of a botocore ClientError, else None."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return str(code) if code is not None else None
    return None


def http_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(status) if status is not None else None
    return None


def is_retryable(exc: BaseException) -> bool:
    """Pure classification: is another try of the same call reasonable?"""
    from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError, ResponseStreamingError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(exc, ClientError):
        return error_code(exc) in RETRYABLE_CODES or http_status(exc) in RETRYABLE_STATUS
    if isinstance(exc, (BotoConnectionError, HTTPClientError, IncompleteReadError, ResponseStreamingError)):
        return True  # resets, timeouts, truncated bodies (botocore's own wrappers)
    try:
        from urllib3.exceptions import HTTPError as Urllib3Error
    except ImportError:  # pragma: no cover - urllib3 ships with botocore
        Urllib3Error = ()  # type: ignore[assignment]  # noqa: N806
    if isinstance(exc, (ConnectionError, TimeoutError, socket.timeout, Urllib3Error, http.client.HTTPException)):
        return True
    return isinstance(exc, ShortRead)


#: errnos of a file or fsspec call worth another try: the network or a server's, never the data's
TRANSIENT_ERRNOS = frozenset({
    errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE,
    errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.ENETRESET, errno.ESTALE,
})


def is_transient(exc: BaseException) -> bool:
    """Pure classification for file and fsspec destinations: is another try of the same call reasonable?"""
    if isinstance(exc, (ConnectionError, TimeoutError, http.client.HTTPException, ShortRead)):
        return True
    if isinstance(exc, OSError):
        return exc.errno in TRANSIENT_ERRNOS
    status = next((v for v in (getattr(exc, a, None) for a in ("status", "status_code", "code"))
                   if isinstance(v, int)), None)
    return status in RETRYABLE_STATUS


class ShortRead(Exception):
    """A response body ended before the length the server announced (a truncated GET)."""


def describe(exc: BaseException) -> str:
    code = error_code(exc)
    text = str(exc) or type(exc).__name__
    return redact(f"{code}: {text}" if code and code not in text else text) or type(exc).__name__


def call(fn: Callable[[], T], policy: RetryPolicy, what: str, *,
         sleep: Callable[[float], None] = time.sleep,
         transient: Callable[[BaseException], bool] = is_retryable) -> T:
    """Run `fn` until it succeeds, a failure is final (`transient` says no), or the attempts run out
    (then DestinationError)."""
    failures = 0
    while True:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified below
            if not transient(e):
                raise
            failures += 1
            if failures >= policy.attempts:
                raise DestinationError(f"{redact(what)}: gave up after {failures} attempts: {describe(e)}") from e
            wait = policy.delay(failures)
            log.debug("%s failed (%s); retry %d/%d in %.2fs", redact(what), describe(e), failures,
                      policy.attempts - 1, wait)
            sleep(wait)
