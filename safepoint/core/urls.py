"""Local paths in URLs, parsed in one place: `file://` (and `local://`) URLs to paths and back.

A file URL's path is percent-encoded (RFC 8089): `file:///a%20b` is the folder `/a b`. Safepoint
has always read `file://rel/x` as the relative path `rel/x` (not host `rel`), and keeps doing so;
`file://localhost/x` is `/x`. A plain path (no scheme) is a local path too.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote, unquote

__all__ = ["LOCAL_SCHEMES", "local_path", "path_url", "scheme_of"]

LOCAL_SCHEMES = frozenset({"file", "local"})
#: what a path segment may hold unencoded (RFC 3986 pchar, and "/"): the rest is percent-encoded
_SAFE = "/:@!$&'()*+,;=-._~"


def scheme_of(url: str) -> str:
    """The URL's scheme, lower case; `file` for a plain path (`block:NAME/...` names a Prefect block)."""
    if url.startswith("block:"):
        return "block"
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep else "file"


def local_path(url: str | os.PathLike) -> Path | None:
    """The local path `url` names (a file:// or local:// URL, or a plain path); None for any other URL."""
    url = os.fspath(url)
    if url.startswith("block:"):
        return None
    if "://" not in url:
        return Path(unquote(url[len("file:"):])) if url.lower().startswith("file:") else Path(url)
    if scheme_of(url) not in LOCAL_SCHEMES:
        return None
    rest = url.partition("://")[2]
    host, slash, path = rest.partition("/")
    if host in ("", "localhost"):
        return Path("/" + unquote(path))
    return Path(unquote(rest))


def path_url(path: str | os.PathLike) -> str:
    """The file:// URL of `path`, made absolute and percent-encoded (the inverse of local_path)."""
    return "file://" + quote(os.path.abspath(path), safe=_SAFE)
