"""Benchmark: a fleet of N nodes x R ranks x S steps on Prefect, both lanes side by side, and what each costs.

    flock /tmp/safepoint-bench.lock python bench/fleet.py [--configs 4x8x10,8x4x10] [--lanes warm,deploy]
        [--api-servers 2] [--query-seconds 1] [--every 0] [--peer-steps 3]

Each (config, lane) is one fleet of tests/fleet.py, started fresh: Prefect on a fresh PostgreSQL
database (with --api-servers 2, the default: two `prefect server start --no-services` behind a
balancer, Redis via prefect-redis, the services in a process of their own; 1: one `prefect server
start`), a catalog on another database, and per node either
- `warm` (the fleet's default): `safepoint serve --watch ROOT`, the node's ingests as flow runs in
  one long-lived process; or
- `deploy`: `prefect deploy --prefect-file prefect-fleet.yaml` (deployment ingest-NODE on work
  queue NODE, an event trigger), a process worker and `safepoint watch ROOT --emit`, plus the
  zombie-run automation.
Each step, every node commits its part (R rank files of a world of N*R; small tensors, so
orchestration is what is measured) under its own root; the last part assembles and validates the
set. With --every 0 (default) the next step starts when the previous one is verified (closed loop:
latency); with --every T a step starts every T seconds (throughput).

Printed, per (config, lane), then side by side:
- marker -> verified per checkpoint (the last part's COMMITTED mtime to the catalog's `verified`
  state event), p50/p95, and stages from the flow runs' own timestamps (median over parts):
  marker -> run created, created -> started, started -> ended (the flow), last run ended -> verified;
- checkpoints per hour over the measured window;
- CPU seconds per checkpoint (psutil, sampled every 0.2 s; a process first seen inside the window
  counts from zero) for each component: the API servers, the Prefect services process (HA only),
  Prefect's database (PostgreSQL backends of its database), Redis, the catalog (backends of the
  catalog database), the executors (warm: the serve processes; deploy: the workers with their
  flow-run processes) and the deploy lane's watchers;
- per checkpoint: the events Prefect stored (and per part), the catalog rows written
  (pg_stat_user_tables) and the transactions of each database;
- the peer: the same parts ingested directly in this warm process (no Prefect), per checkpoint,
  and each lane's executor CPU as a multiple of it.
Load average at the start and end of each run is printed with it: on a shared machine the
latencies are upper bounds; CPU seconds and counts per checkpoint hardly depend on the load.
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
        apis = f.apis or [f.server]
        groups = {"api servers": [x for a in apis if a.proc for x in self._tree(a.proc.pid)],
                  "prefect services": self._tree(f.services.pid) if f.services else [],
                  "prefect db": self._backends(f.prefect_db),
                  "redis": self._tree(f.redis.proc.pid) if f.redis and f.redis.proc else [],
                  "catalog db": self._backends(f.catalog_db),
                  "executors": [x for p in [*f.workers.values(), *f.executors.values()] for x in self._tree(p.pid)],
                  "watchers": [x for p in list(f.watchers.values()) for x in self._tree(p.pid)]}
        with self.lock:
            seen = set()
            for g, procs in groups.items():
                for pid, cpu in procs:
                    key = (g, pid)
                    seen.add(key)
                    if key not in self.base:
                        self.base[key] = cpu if not self.marked else 0.0
                    self.last[key] = max(cpu, self.last.get(key, 0.0))
            # A process of a tree that exited was reaped by its parent, whose children_* now hold all of
            # its CPU: counting its last sample as well would count it twice (flow-run processes,
            # validation sandboxes). Database backends are reaped by PostgreSQL: theirs are kept.
            for key in [k for k in self.last if k[0] not in ("prefect db", "catalog db") and k not in seen]:
                del self.last[key]
                self.base.pop(key, None)

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


def events_by_name(fleet) -> dict[str, int]:
    import psycopg

    with psycopg.connect(f"host=127.0.0.1 port=5432 user=postgres dbname={fleet.prefect_db}") as c:
        return dict(c.execute("select event, count(*) from events group by event").fetchall())


def events_settled(fleet, quiet_s: float = 2.0, timeout_s: float = 60.0) -> dict[str, int]:
    """Prefect persists events in batches, seconds after they happen: wait until the count holds still."""
    last, since, deadline = None, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = events_by_name(fleet)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.5)
    return last or {}


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


GROUPS = ("api servers", "prefect services", "prefect db", "redis", "catalog db", "executors", "watchers")


def run_lane(args, lane: str, n_nodes: int, n_ranks: int, steps: int, work: Path) -> dict:
    """One fleet of `lane`, warmed up, then `steps` checkpoints measured; returns the figures."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    from tests.fleet import Fleet

    nodes = [f"n{i}" for i in range(n_nodes)]
    world = n_nodes * n_ranks
    ranks = {n: list(range(i * n_ranks, (i + 1) * n_ranks)) for i, n in enumerate(nodes)}
    fleet = Fleet(work, nodes, query_s=args.query_seconds, lane=lane, api_servers=args.api_servers)
    load0 = os.getloadavg()
    results: list[dict[str, float]] = []
    cpu = None
    try:
        t_up = time.monotonic()
        fleet.start()
        print(f"[{lane}] fleet up in {time.monotonic() - t_up:.1f}s (prefect {fleet.timings['server']:.1f}s); "
              f"{n_nodes} nodes x {n_ranks} ranks, world {world}, {args.api_servers} API server(s); work {work}",
              flush=True)
        cpu = Cpu(fleet)
        cpu.start()
        cat = fleet.catalog()

        def commit_step(step: int) -> float:
            for n in nodes:
                write_part(fleet.root(n), step, n, ranks[n], world)
            return max((fleet.root(n) / RUN / f"step-{step}" / "COMMITTED").stat().st_mtime for n in nodes)

        def wait_verified(step: int, timeout_s: float = 300) -> None:
            fleet.wait_for(f"step {step} verified", lambda: fleet.state(RUN, step) == "verified", timeout_s, 0.05)

        # Warm-up (not measured): the first runs of each node, caches, connection pools, and the lazy
        # imports of the part that assembles and validates (whichever node settles last: several steps).
        for step in range(1, args.warmup + 1):
            commit_step(step)
            wait_verified(step)
        fleet.wait_for("warm-up runs finished", lambda: all(
            r.state_type.value in ("COMPLETED", "FAILED", "CRASHED") for r in fleet.ingest_runs()), 120)
        e0 = events_settled(fleet)
        cpu.mark()
        c0 = db_counters(fleet)
        t0 = time.time()
        markers: dict[int, float] = {}
        for step in range(args.warmup + 1, args.warmup + steps + 1):
            if args.every:
                time.sleep(max(0.0, t0 + (step - 1) * args.every - time.time()))
            markers[step] = commit_step(step)
            if not args.every:
                wait_verified(step)
        for step in markers:
            wait_verified(step)
        fleet.wait_for("every run finished", lambda: all(
            r.state_type.value in ("COMPLETED", "FAILED", "CRASHED") for r in fleet.ingest_runs()), 120)
        t1 = time.time()
        totals = cpu.totals()
        e1 = events_settled(fleet)
        c1 = db_counters(fleet)
        load1 = os.getloadavg()
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
                    if str((r.parameters or {}).get("snapshot", "")).rstrip("/").endswith(f"/{RUN}/step-{step}")
                    and r.start_time and r.end_time]
            first_marker = min((fleet.root(n) / RUN / f"step-{step}" / "COMMITTED").stat().st_mtime for n in nodes)
            results.append({
                "total": ev["verified"] - t_marker,
                "first marker -> verified": ev["verified"] - first_marker,
                "marker -> run created": statistics.median(r.created.timestamp() - first_marker for r in mine),
                "created -> started": statistics.median(r.start_time.timestamp() - r.created.timestamp() for r in mine),
                "flow run": statistics.median(r.end_time.timestamp() - r.start_time.timestamp() for r in mine),
                "last run ended -> verified": ev["verified"] - max(r.end_time.timestamp() for r in mine),
                "runs": len(mine)})
    finally:
        if cpu is not None:
            cpu.stop.set()
        fleet.close()
    n = len(results)
    return {"lane": lane, "nodes": n_nodes, "ranks": n_ranks, "n": n, "load": (load0[0], load1[0]),
            "window": t1 - t0, "results": results, "cpu": {g: totals.get(g, 0.0) / n for g in GROUPS},
            "counters": {k: (c1[k] - c0[k]) / n for k in c1},
            "events": {k: (v - e0.get(k, 0)) / n for k, v in sorted(e1.items()) if v != e0.get(k, 0)}}


