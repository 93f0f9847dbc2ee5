"""Settings of an s3:// destination: fsspec/s3fs storage options in, botocore client settings out.

Credentials and the endpoint come the way the AWS ecosystem expects: `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_ENDPOINT_URL`, `AWS_PROFILE`, `~/.aws/config`,
instance roles. Safepoint's configuration may add s3fs storage options by URL prefix
(`[storage."s3://bucket"]` in config.toml, see safepoint/config.py), with s3fs's names: `key`,
`secret`, `token`, `profile`, `endpoint_url`, `anon`, `client_kwargs` (e.g. `region_name`),
`config_kwargs` (botocore Config: `connect_timeout`, `read_timeout`, ...) and
`s3_additional_kwargs` (extra PutObject parameters, e.g. `ServerSideEncryption`). Secrets belong
in the environment or a profile; whatever their source, they are never logged, stored or put in
an error message.

Safepoint's own tuning keys (removed before the rest goes to s3fs):

- `part_size` (32 MiB): multipart part size and read-back range size; larger files go as
  multipart uploads.
- `max_parts_in_flight` (8): parts being read, hashed, sent or read back at once, per
  destination; memory is bounded by this times `part_size`.
- `read_window` (4): ranged GETs in flight per object during read-back.
- `checksum` (`"auto"`): the checksum sent with every PUT and part, which the server validates as
  the bytes arrive; where the store returns it (HeadObject), it stands for the read-back of the
  replica (S3Destination.attest) once the store has earned it (safepoint.destinations.attestation).
  `"auto"` sends CRC32 to a store seen to refuse a wrong one (a probe like the next request, asked
  again at random) and nothing elsewhere, where every byte is then read back. `"CRC32"`
  or `"SHA256"` always send that one (a store that takes a wrong one unchecked is still read back);
  `"none"` sends nothing and always reads back. SHA-256 costs about 1.3 s of CPU per GiB on each end
  (measured on this project's machines); CRC32 (32 bits: for damage, not for an adversary) about a
  quarter of that, and is what AWS's SDKs send by default since 2025.
- `sign_payload` (false): sign the body's SHA-256 on plain http (a second pass over every byte).
- `retry_attempts` (8), `retry_base_s` (0.2), `retry_cap_s` (10): tries per request before the
  replica fails, and the backoff (base * 2**n, capped, full jitter).
- `connect_timeout` (10), `read_timeout` (60): seconds; a stalled request fails after
  `read_timeout` and is retried (also handed to s3fs through `config_kwargs`).
- `stream_put_max` (0: off): files larger than `part_size` and up to this size go as one PUT
  streamed from the file through one buffer, instead of a multipart upload. SeaweedFS spends
  about 6% less CPU per byte on a plain PUT (measured: 10.5 against 11.2 s/GiB); a failed
  request is resent whole, so keep it moderate (e.g. 128 MiB). Such a PUT carries no checksum: with
  `stream_put_max` set, `checksum` defaults to `"none"` (read back), and an explicit one wins over it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from safepoint.core.errors import UsageError
from safepoint.destinations.retry import RetryPolicy

MiB = 1024 * 1024
MIN_PART = 5 * MiB          # S3's minimum part size (all parts but the last)
MAX_PART = 5 * 1024 * MiB   # S3's maximum part size
MAX_PARTS = 10_000          # S3's maximum number of parts

SAFEPOINT_KEYS = frozenset({
    "part_size", "max_parts_in_flight", "read_window", "checksum", "sign_payload",
    "retry_attempts", "retry_base_s", "retry_cap_s", "connect_timeout", "read_timeout", "stream_put_max",
})


@dataclass(frozen=True)
class Tuning:
    part_size: int = 32 * MiB
    max_parts_in_flight: int = 8
    read_window: int = 4
    checksum: str | None = "AUTO"  # "AUTO", "CRC32", "SHA256" or None (see `checksum` above)
    sign_payload: bool = False
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    stream_put_max: int = 0


@dataclass(frozen=True)
class ClientSettings:
    """What botocore needs: session kwargs (profile), create_client kwargs, Config kwargs."""

    session: dict[str, Any]
    client: dict[str, Any]
    config: dict[str, Any]
    extra_put: dict[str, Any]    # s3_additional_kwargs, for PutObject / CreateMultipartUpload


def split_options(options: dict[str, Any] | None) -> tuple[Tuning, dict[str, Any]]:
    """(Safepoint's tuning, the s3fs storage options). Pure; raises UsageError on bad values."""
    opts = dict(options or {})
    mine = {k: opts.pop(k) for k in list(opts) if k in SAFEPOINT_KEYS}
    try:
        part = int(mine.get("part_size", 32 * MiB))
        tuning = Tuning(
            part_size=part,
            max_parts_in_flight=int(mine.get("max_parts_in_flight", 8)),
            read_window=int(mine.get("read_window", 4)),
            # Streamed PUTs carry no checksum: asking for them (stream_put_max) turns "auto" off.
            checksum=_checksum_option(mine.get("checksum", "none" if int(mine.get("stream_put_max", 0)) else "auto")),
            sign_payload=bool(mine.get("sign_payload", False)),
            retry=RetryPolicy(attempts=int(mine.get("retry_attempts", 8)),
                              base_s=float(mine.get("retry_base_s", 0.2)),
                              cap_s=float(mine.get("retry_cap_s", 10.0))),
            connect_timeout=float(mine.get("connect_timeout", 10.0)),
            read_timeout=float(mine.get("read_timeout", 60.0)),
            stream_put_max=int(mine.get("stream_put_max", 0)),
        )
    except (TypeError, ValueError) as e:
        raise UsageError(f"bad s3 storage option: {e}") from None
    if not MIN_PART <= tuning.part_size <= MAX_PART:
        raise UsageError(f"part_size must be between {MIN_PART} and {MAX_PART} bytes")
    if tuning.max_parts_in_flight < 1 or tuning.read_window < 1 or tuning.retry.attempts < 1:
        raise UsageError("max_parts_in_flight, read_window and retry_attempts must be at least 1")
    if tuning.checksum not in (None, "AUTO", "SHA256", "CRC32"):
        raise UsageError('checksum must be "auto", "CRC32", "SHA256" or "none"')
    # s3fs takes timeouts through botocore's Config only: hand them on for `S3Destination.fs`.
    if "connect_timeout" in mine or "read_timeout" in mine:
        opts["config_kwargs"] = {"connect_timeout": tuning.connect_timeout, "read_timeout": tuning.read_timeout,
                                 **(opts.get("config_kwargs") or {})}
    return tuning, opts


def _checksum_option(value: Any) -> str | None:
    """The `checksum` option, normalised: None (nothing sent) for "none", "off", false or empty."""
    if value is None or value is False or str(value).strip().lower() in ("", "none", "off", "false"):
        return None
    return str(value).strip().upper()


def client_settings(fs_options: dict[str, Any], tuning: Tuning) -> ClientSettings:
    """Map s3fs storage options onto a botocore client. Pure."""
    o = dict(fs_options)
    session: dict[str, Any] = {}
    if o.get("profile"):
        session["profile"] = o["profile"]
    client: dict[str, Any] = dict(o.get("client_kwargs") or {})
    for ours, theirs in (("key", "aws_access_key_id"), ("username", "aws_access_key_id"),
                         ("secret", "aws_secret_access_key"), ("password", "aws_secret_access_key"),
                         ("token", "aws_session_token")):
        if o.get(ours) is not None:
            client[theirs] = o[ours]
    if o.get("endpoint_url"):
        client["endpoint_url"] = o["endpoint_url"]
    if "use_ssl" in o:
        client["use_ssl"] = bool(o["use_ssl"])
    config: dict[str, Any] = {
        # Retries are ours (safepoint.destinations.retry): one policy for requests and bodies.
        "retries": {"mode": "standard", "total_max_attempts": 1},
        "max_pool_connections": max(10, 2 * tuning.max_parts_in_flight + 4),
        "connect_timeout": tuning.connect_timeout,
        "read_timeout": tuning.read_timeout,  # a stalled transfer fails after this long, and is retried
        "tcp_keepalive": True,
        # Checksums are Safepoint's to send (`checksum`, of the very buffer it BLAKE3-hashed), or
        # botocore's only where an operation requires one: its own would be one more pass per byte.
        "request_checksum_calculation": "when_required",
        "response_checksum_validation": "when_required",
        # On plain http botocore would SHA-256 every body a second time just to sign it.
        "s3": {"payload_signing_enabled": tuning.sign_payload},
    }
    config.update(o.get("config_kwargs") or {})
    if o.get("anon"):
        from botocore import UNSIGNED

        config["signature_version"] = UNSIGNED
        for k in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token"):
            client.pop(k, None)
    return ClientSettings(session=session, client=client, config=config,
                          extra_put=dict(o.get("s3_additional_kwargs") or {}))


def plan_parts(size: int, part_size: int) -> list[tuple[int, int]]:
    """(offset, length) of each part of a `size`-byte object. Pure.

    The part size grows (in whole MiB) when `size` would need more than S3's 10,000 parts.
    """
    if size <= 0:
        return [(0, 0)]
    if -(-size // part_size) > MAX_PARTS:
        part_size = -(-size // MAX_PARTS)
        part_size = -(-part_size // MiB) * MiB
    return [(off, min(part_size, size - off)) for off in range(0, size, part_size)]


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix/` -> ("bucket", "some/prefix"). Pure."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("s3", "s3a"):
        raise UsageError(f"not an s3:// URL: {url!r}")
    rest = rest.split("@", 1)[-1] if "@" in rest.split("/", 1)[0] else rest  # never keep userinfo
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise UsageError(f"no bucket in {url!r}")
    return bucket, prefix.strip("/")
