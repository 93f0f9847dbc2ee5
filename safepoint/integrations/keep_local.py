"""`keep_local=N`: a trainer's retention of its own local checkpoint folders, instead of HF's
`save_total_limit` or Lightning's `save_top_k`, which delete folders whether or not they were ingested.

Each run keeps its newest N verified local checkpoints and everything newer; an older folder goes only
once it has a verified durable replica (safepoint.rules.eviction.plan_keep_local, the evict rule). So
the previous verified checkpoint stays until a newer one has passed.

Whether a checkpoint is verified is the catalog's to say, and the training process imports no catalog
(nor SQLAlchemy, fsspec or Prefect): each pass is `safepoint evict ROOT --keep-local N` in a child
process, which reads the catalog (`SAFEPOINT_CATALOG_URL`, or `catalog=`), re-reads the replicas it
relies on, and deletes through the same checks as `safepoint evict`. A pass starts after each seal
when more than N sealed folders are there, in the background (one at a time; a seal during a pass
asks for one more after it); the trainer's end waits for the last pass. A pass that fails is logged
and never stops training.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from safepoint.local.snapshot import is_committed

__all__ = ["LocalRetention"]

log = logging.getLogger("safepoint.integrations")


class LocalRetention:
    """Passes of `safepoint evict ROOT --keep-local N` for the roots a trainer seals under."""

    def __init__(self, keep: int, *, catalog: str | None = None, min_replicas: int = 1,
                 timeout_s: float = 600.0) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep_local must be a whole number of at least 1, got {keep!r}")
        self.keep, self.catalog, self.min_replicas, self.timeout_s = keep, catalog, min_replicas, timeout_s
        self.evicted: list[str] = []       # the folders removed so far
        self._running: tuple[subprocess.Popen, IO[bytes], Path] | None = None
        self._again: set[Path] = set()     # roots that were sealed under during a pass

    def command(self, root: Path) -> list[str]:
        cmd = [sys.executable, "-m", "safepoint.cli", "evict", os.fspath(root), "--keep-local", str(self.keep),
               "--min-replicas", str(self.min_replicas), "--json"]
        return cmd + (["--catalog", self.catalog] if self.catalog else [])

    def _sealed_count(self, root: Path) -> int:
        try:
            return sum(1 for p in root.iterdir() if p.is_dir() and is_committed(p))
        except OSError:
            return 0

    def after_seal(self, root: str | os.PathLike) -> None:
        """A checkpoint was sealed under `root`: start a pass in the background, unless nothing can go yet."""
        root = Path(root)
        if self._sealed_count(root) <= self.keep:
            return
        self._reap(wait=False)
        if self._running is not None:
            self._again.add(root)
            return
        self._start(root)

    def finish(self) -> None:
        """The trainer is done: wait for the running pass, then run the one asked for during it."""
        self._reap(wait=True)
        while self._again:
            root = self._again.pop()
            self._start(root)
            self._reap(wait=True)

    def _start(self, root: Path) -> None:
        out = tempfile.TemporaryFile()     # a file, not a pipe: a long answer never blocks the child
        try:
            proc = subprocess.Popen(self.command(root), stdout=out, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        except OSError as e:
            out.close()
            log.warning("safepoint: keep_local: could not start `safepoint evict` for %s: %s", root, e)
            return
        self._running = (proc, out, root)

    def _reap(self, *, wait: bool) -> None:
        if self._running is None:
            return
        proc, out, root = self._running
        if not wait and proc.poll() is None:
            return
        try:
            _, err = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            log.warning("safepoint: keep_local: `safepoint evict` for %s ran past %.0f s: stopped", root,
                        self.timeout_s)
        self._running = None
        with out:
            out.seek(0)
            answer = out.read()
        if proc.returncode != 0:
            lines = (err or b"").decode(errors="replace").strip().splitlines()
            log.warning("safepoint: keep_local: no local checkpoint removed under %s (exit %s): %s", root,
                        proc.returncode, lines[-1] if lines else "no message")
            return
        try:
            doc: dict[str, Any] = json.loads(answer)
        except ValueError:
            return
        removed = [p for p in doc.get("evicted", []) if isinstance(p, str)]
        self.evicted.extend(removed)
        for p in removed:
            log.info("safepoint: keep_local=%d: removed %s (verified replica; a newer checkpoint is verified)",
                     self.keep, p)
