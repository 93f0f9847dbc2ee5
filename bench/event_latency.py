"""Benchmark: latency from commit marker to `verified`, event-driven, and how much of it is Prefect's.

    flock /tmp/safepoint-bench.lock python bench/event_latency.py [--n 10] [--poll 1] [--compare-poll 10]

Starts, in one go: a real `prefect server start` (SQLite, loopback), `safepoint serve` (runner poll
`--poll` s) and one `safepoint watch --emit`. Commits `--n` small torch.save snapshots one after
the other under the watched root and times each from the marker (the COMMITTED file's mtime) to
the catalog's `verified` state event, split into stages with the flow run's own timestamps:

  detect+emit+trigger  marker -> flow run created by the automation
  runner pickup        created -> flow run started (runner poll, new process, imports)
  flow setup           started -> checkpoint registered in the catalog
  work                 registered -> verified (replicate, read back, validate: Safepoint's own)

Peers measured in the same run: `pipeline.ingest` called directly in a warm process (the work
alone), and the same in a fresh process (`python -c`, imports included). With `--compare-poll`,
`safepoint serve` is restarted with that poll interval (Prefect's default is 10 s) and
`--compare-n` markers are timed again. Medians are printed; Prefect's share is total minus the
direct warm ingest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def snapshot(folder: Path, step: int) -> Path:
    import torch

    from safepoint import commit

    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(step)
    # Both the weights and the optimizer state move from step to step, as in training: the same
    # optimizer state under moved weights is a stale checkpoint (safepoint.rules.consistency).
    torch.save({"model": {"w": torch.randn(256, 256, generator=g)},  # ~256 KiB, like a tiny model
                "optimizer": {"state": {0: {"exp_avg": torch.randn(256, 256, generator=g)}}}, "step": step},
               folder / "model.pt")
    commit(folder, "lat", step)
    return folder


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--poll", type=float, default=1.0)
    ap.add_argument("--compare-poll", type=float, default=None)
    ap.add_argument("--compare-n", type=int, default=5)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()

    from safepoint.catalog.store import open_catalog
    from safepoint.core.config import Config
    from safepoint.events.markers import Marker
    from safepoint.local.snapshot import LocalSnapshot
    from safepoint.ops.ingest import ingest
    from tests.prefect_server import PrefectServer, stop_group

    work = Path(args.work or tempfile.mkdtemp(prefix="sp-latency-"))
    work.mkdir(parents=True, exist_ok=True)
    server = PrefectServer(work / "prefect")
    catalog_url = f"sqlite:///{work / 'catalog.db'}"
    durable = (work / "durable").as_uri()
    root = work / "root"
    root.mkdir(exist_ok=True)
    (work / "home").mkdir(exist_ok=True)
    env = dict(os.environ, SAFEPOINT_HOME=str(work / "home"), SAFEPOINT_CATALOG_URL=catalog_url)
    procs: list[subprocess.Popen] = []

    def spawn(name: str, *a: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "safepoint.cli", *a], env=dict(env, **server.env()),
                             stdout=open(work / f"{name}.log", "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
                             start_new_session=True)
        procs.append(p)
        return p

    cat = open_catalog(catalog_url)
    step = [0]

    def flow_run(event_id: str):
        import asyncio

        from prefect.client.orchestration import get_client

        async def read():
            async with get_client() as c:
                return [r for r in await c.read_flow_runs(limit=200)
                        if (r.parameters or {}).get("event_id") == event_id]

        os.environ.update(server.env())
        runs = asyncio.run(read())
        return runs[0] if runs else None

    def one_marker() -> dict[str, float]:
        step[0] += 1
        folder = snapshot(root / f"step-{step[0]}", step[0])
        t_marker = (folder / "COMMITTED").stat().st_mtime
        marker = Marker.of(LocalSnapshot.open(folder), [durable], "bench")
        deadline = time.time() + 300
        while time.time() < deadline:
            row = cat.get("lat", step[0])
            if row is not None and row.state.value == "verified":
                break
            time.sleep(0.05)
        else:
            raise SystemExit(f"step {step[0]} not verified in 300 s; see {work}")
        ev = {e["detail"].get("to"): e["at"].timestamp() for e in cat.events(row.id, kind="state")}
        run = None
        for _ in range(50):
            run = flow_run(marker.event_id)
            if run is not None and run.start_time is not None:
                break
            time.sleep(0.1)
        created, started = run.created.timestamp(), run.start_time.timestamp()
        return {"total": ev["verified"] - t_marker, "detect+emit+trigger": created - t_marker,
                "runner pickup": started - created, "flow setup": ev["replicating"] - started,
                "work": ev["verified"] - ev["replicating"]}

    def measure(n: int, poll: float) -> list[dict[str, float]]:
        serve = spawn(f"serve-{poll}", "serve", "--to", durable, "--poll", str(poll), "--scrub-every", "0",
                      "--completeness-every", "0")
        time.sleep(8)
        try:
            one_marker()  # warm-up, not counted
            return [one_marker() for _ in range(n)]
        finally:
            stop_group(serve)

    try:
        server.start()
        spawn("watch", "watch", str(root), "--emit", "--to", durable, "--node", "bench", "--interval", "1")
        results = {args.poll: measure(args.n, args.poll)}
        if args.compare_poll is not None:
            results[args.compare_poll] = measure(args.compare_n, args.compare_poll)
    finally:
        for p in reversed(procs):
            stop_group(p)
        server.stop()

    # Peers: the same work without Prefect, warm in this process and in a fresh process.
    direct_cat = open_catalog(f"sqlite:///{work / 'direct.db'}")
    warm = []
    for i in range(args.n):
        folder = snapshot(work / "direct" / f"s{i}", 1000 + i)
        t0 = time.perf_counter()
        assert ingest(folder, [(work / "durable-direct").as_uri()], direct_cat, Config()).state.value == "verified"
        warm.append(time.perf_counter() - t0)
    cold = []
    for i in range(3):
        folder = snapshot(work / "cold" / f"s{i}", 2000 + i)
        code = ("from safepoint.catalog.store import open_catalog; from safepoint.ops.ingest import ingest; "
                f"assert ingest({str(folder)!r}, [{(work / 'durable-cold').as_uri()!r}], "
                f"open_catalog({'sqlite:///' + str(work / 'cold.db')!r})).state.value == 'verified'")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)
        cold.append(time.perf_counter() - t0)

    print(f"\nmarker -> verified, small torch.save snapshot, file:// destination ({work})")
    stages = ["total", "detect+emit+trigger", "runner pickup", "flow setup", "work"]
    print(f"| runner poll | n | {' | '.join(stages)} |")
    print("|---|---|" + "---|" * len(stages))
    for poll, rows in results.items():
        meds = [median([r[s] for r in rows]) for s in stages]
        print(f"| {poll:g} s | {len(rows)} | " + " | ".join(f"{m:.2f} s" for m in meds) + " |")
    print(f"\ndirect pipeline.ingest, warm process: median {median(warm):.3f} s (n={len(warm)})")
    print(f"direct pipeline.ingest, fresh process (imports included): median {median(cold):.2f} s (n={len(cold)})")
    for poll, rows in results.items():
        total = median([r["total"] for r in rows])
        print(f"poll {poll:g} s: Prefect's share = total - warm direct = {total - median(warm):.2f} s "
              f"({(total - median(warm)) / total:.0%} of {total:.2f} s); total / fresh-process direct = "
              f"{total / median(cold):.1f}x")
    print("per-marker totals (s): " + "; ".join(
        f"poll {p:g}: " + ", ".join(f"{r['total']:.1f}" for r in rows) for p, rows in results.items()))


if __name__ == "__main__":
    main()
