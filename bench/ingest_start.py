"""Benchmark: `safepoint ingest` of a small checkpoint, one fresh process per call, and where the time goes.

    flock /tmp/safepoint-heavy.lock python bench/ingest_start.py [--n 5]

As a new user with no PREFECT_API_URL (fresh SAFEPOINT_HOME and PREFECT_HOME): `safepoint server
start` once (timed: the local Prefect server's start-up), then `--n` ingests of a ~5 KB torch.save
checkpoint, each a fresh `python -m safepoint.cli ingest`. Goal on a quiet machine: at most 4 s of
wall time per call. The split, medians over the calls:

  wall           the whole command
  flow           as the CLI reports it ("verified in X s"): importing flows.ingest and torch, the
                 Prefect flow and its tasks, and Safepoint's work
  work           the flow's own `ingest.done` seconds (replicate, verify, validate, catalog)
  outside flow   wall - flow: interpreter, CLI, Prefect import, reaching the server, catalog open

and, measured apart in fresh interpreters: `import safepoint.cli`, `import prefect`,
`import flows.ingest`, `import torch`. The server is stopped afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{cmd} failed: {r.stderr}")
    return time.perf_counter() - t0, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5)
    a = ap.parse_args()
    import torch

    work = Path(tempfile.mkdtemp(prefix="safepoint-ingest-start-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SAFEPOINT_"))}
    # As installed (pip writes .pyc files): with PYTHONDONTWRITEBYTECODE, every call would compile
    # Safepoint's sources again. The first, uncounted call writes them.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(SAFEPOINT_HOME=str(work / "sp"), PREFECT_HOME=str(work / "ph"), PYTHONPATH=str(ROOT))
    sp = [sys.executable, "-m", "safepoint.cli"]
    durable = (work / "durable").as_uri()
    try:
        server_s, _ = timed([*sp, "server", "start"], env)
        walls, flows = [], []
        for i in range(a.n + 1):  # the first call warms .pyc files and the server; not counted
            folder = work / "nvme" / f"step-{i}"
            folder.mkdir(parents=True)
            torch.save({"model": {"w": torch.randn(32, 32)}, "step": i}, folder / "model.pt")
            timed([*sp, "commit", folder, "--run", "start", "--step", str(i)], env)
            wall, out = timed([*sp, "ingest", str(folder), "--to", durable], env)
            m = re.search(r"verified in ([0-9.]+)s", out)
            if not m:
                sys.exit(f"ingest did not verify: {out}")
            if i:
                walls.append(wall)
                flows.append(float(m.group(1)))
        with sqlite3.connect(work / "sp" / "catalog.db") as con:
            works = [json.loads(d)["seconds"] for (d,) in con.execute(
                "SELECT detail FROM events WHERE kind = 'ingest.done' ORDER BY id")][1:]
        imports = {m: timed([sys.executable, "-c", f"import {m}"], env)[0]
                   for m in ("sys", "safepoint.cli.main", "prefect", "flows.ingest", "torch")}
        med = statistics.median
        print(f"{a.n} ingests of a ~5 KB torch.save checkpoint, load average {os.getloadavg()[0]:.2f}")
        print(f"server start   {server_s:6.2f} s  (once, `safepoint server start` on a fresh PREFECT_HOME)")
        print(f"wall           {med(walls):6.2f} s  median (min {min(walls):.2f}, max {max(walls):.2f}); goal <= 4 s")
        print(f"flow           {med(flows):6.2f} s  (imports of flows.ingest/torch, Prefect flow + tasks, work)")
        print(f"work           {med(works):6.2f} s  (ingest.done seconds inside the flow)")
        print(f"outside flow   {med(walls) - med(flows):6.2f} s  (interpreter, CLI, prefect import, server, catalog)")
        print("imports        " + ", ".join(f"{k} {v:.2f} s" for k, v in imports.items())
              + "  (each in a fresh interpreter, python start-up included)")
    finally:
        subprocess.run([*sp, "server", "stop"], env=env, cwd=ROOT, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
