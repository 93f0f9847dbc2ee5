"""The checkpoint listing's one SQL (catalog.listing): sqlite3 alone reads what SQLAlchemy reads.

`safepoint ls` reads a SQLite catalog at head with sqlite3 (no SQLAlchemy import); every other caller
goes through Catalog.list_checkpoints. Both run the same statements, so both must see the same views.
"""

from __future__ import annotations

import sqlite3
from datetime import datetime, timezone
from pathlib import Path

import pytest

from safepoint.catalog.listing import read_sqlite
from safepoint.core.states import CheckpointState as C
from safepoint.core.states import ReplicaState as R
from tests.helpers_catalog import seed

pytestmark = pytest.mark.catalog_backends  # catalog-level: on SQLite and PostgreSQL


@pytest.fixture
def seeded(sqlite_catalog, tmp_path):
    seed(sqlite_catalog, tmp_path, "a", 1, replicas=(R.VERIFIED, R.CORRUPT), tags=("best", "eval"),
         metrics={"loss": 0.5}, pinned=True, created=datetime(2026, 1, 2, 3, 4, 5, 678901, timezone.utc))
    seed(sqlite_catalog, tmp_path, "a", 2, state=C.REPLICATING, replicas=(R.PENDING,), parent=("a", 1))
    seed(sqlite_catalog, tmp_path, "b", 7, state=C.INVALID, replicas=())
    return sqlite_catalog, Path(sqlite_catalog.engine.url.database)


@pytest.mark.parametrize("run,states", [(None, None), ("a", None), (None, {C.VERIFIED, C.INVALID}),
                                        ("a", {C.INVALID}), (None, set())])
def test_sqlite3_reads_what_sqlalchemy_reads(seeded, run, states):
    catalog, db = seeded
    theirs = catalog.list_checkpoints(run, states)
    assert read_sqlite(db, run, states) == theirs
    if run is None and states is None:
        a1 = theirs[0]
        assert (len(theirs), a1.tags, a1.pinned, a1.metrics) == (3, ("best", "eval"), True, {"loss": 0.5})
        assert a1.created_at == datetime(2026, 1, 2, 3, 4, 5, 678901, timezone.utc)
        assert [r.state for r in a1.replicas] == [R.VERIFIED, R.CORRUPT]
        assert theirs[1].parent == ("a", 1)


def test_no_file_is_an_empty_catalog(tmp_path):
    assert read_sqlite(tmp_path / "catalog.db") == []
    assert not (tmp_path / "catalog.db").exists()  # reading creates nothing


def test_a_catalog_at_another_revision_is_left_to_the_catalog_proper(seeded):
    _catalog, db = seeded
    with sqlite3.connect(db) as con:
        con.execute("UPDATE alembic_version SET version_num = '0002_declared_parent'")
    assert read_sqlite(db) is None


def test_a_file_that_is_no_catalog_is_left_to_the_catalog_proper(tmp_path):
    (tmp_path / "catalog.db").write_bytes(b"not sqlite at all" * 100)
    assert read_sqlite(tmp_path / "catalog.db") is None


def test_the_listing_reads_every_column_on_each_backend(catalog, tmp_path):
    """The one SQL through SQLAlchemy: JSON decoded (text on SQLite, JSONB on PostgreSQL), times aware UTC."""
    when = datetime(2026, 1, 2, 3, 4, 5, 678901, timezone.utc)
    seed(catalog, tmp_path, "a", 1, replicas=(R.VERIFIED,), tags=("best",), metrics={"loss": 0.25}, pinned=True,
         created=when)
    seed(catalog, tmp_path, "a", 2, state=C.INVALID, replicas=(), parent=("a", 1))
    one, two = catalog.list_checkpoints("a")
    assert (one.tags, one.metrics, one.pinned, one.created_at, one.parent) == (("best",), {"loss": 0.25}, True,
                                                                                when, None)
    assert one.replicas[0].state is R.VERIFIED and one.replicas[0].verified_at.tzinfo is timezone.utc
    assert (two.state, two.parent, two.replicas, two.tags, two.metrics) == (C.INVALID, ("a", 1), (), (), {})
    assert [v.step for v in catalog.list_checkpoints(states={C.INVALID})] == [2]


def test_ls_of_a_catalog_url_that_names_no_file_says_so(tmp_path, capsys):
    """A mistyped `--catalog` lists nothing, as an empty catalog would, but says there is no file there."""
    from safepoint.cli.main import main

    missing = tmp_path / "typo" / "catalog.db"
    assert main(["ls", "--catalog", f"sqlite:///{missing}"]) == 0
    captured = capsys.readouterr()
    assert f"no catalog at {missing} yet" in captured.err
    assert captured.out.split() == ["run", "step", "state", "bytes", "replicas", "local", "parent", "pin/tags"]
    assert not missing.exists()
