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

    def ingest(self, node: str, folder: Path) -> str:
        args = [a for url in self.durable for a in ("--to", url)]
        got = _cli(self.env(node), "ingest", folder, *args, "--json")
        assert got.stdout, got.stderr
        return json.loads(got.stdout)["state"]

    def replica(self, i: int, step: int) -> Path:
        return Path(self.durable[i][len("file://"):]) / RUN / str(step)


@pytest.fixture
def nodes(tmp_path, prefect_api, sqlite_catalog_url):
    n = Nodes(tmp_path, sqlite_catalog_url, prefect_api)
    parts = {"n0": n.write_part("n0", 1, 0), "n1": n.write_part("n1", 1, 1)}
    assert [n.ingest(node, parts[node]) for node in ("n0", "n1")] == ["replicating", "verified"]
    n.originals = {f"rank{r}.pt": hash_path(parts[f"n{r}"] / f"rank{r}.pt")[1] for r in (0, 1)}
    return n


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


def test_restore_on_node0_without_from_brings_back_every_rank(nodes, sqlite_catalog_url):
    row = open_catalog(sqlite_catalog_url).get(RUN, 1)
    assert row.state is CS.VERIFIED and row.world_size == 2
    for i in (0, 1):  # the whole manifest's digest was recorded when the last part arrived
        assert digest_bytes((nodes.replica(i, 1) / MANIFEST_NAME).read_bytes()) == row.manifest_blake3

    into = nodes.base / "n0" / "resume"
    got = _cli(nodes.env("n0"), "restore", "--run", RUN, "--into", into, "--json")
    assert got.returncode == 0, got.stderr
    assert _restored(into) == nodes.originals
    # local parts first (this machine sees both nodes' folders): no replica was needed
    assert json.loads(got.stdout)["sources"] == [str(nodes.root(n) / RUN / "step-1") for n in ("n0", "n1")]


def test_a_forged_replica_is_refused_healed_around_and_found_by_verify_and_scrub(nodes, sqlite_catalog_url):
    forged = nodes.replica(0, 1)
    _forge(forged)
    env = nodes.env("n0")

    into = nodes.base / "n0" / "from-forged"
    got = _cli(env, "restore", "--run", RUN, "--into", into, "--from", nodes.durable[0])
    assert got.returncode == 1, got.stderr
    assert not (into / MARKER_NAME).exists()
    cat = open_catalog(sqlite_catalog_url)
    rep = next(r for r in cat.replicas(cat.get(RUN, 1).id) if r.url.startswith(nodes.durable[0]))
    assert rep.state is RS.CORRUPT and "not the one the catalog recorded" in rep.error

    # Without --from, node 1's part gone: rank 0 from node 0, rank 1 from the good replica.
    shutil.rmtree(nodes.base / "n1")
    into = nodes.base / "n0" / "resume"
    got = _cli(env, "restore", "--run", RUN, "--into", into, "--json")
    assert got.returncode == 0, got.stderr
    assert _restored(into) == nodes.originals
    assert json.loads(got.stdout)["sources"][1:] == [nodes.durable[1] + f"/{RUN}/1"]

    # `verify` of the forged replica: corrupt, exit 1; of the good one: verified.
    got = _cli(env, "verify", f"{nodes.durable[0]}/{RUN}/1")
    assert got.returncode == 1 and "not the one the catalog recorded" in got.stderr, got.stderr
    assert _cli(env, "verify", f"{nodes.durable[1]}/{RUN}/1").returncode == 0


def test_scrub_finds_a_forged_replica(nodes, sqlite_catalog_url):
    _forge(nodes.replica(1, 1))
    got = _cli(nodes.env("n0"), "scrub", "--subset", "1/16", "--no-repair", "--json")
    assert got.returncode == 1, got.stderr
    summary = json.loads(got.stdout)
    assert summary["unrepaired"] == [nodes.durable[1] + f"/{RUN}/1"]
    cat = open_catalog(sqlite_catalog_url)
    states = {r.url: r.state for r in cat.replicas(cat.get(RUN, 1).id)}
    assert states == {nodes.durable[0] + f"/{RUN}/1": RS.VERIFIED, nodes.durable[1] + f"/{RUN}/1": RS.CORRUPT}


def test_no_good_source_for_a_rank_is_exit_1_and_nothing_committed(nodes):
    for i in (0, 1):
        _forge(nodes.replica(i, 1))
    shutil.rmtree(nodes.base / "n1")  # rank 1 now exists only on the forged replicas
    into = nodes.base / "n0" / "resume"
    got = _cli(nodes.env("n0"), "restore", "--run", RUN, "--into", into)
    assert got.returncode == 1, got.stderr
    assert not (into / MARKER_NAME).exists()
    assert not (into / "rank1.pt").exists()
