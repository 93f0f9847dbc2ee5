"""Naming: where a snapshot of run R at step N lives at a destination (docs/format.md), the lease
names, and where this host keeps its own state under $SAFEPOINT_HOME."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from safepoint.core.format import check_run, check_step, digest_bytes
from safepoint.core.redact import redact_url


def join(base: str, *parts: str) -> str:
    out = base.rstrip("/")
    for p in parts:
        out += "/" + p.strip("/")
    return out


def snapshot_key(run: str, step: int) -> str:
    return f"{check_run(run)}/{check_step(step)}"


def snapshot_url(base: str, run: str, step: int) -> str:
    return join(base, snapshot_key(run, step))


def file_url(base: str, run: str, step: int, relpath: str) -> str:
    return join(snapshot_url(base, run, step), relpath)


def parse_snapshot_url(url: str) -> tuple[str, str, int]:
    """Split `<base>/<run>/<step>` into (base, run, step)."""
    parts = url.rstrip("/").rsplit("/", 2)
    if len(parts) != 3 or not parts[2].isdigit():
        raise ValueError(f"{url!r} is not <base>/<run>/<step>")
    return parts[0], check_run(parts[1]), check_step(int(parts[2]))


# -- this host's state under $SAFEPOINT_HOME (default ~/.safepoint) ---------------------------

def home() -> Path:
    return Path(os.environ.get("SAFEPOINT_HOME") or Path.home() / ".safepoint").expanduser()


def catalog_db() -> Path:
    """The default SQLite catalog."""
    return home() / "catalog.db"


def config_file() -> Path:
    return home() / "config.toml"


def credentials_dir() -> Path:
    """Credentials kept by reference (safepoint.local.credentials), one file each, mode 0600."""
    return home() / "credentials"


def spool_dir(node: str) -> Path:
    """The watcher's unconfirmed markers on `node` (safepoint.events.markers.Spool)."""
    return home() / "spool" / node


def tmp_dir() -> Path:
    """Verified fetches in progress (safepoint.ops.fetch), removed afterwards."""
    return home() / "tmp"


def this_host() -> str:
    """The name this host goes by in leases and events: $SAFEPOINT_NODE, else the host name."""
    return os.environ.get("SAFEPOINT_NODE") or socket.gethostname()


# -- catalog lease names (safepoint.ops.leases) ------------------------------------------------

def ingest_lease(run: str, step: int, url: str, part: str = "all") -> str:
    """The lease an ingest holds while replicating (run, step), or one part of it, to `url`.

    Keyed by a digest of the redacted URL, so no credential is ever part of a catalog row.
    """
    return f"ingest:{run}/{step}/{part}@{digest_bytes(redact_url(url).encode())[:16]}"


def uploads_limit_name(host: str) -> str:
    """The Prefect global concurrency limit that bounds one host's uploads (what the UI shows)."""
    return f"safepoint-uploads-{host}"


def uploads_lease_prefix(host: str) -> str:
    """The slots that bound the uploads one host runs at once (`[limits] uploads_per_host`)."""
    return f"uploads:{host}"
