"""`safepoint restore`: the verified way back to training (safepoint.restore). Registered by safepoint.cli."""

from __future__ import annotations

import argparse
import json

from safepoint.cli.common import EXIT_BAD, EXIT_ERROR, EXIT_OK, _fast_catalog, err, out, run_hint
from safepoint.cli.console import inert
from safepoint.cli.registry import Commands, step_arg


def _ranks_arg(text: str) -> tuple[int, ...]:
    from safepoint.rules.restore import ScopeError, parse_ranks

    try:
        return parse_ranks(text)
    except ScopeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n:,} bytes"


def cmd_restore(args: argparse.Namespace) -> int:
    from safepoint.core.config import load_config
    from safepoint.ops import progress
    from safepoint.ops.restore import NothingToRestore, RestoreError, restore
    from safepoint.ops.resume import find_resume_point

    cat = _fast_catalog(args)
    total = None
    scoped = args.node is not None or args.ranks is not None
    if scoped:
        pass  # a part's size is known once its checkpoint is chosen: no bar total
    elif args.step is None:
        chosen = find_resume_point(cat, args.run, min_replicas=args.min_replicas).chosen
        total = chosen.total_bytes if chosen is not None else None
    else:
        row = cat.get(args.run, args.step)
        total = row.total_bytes if row is not None else None
    say = (lambda msg: None) if args.json else (lambda msg: err.print(msg, markup=False))
    try:
        with progress.bar(f"restore {args.run}", total, err, enabled=err.is_terminal and not args.json) as advance:
            result = restore(args.run, args.into, args.step, sources=args.sources or (),
                             min_replicas=args.min_replicas, force=args.force, catalog=cat, config=load_config(),
                             files_at_once=args.files, on_bytes=advance, say=say, node=args.node,
                             ranks=args.ranks)
    except RestoreError as e:
        if args.json:
            print(json.dumps({"run": args.run, "step": args.step, "restored": False, "error": str(e)}))
        hint = run_hint(cat, args.run) if isinstance(e, NothingToRestore) else ""
        err.print(f"safepoint: {'error: ' if e.exit_code == EXIT_ERROR else ''}{e}{hint}", markup=False)
        return EXIT_BAD if isinstance(e, NothingToRestore) else EXIT_ERROR
    if args.json:
        print(json.dumps({"restored": True, **result.to_dict()}))
        return EXIT_OK
    for f in result.fell_back_from:
        out.print(f"step {f['step']}: {f['reason']}, fell back", markup=False)
    speed = result.bytes_fetched / 2**20 / result.seconds if result.seconds else 0.0
    part = ""
    if result.ranks is not None:
        from safepoint.rules.restore import format_ranks

        part = f" ranks {format_ranks(result.ranks)} of {result.world_size}" + \
            (f" (node {result.node})" if result.node else "")
    out.print(f"restored {result.run} step {result.step}{part} into {inert(result.path)}: verified, "
              f"{_size(result.bytes_fetched)} fetched ({speed:,.0f} MiB/s), {_size(result.bytes_reused)} reused, "
              f"in {result.seconds:.2f}s")
    for s in result.sources:
        out.print(f"  from {inert(s)}")
    for src, n in result.bytes_from.items():
        out.print(f"  {_size(n)} from {inert(src)}")
    out.print(f"  resume from {inert(result.path)}; commit later checkpoints with --parent {result.run}:{result.step}")
    return EXIT_OK


def register(sub: Commands) -> None:
    s = sub.add_parser("restore")
    s.add_argument("--run", required=True, help="the run to restore")
    s.add_argument("--into", required=True, metavar="DIR",
                   help="local folder; ends as a committed snapshot ({step} in it: the step chosen)")
    s.add_argument("--step", type=step_arg,
                   help="this checkpoint exactly (no fallback: exit 1 if it has no whole copy)")
    s.add_argument("--from", dest="sources", action="append", metavar="URL",
                   help="read only from this replica or destination (repeatable, in order of preference)")
    s.add_argument("--min-replicas", type=int, default=1, help="verified replicas the resume point needs")
    s.add_argument("--node", metavar="NAME",
                   help="only the part this node held (a fleet restart: every node restores its own; DIR may "
                        "hold {step}); no fallback: exit 1 when it has no whole copy, then run every node again")
    s.add_argument("--ranks", type=_ranks_arg, metavar="LIST",
                   help="only these ranks, e.g. 0-7,16 (a node taking over another's); with --node, the part "
                        "is committed under that node's name")
    s.add_argument("--force", action="store_true", help="replace whatever DIR holds")
    s.add_argument("--files", type=int, default=8, help="files fetched at once (default 8)")
    s.add_argument("--json", action="store_true", help="print the result as JSON (no progress bar)")
    s.set_defaults(fn=cmd_restore)
