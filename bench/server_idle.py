"""What an idle embedded Prefect server costs: CPU and memory of its whole process group.

Starts the local server for a fresh PREFECT_HOME (flows/local_server.py, as `ingest` would),
lets it settle, then reads /proc for `--seconds`: CPU time of every process in the keeper's group
(keeper and `prefect server start` with its children), as a share of one core, and their resident
memory. The server is stopped at the end. Hold the bench lock while timing:

    flock /tmp/safepoint-bench.lock python bench/server_idle.py --seconds 120
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def group(pgid: int) -> list[tuple[int, int, int]]:
    """(pid, cpu ticks, rss bytes) of every process in process group `pgid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the name: state ppid pgrp ...
            out.append((int(entry.name), int(fields[11]) + int(fields[12]), int(fields[21]) * PAGE))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--settle", type=float, default=30.0, help="wait this long after start-up before measuring")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sp-idle-") as tmp:
        os.environ.update(PREFECT_HOME=str(Path(tmp) / "prefect-home"), SAFEPOINT_HOME=str(Path(tmp) / "sp"),
                          PREFECT_SERVER_ANALYTICS_ENABLED="false")  # default idle stop; this process is its client
        os.environ.pop("PREFECT_API_URL", None)
        from safepoint.flows import local_server as ls

        home = ls.prefect_home()
        state = ls.ensure_server(home, ls.startup_timeout_s())
        try:
            time.sleep(args.settle)
            before = group(state.pid)
            t0 = time.monotonic()
            time.sleep(args.seconds)
            after = group(state.pid)
            dt = time.monotonic() - t0
            ticks = sum(t for _, t, _ in after) - sum(t for _, t, _ in before)
            rss = sum(r for _, _, r in after)
            load = os.getloadavg()[0]
            print(f"idle embedded server, {len(after)} processes: {ticks / TICKS / dt:.1%} of one core over "
                  f"{dt:.0f} s, {rss / 2**20:.0f} MiB resident (load {load:.1f})")
            was = {pid: t for pid, t, _ in before}
            for pid, t, r in after:
                name = "keeper" if pid == state.pid else "server"
                print(f"  pid {pid} ({name}): {(t - was.get(pid, 0)) / TICKS / dt:.1%}, {r / 2**20:.0f} MiB")
        finally:
            ls.stop(home)
    return 0


if __name__ == "__main__":
    sys.exit(main())
