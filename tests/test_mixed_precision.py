"""fp16 with torch's own GradScaler: a step the scaler skips (inf gradients: no optimizer.step(), the
scale backs off) leaves weights and Adam moments as they were. That is normal mixed-precision
training, and the checkpoint after it is verified, not judged a duplicate; the same bytes without
the scaler's back-off still are."""

from __future__ import annotations

from pathlib import Path

import torch

from safepoint.validation.audit import Baseline, stat_rows
from safepoint.validation.validate import validate_snapshot


def _loop():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    return model, opt, scaler


def _step(model, opt, scaler, *, overflow: bool = False) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 4)).pow(2).mean()
    scaler.scale(loss * (torch.tensor(float("inf")) if overflow else 1.0)).backward()
    scaler.step(opt)     # skipped when the unscaled gradients hold inf
    scaler.update()
    opt.zero_grad()


def _save(folder: Path, model, opt, scaler, step: int, *, with_scaler: bool = True) -> Path:
    folder.mkdir(parents=True)
    doc = {"model": model.state_dict(), "optimizer": opt.state_dict(), "global_step": step}
    if with_scaler:
        doc["scaler"] = scaler.state_dict()
    torch.save(doc, folder / "checkpoint.pt")
    return folder


def _against(first: Path, step: int):
    report = validate_snapshot(first, step=step)
    assert report.outcome == "verified", report.summary()
    return Baseline(f"fp16/{step}", {r["name"]: r for r in stat_rows(report.stats)}, step=step,
                    counters=report.checks["counters"])


def test_a_gradscaler_skipped_step_is_verified_not_duplicate(tmp_path: Path) -> None:
    model, opt, scaler = _loop()
    for _ in range(3):
        _step(model, opt, scaler)
    first = _save(tmp_path / "step-3", model, opt, scaler, 3)
    scale = scaler.get_scale()
    _step(model, opt, scaler, overflow=True)
    assert scaler.get_scale() == scale / 2 and opt.state[next(iter(model.parameters()))]["step"] == 3
    skipped = _save(tmp_path / "step-4", model, opt, scaler, 4)

    report = validate_snapshot(skipped, step=4, baseline=_against(first, 3))
    assert report.outcome == "verified", report.summary()
    assert report.checks["counters"]["scaler"] == scale / 2
    assert report.checks["consistency"]["findings"] == []


def test_the_same_bytes_without_a_scaler_back_off_are_still_a_duplicate(tmp_path: Path) -> None:
    model, opt, scaler = _loop()
    for _ in range(3):
        _step(model, opt, scaler)
    first = _save(tmp_path / "step-3", model, opt, scaler, 3)
    again = _save(tmp_path / "step-4", model, opt, scaler, 4)   # a dirty buffer saved again
    report = validate_snapshot(again, step=4, baseline=_against(first, 3))
    assert report.outcome == "invalid" and [f.problem.value for f in report.findings] == ["duplicate"]
