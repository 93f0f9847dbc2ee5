"""Benchmark: a fleet of N nodes x R ranks x S steps through Prefect's own workers, and what it costs.

    flock /tmp/safepoint-bench.lock python bench/fleet.py [--nodes 4] [--ranks 8] [--steps 10]
        [--query-seconds 1] [--every 0] [--peer-steps 3]

The real deployment path (tests/fleet.py): `prefect server start` on a fresh PostgreSQL database,
a catalog on another, a process work pool, per node `prefect deploy --prefect-file
prefect-fleet.yaml` (deployment ingest-NODE on work queue NODE), a `prefect worker start` and a
`safepoint watch ROOT --emit`, plus the zombie-run automation. Each step, every node commits its
part (R rank files of a world of N*R; small tensors, so orchestration is what is measured) under
its own root; the watchers emit, the automations create runs, the workers run them, the last part
assembles and validates the set. With --every 0 (default) the next step starts when the previous
one is verified (closed loop: latency); with --every T a step starts every T seconds (throughput).

Printed:
- marker -> verified per checkpoint (the last part's COMMITTED mtime to the catalog's `verified`
  state event), p50/p95, and stages from the flow runs' own timestamps (median over parts):
  marker -> run created (watcher, event, trigger), created -> started (worker poll, flow-run
  process start), started -> ended (the flow), last run ended -> verified;
- checkpoints per hour over the measured window;
- CPU seconds per checkpoint (psutil, sampled every 0.2 s; a process first seen inside the window
  counts from zero): the Prefect server (its process tree), Prefect's database (PostgreSQL
  backends of its database), the catalog (backends of the catalog database), the workers with
  their flow-run processes, the watchers; and per checkpoint the events Prefect stored, the
  catalog rows written (pg_stat_user_tables) and the transactions of each database;
- the peer: the same parts ingested directly in this warm process (no Prefect), per checkpoint.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

RUN = "fleet"


def write_part(root: Path, step: int, node: str, ranks: list[int], world: int) -> Path:
    import torch

    from safepoint import commit

    folder = root / RUN / f"step-{step}"
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(step)
    for r in ranks:
        torch.save({"model": {f"layer{r}.w": torch.randn(64, 64, generator=g)},
                    "optimizer": {"state": {r: {"exp_avg": torch.randn(64, 64, generator=g)}}}, "step": step},
                   folder / f"rank{r}.pt")
    commit(folder, RUN, step, world_size=world, ranks=ranks, node=node)
    return folder


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


class Cpu(threading.Thread):
    """CPU seconds of groups of processes, sampled; `mark()` starts the window, `totals()` reads it."""

    def __init__(self, fleet, every: float = 0.2):
        super().__init__(daemon=True)
        import psycopg

        self.fleet, self.every = fleet, every
        self.pg = psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres", autocommit=True)
        self.stop = threading.Event()
        self.base: dict[tuple[str, int], float] = {}
        self.last: dict[tuple[str, int], float] = {}
        self.marked = False
        self.lock = threading.Lock()

    def _tree(self, pid: int) -> list[tuple[int, float]]:
        import psutil

        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        out = []
        for p in procs:
            try:
                t = p.cpu_times()
                # children_*: processes it waited for (a worker's finished flow runs)
                out.append((p.pid, t.user + t.system + t.children_user + t.children_system))
            except psutil.NoSuchProcess:
                pass
        return out

    def _backends(self, db: str) -> list[tuple[int, float]]:
        import psutil

        rows = self.pg.execute("select pid from pg_stat_activity where datname = %s", (db,)).fetchall()
        out = []
        for (pid,) in rows:
            try:
                t = psutil.Process(pid).cpu_times()
                out.append((pid, t.user + t.system))
            except psutil.NoSuchProcess:
                pass
        return out

    def sample(self) -> None:
        f = self.fleet
        groups = {"prefect server": self._tree(f.server.proc.pid) if f.server.proc else [],
                  "prefect db": self._backends(f.prefect_db), "catalog db": self._backends(f.catalog_db),
                  "workers+flow runs": [x for p in list(f.workers.values()) for x in self._tree(p.pid)],
                  "watchers": [x for p in list(f.watchers.values()) for x in self._tree(p.pid)]}
        with self.lock:
            for g, procs in groups.items():
                for pid, cpu in procs:
                    key = (g, pid)
                    if key not in self.base:
                        self.base[key] = cpu if not self.marked else 0.0
                    self.last[key] = max(cpu, self.last.get(key, 0.0))

    def mark(self) -> None:
        self.sample()
        with self.lock:
            self.base = dict(self.last)
            self.marked = True

    def totals(self) -> dict[str, float]:
        self.sample()
        out: dict[str, float] = {}
        with self.lock:
            for (g, pid), cpu in self.last.items():
                out[g] = out.get(g, 0.0) + cpu - self.base.get((g, pid), 0.0)
        return out

    def run(self) -> None:
        while not self.stop.wait(self.every):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a process went away mid-sample
                continue


def db_counters(fleet) -> dict[str, float]:
    """Counters to difference over the window: events stored, catalog rows written, transactions."""
    import psycopg

    out: dict[str, float] = {}
    with psycopg.connect(f"host=127.0.0.1 port=5432 user=postgres dbname={fleet.prefect_db}") as c:
        out["prefect events"] = c.execute("select count(*) from events").fetchone()[0]
    with psycopg.connect(f"host=127.0.0.1 port=5432 user=postgres dbname={fleet.catalog_db}") as c:
        ins, upd = c.execute("select coalesce(sum(n_tup_ins),0), coalesce(sum(n_tup_upd),0) "
                             "from pg_stat_user_tables").fetchone()
        out["catalog rows inserted"], out["catalog rows updated"] = float(ins), float(upd)
    with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres") as c:
        for label, db in (("prefect db xacts", fleet.prefect_db), ("catalog db xacts", fleet.catalog_db)):
            out[label] = float(c.execute("select xact_commit + xact_rollback from pg_stat_database "
                                         "where datname = %s", (db,)).fetchone()[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=8, help="ranks per node")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--query-seconds", type=float, default=1.0, help="PREFECT_WORKER_QUERY_SECONDS")
    ap.add_argument("--every", type=float, default=0.0, help="seconds between steps; 0: when verified")
    ap.add_argument("--peer-steps", type=int, default=3)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()

    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    from tests.fleet import Fleet

    work = Path(args.work or tempfile.mkdtemp(prefix="sp-fleet-"))
    nodes = [f"n{i}" for i in range(args.nodes)]
    world = args.nodes * args.ranks
    ranks = {n: list(range(i * args.ranks, (i + 1) * args.ranks)) for i, n in enumerate(nodes)}
    fleet = Fleet(work, nodes, query_s=args.query_seconds)
    load0 = os.getloadavg()
    results: list[dict[str, float]] = []
    cpu = None
    try:
        t_up = time.monotonic()
        fleet.start()
        print(f"fleet up in {time.monotonic() - t_up:.1f}s (server {fleet.timings['server']:.1f}s, "
              f"pool+deploy+automation {fleet.timings['deploy']:.1f}s); {len(nodes)} nodes x {args.ranks} ranks, "
              f"world {world}; work {work}", flush=True)
        cpu = Cpu(fleet)
        cpu.start()
        cat = fleet.catalog()

        def commit_step(step: int) -> float:
            for n in nodes:
                write_part(fleet.root(n), step, n, ranks[n], world)
            return max((fleet.root(n) / RUN / f"step-{step}" / "COMMITTED").stat().st_mtime for n in nodes)

        def wait_verified(step: int, timeout_s: float = 300) -> None:
            fleet.wait_for(f"step {step} verified", lambda: fleet.state(RUN, step) == "verified", timeout_s, 0.05)

        # Warm-up (not measured): the first runs of each worker, caches, connection pools.
        commit_step(0)
        wait_verified(0)
        time.sleep(2)
        cpu.mark()
        c0 = db_counters(fleet)
        t0 = time.time()
        markers: dict[int, float] = {}
        for step in range(1, args.steps + 1):
            if args.every:
                time.sleep(max(0.0, t0 + (step - 1) * args.every - time.time()))
            markers[step] = commit_step(step)
            if not args.every:
                wait_verified(step)
        for step in markers:
            wait_verified(step)
        t1 = time.time()
        totals = cpu.totals()
        c1 = db_counters(fleet)
        load1 = os.getloadavg()
        fleet.wait_for("every run finished", lambda: all(
            r.state_type.value in ("COMPLETED", "FAILED", "CRASHED") for r in fleet.ingest_runs()), 120)
        runs: list = []
        while True:  # the API answers at most 200 at a time
            page = fleet.api(lambda c, off=len(runs): c.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=["safepoint-ingest"])), limit=200, offset=off))
            runs += page
            if len(page) < 200:
                break
        for step, t_marker in markers.items():
            row = cat.get(RUN, step)
            ev = {e["detail"].get("to"): e["at"].timestamp() for e in cat.events(row.id, kind="state")}
            mine = [r for r in runs  # the whole last name: step-1 must not match step-10's runs
                    if str((r.parameters or {}).get("snapshot", "")).rstrip("/").endswith(f"/{RUN}/step-{step}")]
            first_marker = min((fleet.root(n) / RUN / f"step-{step}" / "COMMITTED").stat().st_mtime for n in nodes)
            results.append({
                "total": ev["verified"] - t_marker,
                "first marker -> verified": ev["verified"] - first_marker,
                "marker -> run created": statistics.median(
                    r.created.timestamp() - first_marker for r in mine),
                "created -> started": statistics.median(
                    r.start_time.timestamp() - r.created.timestamp() for r in mine),
                "flow run": statistics.median(r.end_time.timestamp() - r.start_time.timestamp() for r in mine),
                "last run ended -> verified": ev["verified"] - max(r.end_time.timestamp() for r in mine),
                "runs": len(mine)})
    finally:
        if cpu is not None:
            cpu.stop.set()
        fleet.close()

    # Peer: the same parts ingested directly in this warm process, no Prefect (Safepoint's own work).
    from safepoint.catalog.store import open_catalog
    from safepoint.core.config import Config
    from safepoint.ops.ingest import ingest

    peer_cat = open_catalog(f"sqlite:///{work / 'peer.db'}")
    peer = []
    for step in range(1000, 1000 + args.peer_steps):
        folders = [write_part(work / "peer" / n, step, n, ranks[n], world) for n in nodes]
        t = time.perf_counter()
        for folder in folders:
            ingest(folder, [(work / "peer-durable").as_uri()], peer_cat, Config())
        peer.append(time.perf_counter() - t)
        assert peer_cat.get(RUN, step).state.value == "verified"

    n = len(results)
    totals_ = [r["total"] for r in results]
    window = t1 - t0
    print(f"\n{len(nodes)} nodes x {args.ranks} ranks x {n} steps, worker poll {args.query_seconds:g}s, "
          f"{'closed loop' if not args.every else f'a step every {args.every:g}s'}; load {load0[0]:.1f} -> "
          f"{load1[0]:.1f} ({os.cpu_count()} cores)")
    print(f"marker (last part) -> verified: p50 {pct(totals_, .5):.2f}s, p95 {pct(totals_, .95):.2f}s, "
          f"min {min(totals_):.2f}s, max {max(totals_):.2f}s")
    stages = ["first marker -> verified", "marker -> run created", "created -> started", "flow run",
              "last run ended -> verified"]
    print("stages (median over checkpoints; per checkpoint the median over its parts' runs):")
    for s in stages:
        print(f"  {s:28s} {statistics.median(r[s] for r in results):6.2f}s")
    print(f"checkpoints per hour: {n / window * 3600:.0f} ({n} in {window:.1f}s); "
          f"flow runs {sum(r['runs'] for r in results)} ({len(nodes)} per checkpoint expected)")
    print("CPU seconds per checkpoint:")
    for g in ("prefect server", "prefect db", "catalog db", "workers+flow runs", "watchers"):
        print(f"  {g:20s} {totals.get(g, 0.0) / n:7.3f}s")
    print("per checkpoint:")
    for k in c1:
        print(f"  {k:24s} {(c1[k] - c0[k]) / n:8.1f}")
    print(f"peer (the same {len(nodes)} parts ingested directly, warm process, no Prefect): "
          f"median {statistics.median(peer):.2f}s per checkpoint (n={len(peer)}); "
          f"through the fleet p50 {pct(totals_, .5):.2f}s = {pct(totals_, .5) / statistics.median(peer):.1f}x")
    print("per checkpoint totals (s): " + ", ".join(f"{t:.1f}" for t in totals_))


if __name__ == "__main__":
    main()
