"""Remove credentials from text before it is stored or logged.

The catalog outlives processes and is read by people and dashboards, so nothing that can open a
bucket may reach it: URL userinfo (``s3://KEY:SECRET@host``) and ``secret=value`` style pairs
(``aws_secret_access_key``, ``token=...``, presigned-URL signatures) are replaced. Idempotent.
"""

from __future__ import annotations

import re

__all__ = ["redact", "redact_url", "MASK"]

MASK = "***"

# scheme://userinfo@ -> scheme://. Either "user@" (no '/'), or "user:password@" where the password
# may hold a raw '/' or '+' (unescaped AWS secrets do): leaking a secret is worse than mangling the
# rare URL that has both a port and an '@' in its path.
_USERINFO_RE = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^\s/@?#:]*:[^\s@]*@|[^\s/@?#:]+@)"
)

_SECRET_KEYS = (
    r"aws_secret_access_key|aws_session_token|secret_access_key|secret[_-]?key|session[_-]?token"
    r"|access[_-]?token|refresh[_-]?token|token|password|passwd|pwd|api[_-]?key|apikey"
    r"|client[_-]?secret|secret|x-amz-signature|x-amz-security-token|x-amz-credential|signature|sig"
)
# key = value, key: value, "key": "value", key=value in query strings. The key must not be the tail
# of a longer alphanumeric word ("max_tokens" is fine, "tokens" is not a key).
_PAIR_RE = re.compile(
    rf"(?i)(?<![A-Za-z0-9])(?P<key>{_SECRET_KEYS})(?P<sep>[\"']?\s*[:=]\s*[\"']?)(?P<val>[^\s\"'&,;}}\]\)]+)"
)
_BEARER_RE = re.compile(r"(?i)\b(?P<key>bearer|basic)\s+(?P<val>[A-Za-z0-9._~+/=\-]{8,})")


def redact(text: str | None) -> str | None:
    """Return `text` with URL credentials and secret-looking key/value pairs masked."""
    if text is None:
        return None
    if not isinstance(text, str):
        text = str(text)
    out = _USERINFO_RE.sub(lambda m: m.group("scheme"), text)
    out = _PAIR_RE.sub(lambda m: m.group("key") + m.group("sep") + MASK, out)
    out = _BEARER_RE.sub(lambda m: m.group("key") + " " + MASK, out)
    return out


def redact_url(url: str) -> str:
    """A URL fit for storage: credentials removed, trailing slashes dropped (``file:///`` kept)."""
    out = redact(url) or ""
    stripped = out.rstrip("/")
    if stripped.endswith(":") or stripped.endswith(":/") or not stripped:
        return out
    return stripped
