"""Destinations checked before anything is written: a bad one is one clear error, at once.

An ingest that meets an unusable destination halfway (an unknown scheme, a bucket that does not
exist, no credentials) used to spend its retries, print a traceback and leave the checkpoint in
another state than it found it. `check_destinations` runs first, in the caller's process, and
raises one UsageError (unknown scheme) or DestinationError (the store says no) naming the URL and
the cause in the store's own words: a missing bucket is NoSuchBucket, not AccessDenied.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from safepoint.core.errors import DestinationError, UsageError
from safepoint.core.redact import redact_url
from safepoint.core.urls import scheme_of

__all__ = ["SUPPORTED_SCHEMES", "check_destinations", "scheme_of"]

#: file and S3 (botocore), plus the fsspec object stores whose writes are whole-object puts
SUPPORTED_SCHEMES = frozenset({"file", "local", "s3", "s3a", "memory", "gs", "gcs", "az", "abfs", "abfss",
                               "hdfs", "webhdfs", "block"})


def check_destinations(urls: Iterable[str], storage_options: Any = None) -> None:
    """Raise for the first destination that cannot be used; `storage_options(url)` gives each one's options."""
    urls = list(urls)
    from safepoint.destinations import check_path_only

    for url in urls:  # every scheme first: no network call before a typo is reported
        scheme = check_path_only(url)
        if scheme not in SUPPORTED_SCHEMES:
            raise UsageError(f"{redact_url(url)}: unsupported destination scheme {scheme!r}; use file://, s3:// "
                             f"or one of {', '.join(sorted(SUPPORTED_SCHEMES - {'file', 'local', 's3', 's3a'}))}")
    for url in urls:
        if scheme_of(url) in ("s3", "s3a", "block"):
            _check_bucket(url, storage_options(url) if callable(storage_options) else storage_options)


def _check_bucket(url: str, options: dict[str, Any] | None) -> None:
    """HEAD the bucket once (no retries): it exists and these credentials may reach it.

    Only definite answers fail here (no credentials, 404, 403). A 5xx, throttling or a dropped connection is
    transient: the operation itself runs under the destination's retries and decides.
    """
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    from safepoint.destinations import open_destination
    from safepoint.destinations.retry import error_code, http_status
    from safepoint.destinations.s3 import S3Destination

    dest = open_destination(url, options, retries=False)  # a block: its own bucket, endpoint and keys
    if not isinstance(dest, S3Destination):
        dest.close()
        return
    where = redact_url(url)
    try:
        dest.client.head_bucket(Bucket=dest.bucket)
    except NoCredentialsError:
        raise DestinationError(f"{where}: no S3 credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                               "a profile, or key/secret in the storage options)") from None
    except ClientError as e:
        status, code = http_status(e), error_code(e)
        if status == 404 or code in ("404", "NoSuchBucket", "NotFound"):
            raise DestinationError(f"{where}: NoSuchBucket: bucket {dest.bucket!r} does not exist") from None
        if status == 403 or code in ("403", "AccessDenied", "Forbidden"):
            raise DestinationError(f"{where}: AccessDenied: these credentials may not use bucket "
                                   f"{dest.bucket!r}") from None
    except BotoCoreError:
        pass
    finally:
        dest.close()
