"""`safepoint` command line. Exit codes: 0 good, 1 bad checkpoint or nothing found, 2 usage or infrastructure error."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from safepoint.cli.common import (
    EXIT_BAD,
    EXIT_ERROR,
    EXIT_OK,
    _catalog,
    _fast_catalog,
    _ingest_exit,
    check_destinations_here,
    err,
    out,
    parse_time,
    run_hint,
    run_ingest_flow,
    watch_here,
)
from safepoint.cli.console import inert, plain_table
from safepoint.cli.guard import checked_output, exit_now, guarded
from safepoint.cli.quiet import console_logging, quiet_prefect
from safepoint.cli.registry import (
    Commands,
    add_commands,
    add_global_options,
    count_arg,
    destination_arg,
    interval_arg,
    parent_arg,
    parse,
    step_arg,
)
from safepoint.core.errors import SafepointError, UsageError
from safepoint.destinations import BLOCK_SCHEME, register_resolver


def ensure_api(on_start: Callable[[str], None] | None = None) -> str:
    """Prefect's API for commands that run flows; the server module (sockets, subprocess) loads only for them."""
    from safepoint.flows.local_server import ensure_api as ensure

    return ensure(on_start=on_start)

def _resolve_block(url: str) -> tuple[str, dict]:
    """`block://NAME/sub` through its Prefect block (loaded from the API, started if need be)."""
    ensure_api(on_start=lambda text: err.print(text))
    from safepoint.flows.credentials import block_destination

    return block_destination(url)


def cmd_commit(args) -> int:
    from safepoint.local.commit import commit

    m = commit(args.dir, args.run, args.step, parent=args.parent, world_size=args.world_size,
               ranks=args.ranks, node=args.node, reseal=args.reseal)
    out.print(f"committed {m.run}/{m.step}: {len(m.files)} files, {m.total_bytes} bytes")
    return EXIT_OK


def cmd_ingest(args) -> int:
    from safepoint.core.format import MARKER_NAME
    from safepoint.local.snapshot import LocalSnapshot

    folder = Path(args.dir)
    if not (folder / MARKER_NAME).is_file():
        raise UsageError(f"{args.dir}: not a committed snapshot (no {MARKER_NAME}); run `safepoint commit` first")
    try:
        snap = LocalSnapshot.open(folder)
    except SafepointError as e:
        err.print(f"[red]corrupt[/red] {inert(args.dir)}: {inert(e)}")
        return EXIT_BAD
    from safepoint.core.config import load_config
    from safepoint.ops import progress
    from safepoint.ops.ingest import Prepared

    # An unusable destination is one error line, before any state changes. What is read, loaded and
    # checked here (the snapshot, the config, the destinations) goes down to the flow as it is.
    urls, config = check_destinations_here(args.to, load_config())
    _catalog(args, config)  # migrate before Prefect starts, so schema errors surface plainly

    t0 = time.perf_counter()
    # On a terminal, one transfer bar per destination (bytes uploaded and read back verified).
    m = snap.manifest
    with progress.bars([(url, f"{m.run}/{m.step} -> {url}", m.total_bytes) for url in dict.fromkeys(urls)],
                       err, enabled=err.is_terminal and not args.json):
        result = run_ingest_flow(folder, args.to, args.model, args.catalog, Prepared(snap, urls, config))
    dt = time.perf_counter() - t0
    if args.json:
        out.print_json(data=result)
    else:
        out.print(f"{result['run']}/{result['step']}: [bold]{result['state']}[/bold] in {dt:.2f}s")
        for r in result["replicas"]:
            out.print(inert(f"  {r['url']}: {r['state']}" + (f" ({r['error']})" if r.get("error") else "")))
        if result["state"] != "verified" and result.get("message"):
            out.print(f"  {inert(result['message'])}")
    return _ingest_exit(result)


