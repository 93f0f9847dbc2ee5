"""What a validation found, and the judgement of it: findings, file statuses and the report, plus the
checks that need every tensor's stats first (strict load, norm jumps, consistency, recorded step).

Torch-free: the process that judges and records a checkpoint imports this, while reading the
files happens in the sandboxed child (safepoint.validation.reading), which adds to the same report
through the same methods. The strict load (safepoint.validation.harness) imports torch, only when a
model factory is given.
"""

from __future__ import annotations

import json
import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safepoint.core.hashing import hash_stream, read_chunks
from safepoint.rules.magnitude import out_of_bound
from safepoint.validation.consistency import check_consistency, counters_of
from safepoint.validation.layouts import PLAIN as PLAIN_LAYOUT
from safepoint.validation.layouts import RecordedStep, step_mismatches
from safepoint.validation.problems import Problem
from safepoint.validation.roles import OFF, WARN, Role
from safepoint.validation.settings import ValidationSettings
from safepoint.validation.stats import Baseline, TensorStat, norm_jumps, stat_keys

if TYPE_CHECKING:
    from safepoint.validation.harness import Found, Harness

__all__ = ["FILE_INVALID", "FILE_MISSING", "FILE_NOT_LOADED", "FILE_OK", "FILE_SKIPPED", "Finding", "Judge",
           "ValidationReport"]

FILE_OK, FILE_INVALID, FILE_SKIPPED, FILE_MISSING = "ok", "invalid", "skipped", "missing"
FILE_NOT_LOADED = "not loaded"   # hashed and replicated, never loaded: opaque pickle or unknown format
OPAQUE_PICKLE, UNKNOWN_FORMAT = "not loaded: opaque pickle", "not loaded: unknown format"


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
        """'verified' (no findings), 'corrupt' (a file read was not the manifest's: no verdict on its
        content), 'incomplete' (only missing files) or 'invalid'."""
        if not self.findings:
            return "verified"
        if any(f.problem is Problem.CHANGED for f in self.findings):
            return "corrupt"
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


NOT_THE_MANIFEST = "does not match the manifest (rewritten since it was committed)"


def read_digest(path: Path) -> tuple[os.stat_result, str | None]:
    """(the file's stat before the read, its BLAKE3; None for anything but a regular file), streamed:
    bounded memory, never mapped. Raises OSError."""
    with open(path, "rb", buffering=0) as f:
        before = os.fstat(f.fileno())
        return before, hash_stream(read_chunks(f), before.st_size)[1] if stat.S_ISREG(before.st_mode) else None


#: PEFT's adapter_config.json is a few KiB; the strict load reads no more than this of it
MAX_ADAPTER_CONFIG_BYTES = 1 << 20

# Bytes per element of the dtypes a TensorStat names (torch's names; unknown ones count 0).
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8,
             "complex32": 4, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4,
             "uint64": 8, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
             "float8_e5m2fnuz": 1}


def _nbytes(s: TensorStat) -> int:
    return s.numel * _ITEMSIZE.get(s.dtype, 0)


