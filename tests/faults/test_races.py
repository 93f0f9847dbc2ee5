"""Races between real processes: two ingests of one checkpoint, prune racing an ingest, two prunes.

Injection: two children of two fork servers released by one wall-clock barrier, with a random
offset per round, on SQLite and on PostgreSQL (where many processes on many hosts really share a
catalog). The plain pipeline takes no leases (the Prefect tasks do), so this is the harder case.
Expected: every round ends with every invariant intact (tests/faults/world.py): one row per
checkpoint, one replica row per URL, one committed copy per destination, nothing verified lost,
the newest verified never pruned, no row pointing at a missing object, and the racing checkpoint
verified.
"""

from __future__ import annotations

import random
import time
from datetime import datetime, timezone

import pytest

from safepoint.catalog.store import open_catalog
from safepoint.core.format import MARKER_NAME
from safepoint.core.states import CheckpointState as CS
from safepoint.local.commit import commit
from safepoint.ops import ingest as pipeline
from safepoint.ops.prune import prune
from safepoint.ops.reconcile import reconcile
from safepoint.rules.retention import KeepLastN
from tests.faults.conftest import figures
from tests.faults.world import ForkServer, World, check, copy_template

pytestmark = pytest.mark.catalog_backends  # catalog-level: on SQLite and PostgreSQL

ROUNDS = 4


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    servers = [ForkServer(None, tmp_path_factory.mktemp(f"race-server-{i}")) for i in range(2)]
    yield servers
    for s in servers:
        s.close()


def _race(servers, a: tuple[str, dict], b: tuple[str, dict], offset: float):
    t = time.time() + 0.3
    ha = servers[0].start(a[0], {**a[1], "start_at": t})
    hb = servers[1].start(b[0], {**b[1], "start_at": t + offset})
    return servers[0].finish(ha), servers[1].finish(hb)


def _check(catalog, world, tmp_path):
    world.observe(catalog)
    found = check(catalog, world, dest_roots=[tmp_path / "durable"], local_roots=[tmp_path / "nvme"],
                  orphans_allowed=True)
    assert not found.violations, found.violations
    return found


def test_two_ingests_of_the_same_checkpoint(two_servers, tmp_path, template, catalog_url):
    catalog = open_catalog(catalog_url)
    dest = (tmp_path / "durable").as_uri()
    rng = random.Random(3)
    world = World()
    outcomes = []
    for step in range(ROUNDS):
        folder = copy_template(template, tmp_path / "nvme" / f"step-{step}")
        commit(folder, "twice", step)
        args = {"folder": str(folder), "dest": dest, "catalog_url": catalog_url}
        ra, rb = _race(two_servers, ("ingest", args), ("ingest", args), rng.uniform(0, 0.2))
        assert ra.exit == rb.exit == 0
        outcomes += [ra.result["state"], rb.result["state"]]
        # Each reports verified, or that the other ingest had taken the checkpoint over.
        assert {ra.result["state"], rb.result["state"]} <= {"verified", "replicating", "replicated", "validating"}
        row = catalog.get("twice", step)
        assert row.state is CS.VERIFIED
        assert len(catalog.replicas(row.id)) == 1
        snapdir = tmp_path / "durable" / "twice" / str(step)
        names = sorted(p.relative_to(snapdir).as_posix() for p in snapdir.rglob("*") if p.is_file())
        assert names == sorted([f.path for f in catalog.files(row.id)] + ["COMMITTED", "MANIFEST.json"])
        _check(catalog, world, tmp_path)
    figures(f"two ingests of one checkpoint ({catalog.engine.dialect.name})", rounds=ROUNDS,
            outcomes="/".join(sorted(set(outcomes))), duplicates=0, bytes_lost=0)


def test_prune_racing_an_ingest(two_servers, tmp_path, template, catalog_url):
    catalog = open_catalog(catalog_url)
    dest = (tmp_path / "durable").as_uri()
    rng = random.Random(5)
    world = World()
    for step in range(2):
        folder = copy_template(template, tmp_path / "nvme" / f"step-{step}")
        commit(folder, "pr", step)
        assert pipeline.ingest(folder, [dest], catalog).state is CS.VERIFIED
    pruned = 0
    for step in range(2, 2 + ROUNDS):
        folder = copy_template(template, tmp_path / "nvme" / f"step-{step}")
        commit(folder, "pr", step)
        world.observe(catalog)
        ingest = ("ingest", {"folder": str(folder), "dest": dest, "catalog_url": catalog_url})
        pr = ("prune", {"run": "pr", "catalog_url": catalog_url, "keep_last": 1})
        ra, rb = _race(two_servers, ingest, pr, rng.uniform(-0.2, 0.3))
        assert ra.exit == rb.exit == 0 and ra.result["state"] == "verified", (ra.result, rb.result)
        assert not rb.result["errors"], rb.result
        pruned += len(rb.result["pruned"])
        assert step not in rb.result["pruned"]
        _check(catalog, world, tmp_path)
    # Afterwards, a prune alone converges: retention's invariants keep the two newest verified.
    prune(catalog, ["pr"], KeepLastN(1), now=datetime.now(timezone.utc))
    live = sorted(c.step for c in catalog.list_checkpoints("pr") if c.state is CS.VERIFIED)
    assert live == [ROUNDS, ROUNDS + 1]
    found = _check(catalog, world, tmp_path)
    figures(f"prune racing an ingest ({catalog.engine.dialect.name})", rounds=ROUNDS, pruned_during_races=pruned,
            bytes_lost=found.bytes_lost)


def test_two_prunes_at_once(two_servers, tmp_path, template, catalog_url):
    catalog = open_catalog(catalog_url)
    dest = (tmp_path / "durable").as_uri()
    world = World()
    for step in range(6):
        folder = copy_template(template, tmp_path / "nvme" / f"step-{step}")
        commit(folder, "pp", step)
        assert pipeline.ingest(folder, [dest], catalog).state is CS.VERIFIED
    world.observe(catalog)
    args = {"run": "pp", "catalog_url": catalog_url, "keep_last": 2}
    ra, rb = _race(two_servers, ("prune", args), ("prune", args), 0.0)
    assert ra.exit == rb.exit == 0
    assert not ra.result["errors"] and not rb.result["errors"], (ra.result, rb.result)
    # Each checkpoint was marked by exactly one of them.
    assert sorted(ra.result["pruned"] + rb.result["pruned"]) == [0, 1, 2, 3]
    assert sorted(c.step for c in catalog.list_checkpoints("pp") if c.state is CS.VERIFIED) == [4, 5]
    for step in range(4):
        assert not (tmp_path / "durable" / "pp" / str(step) / MARKER_NAME).exists()
    rep = reconcile(catalog, [dest], grace_s=0)
    assert not rep.errors and all(s.action in ("remove_partial", "remove_tmp") for s in rep.steps), rep.to_dict()
    found = check(catalog, world, dest_roots=[tmp_path / "durable"], local_roots=[tmp_path / "nvme"])
    assert not found.violations, found.violations
    figures(f"two prunes at once ({catalog.engine.dialect.name})", pruned=4, errors=0, bytes_lost=found.bytes_lost)
