"""What every command module shares: the consoles, the catalog, time parsing, running the ingest flow.

The command modules (main, catalog_cmds, events_cmds, repair_cmds, validation_cmds) import this,
never each other's internals, so the CLI has no import loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from safepoint.cli.console import LazyConsole
from safepoint.core.errors import UsageError
from safepoint.core.exits import EXIT_BAD, EXIT_ERROR, EXIT_OK

if TYPE_CHECKING:
    from datetime import datetime

    from safepoint.core.config import Config
    from safepoint.local.snapshot import LocalSnapshot
    from safepoint.ops.ingest import Prepared

__all__ = ["EXIT_BAD", "EXIT_ERROR", "EXIT_OK", "err", "out", "parse_time", "run_hint", "run_ingest_flow", "watch_here",
           "check_destinations_here"]

out = LazyConsole()  # rich's Console, imported only when a command's output needs it
err = LazyConsole(stderr=True)


def _catalog(args, config: Config | None = None, *, existing: bool = False):
    """The catalog of --catalog, else of `config` (default: loaded). `existing`: a command that only
    reads or annotates what is recorded, so a --catalog SQLite file that is not there is a mistyped
    URL (exit 2), never a new, empty catalog to answer from."""
    from safepoint.catalog.store import open_catalog
    from safepoint.core.config import load_config

    url = getattr(args, "catalog", None)
    if existing:
        _require_recorded(url)
    url = url or (config or load_config()).catalog_url
    _refuse_in_memory(url)
    return open_catalog(url)


def _fast_catalog(args):
    """The catalog for the read-mostly commands (restore, resume-point): sqlite3 alone on a SQLite catalog
    at head (safepoint.catalog.lite), the catalog proper otherwise; a --catalog file must exist."""
    from safepoint.catalog.lite import open_fast
    from safepoint.core.config import load_config

    _require_recorded(getattr(args, "catalog", None))
    url = getattr(args, "catalog", None) or load_config().catalog_url
    _refuse_in_memory(url)
    return open_fast(url)


def _refuse_in_memory(url: str | None) -> None:
    """A SQLite catalog in memory keeps nothing past this process: a command would record a verdict
    nobody can read again, or answer from an empty catalog. Refused (exit 2), whatever its spelling."""
    scheme, sep, rest = (url or "").partition("://")
    if not sep or not scheme.lower().startswith("sqlite"):
        return
    path = rest.partition("?")[0].partition("#")[0].removeprefix("/")
    if path in ("", ":memory:") or path.startswith("file::memory:") or "mode=memory" in rest:
        raise UsageError(f"{url}: an in-memory SQLite catalog keeps nothing past this command; "
                         "give a file (sqlite:////path/catalog.db) or a PostgreSQL URL")


def _require_recorded(url: str | None) -> None:
    from safepoint.catalog.probe import sqlite_file

    db = sqlite_file(url) if url else None
    if db is not None and not db.exists():
        raise UsageError(f"no catalog at {db}: nothing has been recorded there (check --catalog)")


def run_hint(cat, run: str) -> str:
    """' (did you mean 'my-run'?)' when `run` is not in the catalog and a recorded run is close to it."""
    if cat.get_run_id(run) is not None:
        return ""
    from safepoint.rules.suggest import did_you_mean

    return did_you_mean(run, cat.runs())


def parse_time(text: str, now: datetime | None = None) -> datetime:
    """ISO 8601 (naive means UTC), or a duration meaning that long ago ('2h', '3d')."""
    from datetime import datetime, timezone

    from safepoint.rules.retention import parse_duration

    now = now or datetime.now(timezone.utc)
    try:
        return now - parse_duration(text)
    except UsageError:
        pass
    try:
        t = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(f"not a time: {text!r} (ISO 8601, e.g. 2026-11-30T12:00:00Z, or a duration ago: 2h)") \
            from None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def check_destinations_here(to: list[str], config: Config | None = None) -> tuple[list[str], Config]:
    """Check `to` (or [ingest] to) before anything runs: the plain URLs (blocks and userinfo resolved, in
    memory) and `config` (default: loaded) with their credentials, for the ingest to use as they are."""
    from safepoint.core.config import load_config
    from safepoint.destinations.check import check_destinations
    from safepoint.flows.credentials import resolve_destinations

    config = config or load_config()
    urls, config = resolve_destinations(list(to) or list(config.section("ingest").get("to", [])), config)
    check_destinations(urls, config.storage_options)
    return urls, config


def run_ingest_flow(folder: str | Path, to: list[str], model: str | None, catalog_url: str | None,
                    prepared: Prepared | None = None) -> dict:
    """The ingest flow, its parameters free of secrets: credential-bearing URLs go sealed (core.credentials).

    `prepared`: the snapshot this command opened and the destinations it resolved and checked; the
    flow (in this process) uses them instead of reading, loading and checking them again."""
    from safepoint.flows.ingest import ingest_result
    from safepoint.local.credentials import hide_credentials
    from safepoint.ops.ingest import PREPARED

    token = PREPARED.set(prepared)
    try:
        return ingest_result(snapshot=str(Path(folder).resolve()), to=[hide_credentials(u) or u for u in to],
                             model=model, catalog_url=hide_credentials(catalog_url))
    finally:
        PREPARED.reset(token)


def _ingest_exit(result: dict) -> int:
    """0: verified, or a node's part delivered that waits for the others; 1: a verdict; 2: anything else
    (the outcome rule, safepoint.rules.outcome, which the flow's run state reads too)."""
    from safepoint.rules.outcome import decide

    return decide(result).exit_code


def watch_here(args) -> int:
    """`safepoint watch` without --emit: the watch loop (safepoint.events.watch) ingesting in this process.

    A folder whose ingest fails (a hostile manifest, a step the catalog cannot hold) is set aside
    with one `safepoint: error:` line and not retried until its marker changes; the others go on.
    """
    from safepoint.cli.guard import one_line
    from safepoint.core.config import load_config
    from safepoint.events.watch import IngestHere, Watcher
    from safepoint.ops.ingest import Prepared

    _urls, config = check_destinations_here(args.to, load_config())
    cat = _catalog(args, config)

    def ingest(folder: Path, snap: LocalSnapshot) -> int:
        # The folder as the watcher opened it; the config as it is now (a long watch sees its edits).
        result = run_ingest_flow(folder, args.to, args.model, args.catalog,
                                 Prepared(snap, *check_destinations_here(args.to, load_config())))
        out.print(f"{result['run']}/{result['step']}: {result['state']}", markup=False)
        return _ingest_exit(result)

    here = IngestHere(cat, ingest, describe=one_line)
    Watcher(Path(args.root), cat, here, config=config, interval=args.interval,
            timeouts_every=None if args.no_timeouts else args.timeouts_every, use_inotify=not args.poll_only,
            on_event=lambda text: err.print(text, markup=False, highlight=False)).run(once=args.once)
    return here.worst