def _listing(args) -> list:
    """The checkpoints `ls` shows: read with sqlite3 alone when the catalog is a SQLite file at head
    (no SQLAlchemy, no Alembic: the command stays under 0.3 s), else through the catalog proper."""
    from safepoint.catalog.listing import read_sqlite
    from safepoint.catalog.probe import sqlite_file
    from safepoint.core.config import load_config

    url = getattr(args, "catalog", None) or load_config().catalog_url
    db = sqlite_file(url)
    if db is not None and getattr(args, "catalog", None) and not db.exists():
        err.print(f"no catalog at {db} yet: nothing has been recorded there (check --catalog)")
    views = read_sqlite(db, args.run) if db is not None else None
    return views if views is not None else _catalog(args).list_checkpoints(args.run)


def cmd_ls(args) -> int:
    views = _listing(args)
    rows = [{
        "run": c.run, "step": c.step, "state": str(c.state), "local_path": c.local_path,
        "bytes": c.total_bytes, "created": c.created_at.isoformat() if c.created_at else None,
        "parent": f"{c.parent[0]}:{c.parent[1]}" if c.parent else None,
        "pinned": c.pinned, "tags": list(c.tags),
        "replicas": [{"url": r.url, "state": str(r.state)} for r in c.replicas],
    } for c in views]
    if args.json:
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    if args.run and not rows:
        err.print(inert(f"no checkpoints recorded for run {args.run!r}{run_hint(_catalog(args), args.run)}"))
    headers = ("run", "step", "state", "bytes", "replicas", "local", "parent", "pin/tags")

    def cells(r: dict, sep: str, name: Callable[[str], str] = str) -> tuple[str, ...]:
        """A checkpoint's cells; `name` makes each value (a replica each) safe for the table it goes to."""
        reps = sep.join(name(f"{x['url']} ({x['state']})") for x in r["replicas"]) or "-"
        marks = " ".join((["pinned"] if r["pinned"] else []) + r["tags"]) or "-"
        return (r["run"], str(r["step"]), r["state"], str(r["bytes"]), reps, name(r["local_path"] or "-"),
                r["parent"] or "-", name(marks))

    if not out.is_terminal:  # a pipe or a file: whole values, one line per checkpoint, no rich import
        out.file.write(plain_table(headers, (cells(r, ", ") for r in rows)) + "\n")
        return EXIT_OK
    from rich.table import Table

    table = Table(*headers)
    for r in rows:
        table.add_row(*cells(r, "\n", inert))
    out.print(table)
    return EXIT_OK


def _check_min_replicas(n: int) -> None:
    if n < 1:
        raise UsageError(f"--min-replicas must be at least 1, got {n}: a checkpoint with no verified copy is unsafe")


def cmd_resume_point(args) -> int:
    from safepoint.ops.resume import find_resume_point

    _check_min_replicas(args.min_replicas)
    cat = _fast_catalog(args)
    decision = find_resume_point(cat, args.run, min_replicas=args.min_replicas, max_step=args.max_step,
                                 before=parse_time(args.before) if args.before else None, tag=args.tag)
    passed = [{"step": c.step, "state": str(c.state), "reason": why} for c, why in decision.passed_over]
    if args.explain:
        if decision.scope:
            err.print("considered only checkpoints " + ", ".join(decision.scope))
        for c, why in decision.passed_over:
            err.print(f"skipped {c.run}/{c.step}: {inert(why)}")
    c = decision.chosen
    if c is None:
        if args.json:
            print(json.dumps({"run": args.run, "step": None, "url": None, "urls": [], "passed_over": passed}))
        known = bool(passed) or cat.get_run_id(args.run) is not None
        err.print(inert(f"no verified checkpoint with {args.min_replicas} verified replica(s) for run {args.run!r}"
                        if known else f"no checkpoints recorded for run {args.run!r}{run_hint(cat, args.run)}"))
        return EXIT_BAD
    urls = decision.urls
    doc = {"run": c.run, "step": c.step, "url": urls[0] if urls else None, "urls": urls,
           "replicas": [{"url": r.url, "destination": r.destination,
                         "verified_at": r.verified_at.isoformat() if r.verified_at else None}
                        for r in c.verified_replicas()],
           "local_path": c.local_path, "created": c.created_at.isoformat() if c.created_at else None,
           "parent": f"{c.parent[0]}:{c.parent[1]}" if c.parent else None, "passed_over": passed}
    if args.json:
        print(json.dumps(doc))
    else:
        out.print(f"{c.run} step {c.step}: {inert(doc['url'] or c.local_path)}")
        for u in urls[1:]:
            out.print(f"  also {inert(u)}")
    return EXIT_OK


