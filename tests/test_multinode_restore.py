"""A multi-node checkpoint is one bound object: restore, verify and scrub, through the real CLI.

Two "nodes" (separate local roots and SAFEPOINT_HOMEs, one process per command) each commit and
ingest their part of a 2-rank checkpoint to two file:// replicas; the catalog is shared. Restored on
node 0 without --from, every rank comes back verified, from node 0's part and a replica. A replica
forged behind Safepoint's back (rank 0's bytes replaced, a new MANIFEST.json and COMMITTED written
to bind them) is refused by restore --from (exit 1, nothing committed), healed around without it,
and found corrupt by `safepoint verify` and `safepoint scrub`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from safepoint.catalog.store import open_catalog
from safepoint.core.format import (
    MANIFEST_NAME,
    MARKER_NAME,
    FileEntry,
    build_manifest,
    digest_bytes,
    marker_for,
    parse_manifest,
)
from safepoint.core.hashing import hash_path
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.local.snapshot import LocalSnapshot

REPO = Path(__file__).resolve().parents[1]
RUN = "mn"

pytestmark = pytest.mark.slow  # two nodes, one process per command


def _cli(env: dict[str, str], *args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "safepoint.cli", *map(str, args)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


class Nodes:
    """Two nodes sharing a catalog and two durable replicas."""

    def __init__(self, base: Path, catalog_url: str, prefect_api: str):
        self.base, self.catalog_url = base, catalog_url
        self.durable = [(base / "durable-a").as_uri(), (base / "durable-b").as_uri()]
        self.prefect_api = prefect_api

    def root(self, node: str) -> Path:
        return self.base / node / "nvme"

    def env(self, node: str) -> dict[str, str]:
        home = self.base / node / "sp-home"
        home.mkdir(parents=True, exist_ok=True)
        return {**os.environ, "SAFEPOINT_HOME": str(home), "SAFEPOINT_CATALOG_URL": self.catalog_url,
                "PREFECT_API_URL": self.prefect_api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PYTHONPATH": str(REPO)}

    def write_part(self, node: str, step: int, rank: int) -> Path:
        folder = self.root(node) / RUN / f"step-{step}"
        folder.mkdir(parents=True)
        g = torch.Generator().manual_seed(10 * step + rank)
        torch.save({"shard": torch.randn(64, 64, generator=g), "rank": torch.tensor(rank)}, folder / f"rank{rank}.pt")
        got = _cli(self.env(node), "commit", folder, "--run", RUN, "--step", step, "--world-size", 2,
                   "--ranks", rank, "--node", node)
        assert got.returncode == 0, got.stderr
        return folder

    def replica(self, i: int, step: int) -> Path:
        return Path(self.durable[i][len("file://"):]) / RUN / str(step)


STEPS = (1, 2, 3, 4)   # one checkpoint per test (each test changes only its own), 4 the resume point


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, prefect_api):
    """Both nodes commit their part of every step; each node's watcher ingests its parts in one pass."""
    from safepoint.catalog import db

    base = tmp_path_factory.mktemp("nodes")
    url = f"sqlite:///{base / 'catalog.db'}"
    n = Nodes(base, url, prefect_api)
    n.originals = {}
    for step in STEPS:
        parts = {f"n{r}": n.write_part(f"n{r}", step, r) for r in (0, 1)}
        n.originals[step] = {f"rank{r}.pt": hash_path(parts[f"n{r}"] / f"rank{r}.pt")[1] for r in (0, 1)}
    for node, state in (("n0", "replicating"), ("n1", "verified")):  # n1's parts are the last to arrive
        got = _cli(n.env(node), "watch", n.root(node), *[a for u in n.durable for a in ("--to", u)], "--once")
        assert sorted(got.stdout.splitlines()) == [f"{RUN}/{s}: {state}" for s in STEPS], got.stderr
        assert got.returncode == 0, got.stderr  # a part delivered that waits for the others is no failure
    cat = open_catalog(url)
    assert [cat.get(RUN, s).state for s in STEPS] == [CS.VERIFIED] * len(STEPS)
    yield n
    db.dispose(url)


def _lose_part(nodes: Nodes, node: str, step: int) -> None:
    """That node's copy of the step is gone (the node died, or its disk was wiped)."""
    shutil.rmtree(nodes.root(node) / RUN / f"step-{step}")


