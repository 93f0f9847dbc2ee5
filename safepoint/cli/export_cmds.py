"""`safepoint plot RUN --out FILE` and `safepoint export mlflow|wandb RUN`: a run's catalog, shown elsewhere.

`plot` draws safepoint.ops.trend (matplotlib, the `plot` extra); `export` records the run's verified
checkpoints as references in a tracker (safepoint.ops.export; the tracker's library is its extra).
Both only read the catalog; a missing library is one line, exit 2.
"""

from __future__ import annotations

import json
from typing import Any

from safepoint.cli.registry import step_arg
from safepoint.core.exits import EXIT_BAD, EXIT_OK


def register(commands: Any) -> None:
    s = commands.add_parser("plot")
    s.add_argument("run", metavar="RUN", help="run name")
    s.add_argument("--out", required=True, metavar="FILE", help="the picture to write: FILE.png or FILE.svg")
    s.add_argument("--last", type=int, default=None, metavar="N", help="only the N newest checkpoints")
    s.set_defaults(fn=cmd_plot)

    s = commands.add_parser("export")
    s.add_argument("tracker", choices=["mlflow", "wandb"], help="where to record the references")
    s.add_argument("run", metavar="RUN", help="run name")
    s.add_argument("--step", type=step_arg, action="append", dest="steps", metavar="STEP",
                   help="only this step (repeatable; default: every verified checkpoint)")
    s.add_argument("--tracking-uri", help="mlflow: tracking URI (default [export.mlflow] or $MLFLOW_TRACKING_URI)")
    s.add_argument("--experiment", help="mlflow: experiment (default [export.mlflow] experiment, else 'safepoint')")
    s.add_argument("--model", help="mlflow: registered model (default: the run's name)")
    s.add_argument("--project", help="wandb: project (default [export.wandb] project, else $WANDB_PROJECT)")
    s.add_argument("--entity", help="wandb: entity")
    s.add_argument("--json", action="store_true", help="print what was recorded as JSON")
    s.set_defaults(fn=cmd_export)


def cmd_plot(args: Any) -> int:
    from safepoint.cli.common import _catalog, err, out, run_hint
    from safepoint.cli.console import inert
    from safepoint.ops import trend

    if args.last is not None and args.last < 1:
        from safepoint.core.errors import UsageError

        raise UsageError("--last must be 1 or more")
    cat = _catalog(args, existing=True)
    hint = run_hint(cat, args.run)
    if hint:
        err.print(f"no checkpoints of run {inert(args.run)} in the catalog{inert(hint)}")
        return EXIT_BAD
    t = trend.run_trend(cat, args.run, last=args.last)
    path = trend.render(t, args.out)
    marked = [f"{p.step} ({', '.join(p.marks)})" for p in t.points if p.marks]
    out.print(inert(f"{path}: {len(t.points)} checkpoints of {args.run}, series: {', '.join(t.series) or 'none'}"
                    + (f"; marked: {', '.join(marked)}" if marked else "")))
    return EXIT_OK


def cmd_export(args: Any) -> int:
    from safepoint.cli.common import _catalog, err, out, run_hint
    from safepoint.cli.console import inert
    from safepoint.core.config import load_config
    from safepoint.ops import export

    config = load_config()
    given = ({"tracking_uri": args.tracking_uri, "experiment": args.experiment, "model": args.model}
             if args.tracker == "mlflow" else {"project": args.project, "entity": args.entity})
    options = export.options_for(args.tracker, config, **given)
    cat = _catalog(args, config, existing=True)
    refs = export.references(cat, args.run, args.steps)
    if not refs:
        err.print(f"no verified checkpoint of {inert(args.run)} with a verified replica to export"
                  + inert(run_hint(cat, args.run)))
        return EXIT_BAD
    done = export.export_run(cat, args.run, args.tracker, options, steps=args.steps)
    if args.json:
        print(json.dumps(done, indent=1))
    else:
        for d in done:
            where = (f"model {d['model']} version {d['version']}" if args.tracker == "mlflow"
                     else f"artifact {d['artifact']}:{','.join(d['aliases'])}")
            out.print(inert(f"{args.run}/{d['step']}: {where} -> {d.get('source') or d.get('reference')}"))
    return EXIT_OK
