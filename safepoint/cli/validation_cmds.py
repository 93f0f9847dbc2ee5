"""`safepoint show RUN STEP`: a checkpoint's validation report in the terminal.

Reads what the catalog recorded (the same report the validate task publishes as Prefect
artifacts): state, what was checked, every failure and warning with its tensor and why, the files,
and optionally the tensors with the largest norms. Exit 0 when the latest validation passed, 1 when
it failed or there is none.
"""

from __future__ import annotations

import json
from typing import Any

from rich.table import Table

from safepoint.cli.console import inert
from safepoint.cli.registry import step_arg
from safepoint.core.exits import EXIT_BAD, EXIT_OK
from safepoint.validation.report import consistency_line, finding_rows, tensor_rows


def register(subparsers: Any) -> None:
    s = subparsers.add_parser("show")
    s.add_argument("run", metavar="RUN", help="run name")
    s.add_argument("step", metavar="STEP", type=step_arg, help="training step")
    s.add_argument("--tensors", type=int, default=0, metavar="N",
                   help="also list N tensors (flagged first, then the largest norms)")
    s.add_argument("--json", action="store_true", help="the stored report (and stats with --tensors) as JSON")
    s.set_defaults(fn=cmd_show)


def cmd_show(args: Any) -> int:
    from safepoint.cli.common import _catalog, err, out, run_hint

    cat = _catalog(args, existing=True)
    row = cat.get(args.run, args.step)
    if row is None:
        err.print(f"no checkpoint {inert(args.run)}/{args.step} in the catalog{inert(run_hint(cat, args.run))}")
        return EXIT_BAD
    v = cat.latest_validation(row.id)
    if v is None:
        if args.json:
            print(json.dumps({"run": row.run, "step": row.step, "state": str(row.state), "validation": None}))
        else:
            err.print(f"{row.run}/{row.step}: {row.state}; never validated" + (f" ({inert(row.error)})" if row.error
                                                                                else ""))
        return EXIT_BAD
    doc = dict(v.report or {})
    stats = cat.tensor_stats(v.id) if args.tensors else []
    if args.json:
        payload = {"run": row.run, "step": row.step, "state": str(row.state), "validated_at": v.finished_at.isoformat()
                   if v.finished_at else None, "ok": v.ok, "report": doc}
        if args.tensors:
            payload["stats"] = stats
        print(json.dumps(payload, indent=1, default=str))
        return EXIT_OK if v.ok else EXIT_BAD

    color = "green" if v.ok else "red"
    out.print(f"[bold]{row.run}/{row.step}[/bold]: [{color}]{row.state}[/{color}]"
              + (f"  (validated {v.finished_at:%Y-%m-%d %H:%M:%S} UTC)" if v.finished_at else ""))
    out.print(inert(v.summary))
    checks = doc.get("checks") or {}
    h, a = checks.get("harness"), checks.get("audit")
    if h:
        step = h.get("step") or {}
        out.print(inert(f"strict load: {h.get('model')} (model under {h.get('model_key') or 'top level'!r}, optimizer "
                        f"{h.get('optimizer') or '-'} under {h.get('optimizer_key') or '-'!r}"
                        + (f", step {step.get('checkpoint')} vs catalog {step.get('catalog')}" if step else "") + ")"))
    else:
        out.print(inert("strict load: no model factory configured (--model, or model = ... under [runs.RUN])"))
    if a:
        out.print(inert(f"norm audit: against {a.get('against')}, {a.get('compared')} tensors compared, "
                        f"{a.get('flagged')} beyond x{a.get('norm_jump_factor')}"))
    else:
        out.print("norm audit: no earlier verified checkpoint of this run to compare with")
    consistency = consistency_line(doc)
    if consistency:
        out.print(inert(f"consistency: {consistency}"))

    rows = finding_rows(doc)
    for severity, title, style in (("fail", "Failures", "red"), ("warn", "Warnings", "yellow")):
        group = [r for r in rows if r["severity"] == severity]
        if not group:
            continue
        t = Table("tensor", "problem", "file", "why", title=f"{title} ({len(group)})", title_style=f"bold {style}",
                  expand=False)
        for r in group:
            t.add_row(inert(r["tensor"] or "-"), inert(r["problem"]), inert(r["file"]), inert(r["why"]), style=style)
        out.print(t)
    files = doc.get("files") or {}
    if files:
        notes = doc.get("not_loaded") or {}
        t = Table("file", "status", title="Files")
        for f, s in sorted(files.items()):
            status = inert(notes[f]) if s == "not loaded" and f in notes else inert(s)
            t.add_row(inert(f), status, style=None if s in ("ok", "skipped") else "yellow" if s == "not loaded"
                      else "red")
        for f, why in sorted(notes.items()):
            if f not in files:  # one entry of a file (a DCP bytes entry)
                t.add_row(inert(f), inert(why), style="yellow")
        out.print(t)
    if args.tensors:
        ranked = tensor_rows(doc, stats)
        ranked.sort(key=lambda r: (r["verdict"] == "ok", -_num(r["norm"])))
        t = Table("tensor", "file", "role", "verdict", "dtype", "shape", "norm", "max |x|", "NaN", "Inf",
                  title=f"Tensors ({min(args.tensors, len(ranked))} of {len(stats)})")
        for r in ranked[: args.tensors]:
            t.add_row(inert(r["tensor"]), inert(r["file"]), inert(r["role"]), r["verdict"], inert(r["dtype"]),
                      inert(r["shape"]), r["norm"], r["max_abs"], str(r["nan"]), str(r["inf"]),
                      style=None if r["verdict"] == "ok" else "red")
        out.print(t)
    return EXIT_OK if v.ok else EXIT_BAD


def _num(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("-inf")
