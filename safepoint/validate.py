"""Dry-run load validation of a snapshot folder: every tensor loads, safely, with bounded memory.

`validate_snapshot(folder)` loads every checkpoint file of a snapshot the safe way (torch.save files
with the weights-only unpickler, safetensors after checking the header, DCP folders with a restricted
metadata unpickler and no process group), walks every tensor (model and optimizer state) and
computes NaN/Inf counts, the L2 norm and max |x| in chunks. Results are data (ValidationReport),
never exceptions: a file that cannot be loaded is a finding, not a crash.

Extension points: `iter_file_tensors(path)` (safepoint.loaders) gives (name, tensor) for any
supported file; `iter_tensors(obj)` walks a loaded object; `tensor_stat(name, t)` computes stats.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from safepoint.errors import FormatError
from safepoint.format import CONTROL_FILES, TMP_PREFIX, safe_relpath
from safepoint.loaders import (
    SAFETENSORS,
    TORCH,
    DcpCheckpoint,
    Limits,
    LoadError,
    Problem,
    detect_format,
    iter_file_tensors,
    iter_tensors,
    one_line,
)
from safepoint.loaders.dcp import DCP_SUFFIX, METADATA_NAME

__all__ = [
    "Finding", "Limits", "LoadError", "Problem", "TensorStat", "ValidationReport", "iter_file_tensors",
    "iter_tensors", "tensor_stat", "validate_snapshot",
]

FILE_OK, FILE_INVALID, FILE_SKIPPED, FILE_MISSING = "ok", "invalid", "skipped", "missing"


@dataclass(frozen=True)
class TensorStat:
    """Stats of one tensor. norm and max_abs cover the finite values only (NaN/Inf are counted apart)."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    norm: float | None
    max_abs: float | None
    nan_count: int
    inf_count: int

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclass(frozen=True)
class Finding:
    file: str
    tensor: str | None
    problem: Problem
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "tensor": self.tensor, "problem": self.problem.value, "message": self.message}


@dataclass
class ValidationReport:
    files: dict[str, str] = field(default_factory=dict)   # path -> ok | invalid | skipped | missing
    stats: list[TensorStat] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

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
        for status in self.files.values():
            counts[status] = counts.get(status, 0) + 1
        head = (f"{self.outcome}: {len(self.files)} files ({', '.join(f'{n} {s}' for s, n in counts.items())}), "
                f"{len(self.stats)} tensors")
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
            "tensors": len(self.stats),
            "findings": [f.to_dict() for f in self.findings],
        }
        if include_stats:
            d["stats"] = [s.to_dict() for s in self.stats]
        return d


