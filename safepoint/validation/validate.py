"""Dry-run load validation of a snapshot folder: every tensor loads, safely, with bounded memory.

`validate_snapshot(folder)` reads every checkpoint file of a snapshot the safe way (torch.save files
with the weights-only unpickler, memory-mapped; safetensors after checking the header; DCP folders
with a restricted metadata unpickler and no process group) and streams every tensor, model and
optimizer state alike, piece by piece through the numerical audit (safepoint.validation.audit: NaN/Inf, L2
norm, max |x|). Peak memory is one piece per tensor, not one file: read pages are released as soon
as they are used.

A verdict is bound to the manifest (`digests`): every file is hashed with BLAKE3 just before it is
loaded (one read from disk: the loader then reads the page cache) and checked against the manifest's
digest, and its identity (inode, size, mtime, ctime) is checked unchanged once it was read. A file
rewritten since the commit (a trainer re-saving the step while the ingest runs) is never judged: it
is a CHANGED finding and the report's outcome is `corrupt`, so a verdict on other bytes than those
replicated is never recorded as the checkpoint's.

On top of what loading alone catches, validation can run:
- a strict dry-run load against the user's model factory (safepoint.validation.harness): missing, unexpected
  and renamed keys, shape and dtype mismatches, optimizer state vs parameter groups, recorded step
  vs the catalog's step;
- a norm-jump audit against the previous verified checkpoint of the run (`baseline`);
- the consistency rules against it (safepoint.rules.consistency): a stale optimizer or stale weights,
  a duplicate of an earlier step, step counters that tear (safepoint.validation.consistency).

Every tensor has a role (safepoint.validation.roles: parameter, buffer, optimizer state, trainer metadata, RNG
state, unknown); the rules table says per role whether NaN/Inf fail or are reported as warnings,
and whether the norm-jump audit compares it. Files are classified before anything loads them
(safepoint.validation.loaders.kinds): a pickle that the weights-only unpickler refuses and an unknown format are
"not loaded" (hashed and replicated, not damage, unless `opaque_pickle`/`unknown_format = "fail"`);
a file that claims a known format and does not parse is damage. The step a trainer recorded
(safepoint.validation.layouts) is checked against the catalog's.

Results are data (ValidationReport), never exceptions: a file that cannot be loaded is a finding,
not a crash. Only a model factory that cannot be built raises (HarnessError: a usage error, not a
verdict on the checkpoint). Problems listed in `warn_only` are reported as warnings.

Extension points: `iter_file_leaves(path)` / `iter_file_tensors(path)` (safepoint.validation.loaders) give the
leaves or tensors of any supported file; `tensor_stat(name, t)` computes stats of one tensor.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safepoint.core.errors import FormatError
from safepoint.core.format import CONTROL_FILES, TMP_PREFIX, safe_relpath
from safepoint.validation.judge import FILE_INVALID, Finding, Judge, ValidationReport
from safepoint.validation.layouts import RecordedStep
from safepoint.validation.problems import ZIP_MAGIC, Limits, LoadError, Problem
from safepoint.validation.sandbox import run_limited
from safepoint.validation.settings import ValidationSettings
from safepoint.validation.stats import Baseline, TensorStat, baseline_heads

if TYPE_CHECKING:
    from safepoint.validation.harness import Harness

__all__ = [
    "Finding", "Limits", "LoadError", "Problem", "TensorStat", "ValidationReport", "ValidationSettings",
    "validate_snapshot",
]

# The sandboxed child's work, by name: the child imports it (and torch), this process never does.
READER = "safepoint.validation.reading:read_files"
# Names this module offers that live with the torch-importing readers: loaded on first use.
_READER_NAMES = {"iter_file_tensors": "safepoint.validation.loaders", "iter_tensors": "safepoint.validation.loaders",
                 "tensor_stat": "safepoint.validation.audit"}


def __getattr__(name: str) -> Any:
    if name in _READER_NAMES:
        import importlib

        return getattr(importlib.import_module(_READER_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------ walking

def _walk_folder(folder: Path) -> tuple[list[str], list[str]]:
    """(data files, unsafe entries) under folder, as relative '/' paths; control and temp files skipped."""
    files: list[str] = []
    unsafe: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        rel_dir = Path(dirpath).relative_to(folder)
        for d in list(dirnames):
            if os.path.islink(os.path.join(dirpath, d)):
                unsafe.append((rel_dir / d).as_posix())
                dirnames.remove(d)
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            if name.startswith(TMP_PREFIX) or (rel_dir == Path(".") and name in CONTROL_FILES):
                continue
            files.append(rel)
    return sorted(files), sorted(unsafe)


def validate_snapshot(
    folder: str | os.PathLike, files: Iterable[str] | None = None, *, limits: Limits | None = None,
    model: str | Harness | None = None, settings: ValidationSettings | None = None, step: int | None = None,
    baseline: Baseline | None = None, digests: dict[str, str] | None = None,
) -> ValidationReport:
    """Dry-run load every checkpoint file of a snapshot folder; return a report (never raises for bad data).

    files: the data files' relative paths (from the manifest); None walks the folder, skipping
    MANIFEST.json, COMMITTED and temporary files. DCP tensors are reported under the `.metadata`
    path as their file.
    model: a factory spec `package.module:function` (or a built Harness) for the strict dry-run
    load; it overrides settings.model. step: the catalog's step, checked against the checkpoint's.
    baseline: stats of the previous verified checkpoint, for the norm-jump audit and the consistency rules.
    digests: the manifest's BLAKE3 by path; a file whose bytes differ is a CHANGED finding, never judged.
    Raises HarnessError (a UsageError) when the model factory cannot be built.
    """
    settings = settings or ValidationSettings()
    if limits is not None:
        settings = replace(settings, limits=limits)
    spec = model if model is not None else settings.model
    if isinstance(spec, str):
        from safepoint.validation.harness import build_harness  # torch: only with a model factory

        harness = build_harness(spec, settings.device)
    else:
        harness = spec
    root = Path(folder)
    heads = baseline_heads(baseline)
    if settings.sandbox.enabled:
        v = Judge(root, settings, heads, digests)   # the files are read in the sandboxed child
    else:
        from safepoint.validation.reading import Reader  # read here: this process imports torch

        v = Reader(root, settings, heads, digests)
    if not root.is_dir():
        v.find(".", Problem.MISSING, f"{os.fspath(folder)}: snapshot folder missing")
        return v.report
    if files is None:
        file_list, unsafe = _walk_folder(root)
        for rel in unsafe:
            v.status(rel, FILE_INVALID)
            v.find(rel, Problem.UNSAFE, f"{rel}: symbolic link (snapshots hold regular files only)")
    else:
        file_list = sorted(dict.fromkeys(files))
    if settings.sandbox.enabled:
        _run_in_sandbox(v, file_list)
    else:
        v.read(file_list)
    unreadable = any(f.problem in (Problem.UNSAFE, Problem.UNLOADABLE, Problem.MALFORMED, Problem.MISSING,
                                   Problem.LIMIT, Problem.CHANGED)
                     for f in v.report.findings)
    if harness is not None and not unreadable:
        v.run_harness(harness, step)
    if baseline is not None and not unreadable:
        v.run_audit(baseline)
    if not unreadable:
        v.run_bounds()
        v.run_consistency(baseline, step)
    if settings.check_step and not unreadable:
        v.run_step_check(step)
    return v.report


# ------------------------------------------------------------------------------------------ the sandbox

def _finding(d: dict[str, Any]) -> Finding:
    return Finding(str(d["file"]), d.get("tensor"), Problem(d["problem"]), str(d["message"]), d.get("role"))


def _input_bytes(folder: Path, files: list[str]) -> tuple[int, int]:
    """(bytes of the files, bytes of those torch.load maps whole: the zip format)."""
    total = mapped = 0
    for rel in files:
        try:
            path = folder / safe_relpath(rel)
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                continue  # a link or a special file: refused by the validator, never opened here
            with open(path, "rb") as f:
                head = f.read(len(ZIP_MAGIC))
        except (OSError, FormatError):
            continue
        total += st.st_size
        mapped += st.st_size if head == ZIP_MAGIC else 0
    return total, mapped


def _run_in_sandbox(v: Judge, files: list[str]) -> None:
    """v.run(files) in a child process with memory, CPU and wall-clock limits (safepoint.validation.sandbox)."""
    limits = v.settings.sandbox
    nbytes, mapped = _input_bytes(v.folder, files)
    out = run_limited(READER, (os.fspath(v.folder), files, v.settings, v.heads, v.digests), limits, input_bytes=nbytes,
                      mapped_bytes=mapped)
    v.report.checks["sandbox"] = {"limit": out.limit, "usage": out.usage}
    if not out.ok:
        where = out.last_note or "."
        v.status(where, FILE_INVALID)
        if out.limit:
            v.find(where, Problem.LIMIT, f"{where}: {out.limit}")
        else:
            v.find(where, Problem.UNLOADABLE, f"{where}: validation failed: {out.error}")
        v.unbound(files)  # a file truncated under the reader's map kills it: that is no verdict on the bytes
        return
    doc = out.value
    for rel, status in doc["files"].items():
        v.status(rel, status)
    v.report.stats.extend(TensorStat(**{**s, "shape": tuple(s["shape"])}) for s in doc["stats"])
    v.report.findings.extend(_finding(f) for f in doc["findings"])
    v.report.warnings.extend(_finding(f) for f in doc["warnings"])
    v.values.update({k: tuple(x) if kind == "tuple" else x for k, kind, x in doc["values"]})
    v.report.not_loaded.update(doc.get("not_loaded", {}))
    v.report.checks.update(doc.get("checks", {}))
    v.layout = doc.get("layout", v.layout)
    v.recorded.extend(RecordedStep(f, k, x) for f, k, x in doc.get("recorded", []))
