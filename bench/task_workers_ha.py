"""Experiment: are Prefect background task workers sound behind two API servers? (docs/scale.md)

    python bench/task_workers_ha.py

Starts Prefect scaled out as tests/fleet.py does (two `prefect server start --no-services` on one
PostgreSQL database, Redis, services apart), a task worker subscribed through API server B, then
delays one task run through B and one through A, and reports which ran within --wait seconds.
Prefect 3.9 keeps the queue of delayed runs in the memory of the API server that accepted them
(prefect/server/task_queue.py), so the run delayed through A is expected never to reach the worker.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

WORKER = "from prefect.task_worker import serve\nfrom probe_tasks import probe\nserve(probe)"

TASKS = textwrap.dedent("""
    from pathlib import Path
    from prefect import task

    @task(name="sp-probe")
    def probe(tag: str, out: str) -> str:
        (Path(out) / tag).write_text("ran")
        return tag
""")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wait", type=float, default=30.0)
    args = ap.parse_args()
    from tests.fleet import Fleet

    work = Path(tempfile.mkdtemp(prefix="sp-tw-"))
    (work / "probe_tasks.py").write_text(TASKS)
    out = work / "out"
    out.mkdir()
    fleet = Fleet(work / "fleet", [], lane="warm", api_servers=2)
    try:
        fleet.start()
        a, b = fleet.apis
        results = work / "results"  # the parameters travel through result storage: one both sides see
        env = dict(fleet.env(), PYTHONPATH=f"{work}:{os.environ.get('PYTHONPATH', '')}",
                   PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(results))
        worker = subprocess.Popen(
            [sys.executable, "-c", WORKER],
            env={**env, "PREFECT_API_URL": b.url}, cwd=work, start_new_session=True,
            stdout=open(work / "worker.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
        fleet._procs.append(worker)
        import httpx

        fleet.wait_for("the task worker subscribed", lambda: httpx.post(
            f"{b.url}/task_workers/filter", json={}, timeout=10).json(), 180, poll_s=1)
        for tag, server in (("via-B", b), ("via-A", a)):
            subprocess.run([sys.executable, "-c", f"from probe_tasks import probe; probe.delay({tag!r}, {str(out)!r})"],
                           env={**env, "PREFECT_API_URL": server.url}, cwd=work, check=True, timeout=120)
        deadline = time.monotonic() + args.wait
        while time.monotonic() < deadline and len(list(out.iterdir())) < 2:
            time.sleep(0.5)
        ran = sorted(p.name for p in out.iterdir())
        print(f"worker subscribed through B; delayed through B and A; ran within {args.wait:g}s: {ran}")
        print("sound behind several API servers" if ran == ["via-A", "via-B"] else
              "NOT sound: a run delayed through another API server never reached the worker")
    finally:
        fleet.close()


if __name__ == "__main__":
    main()