# ---------------------------------------------------------------------------------------------- stats

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _chunks(t: torch.Tensor, chunk_elems: int) -> Iterator[torch.Tensor]:
    """Flat pieces of `t` of about chunk_elems elements; copies at most one piece at a time."""
    if t.numel() == 0:
        return
    if t.dim() == 0:
        yield t.reshape(1)
        return
    if t.is_contiguous():
        flat = t.view(-1)
        for i in range(0, flat.numel(), chunk_elems):
            yield flat[i: i + chunk_elems]
        return
    row = max(1, t.numel() // t.shape[0])
    rows = max(1, chunk_elems // row)
    for i in range(0, t.shape[0], rows):
        yield from _chunks(t[i: i + rows].contiguous(), chunk_elems)


def tensor_stat(
    name: str, t: torch.Tensor, *, file: str = "", chunk_elems: int = Limits.stats_chunk_elems,
) -> TensorStat:
    """NaN/Inf counts, L2 norm (float64) and max |x| of a tensor, computed chunk by chunk.

    Floating and complex tensors (bf16, fp16, fp8 are upcast per chunk) count NaN/Inf; integer and
    bool tensors have none. norm and max_abs cover finite values; they are None for layouts or
    dtypes the stats cannot read (e.g. quantized).
    """
    shape = tuple(int(d) for d in t.shape)
    numel = math.prod(shape)
    base = dict(name=name, file=file, dtype=_dtype_name(t.dtype), shape=shape, numel=numel)
    t = t.detach()
    try:
        if t.layout == torch.sparse_coo:
            t = t._values()
        elif t.layout != torch.strided or t.is_quantized:
            raise TypeError(f"unsupported layout {t.layout}")
        floating = t.is_floating_point() or t.is_complex()
        sumsq, max_abs, nans, infs = 0.0, 0.0, 0, 0
        for c in _chunks(t, max(1, chunk_elems)):
            if c.is_complex():
                c = torch.view_as_real(c).reshape(-1)  # real and imaginary parts, counted apart
            # float64 stays float64; everything else is upcast to float32 (exact for 16/8-bit floats),
            # and the sum of squares is accumulated in float64.
            if c.dtype != torch.float64:
                c = c.to(torch.float32) if floating else c.to(torch.float64)
            if floating:
                finite = torch.isfinite(c)
                if not bool(finite.all()):
                    n_nan = int(torch.isnan(c).sum())
                    nans += n_nan
                    infs += int(c.numel() - int(finite.sum())) - n_nan
                    c = c.masked_fill(~finite, 0.0)
                del finite
            sumsq += float(torch.linalg.vector_norm(c, dtype=torch.float64)) ** 2
            max_abs = max(max_abs, float(c.abs().max()))
            del c
        return TensorStat(**base, norm=math.sqrt(sumsq), max_abs=max_abs, nan_count=nans, inf_count=infs)
    except Exception:
        return TensorStat(**base, norm=None, max_abs=None, nan_count=0, inf_count=0)


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


class _Validator:
    def __init__(self, folder: Path, limits: Limits) -> None:
        self.folder = folder
        self.limits = limits
        self.report = ValidationReport()

    def find(self, file: str, problem: Problem, message: str, tensor: str | None = None) -> None:
        self.report.findings.append(Finding(file, tensor, problem, message))

    def status(self, file: str, status: str) -> None:
        # missing and invalid win over ok/skipped
        rank = {FILE_SKIPPED: 0, FILE_OK: 1, FILE_INVALID: 2, FILE_MISSING: 3}
        old = self.report.files.get(file)
        if old is None or rank[status] > rank[old]:
            self.report.files[file] = status

    def add_stats(self, file: str, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in tensors:
            st = tensor_stat(name, t, file=file, chunk_elems=self.limits.stats_chunk_elems)
            del t
            self.report.stats.append(st)
            if st.nan_count:
                self.find(file, Problem.NAN, f"{name}: {st.nan_count} NaN values", name)
            if st.inf_count:
                self.find(file, Problem.INF, f"{name}: {st.inf_count} Inf values", name)

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
        path = self.folder / rel
        try:
            fmt = detect_format(path)
        except OSError as e:
            self.status(rel, FILE_INVALID)
            self.find(rel, Problem.UNLOADABLE, f"{rel}: {one_line(e)}")
            return
        if fmt not in (TORCH, SAFETENSORS):
            self.status(rel, FILE_SKIPPED)
            return
        errors: list[LoadError] = []
        try:
            self.add_stats(rel, iter_file_tensors(path, limits=self.limits, on_problem=errors.append))
        except LoadError as e:
            errors.append(e)
        except Exception as e:  # a loader bug or an unexpected library error: still data
            errors.append(LoadError(Problem.UNLOADABLE, one_line(e)))
        for e in errors:
            self.find(rel, e.problem, f"{rel}: {e.message}", e.tensor)
        had_findings = errors or any(f.file == rel for f in self.report.findings)
        self.status(rel, FILE_INVALID if had_findings else FILE_OK)

    def validate_dcp(self, meta_rel: str, listed: set[str]) -> set[str]:
        """Validate the DCP checkpoint whose metadata is meta_rel; return the files it claims."""
        prefix = meta_rel[: -len(METADATA_NAME)]  # "" or "sub/dir/"
        claimed = {meta_rel}
        try:
            ckpt = DcpCheckpoint.open(self.folder / meta_rel, self.limits)
        except LoadError as e:
            self.status(meta_rel, FILE_INVALID)
            self.find(meta_rel, e.problem, f"{meta_rel}: {e.message}")
            return claimed
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
            self.status(file, FILE_MISSING if e.problem is Problem.MISSING else FILE_INVALID)
            self.find(file, e.problem, e.message, e.tensor)

        try:
            self.add_stats(meta_rel, ckpt.iter_tensors(on_problem))
        except LoadError as e:
            on_problem(e)
        except Exception as e:
            on_problem(LoadError(Problem.UNLOADABLE, one_line(e)))
        return claimed


def validate_snapshot(
    folder: str | os.PathLike, files: Iterable[str] | None = None, *, limits: Limits = Limits(),
) -> ValidationReport:
    """Dry-run load every checkpoint file of a snapshot folder; return a report (never raises for bad data).

    files: the data files' relative paths (from the manifest); None walks the folder, skipping
    MANIFEST.json, COMMITTED and temporary files. DCP tensors are reported under the `.metadata`
    path as their file.
    """
    root = Path(folder)
    v = _Validator(root, limits)
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
    return v.run(file_list)
