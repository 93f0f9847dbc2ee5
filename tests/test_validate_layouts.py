"""Every tensor layout fails closed: sparse values are audited completely, layouts the audit cannot
read (quantized, ...) are refused, never reported clean."""

from __future__ import annotations

import warnings

import pytest
import torch

from safepoint.validation.loaders.base import Problem
from safepoint.validation.validate import validate_snapshot

DENSE = torch.tensor([[0.0, 1.0, 0.0], [float("nan"), 0.0, 2.0]])


@pytest.mark.parametrize("to_layout", [
    lambda t: t.to_sparse(),
    lambda t: t.to_sparse_csr(),
    lambda t: t.to_sparse_csc(),
    lambda t: t.to_sparse_bsr((1, 1)),
], ids=["coo", "csr", "csc", "bsr"])
def test_nan_inside_a_sparse_tensor_is_found(tmp_path, to_layout):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save({"model": {"w": to_layout(DENSE)}}, tmp_path / "model.pt")
    report = validate_snapshot(tmp_path)
    assert report.outcome == "invalid", report.summary()
    assert [(f.tensor, f.problem) for f in report.findings] == [("model.w", Problem.NAN)]


def test_clean_sparse_tensor_is_verified(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save({"model": {"w": torch.nan_to_num(DENSE).to_sparse_csr()}}, tmp_path / "model.pt")
    report = validate_snapshot(tmp_path)
    assert report.outcome == "verified", report.summary()
    [s] = report.stats
    assert s.norm == pytest.approx(5 ** 0.5)


def test_quantized_tensor_is_refused(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8)
        torch.save({"model": {"q": q}}, tmp_path / "model.pt")
    report = validate_snapshot(tmp_path)
    assert report.outcome == "invalid", report.summary()
    [f] = report.findings
    assert f.tensor in ("model.q", None) and f.problem in (Problem.UNLOADABLE, Problem.UNSAFE)
