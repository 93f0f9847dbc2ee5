"""Destinations as a flow run sees them: references and blocks resolved into URLs plus storage options.

What reaches Prefect (parameters, payloads, deployment defaults) names a destination without its
secret: a sealed URL (`s3://safepoint-ref-<id>@bucket/p`, safepoint.local.credentials) or a
Prefect block, `block:NAME[/sub/prefix]`, an `S3Bucket` block of prefect-aws (bucket, folder and
its `AwsCredentials`: keys, profile, region, endpoint). The process that runs the flow resolves
them here, in memory: a sealed URL becomes the plain URL, its credentials storage options of that
URL; a block stays `block://NAME/sub` (what the catalog records, so restore, verify, scrub,
reconcile and evict open it through the block again), and `open_destination` resolves it with
`block_destination`, registered here. Credentials are never logged or stored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from safepoint.core.config import Config, load_config
from safepoint.core.errors import UsageError
from safepoint.core.redact import split_userinfo
from safepoint.destinations import BLOCK_SCHEME, block_url, is_block_url, register_resolver
from safepoint.local.credentials import reveal_credentials

__all__ = ["resolve_destinations", "block_destination"]


def _aws_options(creds: Any) -> dict[str, Any]:
    """s3fs storage options from a prefect-aws `AwsCredentials` block (unset fields left out)."""
    opts: dict[str, Any] = {}
    if creds.aws_access_key_id:
        opts["key"] = creds.aws_access_key_id
    if creds.aws_secret_access_key is not None:
        opts["secret"] = creds.aws_secret_access_key.get_secret_value()
    if creds.aws_session_token:
        opts["token"] = creds.aws_session_token
    if creds.profile_name:
        opts["profile"] = creds.profile_name
    if creds.region_name:
        opts["client_kwargs"] = {"region_name": creds.region_name}
    params = creds.aws_client_parameters
    if params is not None and params.endpoint_url:
        opts["endpoint_url"] = params.endpoint_url
    return opts


def block_destination(ref: str) -> tuple[str, dict[str, Any]]:
    """`block:NAME[/sub]` -> (s3://bucket/folder/sub, storage options) from the `S3Bucket` block NAME."""
    from prefect_aws import S3Bucket

    name, _, sub = block_url(ref)[len(BLOCK_SCHEME) + 3:].partition("/")
    try:
        block = S3Bucket.load(name)
    except ValueError as e:  # Prefect says "Unable to find block document named ..."
        raise UsageError(f"{ref}: no S3Bucket block named {name!r} ({e})") from None
    path = "/".join(p.strip("/") for p in (block.bucket_folder or "", sub) if p.strip("/"))
    url = f"s3://{block.bucket_name}" + (f"/{path}" if path else "")
    # Options configured for the bucket's prefix still apply; the block's credentials are laid over them.
    return url, {**load_config().storage_options(url), **_aws_options(block.credentials)}


def resolve_destinations(to: list[str], config: Config) -> tuple[list[str], Config]:
    """(URLs, `config` with each one's credentials added to its storage options).

    The URL keeps the options configured for its prefix ([storage."s3://bucket"], e.g. an endpoint);
    the credentials of the URL's userinfo are laid over them. A block stays `block://NAME/sub`: its
    own endpoint and credentials come with it each time it is opened (block_destination).
    """
    urls: list[str] = []
    storage = dict(config.storage)
    for given in to:
        url = reveal_credentials(given) or given
        if is_block_url(url):
            url, extra = block_url(url), {}  # resolved by open_destination, wherever it is opened
        else:
            clean, user, password = split_userinfo(url)
            extra = {}
            if clean.startswith(("s3://", "s3a://")) and user is not None and password is not None:
                url, extra = clean, {"key": user, "secret": password}
        if extra:
            storage[url] = {**config.storage_options(url), **extra}
        urls.append(url)
    return urls, dataclasses.replace(config, storage=storage)


register_resolver(BLOCK_SCHEME, block_destination)
