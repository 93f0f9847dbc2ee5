"""Fleet restart across separate processes: 4 nodes (each its own SAFEPOINT_HOME, one `safepoint restore`
process per node, all at once), one shared catalog (SQLite and PostgreSQL), one SeaweedFS replica.

A 4 x 2-rank checkpoint (world 8, 192 KiB a rank) is replicated and assembled in this process; then:
- node n1 is replaced (its folder gone) and every node restores its part at once: n1's part comes
  from the replica, the others move nothing but the shared file they never held; the bytes moved
  are the bytes needed; each folder holds exactly its ranks' files, verified and committed;
- a rotten rank in the only replica is refused (exit 1, nothing committed);
- a store answering 503 SlowDown to the herd is retried, never read as "nothing there", and no node
  lists the bucket; one that keeps answering 503 is an exit 2 that records nothing;
- one node cannot restore its part of the newest step: it exits 1, the failure is recorded, and in
  the next round every node restores the same older step (and `resume-point` says so on each).
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

from safepoint import commit
from safepoint.core.config import Config
from safepoint.core.format import MARKER_NAME
from safepoint.core.states import CheckpointState as CS
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.assemble import replicate_part_to, settle_part
from safepoint.ops.steps import register
from tests.faultproxy import Fault

REPO = Path(__file__).resolve().parents[1]
RUN = "fleet"
NODES = {"n0": (0, 1), "n1": (2, 3), "n2": (4, 5), "n3": (6, 7)}
WORLD = 8
SHARED = "config.json"   # only n0's part holds it; every part needs it

pytestmark = [pytest.mark.catalog_backends, pytest.mark.slow]


class FleetNodes:
    def __init__(self, base: Path, catalog_url: str, replica: str):
        self.base, self.catalog_url, self.replica = base, catalog_url, replica
        self.endpoint: str | None = None   # the nodes' S3 endpoint, when not the server's own

    def folder(self, node: str, step: int | str) -> Path:
        return self.base / node / "nvme" / RUN / f"step-{step}"

    def env(self, node: str) -> dict[str, str]:
        home = self.base / node / "home"
        home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "SAFEPOINT_HOME": str(home), "SAFEPOINT_CATALOG_URL": self.catalog_url,
               "SAFEPOINT_NODE": node, "PYTHONPATH": str(REPO), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        env.pop("SAFEPOINT_CONFIG", None)
        if self.endpoint:
            env["AWS_ENDPOINT_URL"] = self.endpoint
        return env

    def write(self, step: int) -> dict[str, Path]:
        out = {}
        for node, ranks in NODES.items():
            folder = self.folder(node, step)
            folder.mkdir(parents=True)
            for r in ranks:
                g = torch.Generator().manual_seed(100 * step + r)
                torch.save({"shard": torch.randn(48 * 1024, generator=g)}, folder / f"rank{r:02d}.pt")
            if 0 in ranks:
                (folder / SHARED).write_text(json.dumps({"world_size": WORLD}))
            commit(folder, RUN, step, world_size=WORLD, ranks=list(ranks), node=node)
            out[node] = folder
        return out

    def restore_all(self, *extra: str, nodes=tuple(NODES)) -> dict[str, tuple[int, dict | None, str]]:
        """Every node's `safepoint restore --node N` at once, into its own folder: (exit, JSON, stderr)."""
        procs = {n: subprocess.Popen(
            [sys.executable, "-m", "safepoint.cli", "restore", "--run", RUN, "--node", n, "--json",
             "--into", str(self.folder(n, "{step}")), *extra],
            env=self.env(n), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in nodes}
        out = {}
        for n, p in procs.items():
            so, se = p.communicate(timeout=300)
            out[n] = (p.returncode, json.loads(so) if so.strip() else None, se)
        return out

    def cli(self, node: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "safepoint.cli", *args], env=self.env(node), cwd=REPO,
                              capture_output=True, text=True, timeout=300)


@pytest.fixture
def fleet(tmp_path, catalog, catalog_url, s3_env, monkeypatch):
    """Step 2 of a 4-node run, every part ingested to one SeaweedFS replica and verified (`add` for more)."""
    monkeypatch.setenv("SAFEPOINT_MULTINODE_TIMEOUT_S", "60")
    f = FleetNodes(tmp_path, catalog_url, s3_env.url())
    cfg = Config()

    def add(step: int) -> None:
        # Each part replicated and the set assembled as ingest does; the dry-run load (which would read
        # the assembled set back) is left out: tests/test_fleet_restore.py ingests for real.
        for folder in f.write(step).values():
            snap = LocalSnapshot.open(folder)
            row = register(catalog, snap)
            settle_part(catalog, row.id, snap, [replicate_part_to(catalog, row.id, snap, f.replica, cfg)],
                        [f.replica], cfg)
        assert catalog.get(RUN, step).state is CS.REPLICATED
        catalog.transition(row.id, CS.VALIDATING)
        catalog.transition(row.id, CS.VERIFIED)

    add(2)
    f.add, f.s3 = add, s3_env
    return f


