"""Command group for event-driven operation: `serve`, `watch --emit`, `metrics`, `parts`.

- `safepoint serve --watch ROOT` is the warm lane: this node's ingests run in this process, each an
  ingest flow run (`serve_warm`); without --watch, `safepoint serve` runs the ingest (event
  trigger), scrub and completeness deployments from one process with Prefect's `serve(...)`;
- `safepoint watch ROOT --emit` watches ROOT (inotify where available, polling otherwise) and
  emits one deterministic event per marker, confirmed through the catalog (safepoint.events);
  without `--emit`, `watch` ingests in-process as before (safepoint.cli.events_cmds.cmd_watch);
- `safepoint metrics` prints the Prometheus exposition once (`serve --metrics-port` serves it);
- `safepoint parts --run R` shows multi-node completeness and, with `--apply`, applies timeouts.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

from safepoint.core.errors import UsageError
from safepoint.core.exits import EXIT_BAD, EXIT_OK


def cmd_serve(args) -> int:
    from safepoint.cli.common import _catalog, err
    from safepoint.flows.deployments import api_url, build, serve_all
    from safepoint.ops import metrics

    api_url()
    if args.watch:
        return serve_warm(args)
    os.environ.setdefault("PREFECT_RUNNER_POLL_FREQUENCY", str(max(1, int(args.poll))))
    cat = _catalog(args)  # migrate before flows start, so schema errors surface plainly
    if args.catalog:
        os.environ["SAFEPOINT_CATALOG_URL"] = args.catalog  # for the flow runs this process starts
    if args.timeout is not None:
        os.environ["SAFEPOINT_MULTINODE_TIMEOUT_S"] = str(args.timeout)
    if args.metrics_port:
        metrics.serve(args.metrics_port, cat.url, addr=args.metrics_addr)
        err.print(f"metrics on http://{args.metrics_addr}:{args.metrics_port}/metrics")
    from safepoint.local.credentials import hide_credentials

    # Deployment defaults are stored by Prefect: credentials go by reference (safepoint.local.credentials).
    deployments = build([hide_credentials(u) or u for u in args.to], node=args.node, name=args.name,
                        scrub_every_s=args.scrub_every or None, scrub_subset=args.scrub_subset,
                        completeness_every_s=args.completeness_every or None)
    serve_all(deployments, limit=args.limit, query_seconds=args.poll, pause_on_shutdown=False,
              print_starting_message=args.verbose)
    return EXIT_OK


def serve_warm(args) -> int:
    """`safepoint serve --watch ROOT`: the warm lane, the fleet's default (docs/scale.md).

    This node's watcher runs each ingest of a part under ROOT (its own disks: node affinity by
    construction) as an ingest flow run in this long-lived process: no interpreter start, no work
    pool poll, no trigger; Prefect still sees the run, its two steps, their retries, logs and
    artifacts, through any of the API servers behind PREFECT_API_URL. A killed process loses
    nothing: the catalog holds what was done, and on restart the watcher offers every folder not
    yet in an end state again (reconcile, then the steps, each idempotent). Scrub and completeness
    stay deployments (`safepoint serve` without --watch, or prefect.yaml's, once per fleet); the
    watcher applies multi-node timeouts itself.
    """
    import argparse

    from safepoint.cli.common import watch_here

    if not args.to:
        raise UsageError("serve --watch needs --to URL (where this node's checkpoints go)")
    if args.metrics_port:
        from safepoint.cli.common import _catalog, err
        from safepoint.ops import metrics

        metrics.serve(args.metrics_port, _catalog(args).url, addr=args.metrics_addr)
        err.print(f"metrics on http://{args.metrics_addr}:{args.metrics_port}/metrics")
    if args.timeout is not None:
        os.environ["SAFEPOINT_MULTINODE_TIMEOUT_S"] = str(args.timeout)
    watch = argparse.Namespace(**vars(args))
    watch.root, watch.once, watch.interval = args.watch, False, args.poll
    watch.no_timeouts, watch.timeouts_every, watch.poll_only = not args.completeness_every, \
        args.completeness_every or 10.0, False
    from safepoint.flows.ingest import warm_process
    from safepoint.flows.watch import crash_orphaned_runs

    crashed = crash_orphaned_runs(args.watch)
    if crashed:
        from safepoint.cli.common import err

        err.print(f"marked {crashed} ingest run(s) of a stopped executor Crashed; their folders are ingested again")
    with warm_process():  # settings and the Prefect client once for the process, not once per ingest
        return watch_here(watch)


def cmd_watch(args) -> int:
    if not args.emit:
        from safepoint.cli.common import watch_here as ingest_here

        return ingest_here(args)
    from safepoint.cli.common import _catalog, err
    from safepoint.core.config import load_config
    from safepoint.core.naming import spool_dir, this_host
    from safepoint.events.markers import DEFAULT_DEPLOYMENT, Dispatcher, Policy, Spool
    from safepoint.events.watch import Emit, Watcher
    from safepoint.flows.deployments import api_url
    from safepoint.flows.gateway import PrefectGateway

    api_url()
    root = Path(args.root)
    if not root.is_dir():
        raise UsageError(f"{root}: not a directory")
    node = args.node or this_host()
    catalog = _catalog(args)
    spool = Spool(Path(args.spool) if args.spool else spool_dir(node))
    policy = Policy(confirm_after_s=args.confirm_after, retry_max_s=args.retry_max)
    dispatcher = Dispatcher(catalog, spool, PrefectGateway(args.deployment or DEFAULT_DEPLOYMENT), policy)
    from safepoint.local.credentials import hide_credentials

    to = [hide_credentials(u) or u for u in args.to]  # event payloads are stored by Prefect: credentials by reference
    watcher = Watcher(root, catalog, Emit(catalog, dispatcher, to, node), config=load_config(),
                      interval=args.interval, timeouts_every=None if args.no_timeouts else args.timeouts_every,
                      use_inotify=not args.poll_only, on_event=lambda text: err.print(text, markup=False))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    watcher.run(stop, once=args.once)
    return EXIT_OK if not spool.all() else EXIT_BAD


def cmd_metrics(args) -> int:
    from safepoint.cli.common import _catalog
    from safepoint.ops import metrics

    print(metrics.render(_catalog(args).url).decode(), end="")
    return EXIT_OK


def cmd_parts(args) -> int:
    from safepoint.cli.common import _catalog, out
    from safepoint.core.config import load_config
    from safepoint.ops import assemble

    cat = _catalog(args)
    config = load_config()
    if args.timeout is not None:
        os.environ["SAFEPOINT_MULTINODE_TIMEOUT_S"] = str(args.timeout)
    if args.apply:
        for a in assemble.check_completeness(cat, config, run=args.run):
            out.print(f"{a.run}/{a.step}: {a.state} ({a.assessment.summary()})", markup=False)
    rows = []
    for v in cat.list_checkpoints(args.run):
        if v.world_size <= 1:
            continue
        row = cat.get_by_id(v.id)
        a = assemble.assessment(cat, row, config)
        rows.append({"run": v.run, "step": v.step, "state": str(v.state), "world_size": v.world_size,
                     "delivered": list(row.delivered_ranks), "missing": list(a.missing),
                     "completeness": str(a.status), "deadline": a.deadline.isoformat() if a.deadline else None})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            miss = f", missing {r['missing']}" if r["missing"] else ""
            out.print(f"{r['run']}/{r['step']}: {r['state']}, {len(r['delivered'])}/{r['world_size']} ranks{miss}")
    return EXIT_OK


def register(sub) -> None:
    s = sub.add_parser("serve")
    s.add_argument("--watch", metavar="ROOT",
                   help="the warm lane (a fleet's default): ingest each committed folder under ROOT in this process, "
                        "each an ingest flow run; without it, the event-triggered deployments")
    s.add_argument("--to", action="append", default=[], metavar="URL",
                   help="destination URL(s): of the ingest deployment, or of --watch's ingests")
    s.add_argument("--model", help="with --watch: model factory package.module:function for a strict load check")
    s.add_argument("--node", help="only ingest markers from this node (deployment names get '-NODE')")
    s.add_argument("--name", default="ingest", help="ingest deployment name (default: ingest)")
    s.add_argument("--poll", type=float, default=2.0, help="seconds between the runner's polls (Prefect: 10)")
    s.add_argument("--limit", type=int, default=4, help="flow runs at once")
    s.add_argument("--scrub-every", type=float, default=3600.0, help="seconds between scrub passes; 0: none")
    s.add_argument("--scrub-subset", default="16", help="scrub slices: 'n' rotates through n slices")
    s.add_argument("--completeness-every", type=float, default=60.0,
                   help="seconds between multi-node completeness checks; 0: none")
    s.add_argument("--timeout", type=float, help="multi-node timeout in seconds ([multinode] timeout_s)")
    s.add_argument("--metrics-port", type=int, help="export Prometheus metrics on this port")
    s.add_argument("--metrics-addr", default="127.0.0.1", help="address for --metrics-port (default 127.0.0.1)")
    # --watch validates here: the sandbox's fork server holds torch, the executor never imports it
    s.set_defaults(fn=cmd_serve, prefect=True, validates=lambda a: bool(a.watch))

    w = sub.choices.get("watch")
    if w is not None:
        w.add_argument("--emit", action="store_true",
                       help="emit a deterministic event per marker to the Prefect server instead of ingesting here")
        w.add_argument("--node", help="this node's name in events (default: $SAFEPOINT_NODE or the host name)")
        w.add_argument("--spool", help="folder of unconfirmed markers (default: $SAFEPOINT_HOME/spool/NODE)")
        w.add_argument("--deployment", help="deployment for the run_deployment fallback (default: "
                                            "safepoint-ingest/ingest)")
        w.add_argument("--confirm-after", type=float, default=30.0,
                       help="seconds without a flow run before falling back to run_deployment")
        w.add_argument("--retry-max", type=float, default=30.0,
                       help="longest wait between retries while the Prefect server is down")
        w.add_argument("--poll-only", action="store_true", help="no inotify: rescan every --interval")
        w.add_argument("--no-timeouts", action="store_true", help="do not apply multi-node timeouts here")
        w.add_argument("--timeouts-every", type=float, default=10.0,
                       help="seconds between multi-node timeout checks (cheap catalog queries)")
        w.set_defaults(fn=cmd_watch, prefect=True)

    s = sub.add_parser("metrics")
    s.set_defaults(fn=cmd_metrics)

    s = sub.add_parser("parts")
    s.add_argument("--run", help="only this run")
    s.add_argument("--apply", action="store_true", help="apply timeouts now (mark lost sets incomplete)")
    s.add_argument("--timeout", type=float, help="override [multinode] timeout_s")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(fn=cmd_parts)
