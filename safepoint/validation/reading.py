"""Reading a snapshot's files: every tensor streamed through the audit, in the sandboxed child.

This is the half of validation that imports torch and touches untrusted bytes: `read_files` runs in
the child that safepoint.validation.sandbox limits (named by its dotted path, so the judging
process never imports this module), or in-process when the sandbox is off.

With the manifest's digests, every file is bound before a loader reads it (`Reader.bind`): hashed
and checked against the manifest, and checked unchanged (inode, size, mtime, ctime) once every file
was read, so what was judged is what was replicated.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safepoint.core.errors import FormatError
from safepoint.core.format import safe_relpath
from safepoint.validation.audit import stat_of
from safepoint.validation.judge import (
    FILE_INVALID,
    FILE_MISSING,
    FILE_NOT_LOADED,
    FILE_OK,
    FILE_SKIPPED,
    NOT_THE_MANIFEST,
    OPAQUE_PICKLE,
    UNKNOWN_FORMAT,
    Finding,
    Judge,
    ValidationReport,
    read_digest,
)
from safepoint.validation.layouts import TRAINER_STATE, RecordedStep, detect_layout, is_step_leaf
from safepoint.validation.loaders import (
    SAFETENSORS,
    TORCH,
    DcpCheckpoint,
    LoadError,
    Problem,
    TensorSource,
    detect_format,
    iter_file_leaves,
    one_line,
)
from safepoint.validation.loaders.dcp import DCP_SUFFIX, METADATA_NAME
from safepoint.validation.loaders.kinds import JSON, PICKLE, UNKNOWN, bare_pickle_dangerous, file_kind, holds_tensors
from safepoint.validation.roles import FAIL, WARN
from safepoint.validation.sandbox import note
from safepoint.validation.settings import FAIL as SETTING_FAIL
from safepoint.validation.settings import ValidationSettings

__all__ = ["Reader", "read_files", "torch_threads"]

MAX_JSON_BYTES = 64 * 1024 * 1024
# Plain values kept for the harness (param groups, step): small ones only.
_MAX_VALUE_ITEMS = 1_000_000


def _small_value(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return not isinstance(v, str) or len(v) <= 4096
    if isinstance(v, (list, tuple)):
        return len(v) <= _MAX_VALUE_ITEMS and all(x is None or isinstance(x, (bool, int, float, str)) for x in v)
    return False


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is rewritten, in place or by a rename over it."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class Reader(Judge):
    """A Judge that also reads the files: what runs in the sandboxed child."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bound: dict[str, tuple[int, ...]] = {}  # path -> identity when it was hashed (bind)

    def bind(self, rel: str) -> bool:
        """Whether `rel` holds the manifest's bytes, hashed now, before a loader reads it (the loader
        then reads the page cache): a file that does not is a CHANGED finding and is never loaded.
        Its identity is kept, to check that nothing rewrote it while it was read (`check_bound`)."""
        if self.digests is None or rel not in self.digests:
            return True
        if rel in self._bound:
            return True
        try:
            before, digest = read_digest(self.folder / rel)
        except OSError as e:
            self.status(rel, FILE_INVALID)
            self.find(rel, Problem.UNLOADABLE, f"{rel}: {one_line(e)}")
            return False
        self._bound[rel] = _identity(before)
        if digest != self.digests[rel]:
            self.changed(rel, NOT_THE_MANIFEST)
            return False
        return True

    def check_bound(self) -> None:
        """Every bound file is still the one hashed: a rewrite during the read makes the read void."""
        for rel, identity in self._bound.items():
            try:
                now = _identity(os.stat(self.folder / rel, follow_symlinks=False))
            except OSError:
                now = ()
            if now != identity and not any(f.file == rel and f.problem is Problem.CHANGED
                                           for f in self.report.findings):
                self.changed(rel, "changed while it was validated")

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
        """Whether to digest a tensor whole: where the previous checkpoint has a tensor with the same head,
        under this name or another (the consistency rules compare the multiset, not only the names)."""
        if self._heads_seen is None:
            self._heads_seen = frozenset(self.heads.values())
        return self._heads_seen.__contains__

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
        self.check_bound()
        return self.report

    def validate_file(self, rel: str) -> None:
        note(rel)
        if not self.bind(rel):
            return
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
        if not self.bind(meta_rel):
            return claimed
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
        if not all([self.bind(rel) for rel in data_files if rel in listed]):  # every shard, before any is read
            return claimed

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

    def read(self, files: list[str]) -> ValidationReport:
        """Read `files` with the configured number of torch threads."""
        with torch_threads(self.settings.threads):
            return self.run(files)


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


def read_files(folder: str, files: list[str], settings: ValidationSettings,
               heads: dict[str, str] | None = None, digests: dict[str, str] | None = None) -> dict[str, Any]:
    """Read and audit `files` of a snapshot folder (in the sandboxed child); the results as plain data."""
    v = Reader(Path(folder), settings, heads, digests)
    v.read(files)
    r = v.report
    return {"files": r.files, "stats": [s.to_dict() for s in r.stats],
            "findings": [f.to_dict() for f in r.findings], "warnings": [f.to_dict() for f in r.warnings],
            "values": [[k, "tuple" if isinstance(x, tuple) else "", list(x) if isinstance(x, tuple) else x]
                       for k, x in v.values.items()],
            "not_loaded": r.not_loaded, "layout": v.layout, "checks": {k: c for k, c in r.checks.items()},
            "recorded": [[x.file, x.key, x.value] for x in v.recorded]}
