"""A real tiny training run, ingested: the data behind docs/trackers.md (the plot, the exports).

A 2-layer MLP trained with Adam for 8 steps on a fixed regression task, one checkpoint per step
(torch.save of model and optimizer into step-N/, sealed with safepoint.commit, ingested inline into a
file:// replica). With --bad STEP, that step's checkpoint gets NaN in an Adam moment (what a broken
optimizer writes), so the plot has a step judged invalid. Prints the catalog URL and the replica root.

    PYTHONPATH=. python examples/tiny_run.py DIR [--steps 8] [--bad 6] [--run tiny] [--parent RUN:STEP]
"""

from __future__ import annotations

import argparse
import copy
import os
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--bad", type=int, default=None)
    ap.add_argument("--run", default="tiny")
    ap.add_argument("--parent", default=None, help="RUN:STEP this run forks from")
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SAFEPOINT_HOME", str(a.dir / "home"))
    import torch

    from safepoint.catalog.store import open_catalog
    from safepoint.core.config import load_config
    from safepoint.local.commit import commit
    from safepoint.ops.ingest import ingest

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    x, y = torch.randn(256, 16), torch.randn(256, 1)
    config = load_config()
    catalog = open_catalog(f"sqlite:///{a.dir / 'home' / 'catalog.db'}")
    dest = (a.dir / "replicas").as_uri()
    parent, first = None, 1
    if a.parent:  # a fork: start from the parent's saved state, and say so in the manifest
        run, _, step = a.parent.rpartition(":")
        parent, first = (run, int(step)), int(step) + 1
        sd = torch.load(a.dir / "ckpt" / run / f"step-{step}" / "model.pt", weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
    for step in range(first, first + a.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        folder = a.dir / "ckpt" / a.run / f"step-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        if step == a.bad:  # a copy: the training itself goes on unharmed
            sd = copy.deepcopy(sd)
            sd["optimizer"]["state"][0]["exp_avg_sq"].view(-1)[:3] = float("nan")
        torch.save(sd, folder / "model.pt")
        commit(folder, a.run, step, parent=parent if step == first else (a.run, step - 1))
        out = ingest(folder, [dest], catalog, config)
        print(f"step {step}: loss {loss.item():.4f} -> {out.state}")
    print(f"catalog sqlite:///{a.dir / 'home' / 'catalog.db'}; replicas {dest}")


if __name__ == "__main__":
    main()
