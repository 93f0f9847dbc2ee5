"""Every `safepoint` command: its name, one line of help, and the modules that define its arguments.

`safepoint --help` lists the commands from this table alone; a command's modules are imported (with
their dependencies: rich tables, the catalog, Prefect) only once argparse has chosen that command.
So `safepoint verify` starts about as fast as `b3sum`, however many command groups there are.

A module named here has `register(subparsers)`, which adds the arguments and the handler (`fn`) of
its commands to `subparsers.add_parser(name)`. Until a command's modules have registered it,
`subparsers.choices[name]` is None (so a module that extends another's command skips it then).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

MAIN = "safepoint.cli.main"

#: name -> (help, modules that add its arguments, in order); `safepoint --help` lists them in this order
COMMANDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "commit": ("seal a folder written by any tool", (MAIN,)),
    "ingest": ("replicate, verify, validate and catalog one committed snapshot", (MAIN,)),
    # events_cmds adds `watch --emit` and its options to the watch parser
    "watch": ("ingest committed snapshots that appear under ROOT", (MAIN, "safepoint.cli.events_cmds")),
    "ls": ("list checkpoints", (MAIN,)),
    "resume-point": ("the checkpoint to resume from", (MAIN,)),
    "verify": ("re-hash a replica or local snapshot against its manifest", (MAIN,)),
    "validate": ("dry-run load validation of a snapshot folder", (MAIN,)),
    "prune": ("apply retention (invariants: the newest verified and at least two verified are kept; nothing "
              "goes while a newer checkpoint is pending)", (MAIN,)),
    "demo": ("train a tiny model, checkpoint it, corrupt one, run the pipeline", (MAIN,)),
    "lineage": ("the chain of checkpoints RUN STEP resumed or forked from", ("safepoint.cli.catalog_cmds",)),
    "risk": ("corruption risk of a run's checkpoints vs what scrubs found", ("safepoint.cli.catalog_cmds",)),
    "pin": ("pin a checkpoint: retention never deletes it", ("safepoint.cli.catalog_cmds",)),
    "tag": ("add (or --remove) tags on a checkpoint", ("safepoint.cli.catalog_cmds",)),
    "metric": ("record metrics on a checkpoint (for --keep-best)", ("safepoint.cli.catalog_cmds",)),
    "evict": ("free node-local space: delete local copies that have a verified replica",
              ("safepoint.cli.catalog_cmds",)),
    "show": ("the validation report of one checkpoint (each failure: tensor and why)",
             ("safepoint.cli.validation_cmds",)),
    "serve": ("run the ingest (event-triggered), scrub and completeness deployments here",
              ("safepoint.cli.events_cmds",)),
    "metrics": ("print Safepoint's Prometheus metrics once", ("safepoint.cli.events_cmds",)),
    "parts": ("completeness of multi-node checkpoints", ("safepoint.cli.events_cmds",)),
    "reconcile": ("repair the catalog from what the destinations hold; remove orphans older than the grace "
                  "period", ("safepoint.cli.repair_cmds",)),
    "scrub": ("re-verify a rotating slice of every verified replica; repair rot", ("safepoint.cli.repair_cmds",)),
    "server": ("the local Prefect server used when PREFECT_API_URL is unset", ("safepoint.cli.server_cmds",)),
    "restore": ("restore the resume point (or --step) into DIR, every byte verified", ("safepoint.cli.restore_cmds",)),
}


class LazySubParsers(argparse._SubParsersAction):
    """Subcommands declared up front (name and help); each one's modules register it when it is chosen."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._modules: dict[str, tuple[str, ...]] = {}
        self._registered: set[str] = set()

    def declare(self, name: str, help: str, modules: Sequence[str]) -> None:  # noqa: A002 - argparse's word
        """List `name` in help and choices; its parser (0.2 ms each) is made when its module registers it."""
        self._choices_actions.append(self._ChoicesPseudoAction(name, (), help))
        self._name_parser_map[name] = None  # a valid choice, not yet a parser: `choices.get(name)` is None
        self._modules[name] = tuple(modules)

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        """The parser of `name`: declared ones keep the registry's help; undeclared ones are added as usual."""
        if name not in self._modules:
            return super().add_parser(name, **kwargs)
        if self._name_parser_map[name] is None:
            kwargs.pop("help", None)
            self._name_parser_map[name] = self._parser_class(prog=f"{self._prog_prefix} {name}", **kwargs)
        return self._name_parser_map[name]

    def load(self, name: str) -> None:
        """Import the modules that define `name` and let each register its commands (once per module)."""
        for module in self._modules.get(name, ()):
            if module not in self._registered:
                self._registered.add(module)
                importlib.import_module(module).register(self)

    def load_all(self) -> None:
        for name in list(self._modules):
            self.load(name)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        self.load(values[0])
        super().__call__(parser, namespace, values, option_string)


def add_commands(parser: argparse.ArgumentParser) -> LazySubParsers:
    """Declare every command of COMMANDS on `parser`; none of their modules is imported yet."""
    sub = parser.add_subparsers(dest="command", required=True, action=LazySubParsers)
    for name, (text, modules) in COMMANDS.items():
        sub.declare(name, text, modules)
    return sub