def _rot(f: FleetNodes, step: int, path: str) -> None:
    """Flip one byte of a file in the replica, behind Safepoint's back."""
    client = f.s3.server.client()
    key = f"{f.s3.key('ckpt')}/{RUN}/{step}/{path}"
    data = bytearray(client.get_object(Bucket=f.s3.bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    client.put_object(Bucket=f.s3.bucket, Key=key, Body=bytes(data))


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_four_nodes_one_replaced_move_only_what_is_missing(fleet):
    shutil.rmtree(fleet.folder("n1", 2))          # n1 was replaced: its NVMe is empty
    shared = (fleet.folder("n0", 2) / SHARED).stat().st_size
    got = fleet.restore_all()
    for n, (rc, doc, err) in got.items():
        assert rc == 0, (n, err)
        assert doc["step"] == 2 and doc["ranks"] == list(NODES[n]) and doc["node"] == n
    # Needed: n1's whole part (its ranks and the shared file), and the shared file on n2 and n3.
    needed = LocalSnapshot.open(fleet.folder("n1", 2)).manifest.total_bytes + 2 * shared
    moved = sum(v for doc in (d for _rc, d, _e in got.values()) for k, v in doc["bytes_from"].items() if k != "local")
    assert needed <= moved <= 1.05 * needed
    assert got["n0"][1]["bytes_fetched"] == 0 and got["n1"][1]["bytes_from"]["local"] == 0
    assert set(got["n1"][1]["bytes_from"]) == {"local", fleet.replica}
    for n, ranks in NODES.items():
        folder = fleet.folder(n, 2)
        snap = LocalSnapshot.open(folder)
        assert snap.verify().outcome is CS.VERIFIED
        assert (snap.manifest.held_ranks, snap.manifest.node, snap.manifest.world_size) == (ranks, n, WORLD)
        assert _files(folder) == {f"rank{r:02d}.pt" for r in ranks} | {SHARED, "MANIFEST.json", "COMMITTED"}
    # Run again: every part is there and verifies, nothing moves.
    again = fleet.restore_all()
    assert all(rc == 0 and doc["bytes_fetched"] == 0 for rc, doc, _e in again.values())


def test_a_rotten_rank_in_the_only_replica_is_refused(fleet):
    # First, a rank the checkpoint does not have: exit 2, one line, nothing written.
    got = fleet.cli("n1", "restore", "--run", RUN, "--into", str(fleet.base / "x"), "--ranks", "6-8")
    assert got.returncode == 2 and len(got.stderr.strip().splitlines()) == 1 and "rank 8" in got.stderr
    assert not (fleet.base / "x" / MARKER_NAME).exists()
    shutil.rmtree(fleet.folder("n1", 2))
    _rot(fleet, 2, "rank03.pt")
    rc, doc, err = fleet.restore_all("--step", "2", nodes=("n1",))["n1"]
    assert rc == 1, err
    assert doc["restored"] is False and "rank03.pt" in err
    assert len(err.strip().splitlines()) == 1
    assert not (fleet.folder("n1", 2) / MARKER_NAME).exists()


def test_one_node_cannot_restore_the_newest_step_so_every_node_takes_the_same_older_one(fleet):
    fleet.add(1)
    shutil.rmtree(fleet.folder("n2", 2))           # n2 was replaced, and its part of step 2 rotted in the replica
    _rot(fleet, 2, "rank05.pt")
    first = fleet.restore_all()
    assert first["n2"][0] == 1 and "run the restore again on every node" in first["n2"][2]
    assert {rc for rc, _d, _e in first.values()} <= {0, 1}
    second = fleet.restore_all()                      # the launcher's next round
    assert {n: (rc, doc["step"]) for n, (rc, doc, _e) in second.items()} == {n: (0, 1) for n in NODES}
    for n, ranks in NODES.items():
        snap = LocalSnapshot.open(fleet.folder(n, 1))
        assert snap.verify().outcome is CS.VERIFIED and snap.manifest.held_ranks == ranks
    points = {n: json.loads(fleet.cli(n, "resume-point", "--run", RUN, "--json").stdout)["step"] for n in NODES}
    assert points == {n: 1 for n in NODES}


def test_slowdown_is_retried_never_read_as_nothing_there_and_nobody_lists(fleet, fault_proxy, catalog):
    shutil.rmtree(fleet.folder("n1", 2))
    fleet.endpoint = fault_proxy.endpoint
    fault_proxy.add(Fault("status", method="GET", times=6))    # 503 SlowDown, the herd's first requests
    fault_proxy.add(Fault("status", method="HEAD", times=3))
    got = fleet.restore_all()
    assert {n: (rc, doc["step"]) for n, (rc, doc, _e) in got.items()} == {n: (0, 2) for n in NODES}
    assert len(fault_proxy.injected) == 9
    listing = [t for m, t in fault_proxy.requests if m == "GET" and ("list-type" in t or "prefix=" in t)]
    assert listing == []
    # A store that keeps answering 503: exit 2 in one line, nothing committed, nothing recorded as missing.
    shutil.rmtree(fleet.folder("n1", 2))
    fault_proxy.add(Fault("status", times=None))
    (fleet.base / "n1" / "home" / "config.toml").write_text(
        f'[storage."s3://{fleet.s3.bucket}"]\nretry_attempts = 2\nretry_base_s = 0.01\n')
    rc, doc, err = fleet.restore_all(nodes=("n1",))["n1"]
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and "nothing was committed" in err
    assert not (fleet.folder("n1", 2) / MARKER_NAME).exists()
    row = catalog.get(RUN, 2)
    assert row.state is CS.VERIFIED and [r.state.value for r in catalog.replicas(row.id)] == ["verified"]
