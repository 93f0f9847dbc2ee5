"""`safepoint demo`: the whole pipeline on a tiny real model, with one checkpoint corrupted on purpose."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from safepoint.cli.console import inert

RUN = "demo-run"


def _train_and_save(nvme: Path, steps: list[int]) -> Iterator[tuple[int, Path]]:
    """Train, and at each of `steps` save model, optimizer and step with torch.save; yield (step, folder)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 32), torch.randn(256, 8)
    step = 0
    for target in steps:
        while step < target:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            step += 1
        folder = nvme / RUN / f"step-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, folder / "model.pt")
        yield step, folder


def run_demo(workdir: Path | None = None, console: Console | None = None, *, progress_console: Any = None) -> int:
    """Run the demo in `workdir` (kept), or in a new temporary folder that is removed once it succeeds.

    `progress_console`: where the bar of the demo's steps goes (the CLI's stderr on a terminal); None: no bar.
    """
    from safepoint.ops import progress

    console = console or Console()
    temporary = workdir is None
    workdir = Path(workdir or tempfile.mkdtemp(prefix="safepoint-demo-")).resolve()
    console.print(f"[bold]Safepoint demo[/bold], working in {inert(workdir)}"
                  + (" (removed at the end)" if temporary else ""))
    code = 1
    try:
        with progress.steps(STEPS, progress_console, enabled=progress_console is not None) as steps:
            code = _demo(workdir, console, steps)
    finally:
        if temporary and code == 0:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
            console.print(f"Removed the demo folder {inert(workdir)}.")
        else:
            console.print(f"The demo's files are still in {inert(workdir)}.")
    return code


#: the demo's steps, for its progress bar: three checkpoints, a flipped bit, three ingests, a restore
STEPS = 8


def _demo(workdir: Path, console: Console, steps: Any) -> int:
    from safepoint.catalog.store import open_catalog
    from safepoint.flows.ingest import ingest_result
    from safepoint.local.commit import commit
    from safepoint.rules.resume import resume_point

    nvme, durable = workdir / "nvme", workdir / "durable"
    durable.mkdir(parents=True, exist_ok=True)
    catalog_url = f"sqlite:///{workdir / 'catalog.db'}"

    folders = []
    steps.next("training to step 10")
    for step, folder in _train_and_save(nvme, [10, 20, 30]):
        commit(folder, RUN, step, parent=(RUN, step - 10) if step > 10 else None)
        folders.append(folder)
        if step < 30:
            steps.next(f"training to step {step + 10}")
        console.print(f"Trained a tiny model to step {step} and committed its checkpoint "
                      f"({folder.relative_to(workdir)}).")

    steps.next("flipping one bit")
    victim = folders[-1] / "model.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    console.print(f"[yellow]Flipped one bit[/yellow] in {victim.relative_to(workdir)} after it was committed, "
                  "as a failing disk might.")

    for folder in folders:
        steps.next(f"ingesting {folder.name}")
        result = ingest_result(snapshot=str(folder), to=[durable.as_uri()], catalog_url=catalog_url)
        if result["state"] == "verified":
            console.print(f"Ingested {folder.name}: [bold]verified[/bold] (copied to durable/, read back with "
                          "every hash matching, and its model and optimizer state loaded cleanly).")
        else:
            console.print(f"Ingested {folder.name}: [bold]{result['state']}[/bold]: {inert(result['message'] or '')}")

    cat = open_catalog(catalog_url)
    views = cat.list_checkpoints(RUN)
    table = Table("run", "step", "state", "replicas", title="The catalog")
    for c in views:
        table.add_row(c.run, str(c.step), str(c.state),
                      "\n".join(inert(f"{r.url} ({r.state})") for r in c.replicas) or "-")
    console.print(table)
    decision = resume_point(views)
    for c, why in decision.passed_over:
        console.print(f"Passed over step {c.step}: {inert(why)}.")
    if decision.chosen is None:
        console.print("[red]No resume point.[/red]")
        return 1
    console.print(f"[green]Resume point[/green]: {RUN} step {decision.chosen.step}, at {inert(decision.urls[0])}")
    steps.next("restoring the resume point")
    return _way_back(workdir, nvme, cat, console)


def _way_back(workdir: Path, nvme: Path, cat: object, console: Console) -> int:
    """The node is lost: restore the resume point from the durable replica, verified, and load it."""
    import shutil

    import torch
    from torch import nn

    from safepoint.core.config import Config
    from safepoint.ops.restore import restore

    shutil.rmtree(nvme)
    console.print(f"[yellow]Deleted the local copies[/yellow] ({nvme.relative_to(workdir)}/), as if the node "
                  "were lost.")
    result = restore(RUN, workdir / "restored", catalog=cat, config=Config())  # type: ignore[arg-type]
    console.print(f"[green]Restored[/green] step {result.step} from {inert(result.sources[0])} into "
                  f"{result.path.relative_to(workdir)}/: {result.bytes_fetched:,} bytes, each checked against "
                  "its BLAKE3 hash.")
    state = torch.load(result.path / "model.pt", weights_only=True)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    model.load_state_dict(state["model"])
    console.print(f"Loaded it into the model: {sum(p.numel() for p in model.parameters()):,} parameters at "
                  f"step {state['step']}. Training would resume from here.")
    return 0
