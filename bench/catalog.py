"""Benchmark: catalog queries at scale, SQLite and PostgreSQL in one run.

    flock /tmp/safepoint-bench.lock python bench/catalog.py [--rows 1000000] [--runs 1000]
        [--backends sqlite,postgres] [--queries 300] [--pg-url URL] [--dir DIR] [--whole-plan]

For each backend: a fresh catalog migrated by Alembic (so the indexes are the real ones), filled
with --rows checkpoint rows spread over --runs runs, plus one replica row per checkpoint, with bulk
loads (SQLite: one executemany per table in one transaction; PostgreSQL: COPY FROM STDIN). Each run
looks like a long training run under retention: the oldest 80% pruned (replica deleted), then
verified ones, a few corrupt/invalid, a few verified with a corrupt replica, and the newest one
still validating (even runs) or verified with a corrupt replica (odd runs), so resume-point has
to pass over at least one checkpoint. Then, on random runs:

  * resume-point: find_resume_point(catalog, run), the paging query that feeds the pure decision only
    the rows it needs (uq_checkpoints_run_id_step backwards, then replicas by
    uq_replicas_checkpoint_id_url), against its peer in the same run: the pure decision over the
    whole run as list_checkpoints returns it;
  * a retention plan: list_checkpoints(run) + retention.plan(AnyOf(KeepLastN(3), KeepEveryNSteps(10k))),
    split into loading and planning (--whole-plan also plans every run of the catalog, streamed).

Prints the fill rate, latency percentiles, the ratio to the peer, and the query plan of one page.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sqlalchemy as sa  # noqa: E402

from safepoint.catalog import db  # noqa: E402
from safepoint.catalog.store import Catalog  # noqa: E402
from safepoint.ops.resume import find_resume_point  # noqa: E402
from safepoint.rules import retention  # noqa: E402
from safepoint.rules.resume import resume_point  # noqa: E402

PG_URL = os.environ.get("SAFEPOINT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
CK_COLS = ("id", "run_id", "step", "state", "local_path", "node", "world_size", "total_bytes", "file_count",
           "manifest_blake3", "created_at", "updated_at", "state_changed_at", "parent_id", "parent_run",
           "parent_step", "pinned", "tags", "metrics", "error", "version")
REP_COLS = ("id", "checkpoint_id", "url", "destination", "state", "bytes", "verified_at", "error", "created_at",
            "updated_at")


def history(run_index: int, per_run: int, rnd: random.Random) -> list[tuple[str, str]]:
    """(checkpoint state, replica state) for each step of one run, oldest first."""
    out = []
    pruned = int(per_run * 0.8)
    for i in range(per_run):
        if i < pruned:
            out.append(("pruned", "deleted"))
            continue
        x = rnd.random()
        if x < 0.02:
            out.append(("corrupt", "corrupt"))
        elif x < 0.03:
            out.append(("invalid", "verified"))
        elif x < 0.05:
            out.append(("verified", "corrupt"))
        else:
            out.append(("verified", "verified"))
    out[-1] = ("validating", "verified") if run_index % 2 == 0 else ("verified", "corrupt")
    return out


def rows(n_rows: int, n_runs: int, seed: int = 7):
    """Yield (checkpoint row dict, replica row dict) in id order."""
    rnd = random.Random(seed)
    per_run = n_rows // n_runs
    ck_id = 0
    for r in range(n_runs):
        run_id, run = r + 1, f"run-{r:04d}"
        for i, (state, rstate) in enumerate(history(r, per_run, rnd)):
            ck_id += 1
            step = (i + 1) * 100
            t = T0 + timedelta(minutes=10 * i)
            ck = {"id": ck_id, "run_id": run_id, "step": step, "state": state,
                  "local_path": f"/nvme/{run}/step-{step}", "node": "node-0", "world_size": 1,
                  "total_bytes": 140 * 2**30, "file_count": 24, "manifest_blake3": f"{ck_id:064x}",
                  "created_at": t, "updated_at": t, "state_changed_at": t, "parent_id": None,
                  "parent_run": None, "parent_step": None, "pinned": False, "tags": "[]",
                  "metrics": json.dumps({"loss": round(3.0 / (1 + i / 50) + rnd.random() * 0.05, 5)}),
                  "error": None, "version": 5}
            url = f"s3://ckpt/prod/{run}/{step}"
            rep = {"id": ck_id, "checkpoint_id": ck_id, "url": url, "destination": "s3://ckpt/prod",
                   "state": rstate, "bytes": 140 * 2**30, "verified_at": t if rstate == "verified" else None,
                   "error": None, "created_at": t, "updated_at": t}
            yield ck, rep


# -- bulk loads ---------------------------------------------------------------------------------

def _sqlite_value(v: Any) -> Any:
    if isinstance(v, datetime):  # what catalog.models.UTCDateTime stores on SQLite: naive UTC text
        return v.astimezone(timezone.utc).replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f")
    if isinstance(v, bool):
        return int(v)
    return v


def fill_sqlite(engine: sa.Engine, n_rows: int, n_runs: int) -> None:
    raw = engine.raw_connection()
    try:
        cur = raw.cursor()
        cur.execute("BEGIN")
        cur.executemany("INSERT INTO runs (id, name, created_at) VALUES (?, ?, ?)",
                        [(r + 1, f"run-{r:04d}", _sqlite_value(T0)) for r in range(n_runs)])
        cks: list[tuple] = []
        reps: list[tuple] = []
        ck_sql = f"INSERT INTO checkpoints ({', '.join(CK_COLS)}) VALUES ({', '.join('?' * len(CK_COLS))})"
        rep_sql = f"INSERT INTO replicas ({', '.join(REP_COLS)}) VALUES ({', '.join('?' * len(REP_COLS))})"
        for ck, rep in rows(n_rows, n_runs):
            cks.append(tuple(_sqlite_value(ck[c]) for c in CK_COLS))
            reps.append(tuple(_sqlite_value(rep[c]) for c in REP_COLS))
            if len(cks) >= 50_000:
                cur.executemany(ck_sql, cks)
                cur.executemany(rep_sql, reps)
                cks, reps = [], []
        if cks:
            cur.executemany(ck_sql, cks)
            cur.executemany(rep_sql, reps)
        cur.execute("COMMIT")
        cur.execute("ANALYZE")
    finally:
        raw.close()


def fill_postgres(engine: sa.Engine, n_rows: int, n_runs: int) -> None:
    raw = engine.raw_connection()
    try:
        conn = raw.driver_connection
        with conn.cursor() as cur:
            with cur.copy("COPY runs (id, name, created_at) FROM STDIN") as cp:
                for r in range(n_runs):
                    cp.write_row((r + 1, f"run-{r:04d}", T0))
            with cur.copy(f"COPY checkpoints ({', '.join(CK_COLS)}) FROM STDIN") as cp_ck:
                reps = []
                for ck, rep in rows(n_rows, n_runs):
                    cp_ck.write_row(tuple(ck[c] for c in CK_COLS))
                    reps.append(tuple(rep[c] for c in REP_COLS))
            with cur.copy(f"COPY replicas ({', '.join(REP_COLS)}) FROM STDIN") as cp_rep:
                for rep in reps:
                    cp_rep.write_row(rep)
            for table in ("runs", "checkpoints", "replicas"):
                cur.execute(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT max(id) FROM {table}))")
        conn.commit()
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("VACUUM ANALYZE runs")
            cur.execute("VACUUM ANALYZE checkpoints")
            cur.execute("VACUUM ANALYZE replicas")
        conn.autocommit = False
    finally:
        raw.close()


# -- measurements -------------------------------------------------------------------------------

def _ms(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)

    def pct(p: float) -> float:
        return s[min(len(s) - 1, int(p * len(s)))] * 1000

    return {"n": len(s), "min": s[0] * 1000, "p50": statistics.median(s) * 1000, "p95": pct(0.95),
            "p99": pct(0.99), "max": s[-1] * 1000}


def explain_page(cat: Catalog, run: str) -> list[str]:
    """The database's plan for the statement of one resume page (checkpoints LEFT JOIN replicas)."""
    q, params = cat.resume_page_query(run, limit=8, with_replicas=True)
    dialect = cat.engine.dialect
    sql = str(q.params(**params).compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
    prefix = "EXPLAIN QUERY PLAN " if dialect.name == "sqlite" else "EXPLAIN "
    with cat.engine.connect() as c:
        return [" | ".join(str(x) for x in row) for row in c.exec_driver_sql(prefix + sql)]


def bench_backend(name: str, url: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = db.make_engine(url)
    try:
        db.upgrade(engine)
        t = time.perf_counter()
        (fill_sqlite if name == "sqlite" else fill_postgres)(engine, args.rows, args.runs)
        fill_s = time.perf_counter() - t
        cat = Catalog(engine)
        with engine.connect() as c:
            n = c.execute(sa.text("SELECT count(*) FROM checkpoints")).scalar_one()
            nrep = c.execute(sa.text("SELECT count(*) FROM replicas")).scalar_one()
        rnd = random.Random(11)
        runs = [f"run-{rnd.randrange(args.runs):04d}" for _ in range(args.queries)]
        for run in runs[:10]:  # warm the pool and caches
            find_resume_point(cat, run)
        samples, chosen = [], 0
        load_before, cpu0 = os.getloadavg()[0], time.process_time()
        for run in runs:
            t = time.perf_counter()
            d = find_resume_point(cat, run)
            samples.append(time.perf_counter() - t)
            chosen += d.chosen is not None
        client_cpu_ms = (time.process_time() - cpu0) / len(runs) * 1000
        peer, agree = [], 0
        for run in runs[: args.peer_queries]:
            t = time.perf_counter()
            d = resume_point(cat.list_checkpoints(run))
            peer.append(time.perf_counter() - t)
            agree += d.chosen.id == find_resume_point(cat, run).chosen.id
        policy = retention.AnyOf(retention.KeepLastN(3), retention.KeepEveryNSteps(10_000))
        load, planning, deletions = [], [], 0
        for run in runs[: args.peer_queries]:
            t = time.perf_counter()
            views = cat.list_checkpoints(run)
            t1 = time.perf_counter()
            p = retention.plan(views, policy, T0)
            t2 = time.perf_counter()
            load.append(t1 - t)
            planning.append(t2 - t1)
            deletions += len(p.delete)
        out: dict[str, Any] = {
            "backend": name, "checkpoints": n, "replicas": nrep, "fill_s": fill_s, "load_avg": load_before,
            "client_cpu_ms": client_cpu_ms,
            "fill_rows_per_s": (n + nrep) / fill_s, "resume_point_ms": _ms(samples), "resume_found": chosen,
            "peer_full_run_ms": _ms(peer), "peer_agrees": agree, "plan_load_ms": _ms(load),
            "plan_pure_ms": _ms(planning), "plan_deletions_per_run": deletions / max(1, len(load)),
            "explain": explain_page(cat, runs[0]),
        }
        if args.whole_plan:
            t = time.perf_counter()
            total = 0
            for run in cat.runs():
                total += len(retention.plan(cat.list_checkpoints(run), policy, T0).delete)
            out["whole_catalog_plan_s"] = time.perf_counter() - t
            out["whole_catalog_deletions"] = total
        return out
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--backends", default="sqlite,postgres")
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--peer-queries", type=int, default=30)
    ap.add_argument("--pg-url", default=PG_URL)
    ap.add_argument("--dir", help="where the SQLite file goes (default: a temporary folder)")
    ap.add_argument("--whole-plan", action="store_true", help="also plan retention for every run")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)

    results = []
    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    for name in args.backends.split(","):
        if name == "sqlite":
            url = f"sqlite:///{Path(tmp.name) / 'bench-catalog.db'}"
            results.append(bench_backend(name, url, args))
        elif name == "postgres":
            admin = sa.create_engine(db.normalize_url(args.pg_url), isolation_level="AUTOCOMMIT")
            schema = f"sp_bench_{uuid.uuid4().hex[:10]}"
            with admin.connect() as c:
                c.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
            try:
                url = db.normalize_url(args.pg_url).update_query_dict({"options": f"-csearch_path={schema}"})
                results.append(bench_backend(name, url.render_as_string(hide_password=False), args))
            finally:
                with admin.connect() as c:
                    c.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
                admin.dispose()
        else:
            raise SystemExit(f"unknown backend {name!r}")
        r = results[-1]
        print(f"[{name}] filled {r['checkpoints']:,} checkpoints + {r['replicas']:,} replicas in {r['fill_s']:.1f} s "
              f"({r['fill_rows_per_s']:,.0f} rows/s)", flush=True)
    tmp.cleanup()

    print()
    print(f"catalog: {args.rows:,} checkpoint rows over {args.runs:,} runs ({args.rows // args.runs} per run), "
          f"{args.queries} resume-point queries on random runs, {args.peer_queries} for the peers")
    hdr = (f"{'backend':10} {'resume min':>11} {'p50':>8} {'p95':>8} {'p99':>8} {'max':>8} {'full-run peer p50':>18} "
           f"{'peer/paged':>11} {'plan load p50':>14} {'plan pure p50':>14}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        rp, pe = r["resume_point_ms"], r["peer_full_run_ms"]
        print(f"{r['backend']:10} {rp['min']:9.2f}ms {rp['p50']:6.2f}ms {rp['p95']:6.2f}ms {rp['p99']:6.2f}ms "
              f"{rp['max']:6.2f}ms "
              f"{pe['p50']:16.2f}ms {pe['p50'] / rp['p50']:10.1f}x {r['plan_load_ms']['p50']:12.2f}ms "
              f"{r['plan_pure_ms']['p50']:12.2f}ms")
    print()
    for r in results:
        print(f"[{r['backend']}] load average {r['load_avg']:.1f} on {os.cpu_count()} CPUs when timing; client CPU "
              f"{r['client_cpu_ms']:.2f} ms per resume-point")
        print(f"[{r['backend']}] resume point found for {r['resume_found']}/{args.queries} runs; the peer agreed on "
              f"{r['peer_agrees']}/{args.peer_queries}; retention plan deletes {r['plan_deletions_per_run']:.0f} "
              f"checkpoints per run")
        if "whole_catalog_plan_s" in r:
            print(f"[{r['backend']}] whole-catalog retention plan: {r['whole_catalog_plan_s']:.1f} s, "
                  f"{r['whole_catalog_deletions']:,} deletions")
        print(f"[{r['backend']}] plan of one resume page:")
        for line in r["explain"]:
            print(f"    {line}")
    ok = all(r["resume_point_ms"]["p50"] < 10 for r in results)
    print()
    print(f"resume-point under 10 ms (p50) at {args.rows:,} rows on every backend: {'yes' if ok else 'NO'}; "
          + ", ".join(f"{r['backend']} p95 {r['resume_point_ms']['p95']:.2f} ms" for r in results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
