"""Remove credentials from text before it is stored or logged.

The catalog outlives processes and is read by people and dashboards, so nothing that can open a
bucket may reach it: URL userinfo (``s3://KEY:SECRET@host``), query and fragment parameters whose
name says secret (``?password=``, ``&X-Amz-Signature=``, ``#access_token=``, ``sslpassword``:
`is_secret_param`), and ``secret=value`` style pairs (``aws_secret_access_key``, ``token=...``,
JSON keys such as ``"SecretAccessKey": "..."``, quoted values with spaces, and
``aws_secret_access_key VALUE``) are replaced. Idempotent.
"""

from __future__ import annotations

import re

__all__ = ["redact", "redact_url", "split_userinfo", "without_secrets", "is_secret_param", "MASK"]

MASK = "***"

# scheme://userinfo@ -> scheme://. Either "user@" (no '/'), or "user:password@" where the password
# may hold a raw '/' or '+' (unescaped AWS secrets do): leaking a secret is worse than mangling the
# rare URL that has both a port and an '@' in its path.
_USERINFO_RE = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^\s/@?#:]*:[^\s@]*@|[^\s/@?#:]+@)"
)

_SECRET_KEYS = (
    r"(?:aws[_-]?)?secret[_-]?access[_-]?key|(?:aws[_-]?)?session[_-]?token|secret[_-]?key"
    r"|access[_-]?token|refresh[_-]?token|token|password|passwd|pwd|api[_-]?key|apikey"
    r"|client[_-]?secret|secret|x-amz-signature|x-amz-security-token|x-amz-credential|signature|sig"
)
# Keys so specific that a bare space may separate them from the value (`aws configure set
# aws_secret_access_key VALUE`, config files without '=').
_SPACED_KEYS = r"(?:aws[_-]?)?secret[_-]?access[_-]?key|aws[_-]?session[_-]?token"
# A value: quoted (spaces and escaped quotes included, up to the closing quote or the end of the
# line when it is cut off), or bare up to a delimiter.
_VALUE = r"""(?:(?P<q>["'])(?P<qval>(?:\\.|(?!(?P=q))[^\\\n])*)(?P=q)?|(?P<val>[^\s"'&,;}\])]+))"""
# key = value, key: value, "key": "value", key=value in query strings, and the spaced keys with a
# bare space. The key must not be the tail of a longer alphanumeric word ("max_tokens" is fine,
# "tokens" is not a key); in JSON the key's closing quote sits between key and separator.
_PAIR_RE = re.compile(
    rf"(?i)(?<![A-Za-z0-9])(?P<key>{_SECRET_KEYS})(?P<sep>[\"']?\s*[:=]\s*){_VALUE}"
    rf"|(?<![A-Za-z0-9])(?P<skey>{_SPACED_KEYS})(?P<ssep>[\"']?[ \t]+){_VALUE.replace('?P<', '?P<s')}"
)
# A URL parameter (query, fragment or ';' parameters): the name is judged by is_secret_param.
_PARAM_RE = re.compile(r"(?P<lead>[?&#;])(?P<name>[^=&#;?\s\"'<>]+)=(?P<val>[^&#;\s\"'<>]*)")
# Parameter names (lowercase, letters and digits only) that hold a secret wherever they appear in
# the name (`sslpassword`, `X-Goog-Signature`, `SharedAccessSignature`, `aws_access_key_id`), and
# short ones that are secrets only as the whole name (Azure SAS's `sig`, an API's `key`).
_SECRET_PARTS = ("password", "passwd", "pwd", "passphrase", "secret", "token", "signature", "credential",
                 "apikey", "accesskey", "privatekey", "sessionkey", "clientkey", "authorization", "auth")
_SECRET_NAMES = frozenset({"sig", "key", "pass", "sas", "code", "jwt", "otp", "hmac"})
# ... except these, which only name how to authenticate (MongoDB's authSource, authMechanism).
_NOT_SECRET = frozenset({"authsource", "authmechanism", "authmechanismproperties"})
_BEARER_RE = re.compile(r"(?i)\b(?P<key>bearer|basic)\s+(?P<val>[A-Za-z0-9._~+/=\-]{8,})")


def is_secret_param(name: str) -> bool:
    """Whether a URL parameter called `name` carries a secret (its value is never shown). Pure."""
    from urllib.parse import unquote_plus

    n = re.sub(r"[^a-z0-9]", "", unquote_plus(name).lower())
    return n not in _NOT_SECRET and (n in _SECRET_NAMES or any(part in n for part in _SECRET_PARTS))


def _mask_param(m: re.Match[str]) -> str:
    return f"{m.group('lead')}{m.group('name')}={MASK}" if is_secret_param(m.group("name")) else m.group(0)


def without_secrets(url: str) -> str:
    """`url` without its userinfo and without the query and fragment parameters that carry a secret
    (the others stay, as written: `options=-csearch_path%3Dx` is no secret and worth seeing). Pure."""
    clean = split_userinfo(url)[0]
    base, hashmark, fragment = clean.partition("#")
    path, qmark, query = base.partition("?")

    def kept(part: str) -> str:
        return "&".join(p for p in part.split("&") if not is_secret_param(p.partition("=")[0]))

    query, fragment = kept(query), kept(fragment)
    return path + (f"?{query}" if query else "") + (f"#{fragment}" if fragment else "")


def _mask_pair(m: re.Match[str]) -> str:
    spaced = m.group("skey") is not None
    g = (lambda n: m.group("s" + n)) if spaced else m.group
    key, sep = (m.group("skey"), m.group("ssep")) if spaced else (m.group("key"), m.group("sep"))
    q = g("q")
    return key + sep + (q + MASK + q if q else MASK)


def redact(text: str | None) -> str | None:
    """Return `text` with URL credentials and secret-looking key/value pairs masked."""
    if text is None:
        return None
    if not isinstance(text, str):
        text = str(text)
    out = _USERINFO_RE.sub(lambda m: m.group("scheme"), text)
    out = _PAIR_RE.sub(_mask_pair, out)
    out = _PARAM_RE.sub(_mask_param, out)
    out = _BEARER_RE.sub(lambda m: m.group("key") + " " + MASK, out)
    return out


def redact_url(url: str) -> str:
    """A URL fit for storage: credentials removed, trailing slashes dropped (``file:///`` kept)."""
    out = redact(url) or ""
    stripped = out.rstrip("/")
    if stripped.endswith(":") or stripped.endswith(":/") or not stripped:
        return out
    return stripped


def split_userinfo(url: str) -> tuple[str, str | None, str | None]:
    """(url without userinfo, user, password), both unquoted; (url, None, None) when there is none.

    The same reading as `redact`: a password may hold a raw '/' or '+' (unescaped AWS secrets).
    """
    from urllib.parse import unquote

    m = _USERINFO_RE.match(url)
    if m is None:
        return url, None, None
    info = m.group("userinfo")[:-1]
    user, sep, password = info.partition(":")
    return m.group("scheme") + url[m.end():], unquote(user), unquote(password) if sep else None
