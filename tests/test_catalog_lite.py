"""catalog.lite: restore's and resume-point's reads with sqlite3 alone return what the catalog proper returns.

A restore of a SQLite catalog at head never imports SQLAlchemy (tests/test_architecture.py checks
the modules); these tests check the answers: the same rows, views and resume decisions, an event
that the catalog proper reads back as its own, and the catalog proper behind anything else.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from safepoint.catalog import db as catalog_db
from safepoint.catalog.lite import LiteCatalog, open_fast
from safepoint.catalog.store import Catalog, open_catalog
from safepoint.core.states import CheckpointState as C
from safepoint.core.states import ReplicaState as R
from safepoint.ops.resume import find_resume_point
from tests.helpers_catalog import seed

REPO = Path(__file__).resolve().parents[1]
T0 = datetime(2026, 1, 2, 3, 4, 5, 678901, timezone.utc)


@pytest.fixture
def seeded(sqlite_catalog, tmp_path):
    seed(sqlite_catalog, tmp_path, "a", 1, replicas=(R.VERIFIED, R.CORRUPT), tags=("best",), metrics={"loss": 0.5},
         pinned=True, created=T0)
    seed(sqlite_catalog, tmp_path, "a", 2, replicas=(R.VERIFIED,), parent=("a", 1), created=T0 + timedelta(hours=1))
    seed(sqlite_catalog, tmp_path, "a", 3, state=C.INVALID, replicas=(), created=T0 + timedelta(hours=2))
    seed(sqlite_catalog, tmp_path, "a", 4, replicas=(R.PENDING,), created=T0 + timedelta(hours=3))
    seed(sqlite_catalog, tmp_path, "b", 7, replicas=(R.VERIFIED, R.VERIFIED), tags=("eval",))
    lite = open_fast(sqlite_catalog.url)
    assert isinstance(lite, LiteCatalog)
    return sqlite_catalog, lite


def test_rows_replicas_and_runs_are_the_catalogs(seeded):
    proper, lite = seeded
    for run, step in [("a", 1), ("a", 2), ("a", 3), ("a", 4), ("b", 7), ("a", 99), ("zz", 1)]:
        row = proper.get(run, step)
        assert lite.get(run, step) == row
        if row is not None:
            assert lite.replicas(row.id) == proper.replicas(row.id)
    assert lite.get("a", 1).created_at == T0 and lite.get("a", 1).tags == ("best",)
    assert [r.state for r in lite.replicas(lite.get("a", 1).id)] == [R.VERIFIED, R.CORRUPT]
    assert (lite.runs(), lite.get_run_id("a"), lite.get_run_id("nope")) == (proper.runs(), proper.get_run_id("a"),
                                                                             None)


@pytest.mark.parametrize("kw", [{}, {"min_replicas": 2}, {"max_step": 1}, {"tag": "best"},
                                {"before": T0 + timedelta(minutes=30)}, {"max_step": 0}, {"page": 1}])
def test_resume_decisions_are_the_catalogs(seeded, kw):
    proper, lite = seeded
    for run in ("a", "b", "nope"):
        assert find_resume_point(lite, run, **kw) == find_resume_point(proper, run, **kw)
    if not kw:
        assert find_resume_point(lite, "a").chosen.step == 2  # 4: no verified replica, 3: invalid


def test_an_event_written_with_sqlite3_reads_back_as_the_catalogs_own(seeded):
    proper, lite = seeded
    row = proper.get("a", 2)
    before = datetime.now(timezone.utc)
    lite.add_event("restore", checkpoint_id=row.id, detail={"bytes": 5, "nan": float("nan"), "path": Path("/x")})
    lite.add_event("restore.other", run="b")
    lite.add_event("restore.unknown-run", run="nope", checkpoint_id=row.id)
    proper.add_event("restore.unknown-run", run="nope", checkpoint_id=row.id)
    ev = proper.events(kind="restore")[-1]
    assert (ev["checkpoint_id"], ev["run_id"], ev["detail"]) == (row.id, row.run_id,
                                                                 {"bytes": 5, "nan": "nan", "path": "/x"})
    assert before <= ev["at"] <= datetime.now(timezone.utc)
    assert proper.events(kind="restore.other")[-1]["run_id"] == proper.get_run_id("b")
    assert [e["run_id"] for e in proper.events(kind="restore.unknown-run")] == [None, None]  # as Journal does


def test_anything_else_goes_to_the_catalog_proper(seeded):
    proper, lite = seeded
    row = proper.get("a", 2)
    lite.set_replica(row.id, "file:///elsewhere/a/2", "file:///elsewhere", R.CORRUPT, error="restore: test")
    assert [r.url for r in proper.replicas(row.id)][-1] == "file:///elsewhere/a/2"
    assert isinstance(lite.proper(), Catalog)


def test_open_fast_opens_the_catalog_proper_when_it_cannot_tell(tmp_path):
    url = f"sqlite:///{tmp_path / 'new' / 'catalog.db'}"
    assert isinstance(open_fast(url), Catalog)  # no file yet: created and migrated as usual
    assert isinstance(open_fast(url), LiteCatalog)
    with open_catalog(url).engine.begin() as con:
        con.exec_driver_sql("UPDATE alembic_version SET version_num = 'from-the-future'")
    catalog_db.dispose(url)
    with pytest.raises(Exception):  # noqa: B017,PT011 - whatever Alembic says about an unknown revision
        open_fast(url)  # another revision: never read with a schema this Safepoint does not know
    assert isinstance(open_fast("sqlite://"), Catalog)  # in memory


#: what `safepoint restore` from a file:// replica of a SQLite catalog must not load
RESTORE_MUST_NOT_LOAD = ("sqlalchemy", "alembic", "prefect", "torch", "rich", "fsspec")


def test_restore_of_a_sqlite_catalog_loads_no_heavy_module(tmp_path):
    home = tmp_path / "home"
    url = f"sqlite:///{home / 'catalog.db'}"
    seed(open_catalog(url), tmp_path, "run-a", 3)
    catalog_db.dispose(url)
    into = tmp_path / "into"
    code = ("import sys\nfrom safepoint.cli.main import main\n"
            f"rc = main(['restore', '--run', 'run-a', '--step', '3', '--into', {str(into)!r}, '--from', "
            f"{(tmp_path / 'durable0').as_uri()!r}])\n"
            f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {RESTORE_MUST_NOT_LOAD!r})\n"
            "print('HEAVY', heavy[:5]); sys.exit(rc or (3 if heavy else 0))")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "SAFEPOINT_HOME": str(home), "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "restored run-a step 3" in r.stdout and (into / "COMMITTED").is_file()
    assert (into / "weights.bin").read_bytes() == bytes([3]) * 64
    assert open_catalog(url).events(kind="restore")[-1]["detail"]["step"] == 3
