"""Does a SQLite catalog know a path at all? Answered with the standard library, in milliseconds.

`safepoint verify` of a local folder records its result only if the catalog knows the folder.
Opening the catalog proper (SQLAlchemy, Alembic) costs ~0.5 s of imports, as much as hashing a
GiB; this read-only probe lets verify skip it when the answer is "not known". Any doubt (not
SQLite, schema differs, database locked) answers None and the caller opens the catalog as usual.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qsl, unquote

from safepoint.core.naming import catalog_db

#: the drivers whose URL names a plain file that sqlite3 opens as SQLAlchemy does (scheme compared lowercased)
FILE_DRIVERS = ("sqlite", "sqlite+pysqlite")
#: pysqlite's query arguments that change how a connection behaves, never which file it opens
CONNECTION_ONLY = frozenset({"timeout", "check_same_thread", "cached_statements", "isolation_level", "detect_types"})


def sqlite_file(url: str | None) -> Path | None:
    """The database file of a SQLite catalog URL (None: the default, as catalog.db.default_catalog_url):
    exactly the file SQLAlchemy opens for it, or None when the fast path must leave the URL to SQLAlchemy.

    Only the plain forms are read here: `sqlite:///relative.db`, `sqlite:////absolute.db` (with
    `+pysqlite`, %-escapes decoded as SQLAlchemy does, connection options such as `?timeout=5`).
    Anything else is None: another database, one in memory, and any other query argument (`?uri=true`
    makes the path a `file:` URI with options of its own), which only SQLAlchemy applies exactly; the
    catalog proper then reads it.
    """
    if url is None:
        url = os.environ.get("SAFEPOINT_CATALOG_URL")
    if url is None:
        return catalog_db()
    scheme, sep, rest = url.partition("://")
    rest, _q, query = rest.partition("?")
    if not sep or scheme.lower() not in FILE_DRIVERS or not rest.startswith("/"):
        return None  # not SQLite, or a host part (which SQLAlchemy refuses)
    if any(key not in CONNECTION_ONLY for key, _v in parse_qsl(query, keep_blank_values=True)):
        return None  # `?uri=true` and the like: options only SQLAlchemy applies exactly
    path = unquote(rest[1:])
    return None if path in ("", ":memory:") else Path(path)


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
