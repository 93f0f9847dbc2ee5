"""The async-checkpoint bugs of issue 16, reproduced with real training loops and caught through the CLI.

A tiny model takes real AdamW steps; a writer saves each checkpoint (`safepoint commit`, then
`safepoint ingest --to file://...`, in process) the way a buggy or a correct async writer would:

- NeMo-RL#4183: the first step's optimizer state saved again and again -> invalid, stale optimizer;
- nvidia-resiliency-ext PR#376: the weights (and the trainer's global_step) taken before
  `optimizer.step()`, the optimizer state after it -> invalid, torn (Adam step ahead of global_step);
- Lightning PR#21079: weights not snapshotted before the step, saved next to the optimizer state of
  the next step -> invalid, stale weights (the weights are byte-identical to the previous checkpoint's);
- the same checkpoint saved again under a later step -> invalid, duplicate of step N;
- the Snapshotter and DCP `async_save` used correctly, and a fine-tune with half the layers frozen:
  every checkpoint verified.

On SQLite and PostgreSQL (the `catalog_url` fixture); the 20-checkpoint runs use 20 checkpoints on
SQLite and 5 on PostgreSQL (each ingest costs a sandboxed validation).
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from safepoint.cli.main import main
from safepoint.validation.report import markdown


def sp(*args) -> int:
    return main([str(a) for a in args])


@pytest.fixture
def env(tmp_path, prefect_api, catalog_url):
    """(durable URL, catalog URL), SQLite and PostgreSQL."""
    return (tmp_path / "durable").as_uri(), catalog_url


def commit_and_ingest(env, folder: Path, run: str, step: int) -> int:
    assert sp("--catalog", env[1], "commit", folder, "--run", run, "--step", step) == 0
    return ingest(env, folder)


def ingest(env, folder: Path) -> int:
    return sp("--catalog", env[1], "ingest", folder, "--to", env[0])


def states(env, capsys, run: str) -> dict[int, str]:
    capsys.readouterr()
    assert sp("--catalog", env[1], "ls", "--run", run, "--json") == 0
    return {r["step"]: r["state"] for r in json.loads(capsys.readouterr().out)}


def show(env, capsys, run: str, step: int, code: int = 1) -> dict:
    """The validation report `show --json` prints; its exit code is the verdict (1: invalid)."""
    capsys.readouterr()
    assert sp("--catalog", env[1], "show", run, step, "--json") == code
    return json.loads(capsys.readouterr().out)["report"]


# ------------------------------------------------------------------------------------ a real training loop

class Loop:
    """A tiny MLP trained with AdamW and a per-step LR scheduler; `step()` is one optimizer step."""

    def __init__(self, layers: int = 2, frozen: int = 0, seed: int = 0) -> None:
        torch.manual_seed(seed)
        mods: list[torch.nn.Module] = []
        for i in range(layers):
            mods += [torch.nn.Linear(8, 8 if i < layers - 1 else 1)] + ([torch.nn.ReLU()] if i < layers - 1 else [])
        self.model = torch.nn.Sequential(*mods)
        for lin in [m for m in self.model if isinstance(m, torch.nn.Linear)][:frozen]:
            lin.requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1000)
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(32, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True)
        self.global_step = 0

    def backward(self) -> None:
        self.opt.zero_grad()
        torch.nn.functional.mse_loss(self.model(self.x), self.y).backward()

    def apply(self) -> None:
        self.opt.step()
        self.sched.step()
        self.global_step += 1

    def step(self) -> None:
        self.backward()
        self.apply()

    def steps(self, n: int) -> Iterator[int]:
        for _ in range(n):
            self.step()
            yield self.global_step


def save_ckpt(folder: Path, model_sd: dict, optim_sd: dict, sched_sd: dict, global_step: int) -> Path:
    """A Lightning-layout `.ckpt` (the trainer's global_step is recorded inside, and read by validation)."""
    folder.mkdir(parents=True)
    torch.save({"state_dict": model_sd, "optimizer_states": [optim_sd], "lr_schedulers": [sched_sd],
                "global_step": global_step, "epoch": 0}, folder / "last.ckpt")
    return folder


def snap(loop: Loop) -> tuple[dict, dict, dict]:
    """Copies of the model, optimizer and scheduler state, as a correct async writer stages them."""
    return (copy.deepcopy(loop.model.state_dict()), copy.deepcopy(loop.opt.state_dict()),
            copy.deepcopy(loop.sched.state_dict()))


def failing(report: dict, problem: str) -> list[dict]:
    return [f for f in report["findings"] if f["problem"] == problem]


# ------------------------------------------------------------------------------------ the planted bugs

def test_stale_optimizer_state_is_caught(env, capsys, tmp_path: Path) -> None:
    """NeMo-RL#4183: an async writer keeps the first step's optimizer state and saves it every time."""
    loop, first_optim = Loop(), None
    for step in loop.steps(3):
        model, optim, sched = snap(loop)
        first_optim = first_optim or optim
        code = commit_and_ingest(env, save_ckpt(tmp_path / f"s{step}", model, first_optim, sched, step), "so", step)
        assert code == (0 if step == 1 else 1)
    assert states(env, capsys, "so") == {1: "verified", 2: "invalid", 3: "invalid"}
    for step in (2, 3):  # both compared with step 1, the newest verified checkpoint
        [f] = failing(show(env, capsys, "so", step), "stale_optimizer")
        assert f["tensor"].startswith("optimizer_states.0.state.") and f["tensor"].endswith(("exp_avg", "exp_avg_sq"))
        assert f"step {step} are byte-identical to step 1" in f["message"]
        assert "optimizer_states.0.state.0.exp_avg" in f["message"] and "state_dict.0.weight" in f["message"]
    from safepoint.ops.metrics import render

    metrics = render(env[1]).decode()
    assert 'safepoint_consistency_findings_total{rule="stale_optimizer"} 2.0' in metrics
    assert 'safepoint_consistency_findings_total{rule="torn"} 0.0' in metrics


def test_weights_before_the_step_with_the_optimizer_after_it_is_torn(env, capsys, tmp_path: Path) -> None:
    """nvidia-resiliency-ext PR#376: the model and the trainer's step are taken before optimizer.step(),
    the optimizer state after it: AdamW `step` k+1 saved next to step-k weights."""
    loop = Loop()
    for _ in loop.steps(1):
        pass
    for step in (1, 2):
        model, _, sched = snap(loop)            # the weights of `step`, and the trainer at `step` ...
        loop.step()
        optim = copy.deepcopy(loop.opt.state_dict())  # ... the optimizer after one more step
        assert commit_and_ingest(env, save_ckpt(tmp_path / f"t{step}", model, optim, sched, step), "tn", step) == 1
        report = show(env, capsys, "tn", step)
        [f] = failing(report, "torn")
        assert f"at step {step} the optimizer has taken {step + 1} steps" in f["message"]
        assert f"global_step {step}" in f["message"]
        assert report["checks"]["counters"] == {"catalog": step, "optimizer": step + 1, "scheduler": step,
                                                "trainer": step, "scaler": None}
    assert states(env, capsys, "tn") == {1: "invalid", 2: "invalid"}


def test_weights_not_snapshotted_before_the_next_step_are_stale(env, capsys, tmp_path: Path) -> None:
    """Lightning PR#21079: the writer takes the weights before the next optimizer.step() and the optimizer
    state after it; against the correct checkpoint of the step before, every weight is the same bytes."""
    loop = Loop()
    for _ in loop.steps(1):
        pass
    model, optim, sched = snap(loop)
    assert commit_and_ingest(env, save_ckpt(tmp_path / "w1", model, optim, sched, 1), "sw", 1) == 0
    model = copy.deepcopy(loop.model.state_dict())  # taken before the step ...
    loop.step()
    _, optim, sched = snap(loop)                    # ... the rest after it
    assert commit_and_ingest(env, save_ckpt(tmp_path / "w2", model, optim, sched, 2), "sw", 2) == 1
    assert states(env, capsys, "sw") == {1: "verified", 2: "invalid"}
    [f] = failing(show(env, capsys, "sw", 2), "stale_weights")
    assert f["tensor"] == "state_dict.0.bias"
    assert "all 4 parameters of step 2 are byte-identical to step 1" in f["message"]
    assert "state_dict.2.weight" in f["message"]
    capsys.readouterr()
    assert sp("--catalog", env[1], "resume-point", "--run", "sw", "--explain") == 0
    cap = capsys.readouterr()
    assert "sw step 1" in cap.out
    assert "skipped sw/2: state is invalid" in cap.err and "stale weights: all 4 parameters" in cap.err


def test_a_duplicated_checkpoint_is_caught(env, capsys, tmp_path: Path) -> None:
    """The same state saved again under a later step (a writer that re-sends its last buffer)."""
    loop = Loop()
    for _ in loop.steps(2):
        pass
    model, optim, sched = snap(loop)
    for step in (2, 4):  # plain torch.save: no step recorded inside, only the bytes can tell
        folder = tmp_path / f"d{step}"
        folder.mkdir()
        torch.save({"model": model, "optimizer": optim, "scheduler": sched}, folder / "checkpoint.pt")
        assert commit_and_ingest(env, folder, "dup", step) == (0 if step == 2 else 1)
    assert states(env, capsys, "dup") == {2: "verified", 4: "invalid"}
    report = show(env, capsys, "dup", 4)
    [f] = failing(report, "duplicate")
    assert f["message"].startswith("duplicate of step 2: all 4 parameters and 8 optimizer tensors of step 4")
    assert "| consistency | against dup/2: duplicate (2 -> 4)" in markdown("dup", 4, "invalid", report)  # the artifact
    capsys.readouterr()
    assert sp("--catalog", env[1], "show", "dup", 4) == 1
    assert "duplicate of step 2" in capsys.readouterr().out


def test_a_fork_is_compared_with_its_lineage_parent(env, capsys, tmp_path: Path) -> None:
    """A checkpoint of a new run declared `--parent base:2` is compared with base/2 (its own run has none)."""
    loop = Loop()
    for _ in loop.steps(2):
        pass
    model, optim, sched = snap(loop)
    assert commit_and_ingest(env, save_ckpt(tmp_path / "base2", model, optim, sched, 2), "base", 2) == 0
    loop.step()
    folder = save_ckpt(tmp_path / "fork3", copy.deepcopy(loop.model.state_dict()), optim, sched, 3)
    assert sp("--catalog", env[1], "commit", folder, "--run", "fork", "--step", 3, "--parent", "base:2") == 0
    assert ingest(env, folder) == 1
    report = show(env, capsys, "fork", 3)
    assert report["checks"]["consistency"]["against"] == "base/2"
    [f] = failing(report, "stale_optimizer")
    assert "of step 3 are byte-identical to step 2" in f["message"]


def test_a_consistency_rule_as_a_warning_keeps_the_checkpoint_verified(env, capsys, tmp_path: Path,
                                                                       safepoint_home: Path) -> None:
    (safepoint_home / "config.toml").write_text('[validation]\nwarn_only = ["duplicate"]\n')
    loop = Loop()
    for _ in loop.steps(2):
        pass
    model, optim, sched = snap(loop)
    for step in (2, 3):
        folder = tmp_path / f"d{step}"
        folder.mkdir()
        torch.save({"model": model, "optimizer": optim}, folder / "checkpoint.pt")
        assert commit_and_ingest(env, folder, "dw", step) == 0
    assert states(env, capsys, "dw") == {2: "verified", 3: "verified"}
    report = show(env, capsys, "dw", 3, 0)
    assert report["findings"] == [] and [w["problem"] for w in report["warnings"]] == ["duplicate"]


# ------------------------------------------------------------------------------------ correct runs pass

def _many(catalog_url: str) -> int:
    return 20 if catalog_url.startswith("sqlite") else 5


def test_snapshotter_used_correctly_passes_every_checkpoint(env, capsys, tmp_path: Path) -> None:
    from safepoint.snapshotter import Snapshotter

    n, loop = _many(env[1]), Loop()
    with Snapshotter(tmp_path / "nvme", "snap", budget_bytes=8 << 20, memory_floor=0.0) as snapshotter:
        handles = [snapshotter.save(step, {"model": loop.model.state_dict(), "optim": loop.opt.state_dict(),
                                           "lr_scheduler": loop.sched.state_dict()}) for step in loop.steps(n)]
        for h in handles:
            h.wait()
    assert [ingest(env, tmp_path / "nvme" / "snap" / str(step)) for step in range(1, n + 1)] == [0] * n
    assert set(states(env, capsys, "snap").values()) == {"verified"}
    last = show(env, capsys, "snap", n, 0)
    assert last["checks"]["consistency"] == {"against": f"snap/{n - 1}", "findings": []}
    assert last["checks"]["counters"]["optimizer"] == n


def test_dcp_async_save_used_correctly_passes_every_checkpoint(env, capsys, tmp_path: Path) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from safepoint.snapshotter.dcp_writer import SafepointWriter

    n, loop, pending = _many(env[1]), Loop(), None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP warns and saves as a single rank
        for step in loop.steps(n):
            if pending is not None:
                pending.result()  # one save in flight at a time; training went on while it wrote
            state = {"model": loop.model.state_dict(), "optim": loop.opt.state_dict()}
            pending = dcp.async_save(state, storage_writer=SafepointWriter(tmp_path / "dcp" / str(step), run="dcp"))
        pending.result()
    assert [ingest(env, tmp_path / "dcp" / str(step)) for step in range(1, n + 1)] == [0] * n
    assert set(states(env, capsys, "dcp").values()) == {"verified"}
    assert show(env, capsys, "dcp", n, 0)["checks"]["consistency"]["findings"] == []


def test_a_fine_tune_with_half_the_layers_frozen_passes(env, capsys, tmp_path: Path) -> None:
    loop = Loop(layers=4, frozen=2)
    for step in loop.steps(4):
        model, optim, sched = snap(loop)
        assert commit_and_ingest(env, save_ckpt(tmp_path / f"f{step}", model, optim, sched, step), "ft", step) == 0
    assert states(env, capsys, "ft") == {1: "verified", 2: "verified", 3: "verified", 4: "verified"}
    report = show(env, capsys, "ft", 4, 0)
    assert report["findings"] == [] and report["warnings"] == []
    assert report["checks"]["consistency"] == {"against": "ft/3", "findings": []}
