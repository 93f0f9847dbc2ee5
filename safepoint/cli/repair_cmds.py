"""`safepoint reconcile` and `safepoint scrub`: repair after crashes, find and fix rot.

- `reconcile` makes the catalog agree with the destinations after any crash (safepoint.ops.reconcile):
  adopts or confirms committed replicas by re-hashing them, marks vanished ones missing, finishes
  or abandons stuck ingests, re-replicates bad replicas from a good copy, and removes orphans
  (partial replicas, temporary files, stale multipart uploads) once the grace period has passed.
- `scrub` re-reads one rotating slice of every verified replica (safepoint.ops.scrub, the same pass
  as the scheduled scrub flow, without Prefect); a replica whose slice shows rot is verified in
  full and recorded, and then replicated again from a good copy where one exists.

Exit codes: 0 consistent (or repaired), 1 problems remain (corrupt without a good copy, conflicts,
unreadable markers), 2 errors.
"""

from __future__ import annotations

import json
from typing import Any

from safepoint.cli.common import EXIT_BAD, EXIT_ERROR, EXIT_OK, _catalog, err, out
from safepoint.cli.registry import step_arg

# Findings that need a person: nothing automatic can fix them.
UNRESOLVED = frozenset({"conflict", "unreadable", "no_good_copy", "checkpoint_corrupt", "replica_corrupt",
                        "replica_missing", "replica_failed"})


def _print_report(report: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report.to_dict(), indent=1))
        return
    for s in report.steps:
        verb = s.action if s.done else (f"would {s.action}" if report.dry_run and s.action not in UNRESOLVED
                                        else s.action)
        where = f"{s.run}/{s.step} " if s.run is not None else ""
        out.print(f"{verb}: {where}{s.where}" + (f" ({s.detail})" if s.detail else ""), markup=False)
    for e in report.errors:
        err.print(f"error: {e}", markup=False)
    if not report.steps and not report.errors:
        out.print("consistent: nothing to do")


def _exit(report: Any, repaired_ok: set[str]) -> int:
    if report.errors:
        return EXIT_ERROR
    last: dict[tuple[Any, Any, str], str] = {}
    for s in report.steps:
        last[(s.run, s.step, s.where)] = s.action
    return EXIT_BAD if any(a in UNRESOLVED and a not in repaired_ok for a in last.values()) else EXIT_OK


def cmd_reconcile(args) -> int:
    from safepoint.core.config import load_config
    from safepoint.core.errors import UsageError
    from safepoint.ops.reconcile import reconcile

    if (args.step is not None) and not args.run:
        raise UsageError("--step needs --run")
    config = load_config()
    catalog = _catalog(args)
    scope = (args.run, args.step) if args.run and args.step is not None else None
    report = reconcile(catalog, args.to, config, grace_s=args.grace, dry_run=args.dry_run, scope=scope,
                       finish=not args.no_finish, repair=not args.no_repair)
    if args.run and scope is None:
        report.steps = [s for s in report.steps if s.run in (None, args.run)]
    _print_report(report, args.json)
    return _exit(report, set())


def cmd_scrub(args) -> int:
    from safepoint.core.config import load_config
    from safepoint.ops import progress
    from safepoint.ops.scrub import scrub_pass

    catalog = _catalog(args)
    with progress.bar("scrub", None, err, enabled=err.is_terminal and not args.json):
        summary = scrub_pass(catalog, load_config(), subset=args.subset, run=args.run, repair=not args.no_repair)
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
    else:
        out.print(f"scrub slice {summary['index'] + 1}/{summary['of']}: {summary['replicas']} replica(s), "
                  f"{summary['problems']} with problems")
        for r in summary["rows"]:
            if r["outcome"] != "ok":
                out.print(f"  {r['url']}: {r['outcome']}", markup=False)
        for s in (summary.get("repair") or {}).get("steps", []):
            detail = f" ({s['detail']})" if s["detail"] else ""
            out.print(f"  {s['action']}: {s['run']}/{s['step']} {s['where']}{detail}", markup=False)
    for url in summary["unrepaired"]:
        err.print(f"still bad: {url}", markup=False)
    return EXIT_BAD if summary["unrepaired"] else EXIT_OK


def register(subparsers) -> None:
    s = subparsers.add_parser("reconcile")
    s.add_argument("--to", action="append", metavar="URL",
                   help="destination base URL (repeatable; default: every destination the catalog knows)")
    s.add_argument("--grace", type=float, default=3600.0, metavar="SECONDS",
                   help="how long a partial replica or temporary file must be untouched before it is removed, "
                        "and an ingest stuck before it is finished or abandoned (default 3600)")
    s.add_argument("--run", help="only this run")
    s.add_argument("--step", type=step_arg, help="only this step (with --run)")
    s.add_argument("--dry-run", action="store_true", help="report what would be done; change nothing")
    s.add_argument("--no-repair", action="store_true", help="do not re-replicate bad replicas")
    s.add_argument("--no-finish", action="store_true", help="leave stuck ingests alone")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(fn=cmd_reconcile)

    s = subparsers.add_parser("scrub")
    s.add_argument("--subset", default="16", help="'n': rotate through n slices (default 16); 'i/n': slice i")
    s.add_argument("--run", help="only this run")
    s.add_argument("--no-repair", action="store_true", help="only detect and record; do not re-replicate")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(fn=cmd_scrub)
