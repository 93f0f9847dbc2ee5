"""Thin Prefect tasks for scrubbing and fan-out verification: one task hashes one batch of files."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from safepoint.core.config import Config
from safepoint.core.format import FileEntry
from safepoint.core.hashing import hash_path
from safepoint.core.verify import FileStatus, VerifyReport, check_file
from safepoint.destinations import open_destination
from safepoint.local.snapshot import resolve_inside
from safepoint.ops import scrub
from safepoint.tasks.retry import retry_on_infrastructure


@task(name="verify-batch", retries=2, retry_delay_seconds=2, retry_condition_fn=retry_on_infrastructure)
def verify_batch(destination: str, run: str, step: int, files: list[FileEntry], config: Config) -> VerifyReport:
    """Hash a batch of a replica's files (runs wherever the task runner puts it: thread or Dask worker)."""
    dest = open_destination(destination, config.storage_options(destination))
    try:
        return scrub.verify_files(dest, run, step, files)
    finally:
        dest.close()


@task(name="verify-local-batch")
def verify_local_batch(root: str, files: list[FileEntry]) -> VerifyReport:
    """Hash a batch of a local snapshot folder's files."""
    report = VerifyReport()
    base = Path(root)
    for f in files:
        try:
            path = resolve_inside(base, f.path)
        except Exception:  # noqa: BLE001 - FormatError: the path escapes the folder
            report.files[f.path] = FileStatus.UNSAFE_PATH
            continue
        size = path.stat().st_size if path.is_file() else None
        report.files[f.path] = status = check_file(f, size, lambda p=path: hash_path(p)[1])
        if status is FileStatus.OK:
            report.bytes_checked += f.size
    return report
