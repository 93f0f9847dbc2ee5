"""`safepoint demo`: the whole pipeline on a tiny real model, with one checkpoint corrupted on purpose."""

from __future__ import annotations

import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

RUN = "demo-run"


def _train_and_save(nvme: Path, steps: list[int]) -> list[Path]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 32), torch.randn(256, 8)
    folders, step = [], 0
    for target in steps:
        while step < target:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            step += 1
        folder = nvme / RUN / f"step-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, folder / "model.pt")
        folders.append(folder)
    return folders


def run_demo(workdir: Path | None = None, console: Console | None = None) -> int:
    from safepoint.catalog.store import open_catalog
    from safepoint.flows.ingest import ingest
    from safepoint.local.commit import commit
    from safepoint.rules.resume import resume_point

    console = console or Console()
    workdir = Path(workdir or tempfile.mkdtemp(prefix="safepoint-demo-")).resolve()
    nvme, durable = workdir / "nvme", workdir / "durable"
    durable.mkdir(parents=True, exist_ok=True)
    catalog_url = f"sqlite:///{workdir / 'catalog.db'}"
    console.print(f"[bold]Safepoint demo[/bold] in {workdir}")

    folders = _train_and_save(nvme, [10, 20, 30])
    for folder, step in zip(folders, [10, 20, 30]):
        commit(folder, RUN, step, parent=(RUN, step - 10) if step > 10 else None)
        console.print(f"trained to step {step}, wrote and committed {folder.relative_to(workdir)}")

    victim = folders[-1] / "model.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    console.print(f"[yellow]flipped one bit[/yellow] in {victim.relative_to(workdir)} after it was committed")

    for folder in folders:
        result = ingest(snapshot=str(folder), to=[durable.as_uri()], catalog_url=catalog_url)
        console.print(f"ingest {folder.name}: [bold]{result['state']}[/bold] {result['message'] or ''}")

    cat = open_catalog(catalog_url)
    views = cat.list_checkpoints(RUN)
    table = Table("run", "step", "state", "replicas", title="catalog")
    for c in views:
        table.add_row(c.run, str(c.step), str(c.state),
                      "\n".join(f"{r.url} ({r.state})" for r in c.replicas) or "-")
    console.print(table)
    decision = resume_point(views)
    for c, why in decision.passed_over:
        console.print(f"passed over step {c.step}: {why}")
    if decision.chosen is None:
        console.print("[red]no resume point[/red]")
        return 1
    console.print(f"[green]resume point[/green]: {RUN} step {decision.chosen.step} at {decision.urls[0]}")
    return _way_back(workdir, nvme, cat, console)


def _way_back(workdir: Path, nvme: Path, cat: object, console: Console) -> int:
    """The node is lost: restore the resume point from the durable replica, verified, and load it."""
    import shutil

    import torch
    from torch import nn

    from safepoint.core.config import Config
    from safepoint.ops.restore import restore

    shutil.rmtree(nvme)
    console.print(f"[yellow]deleted the local copies[/yellow] ({nvme.relative_to(workdir)}): the node is gone")
    result = restore(RUN, workdir / "restored", catalog=cat, config=Config())  # type: ignore[arg-type]
    console.print(f"[green]restored[/green] {RUN} step {result.step} into {result.path.relative_to(workdir)} "
                  f"from {result.sources[0]}: {result.bytes_fetched} bytes, every one verified")
    state = torch.load(result.path / "model.pt", weights_only=True)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    model.load_state_dict(state["model"])
    console.print(f"loaded it: {sum(p.numel() for p in model.parameters())} parameters at step {state['step']}; "
                  f"training resumes from here")
    return 0
