"""Does a SQLite catalog know a path at all? Answered with the standard library, in milliseconds.

`safepoint verify` of a local folder records its result only if the catalog knows the folder.
Opening the catalog proper (SQLAlchemy, Alembic) costs ~0.5 s of imports, as much as hashing a
GiB; this read-only probe lets verify skip it when the answer is "not known". Any doubt (not
SQLite, schema differs, database locked) answers None and the caller opens the catalog as usual.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote

from safepoint.core.naming import catalog_db


def sqlite_file(url: str | None) -> Path | None:
    """The database file of a SQLite catalog URL (None: the default, as catalog.db.default_catalog_url)."""
    if url is None:
        url = os.environ.get("SAFEPOINT_CATALOG_URL")
    if url is None:
        return catalog_db()
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.split("+")[0] != "sqlite" or not rest.startswith("/") or len(rest) < 2:
        return None  # not SQLite, or in memory
    return Path(unquote(rest[1:].split("?")[0]))


def knows_local(url: str | None, local_path: str, replica_urls: list[str]) -> bool | None:
    """True/False: whether the catalog records `local_path` or any of `replica_urls`; None: cannot tell."""
    db = sqlite_file(url)
    if db is None:
        return None
    if not db.exists():
        return False
    import sqlite3  # here: a folder verified on a machine with no catalog yet never loads it

    path = os.path.normpath(local_path)
    urls = sorted({u.rstrip("/") for u in replica_urls} | {u.rstrip("/") + "/" for u in replica_urls})
    try:
        with sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=1) as con:
            marks = ",".join("?" * len(urls))
            hit = con.execute(
                "SELECT 1 FROM checkpoints WHERE local_path = ? UNION ALL "
                "SELECT 1 FROM checkpoint_ranks WHERE local_path = ? UNION ALL "
                f"SELECT 1 FROM replicas WHERE url IN ({marks}) LIMIT 1", (path, path, *urls)).fetchone()
        return hit is not None
    except sqlite3.Error:
        return None