def _local_total(target: str) -> int | None:
    """The bytes a local snapshot's manifest lists (for the bar's total); None for a URL or no manifest."""
    from safepoint.core.urls import local_path

    folder = local_path(target)
    if folder is None:
        return None
    from safepoint.local.snapshot import LocalSnapshot

    try:
        return LocalSnapshot.open(folder).manifest.total_bytes
    except (SafepointError, OSError):
        return None


def cmd_verify(args) -> int:
    from safepoint.core.config import load_config
    from safepoint.ops import progress
    from safepoint.ops.verify import verify

    shown = err.is_terminal and not args.json
    with progress.bar(f"verify {args.url}", _local_total(args.url) if shown else None, err, enabled=shown):
        config = load_config()
        # The catalog by URL: opened (SQLAlchemy) only when it may know the target.
        done = verify(args.catalog or config.catalog_url, args.url, config)
    report, where = done.report, done.where
    if args.json:
        print(json.dumps({"url": where, "state": str(report.outcome), "summary": report.summary(),
                          "bytes_checked": report.bytes_checked, "error": report.error,
                          "files": {path: str(status) for path, status in report.files.items()}}, indent=1))
    else:
        (out if done.good else err).print(f"{where}: {'verified' if done.good else str(report.outcome)}: "
                                          f"{report.summary()}", markup=False)
    return EXIT_OK if done.good else EXIT_BAD


def cmd_validate(args) -> int:
    from safepoint.core.urls import local_path
    from safepoint.validation.validate import validate_snapshot

    path = local_path(args.url)
    if path is None:
        raise UsageError("validate works on a local snapshot folder or file:// URL")
    if not Path(path).is_dir():
        raise UsageError(f"{path}: not a directory")
    files, run, step, digests = None, None, None, None
    from safepoint.core.config import load_config
    from safepoint.local.snapshot import LocalSnapshot
    from safepoint.validation.settings import ValidationSettings

    try:  # a committed folder: its manifest's files, each held to its digest as it is read
        manifest = LocalSnapshot.open(path).manifest
        files, run, step = [f.path for f in manifest.files], manifest.run, manifest.step
        digests = {f.path: f.blake3 for f in manifest.files}
    except SafepointError:
        pass
    settings = ValidationSettings.from_config(load_config(), run, model=args.model)
    report = validate_snapshot(path, files, settings=settings, step=step, digests=digests)
    if args.json:
        print(json.dumps({"path": path, **report.to_dict()}, indent=1, default=str))
        return EXIT_OK if report.ok else EXIT_BAD
    for f in report.findings:
        err.print(inert(f"  {f.file}{': ' + f.tensor if f.tensor else ''}: {f.problem}: {f.message}"))
    for f in report.warnings:
        err.print(inert(f"  warning: {f.file}{': ' + f.tensor if f.tensor else ''}: {f.problem}: {f.message}"))
    (out if report.ok else err).print(inert(f"{path}: {report.outcome}: {report.summary()}"))
    return EXIT_OK if report.ok else EXIT_BAD


def _policy_flags(args) -> dict:
    """The retention policy given on the command line (empty: none given)."""
    spec = {k: getattr(args, k) for k in ("keep_last", "keep_every", "keep_within", "keep_best")
            if getattr(args, k, None) is not None}
    if getattr(args, "keep_tagged", None) is not None:
        spec["keep_tagged"] = list(args.keep_tagged) or True
    return spec


