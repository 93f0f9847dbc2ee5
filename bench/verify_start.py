"""Benchmark: `safepoint verify` of a committed 1 GiB snapshot against `b3sum` on the same file.

    python bench/verify_start.py [--gib 1] [--n 5] [--work /tmp/safepoint-verify-bench]

Both hash the same bytes (BLAKE3, all cores, from the page cache: one untimed warm-up read each),
so the difference is what Safepoint adds: interpreter start, imports, reading the manifest, the
catalog probe. Runs alternate (b3sum, verify) `--n` times to share the machine's weather, and the
script prints each tool's median and the ratio (goal: at most 1.5), plus the import time of the CLI
and of the catalog, which `verify` of a folder the catalog does not know no longer pays.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--work", default="/tmp/safepoint-verify-bench")
    a = ap.parse_args()
    b3sum = shutil.which("b3sum")
    if not b3sum:
        sys.exit("b3sum not found (Debian: apt-get install -y b3sum)")
    work = Path(a.work)
    snap, home = work / "snap", work / "home"
    env = dict(os.environ, SAFEPOINT_HOME=str(home), PYTHONPATH=str(ROOT))
    env.pop("SAFEPOINT_CATALOG_URL", None)
    # An installed Safepoint has .pyc files (pip compiles them); with PYTHONDONTWRITEBYTECODE set, every
    # run would compile the sources again and the benchmark would time the compiler. The warm-up writes them.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    data = snap / "data.bin"
    size = int(a.gib * 2**30)
    if not data.exists() or data.stat().st_size != size:
        shutil.rmtree(snap, ignore_errors=True)
        snap.mkdir(parents=True)
        with open(data, "wb") as f:
            for _ in range(size // 2**24):
                f.write(os.urandom(2**24))
        subprocess.run([sys.executable, "-m", "safepoint.cli", "commit", str(snap), "--run", "bench", "--step", "1"],
                       env=env, check=True, stdout=subprocess.DEVNULL)
    verify = [sys.executable, "-m", "safepoint.cli", "verify", str(snap)]
    timed([b3sum, str(data)], env)
    timed(verify, env)  # warm-up: page cache, .pyc files
    b3, sp = [], []
    for _ in range(a.n):
        b3.append(timed([b3sum, str(data)], env))
        sp.append(timed(verify, env))
    imports = {name: timed([sys.executable, "-c", f"import {name}"], env)
               for name in ("sys", "safepoint.cli.main", "catalog.store")}
    mb, ms = statistics.median(b3), statistics.median(sp)
    print(f"file          {size / 2**30:.2f} GiB, {a.n} runs each, load average {os.getloadavg()[0]:.2f}")
    print(f"b3sum         median {mb:.3f} s  (min {min(b3):.3f}, max {max(b3):.3f})")
    print(f"verify        median {ms:.3f} s  (min {min(sp):.3f}, max {max(sp):.3f})")
    print(f"ratio         {ms / mb:.2f}  (goal <= 1.5)")
    print(f"start-up      python {imports['sys']:.3f} s, import safepoint.cli {imports['safepoint.cli.main']:.3f} s, "
          f"catalog.store (not paid) {imports['catalog.store']:.3f} s")


if __name__ == "__main__":
    main()
