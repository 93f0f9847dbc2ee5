"""Dry-run load validation of a snapshot folder: every tensor loads, safely, with bounded memory.

`validate_snapshot(folder)` reads every checkpoint file of a snapshot the safe way (torch.save files
with the weights-only unpickler, memory-mapped; safetensors after checking the header; DCP folders
with a restricted metadata unpickler and no process group) and streams every tensor, model and
optimizer state alike, piece by piece through the numerical audit (safepoint.audit: NaN/Inf, L2
norm, max |x|). Peak memory is one piece per tensor, not one file: read pages are released as soon
as they are used. Each byte is read once; hashing is the replicator's job, not repeated here.

On top of what loading alone catches, validation can run:
- a strict dry-run load against the user's model factory (safepoint.harness): missing, unexpected
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

import json
import os
import stat
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from safepoint.core.errors import FormatError
from safepoint.core.format import CONTROL_FILES, TMP_PREFIX, safe_relpath
from safepoint.validation.audit import Baseline, TensorStat, baseline_heads, norm_jumps, stat_keys, stat_of, tensor_stat
from safepoint.validation.consistency import check_consistency, counters_of
from safepoint.validation.harness import Found, Harness, TensorSpec, build_harness, check
from safepoint.validation.layouts import PLAIN as PLAIN_LAYOUT
from safepoint.validation.layouts import TRAINER_STATE, RecordedStep, detect_layout, is_step_leaf, step_mismatches
from safepoint.validation.loaders import (
    SAFETENSORS,
    TORCH,
    DcpCheckpoint,
    Limits,
    LoadError,
    Problem,
    TensorSource,
    detect_format,
    iter_file_leaves,
    iter_file_tensors,
    iter_tensors,
    one_line,
)
from safepoint.validation.loaders.dcp import DCP_SUFFIX, METADATA_NAME
from safepoint.validation.loaders.kinds import JSON, PICKLE, UNKNOWN, bare_pickle_dangerous, file_kind, holds_tensors
from safepoint.validation.loaders.torchsave import ZIP_MAGIC
from safepoint.validation.roles import FAIL, OFF, WARN, Role
from safepoint.validation.sandbox import note, run_limited
from safepoint.validation.settings import FAIL as SETTING_FAIL
from safepoint.validation.settings import ValidationSettings

__all__ = [
    "Finding", "Limits", "LoadError", "Problem", "TensorStat", "ValidationReport", "ValidationSettings",
    "iter_file_tensors", "iter_tensors", "tensor_stat", "validate_snapshot",
]

FILE_OK, FILE_INVALID, FILE_SKIPPED, FILE_MISSING = "ok", "invalid", "skipped", "missing"
FILE_NOT_LOADED = "not loaded"   # hashed and replicated, never loaded: opaque pickle or unknown format
OPAQUE_PICKLE, UNKNOWN_FORMAT = "not loaded: opaque pickle", "not loaded: unknown format"
MAX_JSON_BYTES = 64 * 1024 * 1024
# Plain values kept for the harness (param groups, step): small ones only.
_MAX_VALUE_ITEMS = 1_000_000


@dataclass(frozen=True)
class Finding:
    file: str
    tensor: str | None
    problem: Problem
    message: str
    role: str | None = None   # the tensor's role (safepoint.validation.roles), when the finding is about a tensor

    def to_dict(self) -> dict[str, Any]:
        d = {"file": self.file, "tensor": self.tensor, "problem": self.problem.value, "message": self.message}
        if self.role:
            d["role"] = self.role
        return d


@dataclass
class ValidationReport:
    files: dict[str, str] = field(default_factory=dict)   # path -> ok | invalid | skipped | missing | not loaded
    not_loaded: dict[str, str] = field(default_factory=dict)  # path (or path:entry) -> why it was not loaded
    stats: list[TensorStat] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)   # failing: the checkpoint is not verified
    warnings: list[Finding] = field(default_factory=list)   # flagged but not failing (warn_only)
    checks: dict[str, Any] = field(default_factory=dict)    # what was compared: harness, audit

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def outcome(self) -> str:
        """'verified' (no findings), 'incomplete' (only missing files) or 'invalid'."""
        if not self.findings:
            return "verified"
        if all(f.problem is Problem.MISSING for f in self.findings):
            return "incomplete"
        return "invalid"

    def summary(self) -> str:
        counts = {s: 0 for s in (FILE_OK, FILE_INVALID, FILE_MISSING, FILE_SKIPPED)}
        if any(s == FILE_NOT_LOADED for s in self.files.values()):
            counts[FILE_NOT_LOADED] = 0
        for status in self.files.values():
            counts[status] = counts.get(status, 0) + 1
        head = (f"{self.outcome}: {len(self.files)} files ({', '.join(f'{n} {s}' for s, n in counts.items())}), "
                f"{len(self.stats)} tensors")
        if self.warnings:
            head += f", {len(self.warnings)} warning{'s' if len(self.warnings) != 1 else ''}"
        if not self.findings:
            return head
        shown = "; ".join(f.message for f in self.findings[:3])
        more = f"; and {len(self.findings) - 3} more" if len(self.findings) > 3 else ""
        n = len(self.findings)
        return f"{head}; {n} problem{'s' if n != 1 else ''}: {shown}{more}"

    def to_dict(self, *, include_stats: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "outcome": self.outcome,
            "ok": self.ok,
            "summary": self.summary(),
            "files": dict(sorted(self.files.items())),
            "not_loaded": dict(sorted(self.not_loaded.items())),
            "tensors": len(self.stats),
            "bytes_checked": sum(_nbytes(s) for s in self.stats),
            "findings": [f.to_dict() for f in self.findings],
            "warnings": [f.to_dict() for f in self.warnings],
            "checks": self.checks,
        }
        if include_stats:
            d["stats"] = [s.to_dict() for s in self.stats]
        return d


def _nbytes(s: TensorStat) -> int:
    import torch

    dtype = getattr(torch, s.dtype, None)
    return s.numel * dtype.itemsize if isinstance(dtype, torch.dtype) else 0


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


def _small_value(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return not isinstance(v, str) or len(v) <= 4096
    if isinstance(v, (list, tuple)):
        return len(v) <= _MAX_VALUE_ITEMS and all(x is None or isinstance(x, (bool, int, float, str)) for x in v)
    return False


class _Validator:
    def __init__(self, folder: Path, settings: ValidationSettings, heads: dict[str, str] | None = None) -> None:
        self.folder = folder
        self.settings = settings
        self.heads = heads or {}  # the previous checkpoint's head digests by stat key (audit.baseline_heads)
        self.limits = settings.limits
        self.report = ValidationReport()
        self.values: dict[str, Any] = {}   # plain leaves and one-element tensors, for the harness
        self.layout = PLAIN_LAYOUT
        self.recorded: list[RecordedStep] = []  # steps the trainer wrote inside (safepoint.validation.layouts)
        self._roles: dict[tuple[str, str], Role] | None = None  # stat_roles(), once every tensor was read

    def find(self, file: str, problem: Problem, message: str, tensor: str | None = None,
             role: str | None = None) -> None:
        self.report.findings.append(Finding(file, tensor, problem, message, role))

    def not_loaded(self, file: str, why: str, problem: Problem, entry: str | None = None) -> None:
        """A file (or one DCP entry) that is never loaded: a note, or a failure if the settings say so."""
        setting = self.settings.opaque_pickle if problem is Problem.OPAQUE else self.settings.unknown_format
        if setting == SETTING_FAIL:
            key = "opaque_pickle" if problem is Problem.OPAQUE else "unknown_format"
            self.find(file, problem, f"{file}{': ' + entry if entry else ''}: {why} ({key} = fail)", entry)
            self.status(file, FILE_INVALID)
            return
        self.report.not_loaded[f"{file}:{entry}" if entry else file] = why
        if entry is None:
            self.status(file, FILE_NOT_LOADED)
            if problem is Problem.OPAQUE and holds_tensors(file):
                self.report.warnings.append(Finding(file, None, problem, f"{file}: {why}: the tensors it may hold "
                                                    "were not checked"))

    def nonfinite(self, file: str, name: str, problem: Problem, count: int) -> None:
        """NaN/Inf in one tensor: what its role's rule says (fail, warn, off)."""
        role = self.settings.rules.role(file, name)
        action = self.settings.rules.rule(role).nonfinite
        what = "NaN" if problem is Problem.NAN else "Inf"
        message = f"{name}: {count} {what} values ({role})"
        if action == FAIL:
            self.find(file, problem, message, name, str(role))
        elif action == WARN:
            self.report.warnings.append(Finding(file, name, problem, message, str(role)))

    def flag(self, file: str, problem: Problem, message: str, tensor: str | None = None) -> None:
        """A harness or audit flag: failing, or a warning when the settings say so."""
        if self.settings.failing(problem):
            self.find(file, problem, message, tensor)
            if file in self.report.files:
                self.status(file, FILE_INVALID)
        else:
            self.report.warnings.append(Finding(file, tensor, problem, message))

    def status(self, file: str, status: str) -> None:
        # missing and invalid win over ok/skipped
        rank = {FILE_SKIPPED: 0, FILE_NOT_LOADED: 1, FILE_OK: 1, FILE_INVALID: 2, FILE_MISSING: 3}
        old = self.report.files.get(file)
        if old is None or rank[status] > rank[old]:
            self.report.files[file] = status

    def add_leaves(self, file: str, leaves: Iterable[tuple[str, Any]], on_problem: Any) -> None:
        """Stream every tensor through the audit; keep small plain values. A tensor that fails to
        read is reported through on_problem (its file may differ, e.g. a DCP rank file)."""
        for name, leaf in leaves:
            if not isinstance(leaf, TensorSource):
                if _small_value(leaf):
                    self.values[name] = leaf
                    if is_step_leaf(self.layout, file, name):
                        self.recorded.append(RecordedStep(file, name, leaf))
                continue
            try:
                st = stat_of(name, leaf, file=file, chunk_elems=self.limits.stats_chunk_elems,
                             full_digest=self.same_head(file, name))
            except LoadError as e:
                e.tensor = e.tensor or name
                on_problem(e)
                continue
            except OSError as e:
                on_problem(LoadError(Problem.UNLOADABLE, f"{name}: {one_line(e)}", tensor=name))
                continue
            finally:
                del leaf
            self.report.stats.append(st)
            if st.value is not None:
                self.values.setdefault(name, st.value)
                if is_step_leaf(self.layout, file, name):
                    self.recorded.append(RecordedStep(file, name, st.value))
            if st.nan_count:
                self.nonfinite(file, name, Problem.NAN, st.nan_count)
            if st.inf_count:
                self.nonfinite(file, name, Problem.INF, st.inf_count)

    def same_head(self, file: str, name: str) -> Callable[[str], bool]:
        """Whether to digest a tensor whole: only where the previous checkpoint's head is the same."""
        previous = {self.heads.get(name), self.heads.get(f"{file}:{name}")} - {None}
        return previous.__contains__

    def run(self, files: list[str]) -> ValidationReport:
        present: list[str] = []
        for rel in files:
            try:
                safe_relpath(rel)
            except FormatError as e:
                self.status(rel, FILE_INVALID)
                self.find(rel, Problem.UNSAFE, str(e))
                continue
            path = self.folder / rel
            if os.path.islink(path):
                self.status(rel, FILE_INVALID)
                self.find(rel, Problem.UNSAFE, f"{rel}: symbolic link (snapshots hold regular files only)")
            elif not path.exists():
                self.status(rel, FILE_MISSING)
                self.find(rel, Problem.MISSING, f"{rel}: missing")
            elif not path.is_file():
                self.status(rel, FILE_INVALID)
                self.find(rel, Problem.UNSAFE, f"{rel}: not a regular file")
            else:
                present.append(rel)
        listed = set(files)
        self.layout = detect_layout(present)
        self.report.checks["layout"] = self.layout
        claimed: set[str] = set()
        for rel in present:
            if rel.rsplit("/", 1)[-1] == METADATA_NAME:
                claimed |= self.validate_dcp(rel, listed)
                # .distcp files next to it that the metadata does not reference: not loadable alone
                prefix = rel[: -len(METADATA_NAME)]
                for other in present:
                    if other not in claimed and other.startswith(prefix) and other.endswith(DCP_SUFFIX) \
                            and "/" not in other[len(prefix):]:
                        claimed.add(other)
                        self.status(other, FILE_SKIPPED)
        for rel in present:
            if rel not in claimed:
                self.validate_file(rel)
        return self.report

    def validate_file(self, rel: str) -> None:
        note(rel)
        path = self.folder / rel
        try:
            fmt = detect_format(path)
        except OSError as e:
            self.status(rel, FILE_INVALID)
            self.find(rel, Problem.UNLOADABLE, f"{rel}: {one_line(e)}")
            return
        if fmt != SAFETENSORS:
            try:
                kind = file_kind(path)  # by content and by names only one format uses (not `.bin`)
            except OSError as e:
                self.status(rel, FILE_INVALID)
                self.find(rel, Problem.UNLOADABLE, f"{rel}: {one_line(e)}")
                return
            if kind not in (TORCH, SAFETENSORS):
                self.validate_other(rel, kind)
                return
            fmt = kind
        errors: list[LoadError] = []
        try:
            self.add_leaves(rel, iter_file_leaves(path, limits=self.limits, on_problem=errors.append), errors.append)
        except LoadError as e:
            errors.append(e)
        except MemoryError:
            raise  # a limit, not a finding about this file (the sandbox reports it)
        except Exception as e:  # a loader bug or an unexpected library error: still data
            errors.append(LoadError(Problem.UNLOADABLE, one_line(e)))
        if len(errors) == 1 and errors[0].problem is Problem.OPAQUE and errors[0].tensor is None:
            self.not_loaded(rel, f"{OPAQUE_PICKLE}{errors[0].message.removeprefix('not loaded: opaque pickle')}",
                            Problem.OPAQUE)
            return
        for e in errors:
            self.find(rel, e.problem, f"{rel}: {e.message}", e.tensor)
        had_findings = errors or any(f.file == rel for f in self.report.findings)
        self.status(rel, FILE_INVALID if had_findings else FILE_OK)

    def validate_other(self, rel: str, kind: str) -> None:
        """A file that is not a tensor format: JSON is parsed (trainer_state.json's step is kept), a
        bare pickle is scanned and never loaded, anything else is hashed only."""
        path = self.folder / rel
        if kind == JSON:
            size = path.stat().st_size
            if size > MAX_JSON_BYTES:
                self.not_loaded(rel, f"{UNKNOWN_FORMAT} (JSON over {MAX_JSON_BYTES} bytes)", Problem.UNLOADABLE)
                return
            try:
                doc = json.loads(path.read_bytes())
            except (ValueError, OSError) as e:
                self.status(rel, FILE_INVALID)
                self.find(rel, Problem.MALFORMED, f"{rel}: not valid JSON ({one_line(e)})")
                return
            self.status(rel, FILE_OK)
            if rel.rsplit("/", 1)[-1] == TRAINER_STATE and isinstance(doc, dict) and "global_step" in doc:
                self.recorded.append(RecordedStep(rel, "global_step", doc["global_step"]))
            return
        if kind == PICKLE:
            names, bad, why = bare_pickle_dangerous(path)
            if bad:
                self.status(rel, FILE_INVALID)
                self.find(rel, Problem.UNSAFE, f"{rel}: refused: the pickle names {', '.join(bad[:3])}")
            elif why is not None:
                self.status(rel, FILE_INVALID)
                self.find(rel, Problem.UNLOADABLE, f"{rel}: corrupt pickle ({why[:200]})")
            else:
                self.not_loaded(rel, OPAQUE_PICKLE + (f" (names {', '.join(names[:3])})" if names else ""),
                                Problem.OPAQUE)
            return
        assert kind == UNKNOWN
        self.not_loaded(rel, UNKNOWN_FORMAT, Problem.UNLOADABLE)

    def validate_dcp(self, meta_rel: str, listed: set[str]) -> set[str]:
        """Validate the DCP checkpoint whose metadata is meta_rel; return the files it claims."""
        note(meta_rel)
        prefix = meta_rel[: -len(METADATA_NAME)]  # "" or "sub/dir/"
        claimed = {meta_rel}
        try:
            ckpt = DcpCheckpoint.open(self.folder / meta_rel, self.limits)
        except LoadError as e:
            self.status(meta_rel, FILE_INVALID)
            self.find(meta_rel, e.problem, f"{meta_rel}: {e.message}")
            return claimed
        except MemoryError:
            raise
        except Exception as e:
            self.status(meta_rel, FILE_INVALID)
            self.find(meta_rel, Problem.UNLOADABLE, f"{meta_rel}: {one_line(e)}")
            return claimed
        self.status(meta_rel, FILE_OK)
        data_files = [prefix + f for f in ckpt.data_files]
        claimed |= set(data_files)
        for rel in data_files:
            if rel not in listed:
                self.status(rel, FILE_MISSING)
                self.find(rel, Problem.MISSING, f"{rel}: referenced by {meta_rel} but not in the snapshot")
            else:
                self.status(rel, FILE_OK)
        unlisted = {f[len(prefix):] for f in data_files if f not in listed}

        def on_problem(e: LoadError) -> None:
            file = prefix + e.file if e.file else meta_rel
            if e.file in unlisted and e.problem is Problem.MISSING:
                return  # already reported above
            if e.problem is Problem.OPAQUE and e.tensor:
                why = e.message.partition("not loaded: ")[2]
                self.not_loaded(file, f"not loaded: {why}" if why else OPAQUE_PICKLE, Problem.OPAQUE, e.tensor)
                return
            self.status(file, FILE_MISSING if e.problem is Problem.MISSING else FILE_INVALID)
            self.find(file, e.problem, e.message, e.tensor)

        try:
            self.add_leaves(meta_rel, ckpt.iter_leaves(on_problem), on_problem)
        except LoadError as e:
            on_problem(e)
        except MemoryError:
            raise
        except Exception as e:
            on_problem(LoadError(Problem.UNLOADABLE, one_line(e)))
        return claimed

    # -- after every tensor was read ---------------------------------------------------------

    def found(self) -> tuple[Found, dict[str, str]]:
        tensors: dict[str, TensorSpec] = {}
        origin: dict[str, str] = {}
        dup: dict[str, list[str]] = {}
        for s in self.report.stats:
            if s.name in origin and origin[s.name] != s.file:
                dup.setdefault(s.name, [origin[s.name]]).append(s.file)
                continue
            tensors[s.name] = TensorSpec(tuple(s.shape), s.dtype)
            origin[s.name] = s.file
        return Found(tensors, dict(self.values), dup), origin

    def run_harness(self, harness: Harness, step: int | None) -> None:
        found, origin = self.found()
        s = self.settings
        result = check(harness, found, step=step, model_key=s.model_key, optimizer_key=s.optimizer_key,
                       step_key=s.step_key, check_step_=s.check_step)
        self.report.checks["harness"] = result.info
        main = max(set(origin.values()), key=list(origin.values()).count) if origin else "."
        for issue in result.issues:
            self.flag(origin.get(issue.tensor or "", main), issue.problem, issue.message, issue.tensor)

    def stat_roles(self) -> dict[tuple[str, str], Role]:
        """The role of every tensor read, by (file, name): computed once for the audit and the consistency rules."""
        if self._roles is None:
            rules = self.settings.rules
            self._roles = {(s.file, s.name): rules.role(s.file, s.name) for s in self.report.stats}
        return self._roles

    def run_audit(self, baseline: Baseline) -> None:
        t = self.settings.thresholds
        rules = self.settings.rules
        roles = self.stat_roles()
        action = {key: rules.rule(role).norm_jump for key, role in roles.items()}
        jumps, compared = norm_jumps(self.report.stats, baseline, t,
                                     include=lambda s: action[(s.file, s.name)] != OFF)
        self.report.checks["audit"] = {"against": baseline.label, "compared": compared,
                                       "norm_jump_factor": t.norm_jump_factor, "flagged": len(jumps)}
        for j in jumps:
            role = roles[(j.file, j.name)]
            message = j.message(baseline.label, t.norm_jump_factor or 0) + f" ({role})"
            if action[(j.file, j.name)] == WARN:
                self.report.warnings.append(Finding(j.file, j.name, Problem.NORM_JUMP, message, str(role)))
            else:
                self.flag(j.file, Problem.NORM_JUMP, message, j.name)

    def run_consistency(self, baseline: Baseline | None, step: int | None) -> None:
        """The consistency rules against the baseline; the counters are kept for the next checkpoint's."""
        if step is None:
            return
        stats, roles = self.report.stats, self.stat_roles()
        counters = counters_of(stats, self.values, self.recorded, roles, step)
        self.report.checks["counters"] = counters.to_dict()
        found = check_consistency(stats, counters, baseline, roles)
        self.report.checks["consistency"] = {"against": baseline.label if baseline is not None else None,
                                             "findings": [f.to_dict() for f in found]}
        if not found:
            return
        files = dict(zip(stat_keys(stats), (s.file for s in stats)))
        main = Counter(files.values()).most_common(1)[0][0] if files else "."  # for counters: the main file
        for f in found:
            tensor = f.tensors[0] if f.tensors and f.tensors[0] in files else None
            self.flag(files.get(tensor or "", main), Problem(f.rule), f.message, tensor)

    def run_step_check(self, step: int | None) -> None:
        """The step the trainer recorded inside (trainer_state.json, Lightning, torchtitan) vs the catalog's."""
        if self.recorded:
            self.report.checks["recorded_step"] = {
                "layout": self.layout, "catalog": step,
                "checkpoint": [{"file": r.file, "key": r.key, "value": r.value} for r in self.recorded]}
        if any(f.problem is Problem.STEP for f in self.report.findings + self.report.warnings):
            return  # the harness already compared it
        for r, why in step_mismatches(self.layout, self.recorded, step):
            self.flag(r.file, Problem.STEP, why, r.key)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with n torch intra-op threads (0: unchanged), restoring the previous count after."""
    import torch

    before = torch.get_num_threads()
    if n and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n and n != before:
            torch.set_num_threads(before)


def validate_snapshot(
    folder: str | os.PathLike, files: Iterable[str] | None = None, *, limits: Limits | None = None,
    model: str | Harness | None = None, settings: ValidationSettings | None = None, step: int | None = None,
    baseline: Baseline | None = None,
) -> ValidationReport:
    """Dry-run load every checkpoint file of a snapshot folder; return a report (never raises for bad data).

    files: the data files' relative paths (from the manifest); None walks the folder, skipping
    MANIFEST.json, COMMITTED and temporary files. DCP tensors are reported under the `.metadata`
    path as their file.
    model: a factory spec `package.module:function` (or a built Harness) for the strict dry-run
    load; it overrides settings.model. step: the catalog's step, checked against the checkpoint's.
    baseline: stats of the previous verified checkpoint, for the norm-jump audit and the consistency rules.
    Raises HarnessError (a UsageError) when the model factory cannot be built.
    """
    settings = settings or ValidationSettings()
    if limits is not None:
        settings = replace(settings, limits=limits)
    spec = model if model is not None else settings.model
    harness = build_harness(spec, settings.device) if isinstance(spec, str) else spec
    root = Path(folder)
    v = _Validator(root, settings, baseline_heads(baseline))
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
        with torch_threads(settings.threads):
            v.run(file_list)
    unreadable = any(f.problem in (Problem.UNSAFE, Problem.UNLOADABLE, Problem.MALFORMED, Problem.MISSING,
                                   Problem.LIMIT)
                     for f in v.report.findings)
    if harness is not None and not unreadable:
        v.run_harness(harness, step)
    if baseline is not None and not unreadable:
        v.run_audit(baseline)
    if not unreadable:
        v.run_consistency(baseline, step)
    if settings.check_step and not unreadable:
        v.run_step_check(step)
    return v.report


# ------------------------------------------------------------------------------------------ the sandbox

def read_files(folder: str, files: list[str], settings: ValidationSettings,
               heads: dict[str, str] | None = None) -> dict[str, Any]:
    """Read and audit `files` of a snapshot folder (in the sandboxed child); the results as plain data."""
    v = _Validator(Path(folder), settings, heads)
    with torch_threads(settings.threads):
        v.run(files)
    r = v.report
    return {"files": r.files, "stats": [s.to_dict() for s in r.stats],
            "findings": [f.to_dict() for f in r.findings], "warnings": [f.to_dict() for f in r.warnings],
            "values": [[k, "tuple" if isinstance(x, tuple) else "", list(x) if isinstance(x, tuple) else x]
                       for k, x in v.values.items()],
            "not_loaded": r.not_loaded, "layout": v.layout, "checks": {k: c for k, c in r.checks.items()},
            "recorded": [[x.file, x.key, x.value] for x in v.recorded]}


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


def _run_in_sandbox(v: _Validator, files: list[str]) -> None:
    """v.run(files) in a child process with memory, CPU and wall-clock limits (safepoint.sandbox)."""
    limits = v.settings.sandbox
    nbytes, mapped = _input_bytes(v.folder, files)
    out = run_limited(read_files, (os.fspath(v.folder), files, v.settings, v.heads), limits, input_bytes=nbytes,
                      mapped_bytes=mapped)
    v.report.checks["sandbox"] = {"limit": out.limit, "usage": out.usage}
    if not out.ok:
        where = out.last_note or "."
        v.status(where, FILE_INVALID)
        if out.limit:
            v.find(where, Problem.LIMIT, f"{where}: {out.limit}")
        else:
            v.find(where, Problem.UNLOADABLE, f"{where}: validation failed: {out.error}")
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