def cmd_prune(args) -> int:
    from safepoint.core.config import load_config
    from safepoint.ops.retention import prune_runs

    if (args.run is None) == (not args.all_runs):
        raise UsageError("give --run R (repeatable) or --all-runs")
    _check_min_replicas(args.min_replicas)
    cat, config = _catalog(args), load_config()
    reports, _ = prune_runs(cat, config, cat.runs() if args.all_runs else args.run, override=_policy_flags(args),
                            require=True, min_replicas=args.min_replicas, dry_run=args.dry_run)
    for r in [] if args.json else reports:
        for d in r["decisions"]:
            c = d.checkpoint
            verb = "keep  " if d.keep else ("would delete" if args.dry_run else "delete")
            out.print(f"{verb} {c.run}/{c.step} ({c.state}): {'; '.join(d.reasons)}", markup=False)
        if not args.dry_run:
            out.print(f"{r['run']}: pruned {len(r['pruned'])} checkpoint(s)"
                      + (f", {len(r['skipped'])} kept after re-checking the catalog" if r["skipped"] else ""))
        for e in r["errors"]:
            err.print(f"could not delete {e} (the next prune retries)", markup=False)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "decisions"} for r in reports], indent=1))
    return EXIT_ERROR if any(r["errors"] for r in reports) else EXIT_OK


def cmd_demo(args) -> int:
    from safepoint.cli.demo import run_demo

    # The step bar shows only when both streams are a terminal: the demo's lines then print above it.
    bar = err if out.is_terminal and err.is_terminal else None
    return run_demo(Path(args.dir) if args.dir else None, console=out, progress_console=bar)


def build_parser() -> tuple[argparse.ArgumentParser, Commands]:
    """The parser of every command in the registry, and the commands (a command's modules are
    imported once it is chosen: `registry.parse`)."""
    p = argparse.ArgumentParser(
        prog="safepoint", description="Verified checkpoints: seal, replicate, verify, validate, catalog, restore.",
        epilog="`safepoint COMMAND --help` explains a command and its exit codes. Exit codes: 0 good, 1 a verdict "
               "(bad checkpoint, or nothing good found), 2 usage or infrastructure error.")
    add_global_options(p, top=True)
    return p, add_commands(p)


