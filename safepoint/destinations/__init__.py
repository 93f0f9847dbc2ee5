"""Destinations: where replicas go. `open_destination(url)` picks the implementation by scheme."""

from __future__ import annotations

from typing import Any

from safepoint.destinations.base import Destination

__all__ = ["Destination", "open_destination"]


def open_destination(url: str, storage_options: dict[str, Any] | None = None) -> Destination:
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    if scheme in ("file", "local"):
        from safepoint.destinations.local import LocalDestination

        if "://" not in url:
            import os

            url = "file://" + os.path.abspath(url)
        return LocalDestination(url, storage_options)
    if scheme in ("s3", "s3a"):
        try:
            from safepoint.destinations.s3 import S3Destination
        except ImportError:  # pragma: no cover - s3 module added separately
            pass
        else:
            return S3Destination(url, storage_options)
    from safepoint.destinations.fsspec_dest import FsspecDestination

    return FsspecDestination(url, storage_options)
