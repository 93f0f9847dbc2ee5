"""Benchmark: ingest of a ~1 GiB torch.save checkpoint to a file:// destination, and Prefect's overhead.

    python bench/ingest.py [--gib 1.0] [--work bench/out/ingest]

Runs, in one process and one go:
  * `cp` of the file plus `sync` (a floor for moving the bytes once);
  * the pipeline as plain functions (`safepoint.pipeline.ingest`), stage by stage;
  * the same pipeline as the Prefect flow (`flows.ingest.ingest`), first call (temporary server
    start included) and warm;
and prints the time and throughput of each, and the Prefect overhead (flow minus plain).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def make_checkpoint(folder: Path, gib: float) -> Path:
    """A model + AdamW-shaped state dict of about `gib` GiB (fp32), saved with torch.save."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.pt"
    if path.exists():
        return path
    g = torch.Generator().manual_seed(0)
    n_params = int(gib * 2**30 / 4 / 3)  # weights + exp_avg + exp_avg_sq
    sizes, left = [], n_params
    while left > 0:
        sizes.append(min(left, 4096 * 4096))
        left -= sizes[-1]
    model = {f"layer{i}.weight": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    state = {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(n, generator=g) * 1e-3,
                 "exp_avg_sq": torch.rand(n, generator=g) * 1e-6} for i, n in enumerate(sizes)}
    opt = {"state": state, "param_groups": [{"lr": 1e-3, "params": list(range(len(sizes)))}]}
    torch.save({"model": model, "optimizer": opt, "step": 10}, path)
    return path


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()

    from safepoint.catalog.store import open_catalog
    from safepoint.core.config import Config
    from safepoint.flows.ingest import ingest as ingest_flow
    from safepoint.local.commit import commit
    from safepoint.local.snapshot import LocalSnapshot
    from safepoint.ops import ingest as pipeline
    from safepoint.ops import steps
    from safepoint.ops import validation as validation_step

    work = Path(args.work or tempfile.mkdtemp(prefix="sp-bench-ingest-"))
    src = work / "nvme" / "bench" / "step-10"
    path = make_checkpoint(src, args.gib)
    size = path.stat().st_size
    gib = size / 2**30
    rows = []

    def dest(name: str) -> Path:
        d = work / name
        shutil.rmtree(d, ignore_errors=True)
        return d

    # Floor: move the bytes once.
    d = dest("cp")
    d.mkdir()
    t, _ = timed(lambda: subprocess.run(["bash", "-c", f"cp {path} {d}/ && sync"], check=True))
    rows.append(("cp + sync (floor)", t))

    t, _ = timed(lambda: commit(src, "bench", 10))
    rows.append(("safepoint commit (hash + fsync)", t))

    catalog_url = f"sqlite:///{work / 'catalog.db'}"
    Path(work / "catalog.db").unlink(missing_ok=True)
    cat = open_catalog(catalog_url)
    snap = LocalSnapshot.open(src)

    # Plain pipeline, stage by stage.
    t_reg, row = timed(lambda: steps.register(cat, snap))
    t_rep, res = timed(lambda: steps.replicate_to(cat, row.id, snap, dest("plain").as_uri(), Config()))
    steps.settle(cat, row.id, [res])
    t_val, state = timed(lambda: validation_step.validate_checkpoint(cat, row.id, snap))
    assert str(state) == "verified", state
    plain = t_reg + t_rep + t_val
    rows += [("  register", t_reg), ("  replicate (read+hash+write, read back)", t_rep),
             ("  validate (load every tensor, NaN/Inf, stats)", t_val), ("pipeline, plain functions", plain)]

    t_flow_cold, out = timed(lambda: ingest_flow(snapshot=str(src), to=[dest("flow1").as_uri()],
                                                 catalog_url=catalog_url))
    assert out["state"] == "verified", out
    rows.append(("Prefect flow, first call (temporary server start)", t_flow_cold))
    t_flow, out = timed(lambda: ingest_flow(snapshot=str(src), to=[dest("flow2").as_uri()], catalog_url=catalog_url))
    assert out["state"] == "verified", out
    rows.append(("Prefect flow, warm", t_flow))
    t_plain2, out2 = timed(lambda: pipeline.ingest(src, [dest("plain2").as_uri()], cat))
    assert out2.state.value == "verified"
    rows.append(("pipeline, plain functions (again, warm cache)", t_plain2))

    print(f"\ncheckpoint: {size} bytes ({gib:.2f} GiB), torch.save model + AdamW state, 1 file")
    print(f"{'what':55s} {'seconds':>8s} {'GiB/s':>7s}")
    for name, t in rows:
        print(f"{name:55s} {t:8.2f} {gib / t:7.2f}")
    print(f"\nPrefect overhead (warm flow - plain, same cache state): {t_flow - t_plain2:+.2f} s "
          f"({(t_flow - t_plain2) / t_plain2 * 100:+.0f}%)")
    print(f"Prefect temporary-server start (first flow - warm flow): {t_flow_cold - t_flow:+.2f} s")
    print(f"ingest vs cp floor: {plain / rows[0][1]:.2f}x the floor's time")


if __name__ == "__main__":
    main()
