"""Every `safepoint` command: its name, one line of help, and the modules that define its arguments.

`safepoint --help` lists the commands from this table alone; a command's modules are imported (with
their dependencies: rich tables, the catalog, Prefect) only once argparse has chosen that command.
So `safepoint verify` starts about as fast as `b3sum`, however many command groups there are.

A module named here has `register(commands)`, which adds the arguments and the handler (`fn`) of
its commands to `commands.add_parser(name)` (`Commands`: the parser made up front, returned again).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import textwrap
from collections.abc import Sequence
from typing import Any, NamedTuple

MAIN = "safepoint.cli.main"
CATALOG = "safepoint.cli.catalog_cmds"
EVENTS = "safepoint.cli.events_cmds"
REPAIR = "safepoint.cli.repair_cmds"

#: exit code lines shared by most commands
ERROR = "2  error: bad usage, or the catalog, storage or Prefect failed (one line `safepoint: error: ...`)"
OK = "0  done"


class Command(NamedTuple):
    """One command: a line for `safepoint --help`, a paragraph for its own help, its exit codes."""

    help: str
    modules: tuple[str, ...]
    exits: tuple[str, ...]
    description: str = ""


#: name -> Command; `safepoint --help` lists them in this order
COMMANDS: dict[str, Command] = {
    "commit": Command(
        "seal a folder written by any tool", (MAIN,),
        ("0  committed", ERROR + "; a symlink or a file changed while hashing is refused"),
        "Hash every file of DIR with BLAKE3, fsync it, write MANIFEST.json, then the COMMITTED marker last. "
        "Works on what torch.save, DCP, safetensors or a trainer wrote. The folder is then ready for "
        "`safepoint ingest` (or a watcher)."),
    "ingest": Command(
        "replicate, verify, validate and catalog one committed snapshot", (MAIN,),
        ("0  verified: every replica re-hashed and the load validation passed",
         "1  corrupt, invalid or incomplete (the reason is printed)", ERROR),
        "Run the ingest flow for the committed snapshot in DIR: copy it to every --to destination, read "
        "each copy back and check it against the manifest, run the dry-run load validation, and record "
        "the result in the catalog. A progress bar per destination shows on a terminal."),
    # events_cmds adds `watch --emit` and its options to the watch parser
    "watch": Command(
        "ingest committed snapshots that appear under ROOT", (MAIN, EVENTS),
        ("0  every snapshot ingested verified (with --emit: every marker confirmed)",
         "1  a snapshot was not verified (with --emit --once: markers left in the spool)", ERROR),
        "Watch ROOT for folders with a COMMITTED marker and ingest each one here; folders without a marker "
        "are ignored. With --emit, send one event per marker to the Prefect server instead, for "
        "`safepoint serve` or a deployment to ingest."),
    "ls": Command(
        "list checkpoints", (MAIN,), (OK, ERROR),
        "List checkpoints with their state, size, replicas, local copy, parent, pins and tags. On a terminal "
        "it is a table; piped or redirected, one line per checkpoint with every value whole."),
    "resume-point": Command(
        "the checkpoint to resume from", (MAIN,),
        ("0  found: its URL is printed", "1  no checkpoint qualifies (--explain says why)", ERROR),
        "The newest verified checkpoint of RUN with at least --min-replicas verified durable replicas, "
        "within the given limits."),
    "verify": Command(
        "re-hash a replica or local snapshot against its manifest", (MAIN,),
        ("0  every byte matches", "1  a file is missing or does not match", ERROR),
        "Read every file of a replica URL or a local snapshot folder, BLAKE3-hash it, compare it with the "
        "manifest, and record the result in the catalog where the catalog knows the copy."),
    "validate": Command(
        "dry-run load validation of a snapshot folder", (MAIN,),
        ("0  passed", "1  failed (each finding is printed)", ERROR),
        "Load every tensor of a local snapshot safely (never plain pickle), count NaN/Inf in model and "
        "optimizer state and, with --model, check a strict load against the model. The catalog is not used."),
    "prune": Command(
        "apply retention", (MAIN,),
        ("0  done (or planned, with --dry-run)", "2  a deletion failed (the next prune retries it), or error"),
        "Delete the checkpoints a retention policy does not keep. The newest verified checkpoint and the "
        "two newest good ones are always kept, and nothing goes while a newer checkpoint is pending. The "
        "policy comes from the flags or from [retention] / [runs.RUN] retention in config.toml."),
    "demo": Command(
        "train a tiny model, checkpoint it, corrupt one, run the pipeline, restore", (MAIN,),
        ("0  the demo ran and restored the resume point", "1  no resume point was found", ERROR),
        "Train a tiny model for 30 steps with three checkpoints, flip one bit in the last one, ingest all "
        "three, show the catalog and the resume point, delete the local copies and restore from the "
        "replica. It works in a temporary folder that it removes at the end (or in --dir, which it keeps)."),
    "lineage": Command(
        "the chain of checkpoints RUN STEP resumed or forked from", (CATALOG,),
        (OK, "1  no such checkpoint", ERROR)),
    "risk": Command(
        "corruption risk of a run's checkpoints vs what scrubs found", (CATALOG,),
        (OK, "1  no checkpoints recorded for the run", ERROR),
        "P(corrupted) = 1 - (1-ε)^(8·S) per checkpoint and for the run, the expected number of corrupted "
        "copies, what scrubs and verifies found, and a suggested scrub cadence."),
    "pin": Command("pin a checkpoint: retention never deletes it", (CATALOG,),
                   (OK, ERROR + "; also: no such checkpoint")),
    "tag": Command("add (or --remove) tags on a checkpoint", (CATALOG,), (OK, ERROR + "; also: no such checkpoint")),
    "metric": Command("record metrics on a checkpoint (for --keep-best)", (CATALOG,),
                      (OK, ERROR + "; also: no such checkpoint")),
    "evict": Command(
        "free node-local space: delete local copies that have a verified replica", (CATALOG,), (OK, ERROR),
        "Burst buffer: once ROOT is fuller than the high-water mark, delete the oldest local copies that "
        "have verified durable replicas until the fill is at the low-water mark."),
    "show": Command(
        "the validation report of one checkpoint (each failure: tensor and why)", ("safepoint.cli.validation_cmds",),
        ("0  the latest validation passed", "1  it failed, or the checkpoint was never validated or is unknown",
         ERROR)),
    "serve": Command(
        "run this node's ingests warm (--watch ROOT), or the event-triggered deployments", (EVENTS,),
        ("0  stopped (Ctrl-C or SIGTERM)", ERROR),
        "With --watch ROOT (a fleet's default): ingest each committed folder under ROOT in this long-lived "
        "process, each an ingest flow run Prefect sees, with no interpreter start per checkpoint. Without it, "
        "serve Safepoint's deployments from this process with Prefect's serve(): ingest on each "
        "safepoint.checkpoint.committed event, scrub and multi-node completeness on a schedule. No work pool "
        "is needed."),
    "metrics": Command("print Safepoint's Prometheus metrics once", (EVENTS,), (OK, ERROR)),
    "parts": Command(
        "completeness of multi-node checkpoints", (EVENTS,), (OK, ERROR),
        "For each multi-node checkpoint: the ranks delivered and missing, and the deadline. With --apply, "
        "sets past [multinode] timeout_s are marked incomplete."),
    "reconcile": Command(
        "repair the catalog from what the destinations hold", (REPAIR,),
        ("0  consistent, or repaired", "1  problems remain that need a person (corrupt without a good copy, "
         "conflicts, unreadable markers)", ERROR),
        "After a crash: adopt or confirm committed replicas (re-hashed), mark vanished ones, re-replicate "
        "bad replicas from a good copy, finish or abandon stuck ingests, and remove orphans untouched for "
        "the grace period."),
    "scrub": Command(
        "re-verify a rotating slice of every verified replica; repair rot", (REPAIR,),
        ("0  no rot, or all of it repaired", "1  a replica is left bad (no good copy to repair from)", ERROR)),
    "server": Command(
        "the local Prefect server used when PREFECT_API_URL is unset", ("safepoint.cli.server_cmds",),
        ("0  done (status: running)", "1  status: none running", ERROR),
        "start: start it ahead of time; status: print its address; stop: end it."),
    "automations": Command(
        "create or update the Prefect automations Safepoint ships", ("safepoint.cli.automation_cmds",),
        (OK, ERROR),
        "apply: a committed checkpoint not verified within --within seconds, and a checkpoint judged corrupt "
        "or invalid, each fire an automation (with --notify, a notification through that block)."),
    "restore": Command(
        "restore the resume point (or --step) into DIR, every byte verified", ("safepoint.cli.restore_cmds",),
        ("0  restored", "1  no whole copy of anything in scope (with --step, --node or --ranks: of that step or "
         "part)", ERROR),
        "Bring the resume point (or --step) back into DIR from the local copy or the replicas, every byte "
        "BLAKE3-verified as it arrives. A bad file is fetched from the next replica and the bad replica "
        "marked; without --step it falls back to the next older checkpoint when no copy is whole. On a "
        "fleet restart each node brings back its own part (--node, or --ranks) and all agree on the step: "
        "a node whose part has no whole copy records it and exits 1, and the round runs again "
        "(docs/fleet-restore.md)."),
    "plot": Command(
        "draw a run's parameter and optimizer-moment norms per step", ("safepoint.cli.export_cmds",),
        (OK, "1  no checkpoints of RUN in the catalog", ERROR + "; also: matplotlib missing (extra `plot`)"),
        "Draw the global L2 norm of the parameters and of each optimizer moment (exp_avg, exp_avg_sq, ...) of "
        "every validated checkpoint of RUN into a PNG or SVG, and mark the steps judged invalid, corrupt or "
        "stale. The norms are the ones the validation recorded (`safepoint show RUN STEP --tensors`)."),
    "export": Command(
        "record a run's verified checkpoints in MLflow or W&B (references only)", ("safepoint.cli.export_cmds",),
        ("0  recorded", "1  no verified checkpoint of RUN to export",
         ERROR + "; also: the tracker's library missing (extra `mlflow` / `wandb`)"),
        "Record each verified checkpoint of RUN in the tracker: its replica URL, the BLAKE3 digest of its "
        "manifest, its state, step and lineage parent. MLflow: a model version per checkpoint whose source is "
        "the replica; W&B: a reference artifact version per checkpoint, nothing uploaded. With [export.mlflow] "
        "or [export.wandb] in config.toml, every ingest does this for the checkpoint it verified."),
}


def step_arg(text: str) -> int:
    """The argparse type of every step argument: an integer in [0, 2**63 - 1], the catalog's BIGINT.

    It raises UsageError, not argparse's ArgumentTypeError, so a bad step is one `safepoint: error:`
    line (exit 2) like every other usage error, never an OverflowError from the database later.
    """
    from safepoint.core.errors import FormatError, UsageError
    from safepoint.core.format import check_step
    from safepoint.core.text import visible

    digits = text.strip()
    try:
        return check_step(int(digits) if digits.isascii() and digits.isdigit() else None)
    except FormatError:
        raise UsageError(f"invalid step {visible(text)!r}: must be an integer in [0, 2**63 - 1]") from None


def destination_arg(text: str) -> str:
    """The argparse type of `--to URL`: a file:// or s3:// URL with a query or fragment is refused while
    the command line is read (safepoint.destinations.check_path_only), before any server is started."""
    from safepoint.destinations import check_path_only

    check_path_only(text)
    return text


def count_arg(text: str) -> int:
    """The argparse type of a count (`--keep-last N`, `risk --last N`): an integer >= 0, else a usage error."""
    from safepoint.core.errors import UsageError
    from safepoint.core.text import visible

    digits = text.strip()
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 18:
        raise UsageError(f"invalid count {visible(text)!r}: must be a whole number, 0 or more")
    return int(digits)


def interval_arg(text: str) -> int:
    """A step interval (`--keep-every STEPS`): a count of at least 1."""
    from safepoint.core.errors import UsageError

    n = count_arg(text)
    if n < 1:
        raise UsageError(f"invalid interval {text!r}: must be 1 or more steps")
    return n


def parent_arg(text: str) -> tuple[str, int]:
    """The argparse type of `--parent RUN:STEP`: the run and a step as `step_arg` takes it."""
    from safepoint.core.errors import UsageError
    from safepoint.core.text import visible

    run, sep, step = text.rpartition(":")
    if not sep or not run:
        raise UsageError(f"--parent must be RUN:STEP, got {visible(text)!r}")
    return run, step_arg(step)


def paragraph(text: str) -> str:
    """A command's description wrapped to the terminal, as argparse would (its text is shown as given)."""
    return textwrap.fill(text, max(min(shutil.get_terminal_size().columns, 100) - 2, 40))


