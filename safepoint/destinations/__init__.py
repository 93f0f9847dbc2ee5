"""Destinations: where replicas go. `open_destination(url)` picks the backend by scheme and wraps it
in the one retry layer (safepoint.destinations.retrying).

`block://NAME/sub` (given as `block:NAME/sub`) names a destination kept in Prefect: an `S3Bucket`
block with its bucket, folder, keys and endpoint. The catalog records that name, so every later
operation (restore, verify, scrub, reconcile, evict) opens it through the block again, never as a
same-named bucket at the default endpoint. Only the Prefect edge may load a block: it registers
the resolver (`register_resolver`, safepoint.flows.credentials; the CLI does so lazily).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from safepoint.core.errors import UsageError
from safepoint.core.urls import LOCAL_SCHEMES, scheme_of
from safepoint.destinations.base import Destination

__all__ = ["BLOCK_SCHEME", "Destination", "block_url", "is_block_url", "open_destination", "register_resolver"]

BLOCK_SCHEME = "block"

#: scheme -> resolver(url) -> (the plain URL it stands for, storage options with its credentials)
_resolvers: dict[str, Callable[[str], tuple[str, dict[str, Any]]]] = {}


def register_resolver(scheme: str, resolve: Callable[[str], tuple[str, dict[str, Any]]]) -> None:
    _resolvers[scheme] = resolve


def is_block_url(url: str) -> bool:
    return url.startswith(f"{BLOCK_SCHEME}:")


def block_url(ref: str) -> str:
    """`block:NAME/sub/` or `block://NAME/sub` -> `block://NAME/sub`, the form recorded. Pure."""
    rest = ref[len(BLOCK_SCHEME) + 1:].lstrip("/")
    name, _, sub = rest.partition("/")
    if not name:
        raise UsageError(f"{ref!r}: give a block name, e.g. block:my-bucket/ckpt")
    sub = "/".join(p for p in sub.split("/") if p)
    return f"{BLOCK_SCHEME}://{name}" + (f"/{sub}" if sub else "")


def open_destination(url: str, storage_options: dict[str, Any] | None = None, *, retries: bool = True
                     ) -> Destination:
    """The destination at `url`, every call retried while it fails transiently (`retries=False`: the
    bare backend, each call tried once)."""
    backend = _open_block(block_url(url), storage_options) if is_block_url(url) else _backend(url, storage_options)
    if not retries:
        return backend
    from safepoint.destinations.retrying import RetryingDestination

    return RetryingDestination(backend)


#: schemes whose URLs name a place by path alone: a `?` or `#` there is no part of any key or folder
PATH_ONLY = LOCAL_SCHEMES | {"s3", "s3a"}


def check_path_only(url: str) -> str:
    """`url`'s scheme; a UsageError when a file:// or s3:// URL has a query or fragment, which would
    otherwise become part of a key or folder name (`p?password=...`: a secret in the catalog, on
    disk and in errors)."""
    scheme = scheme_of(url)
    if scheme in PATH_ONLY and "://" in url and ("?" in url or "#" in url):
        from safepoint.core.redact import redact_url

        raise UsageError(f"a {scheme}:// destination takes no query or fragment: {redact_url(url)} "
                         "(options and credentials go in the storage config or the URL's userinfo)")
    return scheme


def _backend(url: str, storage_options: dict[str, Any] | None) -> Destination:
    scheme = check_path_only(url)
    if scheme in LOCAL_SCHEMES:
        from safepoint.destinations.local import LocalDestination

        return LocalDestination(url, storage_options)
    if scheme in ("s3", "s3a"):
        from safepoint.destinations.s3 import S3Destination

        return S3Destination(url, storage_options)
    from safepoint.destinations.fsspec_dest import FsspecDestination

    return FsspecDestination(url, storage_options)


def _open_block(url: str, storage_options: dict[str, Any] | None) -> Destination:
    """The block's own destination, named by the block URL (what snapshot_url and the catalog say)."""
    resolve = _resolvers.get(BLOCK_SCHEME)
    if resolve is None:
        raise UsageError(f"{url}: a Prefect block; it is resolved where Prefect is (the safepoint command, "
                         "or `import safepoint.flows.credentials` first)")
    plain, options = resolve(url)  # the bucket's configured options, the block's credentials over them
    backend = _backend(plain, {**options, **(storage_options or {})})
    backend.url = url  # its snapshot URLs name the block, as the catalog records them
    return backend
