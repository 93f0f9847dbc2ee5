"""What both sides of the validation sandbox speak: problem kinds, read limits, the load error.

Apart from the loaders (which import torch) so that the process that judges a checkpoint, records
it and drives the sandbox never imports torch: only the sandboxed reader does
(safepoint.validation.reading).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

__all__ = ["MiB", "Limits", "LoadError", "OnProblem", "Problem", "ZIP_MAGIC", "one_line", "raise_problem"]

ZIP_MAGIC = b"PK\x03\x04"  # torch.save's zip format: torch.load maps such a file whole (address space)

MiB = 1024 * 1024


class Problem(str, Enum):
    """Why a file or a tensor failed validation."""

    NAN = "nan"                  # a tensor holds NaN values
    INF = "inf"                  # a tensor holds +/-inf values
    UNLOADABLE = "unloadable"    # the loader failed (truncated, corrupt, unsupported)
    UNSAFE = "unsafe"            # loading would run code or escape the folder: refused
    OPAQUE = "opaque"            # a pickle the weights-only unpickler refuses (no code named): not loaded
    MALFORMED = "malformed"      # the bytes break the format (bad header, bad offsets, bad metadata)
    MISSING = "missing"          # a file the snapshot needs is absent
    CHANGED = "changed"          # the bytes read are not the manifest's (rewritten since the commit): corrupt
    # Strict dry-run load against the model factory (safepoint.validation.harness):
    MISSING_KEY = "missing_key"        # the model expects a tensor the checkpoint lacks
    UNEXPECTED_KEY = "unexpected_key"  # the checkpoint has a model tensor the model does not know
    SHAPE = "shape"                    # a tensor's shape differs from the model's
    DTYPE = "dtype"                    # a tensor's dtype differs from the model's
    OPTIMIZER = "optimizer"            # optimizer state does not match the optimizer's parameter groups
    STEP = "step"                      # the step recorded inside the checkpoint is not the catalog's
    LOAD = "load"                      # the model's own load_state_dict (dry run on meta) refused it
    # Numerical audit against the previous verified checkpoint (safepoint.validation.audit):
    NORM_JUMP = "norm_jump"            # a tensor's norm moved by more than the configured factor
    MAGNITUDE = "magnitude"            # a parameter's |x| beyond max_abs_parameter (safepoint.rules.magnitude)
    # Consistency with the previous verified checkpoint (safepoint.rules.consistency), named as its rules:
    STALE_OPTIMIZER = "stale_optimizer"  # every optimizer tensor byte-identical while the parameters moved
    STALE_WEIGHTS = "stale_weights"      # every parameter byte-identical while the optimizer state moved
    DUPLICATE = "duplicate"              # the whole state byte-identical to an earlier step
    TORN = "torn"                        # the optimizer's step counter disagrees with the trainer's or the catalog's
    # The validation sandbox (safepoint.validation.sandbox):
    LIMIT = "limit"                    # validation ran past its memory, CPU or wall-clock limit

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Limits:
    """Bounds on what validation will read or allocate for one file (bounded memory)."""

    max_safetensors_header_bytes: int = 100 * MiB
    max_dcp_metadata_bytes: int = 512 * MiB
    max_dcp_metadata_objects: int = 4_000_000  # objects made and memo entries fetched while decoding .metadata
    max_dcp_bytes_entry: int = 64 * MiB       # a non-tensor DCP entry (e.g. param_groups)
    max_tensor_bytes: int | None = None       # refuse to materialize a bigger tensor (None: no limit)
    stats_chunk_elems: int = 1 << 20          # elements per piece when computing stats (fits in L2/L3)
    max_nesting: int = 200                    # depth of nested dicts/lists walked in a loaded object


class LoadError(Exception):
    """A file (or one tensor of it) could not be validated; `problem` says why, message is one line."""

    def __init__(self, problem: Problem, message: str, *, file: str | None = None, tensor: str | None = None):
        super().__init__(message)
        self.problem = problem
        self.message = message
        self.file = file
        self.tensor = tensor


# on_problem(LoadError) receives non-fatal problems (one tensor, one referenced file) and lets the
# loader continue; a fatal problem is raised instead.
OnProblem = Callable[[LoadError], None]


def raise_problem(err: LoadError) -> None:
    raise err


def one_line(exc: BaseException, limit: int = 300) -> str:
    """A short one-line description of an exception (no tracebacks, no paragraphs)."""
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    boiler = ("Weights only load failed", "Please file an issue", "Check the documentation", "In PyTorch 2.6")
    useful = [ln for ln in lines if not ln.startswith(boiler)]
    msg = (useful or lines or [""])[0]
    if msg.startswith("WeightsUnpickler error:"):
        msg = msg[len("WeightsUnpickler error:"):].strip() or (useful[1] if len(useful) > 1 else msg)
    msg = f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."
