"""`safepoint verify` of a local folder the catalog does not know: hash it without opening the catalog.

Same result as pipeline.verify_url's local branch (which records nothing for an unknown folder),
without its ~0.5 s of SQLAlchemy imports, so verify starts about as fast as `b3sum`.
"""

from __future__ import annotations

from pathlib import Path

from safepoint.catalog.probe import knows_local
from safepoint.core.errors import FormatError
from safepoint.core.format import MARKER_NAME
from safepoint.core.urls import local_path, path_url
from safepoint.core.verify import VerifyReport
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.progress import hook


def local_target(target: str) -> Path | None:
    """The folder `target` names (a path or file:// URL), or None for a remote URL."""
    path = local_path(target)
    return None if path is None else path.resolve()


def verify_unknown_local(target: str, catalog_url: str | None) -> tuple[VerifyReport, str] | None:
    """The report for a committed local folder the catalog does not record; None: use the catalog."""
    local = local_target(target)
    if local is None or not (local / MARKER_NAME).exists():
        return None
    if knows_local(catalog_url, str(local), [path_url(local)]) is not False:
        return None
    try:
        report = LocalSnapshot.open(local).verify(progress=hook())
    except FormatError as e:
        report = VerifyReport(error=str(e))
    return report, str(local)
