"""Benchmark: start-up of the read commands, each a fresh process, against `python -c pass`.

    flock /tmp/safepoint-bench.lock python bench/startup.py [--n 7]

In a fresh SAFEPOINT_HOME (SQLite catalog), with .pyc files written as an installed package has
them (the first, uncounted call of each writes them), `--n` calls each of:

- `safepoint ls` with no catalog yet, on a migrated empty catalog, and on a small one (a few
  checkpoints with replicas, tags and lineage): goal at most 0.3 s;
- `safepoint resume-point --run R` on the small catalog (the catalog proper: SQLAlchemy);
- `import` of what `safepoint restore` loads before its first byte (CLI, restore, catalog);

and prints medians (min, max) and each over the bare interpreter. The interpreter is this one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def small_catalog(home: Path, work: Path, n: int) -> None:
    """`n` checkpoints of one run, each with a verified file:// replica (tests.helpers_catalog.seed)."""
    from safepoint.catalog import db
    from safepoint.catalog.store import open_catalog
    from tests.helpers_catalog import seed

    url = f"sqlite:///{home / 'catalog.db'}"
    cat = open_catalog(url)
    for step in range(1, n + 1):
        seed(cat, work, "run-a", step, tags=("eval",) if step % 2 else (), parent=("run-a", step - 1) if step > 1
             else None)
    db.dispose(url)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=7)
    ap.add_argument("--checkpoints", type=int, default=5)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="safepoint-startup-"))
    homes = {name: work / name for name in ("none", "empty", "small")}
    for h in homes.values():
        h.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SAFEPOINT_"))}
    base.pop("PYTHONDONTWRITEBYTECODE", None)
    base["PYTHONPATH"] = str(ROOT)
    py, sp = sys.executable, [sys.executable, "-m", "safepoint.cli"]
    try:
        subprocess.run([*sp, "ls"], env={**base, "SAFEPOINT_HOME": str(homes["empty"])}, check=True,
                       capture_output=True)  # migrates the empty catalog (Alembic), untimed
        small_catalog(homes["small"], work, a.checkpoints)
        cases = {
            "python -c pass": ([py, "-c", "pass"], "none"),
            "safepoint ls, no catalog yet": ([*sp, "ls"], "none"),
            "safepoint ls, empty catalog": ([*sp, "ls"], "empty"),
            f"safepoint ls, {a.checkpoints} checkpoints": ([*sp, "ls"], "small"),
            "safepoint ls --json, same": ([*sp, "ls", "--json"], "small"),
            "safepoint resume-point, same": ([*sp, "resume-point", "--run", "run-a"], "small"),
            "import (restore's modules)": ([py, "-c", "import safepoint.cli.main, safepoint.cli.restore_cmds, "
                                                  "safepoint.ops.restore"], "none"),  # no catalog.store since part two
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        for rnd in range(a.n + 1):  # round 0 writes the .pyc files: not counted
            for name, (cmd, home) in cases.items():
                env = {**base, "SAFEPOINT_HOME": str(homes[home])}
                t0 = time.perf_counter()
                r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
                dt = time.perf_counter() - t0
                if r.returncode:
                    sys.exit(f"{cmd} failed: {r.stdout}{r.stderr}")
                if rnd:
                    times[name].append(dt)
        created = (homes["none"] / "catalog.db").exists()  # a read that made a catalog (before issue 26 it did)
        bare = statistics.median(times["python -c pass"])
        print(f"{a.n} fresh processes each, load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")
        print("| command | median (s) | min | max | over `python -c pass` |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, xs in times.items():
            m = statistics.median(xs)
            print(f"| {name} | {m:.3f} | {min(xs):.3f} | {max(xs):.3f} | {m - bare:+.3f} s |")
        print("goal: safepoint ls at most 0.3 s" + ("; note: `ls` with no catalog created one" if created else ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
