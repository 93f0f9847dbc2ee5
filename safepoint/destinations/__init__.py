"""Destinations: where replicas go. `open_destination(url)` picks the backend by scheme and wraps it
in the one retry layer (safepoint.destinations.retrying)."""

from __future__ import annotations

from typing import Any

from safepoint.core.urls import LOCAL_SCHEMES, scheme_of
from safepoint.destinations.base import Destination

__all__ = ["Destination", "open_destination"]


def open_destination(url: str, storage_options: dict[str, Any] | None = None) -> Destination:
    """The destination at `url`, every call retried while it fails transiently."""
    from safepoint.destinations.retrying import RetryingDestination

    return RetryingDestination(_backend(url, storage_options))


def _backend(url: str, storage_options: dict[str, Any] | None) -> Destination:
    scheme = scheme_of(url)
    if scheme in LOCAL_SCHEMES:
        from safepoint.destinations.local import LocalDestination

        return LocalDestination(url, storage_options)
    if scheme in ("s3", "s3a"):
        from safepoint.destinations.s3 import S3Destination

        return S3Destination(url, storage_options)
    from safepoint.destinations.fsspec_dest import FsspecDestination

    return FsspecDestination(url, storage_options)
