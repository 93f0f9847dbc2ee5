"""Command `safepoint automations apply`: the Prefect automations Safepoint ships (flows/automations.py)."""

from __future__ import annotations

from safepoint.core.errors import UsageError
from safepoint.core.exits import EXIT_OK


def cmd_automations(args) -> int:
    from safepoint.cli.common import out
    from safepoint.flows import automations
    from safepoint.flows.deployments import api_url

    api_url()  # automations are evaluated by a server: a temporary one would forget them
    if args.within < 10:  # Prefect's floor for proactive triggers
        raise UsageError(f"--within must be at least 10 seconds, got {args.within:g}")
    notify = automations.notification_block(args.notify) if args.notify else None
    for name, ident, verb in automations.apply(automations.definitions(args.within, notify)):
        out.print(f"{verb} automation {name} ({ident})")
    return EXIT_OK


def register(sub) -> None:
    s = sub.add_parser("automations")
    s.add_argument("action", choices=["apply"], help="create the automations, or update them by name")
    s.add_argument("--within", type=float, default=1800.0, metavar="SECONDS",
                   help="a committed checkpoint not verified within this long fires (default 1800)")
    s.add_argument("--notify", metavar="TYPE/NAME",
                   help="a Prefect notification block to send to, e.g. slack-webhook/oncall (default: none; "
                        "the firing shows in Prefect's event feed)")
    s.set_defaults(fn=cmd_automations, prefect=True)