class Judge:
    """The report of one snapshot's validation as it is built, and the checks run once it is read."""

    def __init__(self, folder: Path, settings: ValidationSettings, heads: dict[str, str] | None = None,
                 digests: dict[str, str] | None = None) -> None:
        self.folder = folder
        self.settings = settings
        self.digests = digests  # path -> the manifest's BLAKE3: what every file read must hash to (None: unbound)
        self.heads = heads or {}  # the previous checkpoint's head digests by stat key (audit.baseline_heads)
        self._heads_seen: frozenset[str] | None = None  # their values, whatever the name (reading.same_head)
        self.limits = settings.limits
        self.report = ValidationReport()
        self.values: dict[str, Any] = {}   # plain leaves and one-element tensors, for the harness
        self.layout = PLAIN_LAYOUT
        self.recorded: list[RecordedStep] = []  # steps the trainer wrote inside (safepoint.validation.layouts)
        self._roles: dict[tuple[str, str], Role] | None = None  # stat_roles(), once every tensor was read

    def find(self, file: str, problem: Problem, message: str, tensor: str | None = None,
             role: str | None = None) -> None:
        self.report.findings.append(Finding(file, tensor, problem, message, role))

    def flag(self, file: str, problem: Problem, message: str, tensor: str | None = None) -> None:
        """A harness or audit flag: failing, or a warning when the settings say so."""
        if self.settings.failing(problem):
            self.find(file, problem, message, tensor)
            if file in self.report.files:
                self.status(file, FILE_INVALID)
        else:
            self.report.warnings.append(Finding(file, tensor, problem, message))

    def changed(self, rel: str, why: str) -> None:
        """A file whose bytes read are not the manifest's: never judged (the outcome is corrupt)."""
        self.status(rel, FILE_INVALID)
        self.find(rel, Problem.CHANGED, f"{rel}: {why}: not judged, its replicas hold other bytes")

    def unbound(self, files: list[str]) -> None:
        """After a read that did not finish (the reader died or hit a limit): a file that no longer holds
        the manifest's bytes is why, more likely than the bytes the reader saw."""
        for rel in files:
            if self.digests is None or rel not in self.digests:
                continue
            try:
                digest = read_digest(self.folder / rel)[1]
            except OSError:
                continue   # the finding already made stands
            if digest != self.digests[rel]:
                self.changed(rel, NOT_THE_MANIFEST)

    def status(self, file: str, status: str) -> None:
        # missing and invalid win over ok/skipped
        rank = {FILE_SKIPPED: 0, FILE_NOT_LOADED: 1, FILE_OK: 1, FILE_INVALID: 2, FILE_MISSING: 3}
        old = self.report.files.get(file)
        if old is None or rank[status] > rank[old]:
            self.report.files[file] = status

    # -- after every tensor was read ---------------------------------------------------------

    def found(self) -> tuple[Found, dict[str, str]]:
        from safepoint.validation.harness import Found, TensorSpec  # torch: only with a model factory

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

    def adapter_config(self) -> dict[str, Any] | None:
        """A PEFT adapter checkpoint's `adapter_config.json` (read and found valid by the reader), or None."""
        from safepoint.validation.harness import ADAPTER_CONFIG, ADAPTER_WEIGHTS

        names = {rel.rsplit("/", 1)[-1]: rel for rel, status in self.report.files.items() if status == FILE_OK}
        if ADAPTER_CONFIG not in names or not any(w in names for w in ADAPTER_WEIGHTS):
            return None
        try:
            with open(self.folder / names[ADAPTER_CONFIG], "rb") as f:
                doc = json.loads(f.read(MAX_ADAPTER_CONFIG_BYTES + 1))
        except (OSError, ValueError):
            return None  # over the bound (truncated JSON) or gone: no strict load, the reader's verdict stands
        return doc if isinstance(doc, dict) else None

    def run_harness(self, harness: Harness, step: int | None) -> None:
        from safepoint.validation.harness import adapter_view, check

        found, origin = self.found()
        s = self.settings
        adapter = self.adapter_config()
        if adapter is not None:
            found, origin = adapter_view(found, origin)
        result = check(harness, found, step=step, model_key=s.model_key, optimizer_key=s.optimizer_key,
                       step_key=s.step_key, check_step_=s.check_step, adapter_config=adapter)
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

    def run_bounds(self) -> None:
        """Parameters beyond the absolute bound (safepoint.rules.magnitude): needs no baseline."""
        roles = self.stat_roles()
        rows = ({"file": s.file, "name": s.name, "dtype": s.dtype, "max_abs": s.max_abs,
                 "role": str(roles.get((s.file, s.name), ""))} for s in self.report.stats)
        for hit in out_of_bound(rows, self.settings.thresholds.max_abs_parameter):
            self.flag(hit.file, Problem.MAGNITUDE, hit.message, hit.name)

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
