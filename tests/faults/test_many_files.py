"""A checkpoint folder of 100,000 tiny files (and a 0-byte one): commit and ingest must stay sane.

Injection: 100 folders x 1,000 files of a few bytes each, plus a 0-byte file, committed and
ingested (replicated to a file:// destination, read back, validated) in a child process.
Expected: verified, in bounded time and memory; the figures (seconds per stage, peak memory
growth) are printed. $SAFEPOINT_FAULT_MANY_FILES changes the count (default 100000).

The first run of this case found the hot spot that made it take minutes: every tiny upload
allocated and zeroed a fresh 8 MiB buffer (safepoint/destinations/local.py), and fsync latency
was overlapped by only 2-4 threads (commit and replicate now use up to 16 for many files).
"""

from __future__ import annotations

import os
import time

import pytest

from safepoint.catalog.store import open_catalog
from safepoint.core.states import CheckpointState as CS
from tests.faults.conftest import figures

MAX_RSS_GROWTH_KIB = 1024 * 1024   # 1 GiB for 100k files: ~10 KiB per file, all-inclusive


@pytest.mark.slow
def test_hundred_thousand_tiny_files(tmp_path, shared_fork_server, sqlite_catalog_url):
    n = int(os.environ.get("SAFEPOINT_FAULT_MANY_FILES", "100000"))
    folder = tmp_path / "nvme" / "many"
    t0 = time.perf_counter()
    per_dir = 1000
    for d in range((n + per_dir - 1) // per_dir):
        sub = folder / f"d{d:03d}"
        sub.mkdir(parents=True)
        for i in range(min(per_dir, n - d * per_dir)):
            with open(sub / f"f{i:04d}.txt", "wb") as f:
                f.write(b"%d:%d\n" % (d, i))
    (folder / "empty.txt").write_bytes(b"")
    write_s = time.perf_counter() - t0
    open_catalog(sqlite_catalog_url)
    ran = shared_fork_server.run("commit_ingest", {
        "folder": str(folder), "run": "many", "step": 1, "dest": (tmp_path / "durable").as_uri(),
        "catalog_url": sqlite_catalog_url}, timeout=1800)
    r = ran.result
    assert r["state"] == "verified", r
    assert r["files"] == n + 1
    catalog = open_catalog(sqlite_catalog_url)
    row = catalog.get("many", 1)
    assert row.state is CS.VERIFIED and row.file_count == n + 1
    assert (tmp_path / "durable" / "many" / "1" / "empty.txt").stat().st_size == 0
    assert r["peak_rss_growth_kib"] < MAX_RSS_GROWTH_KIB, r
    figures("100,000 tiny files", files=n + 1, bytes=r["bytes"], write_s=round(write_s, 1),
            commit_s=r["commit_s"], ingest_s=r["ingest_s"],
            peak_rss_growth_mib=round(r["peak_rss_growth_kib"] / 1024, 1),
            per_file_ms=round(1000 * (r["commit_s"] + r["ingest_s"]) / (n + 1), 2))