def epilog(command: Command) -> str:
    """The exit-code block at the end of a command's help."""
    return "exit codes:\n" + "\n".join(f"  {line}" for line in command.exits)


def add_global_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """--catalog and -v, accepted before the command (top) and after it (each command's parser)."""
    default = {} if top else {"default": argparse.SUPPRESS}  # a subcommand must not reset what came before
    parser.add_argument("--catalog", metavar="URL", help="catalog database URL (default: $SAFEPOINT_CATALOG_URL, "
                        "else sqlite in $SAFEPOINT_HOME/catalog.db)", **default)
    parser.add_argument("-v", "--verbose", action="store_true", help="tracebacks and Prefect's own log lines",
                        **default)


class Commands:
    """Every command's parser, made up front with its name, help and exit codes (0.2 ms each), and
    the arguments each one's modules add once it is chosen. argparse's public API only: the parsers
    come from `add_subparsers().add_parser`, and a module's `register(commands)` gets them back
    through `add_parser(name)` (the same parser, made once) or `choices[name]`."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self._sub = parser.add_subparsers(dest="command", required=True)
        self.choices: dict[str, argparse.ArgumentParser] = {}
        self._registered: set[str] = set()
        for name, command in COMMANDS.items():
            self.add_parser(name, help=command.help, description=paragraph(command.description or command.help),
                            epilog=epilog(command), formatter_class=argparse.RawDescriptionHelpFormatter)

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        """The parser of `name`: made on first call (with the global options), the same one after."""
        if name not in self.choices:
            self.choices[name] = self._sub.add_parser(name, **kwargs)
            add_global_options(self.choices[name], top=False)
        return self.choices[name]

    def load(self, name: str | None) -> None:
        """Import the modules that define `name` and let each register its commands (once per module)."""
        command = COMMANDS.get(name or "")
        for module in command.modules if command else ():
            if module not in self._registered:
                self._registered.add(module)
                importlib.import_module(module).register(self)

    def load_all(self) -> None:
        for name in COMMANDS:
            self.load(name)


def chosen(argv: Sequence[str]) -> str | None:
    """The command `argv` names: its first positional word (a global option's value skipped). Pure."""
    words = iter(argv)
    for word in words:
        if word == "--catalog":
            next(words, None)
        elif not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def add_commands(parser: argparse.ArgumentParser) -> Commands:
    """Every command of COMMANDS on `parser`; none of their modules is imported yet."""
    return Commands(parser)


def parse(parser: argparse.ArgumentParser, commands: Commands, argv: Sequence[str]) -> argparse.Namespace:
    """Load the chosen command's modules, then parse: only that command's dependencies are imported."""
    commands.load(chosen(argv))
    return parser.parse_args(argv)
