"""A copy of a checkpoint that verifies, to repair or validate from: the local folder, then verified replicas.

A file:// replica is opened in place and re-hashed; any other replica comes through the one
verified fetch (safepoint.ops.fetch: hashed as the bytes arrive, into $SAFEPOINT_HOME/tmp,
removed afterwards). The last good copy is only ever read.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from safepoint.catalog.store import Catalog
from safepoint.catalog.views import CheckpointRow
from safepoint.core.config import Config
from safepoint.core.errors import FormatError, SafepointError
from safepoint.core.format import digest_bytes
from safepoint.core.redact import redact_url
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.core.urls import local_path
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.fetch import fetched_copy
from safepoint.rules.restore import Source

__all__ = ["good_source", "verified_copy"]


@contextmanager
def good_source(catalog: Catalog, row: CheckpointRow, config: Config, *, exclude: str | None = None
                ) -> Iterator[LocalSnapshot | None]:
    """A local snapshot of `row` whose every byte verifies against the catalog's manifest, or None.

    Tried in order: the local folder (single-node checkpoints), then verified replicas other than
    `exclude` (file:// in place, others fetched).
    """
    for candidate, fetched in _candidates(catalog, row, config, exclude):
        with candidate as s:
            if s is not None and (fetched or s.verify().outcome is CS.VERIFIED) and (
                    not row.manifest_blake3 or digest_bytes(s.manifest_bytes) == row.manifest_blake3):
                yield s
                return
    yield None


@contextmanager
def verified_copy(catalog: Catalog, checkpoint_id: int, config: Config) -> Iterator[LocalSnapshot | None]:
    """Like good_source, for validating: any copy that verifies."""
    row = catalog.get_by_id(checkpoint_id)
    with good_source(catalog, row, config) as snap:
        yield snap


def _candidates(catalog: Catalog, row: CheckpointRow, config: Config, exclude: str | None
                ) -> Iterator[tuple[Any, bool]]:
    """(context manager yielding a LocalSnapshot or None, whether its bytes were verified on arrival)."""
    if row.world_size == 1 and row.local_path:
        yield _open_local(row.local_path), False
    for rep in catalog.replicas(row.id):
        if rep.state is not RS.VERIFIED or (exclude and rep.url.rstrip("/") == redact_url(exclude).rstrip("/")):
            continue
        if (path := local_path(rep.url)) is not None:
            yield _open_local(path), False
        else:
            yield _fetched(rep, row, config), True


@contextmanager
def _open_local(path: str) -> Iterator[LocalSnapshot | None]:
    try:
        snap: LocalSnapshot | None = LocalSnapshot.open(path)
    except (FormatError, OSError):
        snap = None
    yield snap


@contextmanager
def _fetched(rep: Any, row: CheckpointRow, config: Config) -> Iterator[LocalSnapshot | None]:
    source = Source(rep.destination.rstrip("/"), rep.url.rstrip("/"))
    with ExitStack() as stack:
        try:
            snap, _result = stack.enter_context(fetched_copy(row.run, row.step, [source], config,
                                                             expect_manifest=row.manifest_blake3, label="reconcile"))
        except (OSError, SafepointError, ValueError):  # the local disk, or a destination that cannot be opened
            snap = None
        yield snap
