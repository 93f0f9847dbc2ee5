"""Credentials by reference: a URL that holds a secret never leaves this host in clear.

Prefect stores a flow run's parameters, and an event's payload, in its database, and its UI and
API show them. So before a URL with userinfo (`s3://KEY:SECRET@bucket/p`,
`postgresql://u:PASSWORD@host/db`) or a secret in its query or fragment (`?password=...`,
`&X-Amz-Signature=...`, `#access_token=...`: safepoint.core.redact.is_secret_param) becomes a
parameter or a payload, `hide_credentials` writes it to a file of its own under `$SAFEPOINT_HOME/credentials/`
(mode 0600, folder 0700) and returns the URL with the userinfo replaced by a reference and those
parameters left out: `s3://safepoint-ref-<id>@bucket/p`. The other parameters stay, as written, so
the sealed URL still says what it points at (`?options=-csearch_path%3Dexp`). `redact` strips that
like any userinfo, so the catalog and logs hold `s3://bucket/p`; `reveal_credentials`, in the process that
runs the flow, reads the URL back. The id is a keyed hash (the key is a random file beside the
references), so sealing the same URL twice gives the same reference and the id reveals nothing.

A flow run on another host cannot read the reference: give its worker the credentials in its
environment, or use a Prefect block (`block:NAME/prefix`, safepoint.flows.credentials).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

from safepoint.core.errors import UsageError
from safepoint.core.naming import credentials_dir
from safepoint.core.redact import redact_url, split_userinfo, without_secrets
from safepoint.local.atomic import write_exclusive, write_replace

__all__ = ["REF_PREFIX", "hide_credentials", "hides_credentials", "reveal_credentials"]

REF_PREFIX = "safepoint-ref-"
_REF_RE = re.compile(rf"^{REF_PREFIX}([0-9a-f]{{32}})$")


def _folder() -> Path:
    d = credentials_dir()
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    return d


def _key(folder: Path) -> bytes:
    path = folder / ".key"
    if not path.is_file():
        write_exclusive(path, secrets.token_bytes(32), mode=0o600)  # of two racing makers, one wins
    return path.read_bytes()


def hide_credentials(url: str | None) -> str | None:
    """`url` stored here, and returned with its userinfo replaced by a reference and its secret
    parameters left out; unchanged when it has neither (or is sealed already)."""
    if not url or "://" not in url or hides_credentials(url):
        return url
    clean = without_secrets(url)
    if split_userinfo(url)[1] is None and clean == url:
        return url
    folder = _folder()
    ref = hmac.new(_key(folder), url.encode(), hashlib.sha256).hexdigest()[:32]
    path = folder / ref
    if not path.is_file() or path.read_text() != url:
        write_replace(path, url.encode(), mode=0o600)
    scheme, _, rest = clean.partition("://")
    return f"{scheme}://{REF_PREFIX}{ref}@{rest}"


def hides_credentials(url: str | None) -> bool:
    if not url:
        return False
    _clean, user, password = split_userinfo(url)
    return user is not None and password is None and _REF_RE.match(user) is not None


def reveal_credentials(url: str | None) -> str | None:
    """The URL a reference stands for (other URLs unchanged); UsageError when this host lacks it."""
    if not hides_credentials(url):
        return url
    _clean, user, _ = split_userinfo(url or "")
    path = credentials_dir() / _REF_RE.match(user or "").group(1)  # type: ignore[union-attr]
    try:
        return path.read_text()
    except FileNotFoundError:
        raise UsageError(f"{redact_url(url or '')}: its credentials were sealed on another host or SAFEPOINT_HOME "
                         f"({path} is missing): give this process the credentials in its environment, or use "
                         "a Prefect block (block:NAME/prefix)") from None
