"""What every command module shares: the consoles, the catalog, time parsing, running the ingest flow.

The command modules (main, catalog_cmds, events_cmds, repair_cmds, validation_cmds) import this,
never each other's internals, so the CLI has no import loop.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from safepoint.cli.console import LazyConsole
from safepoint.core.errors import UsageError
from safepoint.core.exits import EXIT_BAD, EXIT_ERROR, EXIT_OK

if TYPE_CHECKING:
    from datetime import datetime

__all__ = ["EXIT_BAD", "EXIT_ERROR", "EXIT_OK", "err", "out", "parse_time", "run_hint", "run_ingest_flow", "watch_here",
           "check_destinations_here"]

out = LazyConsole()  # rich's Console, imported only when a command's output needs it
err = LazyConsole(stderr=True)


def _catalog(args):
    from safepoint.catalog.store import open_catalog
    from safepoint.core.config import load_config

    return open_catalog(getattr(args, "catalog", None) or load_config().catalog_url)


def _fast_catalog(args):
    """The catalog for the read-mostly commands (restore, resume-point): sqlite3 alone on a SQLite catalog
    at head (safepoint.catalog.lite), the catalog proper otherwise."""
    from safepoint.catalog.lite import open_fast
    from safepoint.core.config import load_config

    return open_fast(getattr(args, "catalog", None) or load_config().catalog_url)


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


def check_destinations_here(to: list[str]) -> list[str]:
    """Check `to` (or [ingest] to) before anything runs; the plain URLs (blocks and userinfo resolved, in memory)."""
    from safepoint.core.config import load_config
    from safepoint.destinations.check import check_destinations
    from safepoint.flows.credentials import resolve_destinations

    config = load_config()
    urls, config = resolve_destinations(list(to) or list(config.section("ingest").get("to", [])), config)
    check_destinations(urls, config.storage_options)
    return urls


def run_ingest_flow(folder: str, to: list[str], model: str | None, catalog_url: str | None) -> dict:
    """The ingest flow, its parameters free of secrets: credential-bearing URLs go sealed (core.credentials)."""
    from safepoint.flows.ingest import ingest_result
    from safepoint.local.credentials import hide_credentials

    return ingest_result(snapshot=str(Path(folder).resolve()), to=[hide_credentials(u) or u for u in to], model=model,
                  catalog_url=hide_credentials(catalog_url))


def _ingest_exit(result: dict) -> int:
    """0: verified, or a node's part delivered that waits for the others; 1: a verdict; 2: anything else
    (the outcome rule, safepoint.rules.outcome, which the flow's run state reads too)."""
    from safepoint.rules.outcome import decide

    return decide(result).exit_code


def watch_here(args) -> int:
    """`safepoint watch` without --emit: ingest each committed snapshot under ROOT in this process.

    A folder whose ingest fails (a hostile manifest, a step the catalog cannot hold) is set aside
    with one `safepoint: error:` line and not retried until its marker changes; the others go on.
    """
    from safepoint.cli.guard import one_line
    from safepoint.core.errors import FormatError
    from safepoint.events.watch import marker_identity, pending_snapshots
    from safepoint.local.snapshot import LocalSnapshot

    check_destinations_here(args.to)
    cat = _catalog(args)
    worst = EXIT_OK
    set_aside: dict[Path, tuple[int, int] | None] = {}
    while True:
        for folder in pending_snapshots(Path(args.root), cat):
            ident = marker_identity(folder)
            if folder in set_aside and set_aside[folder] == ident:
                continue
            try:
                LocalSnapshot.open(folder)
            except FormatError as e:  # hostile or rotten control files (a step past int64): a verdict
                set_aside[folder] = ident
                err.print(f"set aside {folder}: {e} (until its marker changes)", markup=False, highlight=False)
                worst = max(worst, EXIT_BAD)
                continue
            err.print(f"ingesting {folder}", markup=False)
            try:
                result = run_ingest_flow(str(folder), args.to, args.model, args.catalog)
            except Exception as e:  # noqa: BLE001 - one bad folder never stops the watcher
                set_aside[folder] = ident
                err.print(f"{one_line(e)} ({folder}: set aside until its marker changes)", markup=False,
                          highlight=False)
                worst = max(worst, EXIT_ERROR)
                continue
            set_aside.pop(folder, None)
            out.print(f"{result['run']}/{result['step']}: {result['state']}")
            worst = max(worst, _ingest_exit(result))
        if args.once:
            return worst
        time.sleep(args.interval)