def _forge(replica: Path) -> None:
    """Replace rank 0's bytes and write a MANIFEST.json and COMMITTED that bind them."""
    torch.save({"shard": torch.zeros(64, 64), "rank": torch.tensor(0)}, replica / "rank0.pt")
    m = parse_manifest((replica / MANIFEST_NAME).read_bytes())
    size, digest = hash_path(replica / "rank0.pt")
    files = [FileEntry(f.path, size, digest) if f.path == "rank0.pt" else f for f in m.files]
    forged = build_manifest(m.run, m.step, files, created=m.created, world_size=m.world_size, ranks=m.ranks,
                            node=m.node, parent=m.parent, meta=m.meta)
    data = forged.to_json_bytes()
    (replica / MANIFEST_NAME).write_bytes(data)
    (replica / MARKER_NAME).write_bytes(marker_for(data, forged).to_json_bytes())


def _restored(into: Path) -> dict[str, str]:
    snap = LocalSnapshot.open(into)
    assert snap.verify().outcome is CS.VERIFIED
    assert snap.manifest.held_ranks == (0, 1)
    return {f.path: f.blake3 for f in snap.manifest.files}


def test_restore_on_node0_without_from_brings_back_every_rank(nodes):
    row = open_catalog(nodes.catalog_url).get(RUN, 4)
    assert row.state is CS.VERIFIED and row.world_size == 2
    for i in (0, 1):  # the whole manifest's digest was recorded when the last part arrived
        assert digest_bytes((nodes.replica(i, 4) / MANIFEST_NAME).read_bytes()) == row.manifest_blake3

    into = nodes.base / "n0" / "resume-4"
    got = _cli(nodes.env("n0"), "restore", "--run", RUN, "--into", into, "--json")  # the resume point
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["step"] == 4
    assert _restored(into) == nodes.originals[4]
    # local parts first (this machine sees both nodes' folders): no replica was needed
    assert json.loads(got.stdout)["sources"] == [str(nodes.root(n) / RUN / "step-4") for n in ("n0", "n1")]


def test_a_forged_replica_is_refused_healed_around_and_found_by_verify(nodes):
    forged, good = (f"{u}/{RUN}/1" for u in nodes.durable)
    _forge(nodes.replica(0, 1))
    env = nodes.env("n0")

    into = nodes.base / "n0" / "from-forged-1"
    got = _cli(env, "restore", "--run", RUN, "--step", 1, "--into", into, "--from", nodes.durable[0])
    assert got.returncode == 1, got.stderr
    assert not (into / MARKER_NAME).exists()
    cat = open_catalog(nodes.catalog_url)
    rep = next(r for r in cat.replicas(cat.get(RUN, 1).id) if r.url == forged)
    assert rep.state is RS.CORRUPT and "not the one the catalog recorded" in rep.error

    # Without --from, node 1's part gone: rank 0 from node 0's part, rank 1 from the good replica.
    _lose_part(nodes, "n1", 1)
    into = nodes.base / "n0" / "resume-1"
    got = _cli(env, "restore", "--run", RUN, "--step", 1, "--into", into, "--json")
    assert got.returncode == 0, got.stderr
    assert _restored(into) == nodes.originals[1]
    assert json.loads(got.stdout)["sources"] == [str(nodes.root("n0") / RUN / "step-1"), good]

    # `verify` of the forged replica: corrupt, exit 1; of the good one: verified.
    got = _cli(env, "verify", forged)
    assert got.returncode == 1 and "not the one the catalog recorded" in got.stderr, got.stderr
    assert _cli(env, "verify", good).returncode == 0


def test_scrub_finds_a_forged_replica(nodes):
    good, forged = (f"{u}/{RUN}/2" for u in nodes.durable)
    _forge(nodes.replica(1, 2))
    got = _cli(nodes.env("n0"), "scrub", "--run", RUN, "--subset", "1/16", "--no-repair", "--json")
    assert got.returncode == 1, got.stderr
    summary = json.loads(got.stdout)
    assert forged in summary["unrepaired"] and good not in summary["unrepaired"]
    cat = open_catalog(nodes.catalog_url)
    assert {r.url: r.state for r in cat.replicas(cat.get(RUN, 2).id)} == {good: RS.VERIFIED, forged: RS.CORRUPT}


def test_no_good_source_for_a_rank_is_exit_1_and_nothing_committed(nodes):
    for i in (0, 1):
        _forge(nodes.replica(i, 3))
    _lose_part(nodes, "n1", 3)  # rank 1 of step 3 is now only on the forged replicas
    into = nodes.base / "n0" / "resume-3"
    got = _cli(nodes.env("n0"), "restore", "--run", RUN, "--step", 3, "--into", into)
    assert got.returncode == 1, got.stderr
    assert not (into / MARKER_NAME).exists()
    assert not (into / "rank1.pt").exists()