def cpu_self_and_children() -> float:
    """CPU seconds of this process and of the children it reaped (the validation's sandboxed reader),
    as the fleet's executors are counted."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def peer_ingest(work: Path, n_nodes: int, n_ranks: int, steps: int) -> float:
    """The same parts ingested directly in this warm process, no Prefect: median CPU seconds per checkpoint."""
    from safepoint.catalog.store import open_catalog
    from safepoint.core.config import Config
    from safepoint.ops.ingest import ingest

    nodes = [f"n{i}" for i in range(n_nodes)]
    world = n_nodes * n_ranks
    peer_cat = open_catalog(f"sqlite:///{work / 'peer.db'}")
    out = []
    for step in range(1000, 1000 + steps + 1):
        folders = [write_part(work / "peer" / n, step, n, list(range(i * n_ranks, (i + 1) * n_ranks)), world)
                   for i, n in enumerate(nodes)]
        t = cpu_self_and_children()
        for folder in folders:
            ingest(folder, [(work / "peer-durable").as_uri()], peer_cat, Config())
        if step > 1000:  # the first is the warm-up
            out.append(cpu_self_and_children() - t)
        assert peer_cat.get(RUN, step).state.value == "verified"
    return statistics.median(out)


def report(r: dict, peer_cpu: float) -> None:
    res = r["results"]
    totals_ = [x["total"] for x in res]
    print(f"\n[{r['lane']}] {r['nodes']} nodes x {r['ranks']} ranks x {r['n']} steps; load {r['load'][0]:.1f} -> "
          f"{r['load'][1]:.1f} ({os.cpu_count()} cores)")
    print(f"  marker (last part) -> verified: p50 {pct(totals_, .5):.2f}s, p95 {pct(totals_, .95):.2f}s, "
          f"min {min(totals_):.2f}s, max {max(totals_):.2f}s")
    for st in ("first marker -> verified", "marker -> run created", "created -> started", "flow run",
               "last run ended -> verified"):
        print(f"  {st:28s} {statistics.median(x[st] for x in res):6.2f}s (median)")
    print(f"  checkpoints per hour: {r['n'] / r['window'] * 3600:.0f} ({r['n']} in {r['window']:.1f}s); "
          f"flow runs {sum(x['runs'] for x in res)} ({r['nodes']} per checkpoint expected)")
    print("  CPU seconds per checkpoint: " + ", ".join(f"{g} {v:.3f}" for g, v in r["cpu"].items() if v))
    print(f"  executors / peer ({peer_cpu:.3f} CPU s per checkpoint in a warm process): "
          f"{r['cpu']['executors'] / peer_cpu:.1f}x")
    c = r["counters"]
    per_part = c['prefect events'] / r['nodes']
    print(f"  per checkpoint: {c['prefect events']:.1f} Prefect events ({per_part:.1f} per part), "
          f"Prefect db {c['prefect db xacts']:.0f} xacts, catalog db {c['catalog db xacts']:.0f} xacts, "
          f"catalog rows {c['catalog rows inserted']:.0f} inserted / {c['catalog rows updated']:.0f} updated")


def side_by_side(rows: list[dict]) -> None:
    for r in rows:
        print(f"\n[{r['lane']}] {r['nodes']}x{r['ranks']}: Prefect events per checkpoint by name: "
              + ", ".join(f"{k} {v:.1f}" for k, v in r["events"].items()))
    print("\n| config | lane | p50 s | p95 s | ckpt/h | events/part | API CPU s | db CPU s | redis CPU s | "
          "executors CPU s | Prefect xacts |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = [x["total"] for x in r["results"]]
        c, cpu = r["counters"], r["cpu"]
        print(f"| {r['nodes']}x{r['ranks']}x{r['n']} | {r['lane']} | {pct(t, .5):.2f} | {pct(t, .95):.2f} | "
              f"{r['n'] / r['window'] * 3600:.0f} | {c['prefect events'] / r['nodes']:.1f} | "
              f"{cpu['api servers'] + cpu['prefect services']:.2f} | {cpu['prefect db']:.2f} | {cpu['redis']:.2f} | "
              f"{cpu['executors'] + cpu['watchers']:.2f} | {c['prefect db xacts']:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="4x8x10,8x4x10", help="NODESxRANKSxSTEPS, comma-separated")
    ap.add_argument("--lanes", default="warm,deploy")
    ap.add_argument("--api-servers", type=int, default=2, help="2: two API servers + Redis + services apart")
    ap.add_argument("--query-seconds", type=float, default=1.0, help="PREFECT_WORKER_QUERY_SECONDS (deploy lane)")
    ap.add_argument("--every", type=float, default=0.0, help="seconds between steps; 0: when verified")
    ap.add_argument("--peer-steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    ap.add_argument("--work", default=None)
    args = ap.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="sp-fleet-"))
    rows = []
    for config in args.configs.split(","):
        n_nodes, n_ranks, steps = (int(x) for x in config.lower().split("x"))
        peer_cpu = peer_ingest(work / f"peer-{config}", n_nodes, n_ranks, args.peer_steps)
        for lane in args.lanes.split(","):
            r = run_lane(args, lane, n_nodes, n_ranks, steps, work / f"{config}-{lane}")
            report(r, peer_cpu)
            rows.append(r)
    side_by_side(rows)


if __name__ == "__main__":
    main()
