"""Catalog commands: lineage, corruption risk, pins, tags, metrics, burst-buffer eviction.

Registered by safepoint.cli.main through `register(subparsers)`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.table import Table

from safepoint.cli.common import EXIT_BAD, EXIT_OK, _catalog, err, out, run_hint
from safepoint.cli.console import inert
from safepoint.cli.registry import count_arg, step_arg
from safepoint.core.errors import UsageError


def _row(cat: Any, run: str, step: int) -> Any:
    row = cat.get(run, step)
    if row is None:
        raise UsageError(f"no checkpoint {run}/{step} in the catalog{run_hint(cat, run)}")
    return row


# -- lineage ---------------------------------------------------------------------------------

def cmd_lineage(args: argparse.Namespace) -> int:
    cat = _catalog(args, existing=True)
    chain = cat.lineage(args.run, args.step)
    if not chain:
        err.print(f"no checkpoint {inert(args.run)}/{args.step} in the catalog{inert(run_hint(cat, args.run))}")
        return EXIT_BAD
    kids = cat.children(args.run, args.step)
    # A step re-saved after a resume from an older one: each earlier version is an abandoned branch.
    abandoned = [e["detail"] for e in cat.events(chain[0].id, kind="resealed")] if chain[0].id else []

    def branch(d: dict[str, Any]) -> dict[str, Any]:
        return {"version": d.get("version"), "manifest_blake3": d.get("old_manifest_blake3"),
                "parent": d.get("old_parent"), "replicas_superseded": d.get("replicas_superseded", [])}

    def doc(link: Any) -> dict[str, Any]:
        return {"run": link.run, "step": link.step, "state": str(link.state) if link.state else None,
                "cataloged": link.id is not None, "relation": link.relation,
                "created": link.created_at.isoformat() if link.created_at else None}

    if args.json:
        print(json.dumps({"chain": [doc(x) for x in chain], "children": [doc(x) for x in kids],
                          "abandoned": [branch(d) for d in abandoned]}, indent=1))
        return EXIT_OK
    first = chain[0]
    out.print(f"{first.run}/{first.step} ({first.state})")
    for prev, link in zip(chain, chain[1:]):
        what = f"{link.state}" if link.state else "not in the catalog"
        out.print(f"  <- {prev.relation} from {link.run}/{link.step} ({what})")
    for k in kids:
        out.print(f"  -> {k.relation} as {k.run}/{k.step} ({k.state})")
    for d in abandoned:
        b = branch(d)
        was = f"{b['parent']['run']}/{b['parent']['step']}" if b["parent"] else "none"
        out.print(f"  x  re-saved after a resume: an abandoned branch's {first.run}/{first.step} (manifest "
                  f"{str(b['manifest_blake3'])[:12]}, parent {was}) was replaced", markup=False)
    return EXIT_OK


# -- risk --------------------------------------------------------------------------------------

def cmd_risk(args: argparse.Namespace) -> int:
    from safepoint.rules.risk import assess

    cat = _catalog(args, existing=True)
    cks, events, states = cat.risk_inputs(args.run)
    if not cks:
        err.print(inert(f"no checkpoints recorded for run {args.run!r}{run_hint(cat, args.run)}"))
        return EXIT_BAD
    r = assess(args.run, cks, events, states, ber=args.ber, target=args.target)
    if args.json:
        print(json.dumps(r.to_dict(), indent=1, default=str))
        return EXIT_OK
    rows = r.checkpoints if args.all else r.checkpoints[-args.last:]
    table = Table("step", "state", "bytes", "copies", "P(corrupted)",
                  title=f"{inert(args.run)}, ε = {args.ber:g} per bit")
    for c in rows:
        table.add_row(str(c.step), str(c.state), f"{c.total_bytes:,}", str(c.copies), f"{c.p:.3e}")
    out.print(table)
    if len(rows) < len(r.checkpoints):
        out.print(f"({len(r.checkpoints) - len(rows)} older checkpoints not shown; --all shows them)")
    f = r.findings
    out.print(f"run so far: {len(r.checkpoints)} checkpoints, {r.total_bytes:,} bytes")
    out.print(f"  P(at least one corrupted)      {r.p_any:.3e}")
    out.print(f"  expected corrupted checkpoints {r.expected_corrupted:.3e}")
    out.print(f"  expected corrupted copies      {r.expected_corrupted_copies:.3e}")
    out.print(f"found: {f.detections} corrupt detection(s) on {f.checkpoints_affected} checkpoint(s); "
              f"now {f.corrupt_now} corrupt and {f.missing_now} missing replica(s); {f.scrub_events} scrub/verify "
              "event(s)")
    hours = r.cadence.total_seconds() / 3600
    out.print(f"suggested scrub cadence: every {hours:.1f} h ({r.cadence_basis})")
    for n in r.notes:
        out.print(f"note: {n}")
    return EXIT_OK


# -- pins, tags, metrics -----------------------------------------------------------------------

def cmd_pin(args: argparse.Namespace) -> int:
    cat = _catalog(args, existing=True)
    row = _row(cat, args.run, args.step)
    cat.set_pinned(row.id, not args.off)
    out.print(f"{inert(args.run)}/{args.step}: {'unpinned' if args.off else 'pinned'}")
    return EXIT_OK


def cmd_tag(args: argparse.Namespace) -> int:
    cat = _catalog(args, existing=True)
    row = _row(cat, args.run, args.step)
    tags = set(row.tags) - set(args.tags) if args.remove else set(row.tags) | set(args.tags)
    cat.set_tags(row.id, tags)
    out.print(inert(f"{args.run}/{args.step}: tags {', '.join(sorted(tags)) or '-'}"))
    return EXIT_OK


def cmd_metric(args: argparse.Namespace) -> int:
    cat = _catalog(args, existing=True)
    row = _row(cat, args.run, args.step)
    metrics = dict(row.metrics)
    for item in args.values:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(f"metric must be NAME=VALUE, got {item!r}")
        try:
            metrics[name] = float(value)
        except ValueError:
            raise UsageError(f"metric {name}: {value!r} is not a number") from None
    cat.set_metrics(row.id, metrics)
    out.print(inert(f"{args.run}/{args.step}: " + ", ".join(f"{k}={v:g}" for k, v in sorted(metrics.items())
                                                           if isinstance(v, (int, float)))))
    return EXIT_OK


# -- eviction ----------------------------------------------------------------------------------

def cmd_evict(args: argparse.Namespace) -> int:
    from safepoint.ops.evict import evict

    if args.min_replicas < 1:
        raise UsageError(f"--min-replicas must be at least 1, got {args.min_replicas}")
    if args.keep_local is not None and args.keep_local < 1:
        raise UsageError(f"--keep-local must be at least 1, got {args.keep_local}")
    res = evict(_catalog(args), args.root, high_water=args.high_water, low_water=args.low_water,
                capacity_bytes=args.capacity, min_replicas=args.min_replicas, keep_newest=args.keep_newest,
                dry_run=args.dry_run, keep_local=args.keep_local)
    p = res.plan
    if args.json:
        print(json.dumps({
            "root": args.root, "used": p.usage.used, "total": p.usage.total, "fill": p.usage.fill,
            "high_water": p.high_water, "low_water": p.low_water, "projected_fill": p.projected_fill,
            "keep_local": p.keep_local,
            "decisions": [{"run": d.copy.run, "step": d.copy.step, "path": d.copy.path, "bytes": d.size,
                           "evict": d.evict, "reason": d.reason} for d in p.decisions],
            "evicted": res.evicted, "skipped": res.skipped, "dry_run": args.dry_run}, indent=1))
        return EXIT_OK
    if p.keep_local is not None:
        out.print(f"{inert(args.root)}: keeping the newest {p.keep_local} verified local checkpoint(s) of each run")
    else:
        out.print(f"{inert(args.root)}: fill {100 * p.usage.fill:.1f}% (high water {100 * p.high_water:.0f}%, "
                  f"target {100 * p.low_water:.0f}%)")
    for d in p.decisions:
        verb = ("would evict" if args.dry_run else "evict") if d.evict else "keep"
        out.print(inert(f"{verb:11} {d.copy.run}/{d.copy.step} {d.copy.path} ({d.size:,} bytes): {d.reason}"))
    if not args.dry_run:
        out.print(f"evicted {len(res.evicted)} local copies" +
                  (f"; {len(res.skipped)} skipped (changed since planning)" if res.skipped else ""))
    return EXIT_OK


def register(sub: Any) -> None:
    s = sub.add_parser("lineage")
    s.add_argument("run", metavar="RUN", help="run name")
    s.add_argument("step", metavar="STEP", type=step_arg, help="training step")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(fn=cmd_lineage)

    s = sub.add_parser("risk")
    s.add_argument("--run", required=True, help="run name")
    s.add_argument("--ber", type=float, default=1e-15, help="bit error rate ε, per bit (default 1e-15)")
    s.add_argument("--target", type=float, default=0.01,
                   help="tolerated expected undetected corrupted copies between scrubs (default 0.01)")
    s.add_argument("--last", type=count_arg, default=20, help="checkpoints to list (default the last 20)")
    s.add_argument("--all", action="store_true", help="list every checkpoint")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(fn=cmd_risk)

    s = sub.add_parser("pin")
    s.add_argument("run", metavar="RUN", help="run name")
    s.add_argument("step", metavar="STEP", type=step_arg, help="training step")
    s.add_argument("--off", action="store_true", help="unpin")
    s.set_defaults(fn=cmd_pin)

    s = sub.add_parser("tag")
    s.add_argument("run", metavar="RUN", help="run name")
    s.add_argument("step", metavar="STEP", type=step_arg, help="training step")
    s.add_argument("tags", nargs="+", metavar="TAG", help="tags to add (or remove)")
    s.add_argument("--remove", action="store_true", help="remove these tags instead")
    s.set_defaults(fn=cmd_tag)

    s = sub.add_parser("metric")
    s.add_argument("run", metavar="RUN", help="run name")
    s.add_argument("step", metavar="STEP", type=step_arg, help="training step")
    s.add_argument("values", nargs="+", metavar="NAME=VALUE", help="metrics, e.g. val_loss=2.31")
    s.set_defaults(fn=cmd_metric)

    s = sub.add_parser("evict")
    s.add_argument("root", help="the node-local checkpoint root (e.g. /nvme/ckpt)")
    s.add_argument("--high-water", type=float, default=0.85, help="evict when the fill passes this (0-1)")
    s.add_argument("--low-water", type=float, help="evict down to this fill (default high water - 0.10)")
    s.add_argument("--capacity", type=int, metavar="BYTES",
                   help="measure the fill as bytes under ROOT against this quota, not the filesystem's")
    s.add_argument("--min-replicas", type=int, default=1,
                   help="verified durable replicas a copy needs before it may be evicted (default 1)")
    s.add_argument("--keep-newest", type=int, default=1, help="local copies kept per run for fast restarts")
    s.add_argument("--keep-local", type=int, metavar="N",
                   help="whatever the fill: keep each run's newest N verified local copies (and any newer); "
                        "delete older ones that have a verified replica (what keep_local=N runs)")
    s.add_argument("--dry-run", action="store_true", help="print the plan; delete nothing")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(fn=cmd_evict)
