"""Runs, commits and parts, and the lookups of what they recorded (checkpoints, files, ranks)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from safepoint.catalog import listing
from safepoint.catalog.base import C, CatalogBase, norm_path
from safepoint.catalog.models import Checkpoint, CheckpointFile, CheckpointRank, Replica, Run, utcnow
from safepoint.catalog.views import CheckpointRow, CheckpointView
from safepoint.core.errors import CatalogError
from safepoint.core.format import FileEntry, Manifest
from safepoint.core.states import CheckpointState, ReplicaState

# A re-commit with a different manifest may replace the files only while nothing downstream
# (replication, validation) relies on them.
REPLACEABLE = frozenset({C.COMMITTED, C.CORRUPT, C.INVALID, C.INCOMPLETE})


def _parse_time(text: str) -> datetime:
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return utcnow()
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _is_part(m: Manifest) -> bool:
    return m.ranks is not None and set(m.ranks) != set(range(m.world_size))


class Commits(CatalogBase):
    """Runs and their checkpoints: record commits (whole or one part), look them up."""

    # -- runs ---------------------------------------------------------------------------------

    def ensure_run(self, name: str, settings: dict[str, Any] | None = None) -> int:
        """Create the run if absent (settings are only used on creation); return its id."""
        with self._write() as s:
            return self._run_id(s, name, settings)

    def get_run_id(self, name: str) -> int | None:
        with self._read() as s:
            return s.execute(sa.select(Run.id).where(Run.name == name)).scalar_one_or_none()

    def runs(self) -> list[str]:
        with self._read() as s:
            return list(s.execute(sa.select(Run.name).order_by(Run.name)).scalars())

    def run_settings(self, name: str) -> dict[str, Any] | None:
        with self._read() as s:
            return s.execute(sa.select(Run.settings).where(Run.name == name)).scalar_one_or_none()

    def set_run_settings(self, name: str, settings: dict[str, Any] | None) -> None:
        with self._write() as s:
            rid = self._run_id(s, name)
            s.execute(sa.update(Run).where(Run.id == rid).values(settings=settings))

    # -- commits ------------------------------------------------------------------------------

    def record_commit(self, manifest: Manifest, manifest_blake3: str,
                      local_path: str | os.PathLike[str] | None = None) -> CheckpointRow:
        """Record a committed snapshot (or one part of a multi-node one); idempotent.

        Same run/step and same manifest digest: returns the existing row unchanged. A different
        manifest replaces files only in a state where nothing downstream used them (REPLACEABLE),
        or when it says it supersedes the cataloged one (`meta["supersedes"]`, written by a re-seal
        of a re-saved folder): a new version, whose old replicas are marked deleted (the bytes of
        an abandoned branch, never kept under this step), with a `resealed` event; else CatalogError.
        A part (ranks a strict subset of the world) merges into the checkpoint.
        ``manifest.meta["tags"]`` (list of str) and ``meta["metrics"]`` (object) seed tags/metrics.
        """
        for attempt in range(5):
            try:
                with self._write() as s:
                    return self._record_commit(s, manifest, manifest_blake3, norm_path(local_path))
            except IntegrityError:
                # A concurrent ingest of the same checkpoint inserted first; retry sees its row.
                if attempt == 4:
                    raise
        raise AssertionError("unreachable")

    def _parent_id(self, s: Session, m: Manifest, checkpoint_id: int, run_id: int) -> int | None:
        """Resolve the manifest's declared parent; a missing one is logged and linked when it appears."""
        if m.parent is None:
            return None
        prun, pstep = m.parent
        pid = s.execute(
            sa.select(Checkpoint.id).join(Run, Checkpoint.run_id == Run.id).where(Run.name == prun,
                                                                                  Checkpoint.step == pstep)
        ).scalar_one_or_none()
        if pid is None:
            self._event(s, "parent_missing", checkpoint_id=checkpoint_id, run_id=run_id,
                        detail={"run": prun, "step": pstep})
        return pid

    def _adopt_children(self, s: Session, checkpoint_id: int, run: str, step: int) -> None:
        """Link checkpoints that declared (run, step) as parent before it was cataloged."""
        s.execute(
            sa.update(Checkpoint)
            .where(Checkpoint.parent_run == run, Checkpoint.parent_step == step, Checkpoint.parent_id.is_(None),
                   Checkpoint.id != checkpoint_id)
            .values(parent_id=checkpoint_id).execution_options(synchronize_session=False)
        )

    def _add_files_and_ranks(self, s: Session, ck_id: int, m: Manifest, blake: str, local_path: str | None,
                             files: Iterable[FileEntry]) -> None:
        held = m.held_ranks
        file_rank = held[0] if len(held) == 1 and m.world_size > 1 else None
        rows = [{"checkpoint_id": ck_id, "path": f.path, "size": f.size, "blake3": f.blake3, "rank": file_rank}
                for f in files]
        if rows:
            s.execute(sa.insert(CheckpointFile), rows)
        have = set(self._ranks(s, ck_id))
        now = utcnow()
        ranks = [{"checkpoint_id": ck_id, "rank": r, "node": m.node, "local_path": local_path,
                  "manifest_blake3": blake, "delivered_at": now} for r in held if r not in have]
        if ranks:
            s.execute(sa.insert(CheckpointRank), ranks)

    def _refresh_totals(self, s: Session, ck: Checkpoint) -> None:
        count, total = s.execute(
            sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(CheckpointFile.size), 0))
            .where(CheckpointFile.checkpoint_id == ck.id)
        ).one()
        ck.file_count, ck.total_bytes = int(count), int(total)

    def _record_commit(self, s: Session, m: Manifest, blake: str, local_path: str | None) -> CheckpointRow:
        run_id = self._run_id(s, m.run)
        part = _is_part(m)
        ck = s.execute(
            sa.select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.step == m.step).with_for_update()
        ).scalar_one_or_none()
        now = utcnow()
        tags = m.meta.get("tags")
        tags = [str(t) for t in tags] if isinstance(tags, list) else []
        metrics = m.meta.get("metrics")
        metrics = dict(metrics) if isinstance(metrics, dict) else {}

        if ck is None:
            ck = Checkpoint(
                run_id=run_id, step=m.step, state=C.COMMITTED.value, local_path=local_path, node=m.node,
                world_size=m.world_size, manifest_blake3=None if part else blake, created_at=_parse_time(m.created),
                updated_at=now, state_changed_at=now, tags=tags, metrics=metrics, version=1,
            )
            s.add(ck)
            s.flush()
            ck.parent_id = self._parent_id(s, m, ck.id, run_id)
            ck.parent_run, ck.parent_step = m.parent if m.parent else (None, None)
            self._adopt_children(s, ck.id, m.run, m.step)
            self._add_files_and_ranks(s, ck.id, m, blake, local_path, m.files)
            self._refresh_totals(s, ck)
            self._event(s, "commit", checkpoint_id=ck.id, run_id=run_id,
                        detail={"manifest_blake3": blake, "ranks": list(m.held_ranks), "node": m.node,
                                "part": part, "files": len(m.files)})
            s.flush()
            return self._row(s, ck, m.run)

        state = C(ck.state)
        if part:
            return self._merge_part(s, ck, m, blake, local_path)
        if ck.manifest_blake3 == blake:
            return self._row(s, ck, m.run)
        supersedes = m.meta.get("supersedes")
        resealed = supersedes is not None and supersedes == ck.manifest_blake3
        if state not in REPLACEABLE and not resealed:
            raise CatalogError(
                f"{m.run}/{m.step} is already cataloged with another manifest and is {state}; "
                "refusing to replace its files (a folder a trainer re-saved is sealed again with "
                "`safepoint commit --reseal`, which records the manifest it supersedes)"
            )
        old = ck.manifest_blake3
        old_parent = {"run": ck.parent_run, "step": ck.parent_step} if ck.parent_run else None
        dropped: list[str] = []
        if resealed:
            dropped = list(s.execute(sa.select(Replica.url).where(
                Replica.checkpoint_id == ck.id, Replica.state != ReplicaState.DELETED.value)).scalars())
            s.execute(sa.update(Replica).where(Replica.checkpoint_id == ck.id)
                      .values(state=ReplicaState.DELETED.value, verified_at=None, updated_at=now,
                              error="superseded: the step was re-saved and sealed again")
                      .execution_options(synchronize_session=False))
        s.execute(sa.delete(CheckpointFile).where(CheckpointFile.checkpoint_id == ck.id))
        s.execute(sa.delete(CheckpointRank).where(CheckpointRank.checkpoint_id == ck.id))
        ck.state, ck.version, ck.error = C.COMMITTED.value, ck.version + 1, None
        ck.state_changed_at = ck.updated_at = now
        ck.local_path, ck.node, ck.world_size, ck.manifest_blake3 = local_path, m.node, m.world_size, blake
        ck.created_at = _parse_time(m.created)
        ck.parent_id = self._parent_id(s, m, ck.id, run_id)
        ck.parent_run, ck.parent_step = m.parent if m.parent else (None, None)
        if tags:
            ck.tags = tags
        if metrics:
            ck.metrics = metrics
        s.flush()
        self._add_files_and_ranks(s, ck.id, m, blake, local_path, m.files)
        self._refresh_totals(s, ck)
        detail: dict[str, Any] = {"from": state.value, "to": C.COMMITTED.value, "old_manifest_blake3": old,
                                  "manifest_blake3": blake}
        if resealed:
            detail.update(version=ck.version, old_parent=old_parent, replicas_superseded=dropped,
                          parent={"run": m.parent[0], "step": m.parent[1]} if m.parent else None)
        self._event(s, "resealed" if resealed else "recommit", checkpoint_id=ck.id, run_id=run_id, detail=detail)
        s.flush()
        return self._row(s, ck, m.run)

    def _merge_part(self, s: Session, ck: Checkpoint, m: Manifest, blake: str, local_path: str | None) -> CheckpointRow:
        """Add one node's part: new files and ranks; the same path with other bytes is an error."""
        if ck.world_size != m.world_size:
            raise CatalogError(f"{m.run}/{m.step}: part has world_size {m.world_size}, catalog has {ck.world_size}")
        if C(ck.state) == C.PRUNED:
            raise CatalogError(f"{m.run}/{m.step} was pruned; refusing a late part")
        existing = {
            p: (size, digest) for p, size, digest in s.execute(
                sa.select(CheckpointFile.path, CheckpointFile.size, CheckpointFile.blake3)
                .where(CheckpointFile.checkpoint_id == ck.id)
            )
        }
        new: list[FileEntry] = []
        for f in m.files:
            old = existing.get(f.path)
            if old is None:
                new.append(f)
            elif old != (f.size, f.blake3):
                raise CatalogError(f"{m.run}/{m.step}: parts disagree on {f.path!r}")
        have = set(self._ranks(s, ck.id))
        if not new and set(m.held_ranks) <= have:
            return self._row(s, ck, m.run)  # this part was already merged
        self._add_files_and_ranks(s, ck.id, m, blake, local_path, new)
        if ck.local_path is None:
            ck.local_path = local_path
        self._refresh_totals(s, ck)
        ck.updated_at, ck.version = utcnow(), ck.version + 1
        self._event(s, "part", checkpoint_id=ck.id, run_id=ck.run_id,
                    detail={"manifest_blake3": blake, "ranks": list(m.held_ranks), "node": m.node,
                            "files": len(new)})
        s.flush()
        return self._row(s, ck, m.run)

    def record_whole_manifest(self, checkpoint_id: int, manifest_blake3: str) -> bool:
        """Bind a multi-node checkpoint to the BLAKE3 of its whole (merged) manifest, once its last part
        assembled: restore, verify and scrub then hold every copy to it. The merge is deterministic, so
        every destination's is the same; False (nothing changed) when another digest is recorded."""
        with self._write() as s:
            ck = s.execute(sa.select(Checkpoint).where(Checkpoint.id == checkpoint_id).with_for_update()
                           ).scalar_one_or_none()
            if ck is None:
                raise CatalogError(f"no checkpoint with id {checkpoint_id}")
            if ck.manifest_blake3 is not None:
                return ck.manifest_blake3 == manifest_blake3
            ck.manifest_blake3, ck.updated_at = manifest_blake3, utcnow()
            self._event(s, "assembled", checkpoint_id=ck.id, run_id=ck.run_id,
                        detail={"manifest_blake3": manifest_blake3})
            return True

    # -- lookups ------------------------------------------------------------------------------

    def get(self, run: str, step: int) -> CheckpointRow | None:
        with self._read() as s:
            return self._get(s, sa.and_(Run.name == run, Checkpoint.step == step))

    def get_by_id(self, checkpoint_id: int) -> CheckpointRow | None:
        with self._read() as s:
            return self._get(s, Checkpoint.id == checkpoint_id)

    def latest(self, run: str, states: Iterable[CheckpointState] = (C.VERIFIED,)) -> CheckpointRow | None:
        """The highest-step checkpoint of `run` in one of `states` (uses ix_checkpoints_run_id_state_step)."""
        with self._read() as s:
            q = (sa.select(Checkpoint, Run.name).join(Run, Checkpoint.run_id == Run.id)
                 .where(Run.name == run, Checkpoint.state.in_([C(x).value for x in states]))
                 .order_by(Checkpoint.step.desc()).limit(1))
            r = s.execute(q).first()
            return None if r is None else self._row(s, r[0], r[1])

    def find_by_local_path(self, path: str | os.PathLike[str]) -> CheckpointRow | None:
        """The checkpoint stored at local `path` (a whole snapshot, or one node's part)."""
        p = norm_path(path)
        with self._read() as s:
            row = self._get(s, Checkpoint.id == sa.select(Checkpoint.id).where(Checkpoint.local_path == p)
                            .order_by(Checkpoint.id.desc()).limit(1).scalar_subquery())
            if row is None:
                sub = (sa.select(CheckpointRank.checkpoint_id).where(CheckpointRank.local_path == p)
                       .order_by(CheckpointRank.checkpoint_id.desc()).limit(1).scalar_subquery())
                row = self._get(s, Checkpoint.id == sub)
            return row

    def files(self, checkpoint_id: int) -> list[FileEntry]:
        with self._read() as s:
            q = (sa.select(CheckpointFile.path, CheckpointFile.size, CheckpointFile.blake3)
                 .where(CheckpointFile.checkpoint_id == checkpoint_id).order_by(CheckpointFile.path))
            return [FileEntry(p, size, b) for p, size, b in s.execute(q)]

    def file_paths(self, checkpoint_id: int) -> list[str]:
        """Relative paths of the checkpoint's data files, sorted."""
        return [f.path for f in self.files(checkpoint_id)]

    def ranks(self, checkpoint_id: int) -> list[dict[str, Any]]:
        """Delivered ranks: rank, node, local_path, manifest_blake3, delivered_at."""
        with self._read() as s:
            q = (sa.select(CheckpointRank).where(CheckpointRank.checkpoint_id == checkpoint_id)
                 .order_by(CheckpointRank.rank))
            return [{"rank": r.rank, "node": r.node, "local_path": r.local_path,
                     "manifest_blake3": r.manifest_blake3, "delivered_at": r.delivered_at}
                    for r in s.execute(q).scalars()]

    def list_checkpoints(self, run: str | None = None,
                         states: Iterable[CheckpointState] | None = None) -> list[CheckpointView]:
        """Checkpoints with lineage and replicas, ordered by run then step (two queries, no N+1).

        The SQL is catalog.listing's, which `safepoint ls` also runs with sqlite3 alone."""
        checkpoints, replicas, params = listing.statements(run, states)
        with self._read() as s:
            return listing.views(s.execute(sa.text(checkpoints), params).all(),
                                 s.execute(sa.text(replicas), params).all())