def register(sub) -> None:
    """The core commands (their help is in cli/registry.py)."""
    s = sub.add_parser("commit")
    s.add_argument("dir", metavar="DIR", help="the folder the training job wrote")
    s.add_argument("--run", required=True, help="run name, e.g. llama-7b")
    s.add_argument("--step", type=step_arg, required=True, help="training step of this checkpoint")
    s.add_argument("--parent", type=parent_arg, help="RUN:STEP this checkpoint resumed or forked from")
    s.add_argument("--world-size", type=int, default=1, help="ranks of a multi-node checkpoint (default 1)")
    s.add_argument("--ranks", type=int, nargs="*", help="ranks this folder holds (default: all)")
    s.add_argument("--node", help="host name for multi-node checkpoints")
    s.add_argument("--reseal", action="store_true",
                   help="seal again a folder whose files changed since it was sealed (a re-saved step)")
    s.set_defaults(fn=cmd_commit)

    s = sub.add_parser("ingest")
    s.add_argument("dir", metavar="DIR", help="a committed snapshot folder (see `safepoint commit`)")
    s.add_argument("--to", action="append", required=True, type=destination_arg, metavar="URL",
                   help="destination URL (repeatable)")
    s.add_argument("--model", help="model factory package.module:function for a strict load check")
    s.add_argument("--json", action="store_true", help="print the result as JSON (no progress bar)")
    s.set_defaults(fn=cmd_ingest, prefect=True, validates=True)

    s = sub.add_parser("watch")
    s.add_argument("root", metavar="ROOT", help="folder under which training jobs write checkpoints")
    s.add_argument("--to", action="append", required=True, type=destination_arg, metavar="URL",
                   help="destination URL (repeatable)")
    s.add_argument("--model", help="model factory package.module:function for a strict load check")
    s.add_argument("--once", action="store_true", help="one pass, then exit")
    s.add_argument("--interval", type=float, default=5.0, help="seconds between scans (default 5)")
    s.set_defaults(fn=watch_here, prefect=True, validates=True)

    s = sub.add_parser("ls")
    s.add_argument("--run", help="only this run")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(fn=cmd_ls)

    s = sub.add_parser("resume-point")
    s.add_argument("--run", required=True, help="the run to resume")
    s.add_argument("--min-replicas", type=int, default=1, help="verified durable replicas required (default 1)")
    s.add_argument("--max-step", type=step_arg, help="only checkpoints at or below this step")
    s.add_argument("--before", metavar="TIME", help="only checkpoints created before TIME (ISO 8601, or 2h/3d ago)")
    s.add_argument("--tag", help="only checkpoints with this tag")
    s.add_argument("--explain", action="store_true", help="say why each newer checkpoint was passed over")
    s.add_argument("--json", action="store_true", help="JSON with the URL of every verified replica")
    s.set_defaults(fn=cmd_resume_point)

    s = sub.add_parser("verify")
    s.add_argument("url", metavar="URL_OR_DIR", help="a replica URL (s3://..., file://...) or a local snapshot folder")
    s.add_argument("--json", action="store_true", help="the state and each file's status as JSON (no progress bar)")
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("validate")
    s.add_argument("url", metavar="DIR", help="a local snapshot folder (or file:// URL)")
    s.add_argument("--model", help="model factory package.module:function for a strict load check")
    s.add_argument("--json", action="store_true", help="the findings and warnings as JSON")
    s.set_defaults(fn=cmd_validate)

    s = sub.add_parser("prune")
    s.add_argument("--run", action="append", help="run to prune (repeatable)")
    s.add_argument("--all-runs", action="store_true", help="prune every run in the catalog")
    s.add_argument("--keep-last", type=count_arg, metavar="N", help="keep the N newest verified")
    s.add_argument("--keep-every", type=interval_arg, metavar="STEPS",
                   help="keep the first verified of every STEPS steps")
    s.add_argument("--keep-within", metavar="DURATION", help="keep everything created within e.g. 12h, 7d")
    s.add_argument("--keep-tagged", nargs="*", metavar="TAG", help="keep tagged checkpoints (any tag, or these)")
    s.add_argument("--keep-best", metavar="METRIC:N[:min|max]", help="keep the N best by a recorded metric")
    s.add_argument("--min-replicas", type=int, default=1, help="verified replicas a checkpoint needs to count")
    s.add_argument("--dry-run", action="store_true", help="print the plan, with a reason for every keep")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(fn=cmd_prune)

    s = sub.add_parser("demo")
    s.add_argument("--dir", help="work folder, kept afterwards (default: a temporary folder, removed at the end)")
    s.set_defaults(fn=cmd_demo, prefect=True)


def main(argv: Sequence[str] | None = None) -> int:
    words = list(argv) if argv is not None else sys.argv[1:]
    verbose = "-v" in words or "--verbose" in words
    quiet_prefect(verbose)
    if argv is None:  # the process's own stdout: lost output is an error (cli/guard.py)
        checked_output()
    code = guarded(lambda: _dispatch(argv), verbose=verbose, stderr=sys.stderr)
    if argv is None:  # the process is the command (console script, `python -m safepoint.cli`)
        code = exit_now(code)
    return code


def _prestart_sandbox() -> None:
    """Start the validation sandbox's fork server (safepoint.validation.sandbox.prestart): it imports
    the readers and torch on another core while this process imports Prefect and opens the catalog."""
    from safepoint.core.config import load_config
    from safepoint.validation.sandbox import prestart
    from safepoint.validation.settings import ValidationSettings

    prestart(ValidationSettings.from_config(load_config()).sandbox)


def _dispatch(argv: Sequence[str] | None) -> int:
    parser, commands = build_parser()
    args = parse(parser, commands, sys.argv[1:] if argv is None else list(argv))  # argparse exits 2 on usage errors
    console_logging(args.verbose)
    register_resolver(BLOCK_SCHEME, _resolve_block)  # catalogued block:// replicas open through their block
    # First: the sandbox's fork server imports torch while Prefect loads (`watch --emit` only sends events).
    validates = getattr(args, "validates", False)  # a command's flag, or a rule over its arguments
    if (validates(args) if callable(validates) else validates) and not getattr(args, "emit", False):
        _prestart_sandbox()
    if getattr(args, "prefect", False):  # commands that run flows or talk to Prefect's API
        ensure_api(on_start=lambda text: err.print(text))
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
