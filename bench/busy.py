"""Benchmark: the embedded default (no PREFECT_API_URL) on a busy node. Heavy: run it alone, under the flock.

    flock /tmp/safepoint-heavy.lock python bench/busy.py [--ingests 20] [--demos 3] [--load 2] [--code DIR]

Keeps `--load` x the cores busy with CPU-bound processes (a training node's data loaders), then, as
a new user would, with a fresh SAFEPOINT_HOME and PREFECT_HOME and no PREFECT_* in the environment:

1. `--ingests` `safepoint ingest` calls of a small torch.save checkpoint, each a fresh process;
2. `--demos` x `safepoint demo`, each in a new folder;
3. one `safepoint serve` plus one `safepoint watch --emit`, and one marker timed to `verified`.

It prints successes (exit 0, `verified`, no traceback), the median and maximum time per call, and
where the time goes: the flow as the CLI reports it, the rest (interpreter, imports, catalog,
reaching or starting the Prefect server), and the first call apart (it starts the server).
`--code DIR` runs another checkout's code (e.g. an unpacked older commit) for a before/after.
Afterwards the local server of the fresh PREFECT_HOME is stopped and everything is removed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_checkpoint(folder: Path, seed: int) -> None:
    import torch

    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    torch.save({"model": {"w": torch.randn(32, 32, generator=g)}, "step": seed}, folder / "model.pt")  # ~5 KB


def cpu_hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


class Cli:
    def __init__(self, code: Path, env: dict[str, str]):
        self.code, self.env = code, env

    def cmd(self, *args: object) -> list[str]:
        return [sys.executable, "-m", "safepoint.cli", *map(str, args)]

    def run(self, *args: object, timeout: float = 900) -> tuple[int, str, str, float]:
        t0 = time.perf_counter()
        try:
            r = subprocess.run(self.cmd(*args), env=self.env, cwd=self.code, capture_output=True, text=True,
                               timeout=timeout)
            code, out, err = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            code, out, err = -1, str(e.stdout or ""), f"timed out after {timeout} s"
        return code, out, err, time.perf_counter() - t0


def clean(out: str, err: str) -> bool:
    return "Traceback" not in out + err and not re.search(r"\| ERROR|ERROR \|", out + err)


def stats(xs: list[float]) -> str:
    return f"median {statistics.median(xs):6.2f} s, max {max(xs):6.2f} s" if xs else "-"


def catalog_state(home: Path, run: str, step: int) -> str | None:
    try:
        with sqlite3.connect(f"file:{home / 'catalog.db'}?mode=ro", uri=True, timeout=5) as con:
            row = con.execute("SELECT c.state FROM checkpoints c JOIN runs r ON r.id = c.run_id "
                              "WHERE r.name = ? AND c.step = ?", (run, step)).fetchone()
        return row[0] if row else None
    except sqlite3.Error:
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ingests", type=int, default=20)
    ap.add_argument("--demos", type=int, default=3)
    ap.add_argument("--load", type=float, default=2.0, help="CPU-bound processes per core")
    ap.add_argument("--code", default=str(ROOT), help="checkout whose safepoint to run (default: this one)")
    ap.add_argument("--event-timeout", type=float, default=300.0)
    a = ap.parse_args()
    code = Path(a.code).resolve()
    work = Path(tempfile.mkdtemp(prefix="safepoint-busy-"))
    sp_home, pf_home = work / "sp-home", work / "prefect-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SAFEPOINT_"))}
    env.update(SAFEPOINT_HOME=str(sp_home), PREFECT_HOME=str(pf_home), PYTHONPATH=str(code))
    cli = Cli(code, env)
    durable = (work / "durable").as_uri()
    folders = []
    for i in range(a.ingests):
        folders.append(work / "nvme" / "busy" / f"step-{i + 1}")
        make_checkpoint(folders[-1], i + 1)
        assert cli.run("commit", folders[-1], "--run", "busy", "--step", i + 1)[0] == 0
    hogs = cpu_hogs(int(a.load * os.cpu_count()))
    print(f"code {code}; {len(hogs)} CPU-bound processes on {os.cpu_count()} cores; work {work}", flush=True)
    try:
        time.sleep(2)
        walls, flows, rest, ok, failures = [], [], [], 0, []
        for i, folder in enumerate(folders):
            rc, out, err, wall = cli.run("ingest", folder, "--to", durable)
            m = re.search(r"verified in ([0-9.]+)s", out)
            good = rc == 0 and m is not None and clean(out, err)
            ok += good
            walls.append(wall)
            if m:
                flows.append(float(m.group(1)))
                rest.append(wall - float(m.group(1)))
            if not good:
                failures.append(f"ingest {i + 1}: exit {rc}: {(err or out).strip().splitlines()[-1:]}")
            print(f"  ingest {i + 1:2d}: exit {rc}, {wall:6.2f} s" + (f" (flow {m.group(1)} s)" if m else ""),
                  flush=True)
        print(f"ingest: {ok}/{len(folders)} verified with no traceback; per call {stats(walls)}; "
              f"first call {walls[0]:.2f} s")
        print(f"  where the time goes (calls 2..n): flow (as the CLI reports it) {stats(flows[1:])}; "
              f"outside the flow (interpreter, imports, catalog, Prefect server) {stats(rest[1:])}")

        demo_walls, demo_ok = [], 0
        for i in range(a.demos):
            rc, out, err, wall = cli.run("demo", "--dir", work / f"demo-{i}")
            lines = [line for line in out.splitlines() if line.strip()]
            # the table and the resume point, then the way back (restored and loaded), and nothing after
            good = rc == 0 and any(line.startswith("resume point: demo-run step 20") for line in lines) \
                and bool(lines) and lines[-1].startswith("loaded it:") and clean(out, err)
            demo_ok += good
            demo_walls.append(wall)
            if not good:
                failures.append(f"demo {i + 1}: exit {rc}: {(err or out).strip().splitlines()[-3:]}")
            print(f"  demo {i + 1}: exit {rc}, {wall:6.2f} s, stderr lines {len(err.splitlines())}", flush=True)
        print(f"demo: {demo_ok}/{a.demos} chose the resume point, restored and loaded it, no traceback; "
              f"per call {stats(demo_walls)}")

        root = work / "watched"
        root.mkdir()
        logs = work / "logs"
        logs.mkdir()
        serve = subprocess.Popen(cli.cmd("serve", "--to", durable, "--poll", "1"), env=env, cwd=code,
                                 stdout=open(logs / "serve.out", "w"), stderr=subprocess.STDOUT)
        watch = subprocess.Popen(cli.cmd("watch", root, "--emit", "--to", durable, "--interval", "1"), env=env,
                                 cwd=code, stdout=open(logs / "watch.out", "w"), stderr=subprocess.STDOUT)
        time.sleep(5)
        folder = root / "ev" / "step-1"
        make_checkpoint(folder, 99)
        t0 = time.perf_counter()
        assert cli.run("commit", folder, "--run", "ev", "--step", 1)[0] == 0
        state = None
        while time.perf_counter() - t0 < a.event_timeout and serve.poll() is None and watch.poll() is None:
            state = catalog_state(sp_home, "ev", 1)
            if state == "verified":
                break
            time.sleep(0.5)
        dt = time.perf_counter() - t0
        time.sleep(5)  # let the watcher see ingest.done and empty its spool before it is stopped
        for p in (watch, serve):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # SIGINT is ignored by background jobs of a shell
        for p in (watch, serve):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        text = (logs / "serve.out").read_text() + (logs / "watch.out").read_text()
        print(f"watch --emit + serve: marker -> {state or 'nothing'} in {dt:.2f} s; serve exit {serve.returncode}, "
              f"watch exit {watch.returncode}; traceback in their output: {'Traceback' in text}")
        if state != "verified":
            failures.append(f"watch/serve: {text.strip().splitlines()[-3:]}")
        for f in failures:
            print("  failure:", f)
    finally:
        for h in hogs:
            h.kill()
        subprocess.run(cli.cmd("server", "stop"), env=env, cwd=code, capture_output=True, timeout=120)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
