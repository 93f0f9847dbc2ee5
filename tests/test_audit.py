"""Numerical audit: per-tensor stats against a float64 reference, norm-jump decisions, settings, and a
norm jump caught through the catalog (two real ingests)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from safepoint.catalog.store import open_catalog
from safepoint.core.config import Config
from safepoint.core.errors import UsageError
from safepoint.core.states import CheckpointState as CS
from safepoint.local.commit import commit
from safepoint.ops.ingest import ingest
from safepoint.validation.audit import (
    HEAD_BYTES,
    Baseline,
    TensorStat,
    Thresholds,
    baseline_heads,
    norm_jumps,
    stat_keys,
    stat_of,
    stat_rows,
    tensor_stat,
)
from safepoint.validation.loaders import Problem
from safepoint.validation.loaders.base import LoadedTensor
from safepoint.validation.settings import ValidationSettings
from tests.helpers_ckpt import make_torch_save_ckpt

# ---------------------------------------------------------------------------------------- stats


def _reference(t: torch.Tensor) -> tuple[float, float]:
    x = torch.view_as_real(t).reshape(-1) if t.is_complex() else t.reshape(-1)
    x = x.to(torch.float64)
    x = x[torch.isfinite(x)]
    return float(x.norm()), float(x.abs().max()) if x.numel() else 0.0


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8,
          torch.bool, torch.complex64, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_stats_match_a_float64_reference(dtype: torch.dtype, chunk: int) -> None:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(33, 17, generator=g) * 3
    if dtype.is_complex:
        t = torch.complex(base, -base)
    elif dtype == torch.bool:
        t = base > 0
    elif not dtype.is_floating_point:
        t = (base * 10).abs().to(dtype)
    else:
        t = base.to(dtype)
    s = tensor_stat("t", t, chunk_elems=chunk)
    norm, max_abs = _reference(t)
    assert (s.nan_count, s.inf_count, s.numel, s.shape) == (0, 0, 33 * 17, (33, 17))
    assert s.norm == pytest.approx(norm, rel=1e-5) and s.max_abs == pytest.approx(max_abs, rel=1e-6)
    # Non-contiguous views are read in row blocks.
    s = tensor_stat("t", t.t(), chunk_elems=chunk)
    assert s.norm == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_and_inf_are_counted_and_excluded(dtype: torch.dtype) -> None:
    t = torch.arange(1000, dtype=torch.float32).to(dtype)
    t[3] = float("nan")
    t[500] = float("inf")
    t[501] = float("-inf")
    s = tensor_stat("t", t, chunk_elems=64)
    assert (s.nan_count, s.inf_count) == (1, 2)
    norm, max_abs = _reference(t)
    assert s.norm == pytest.approx(norm, rel=1e-5) and s.max_abs == max_abs  # 999, or 1000 in bfloat16


def test_float32_overflowing_squares_still_give_the_norm() -> None:
    t = torch.full((1000,), 1e30, dtype=torch.float32)  # each square overflows float32
    s = tensor_stat("t", t)
    assert s.nan_count == s.inf_count == 0
    assert s.norm == pytest.approx(1e30 * math.sqrt(1000), rel=1e-6)


def test_scalar_value_is_kept_for_the_step_check() -> None:
    assert tensor_stat("step", torch.tensor(41.0)).value == 41.0
    assert tensor_stat("w", torch.ones(3)).value is None


def _b3(data: bytes) -> str:
    import blake3

    return blake3.blake3(data).hexdigest(16)


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_digests_are_blake3_of_the_bytes_whatever_the_pieces(dtype: torch.dtype, chunk: int) -> None:
    t = (torch.randn(100_000) * 10).to(dtype)  # more than HEAD_BYTES even as bool
    raw = t.view(torch.uint8).numpy().tobytes()
    head = _b3(raw[:HEAD_BYTES])
    whole = stat_of("t", LoadedTensor(t), chunk_elems=chunk)  # no policy: digested whole
    assert (whole.head, whole.digest) == (head, _b3(raw))
    moved = stat_of("t", LoadedTensor(t), chunk_elems=chunk, full_digest=lambda h: False)
    assert (moved.head, moved.digest) == (head, None)  # head only: the bytes were read once, not hashed twice
    asked = stat_of("t", LoadedTensor(t), chunk_elems=chunk, full_digest={head}.__contains__)
    assert asked.digest == _b3(raw)


def test_a_tensor_smaller_than_the_head_is_always_digested_whole() -> None:
    t = torch.arange(10, dtype=torch.float32)
    s = stat_of("t", LoadedTensor(t), full_digest=lambda h: False)
    assert s.head == s.digest == _b3(t.numpy().tobytes())


def test_digest_follows_logical_order_not_strides() -> None:
    x = torch.randn(300, 200)
    assert tensor_stat("x", x.t()).digest == tensor_stat("x", x.t().contiguous()).digest
    assert tensor_stat("x", x.t()).digest != tensor_stat("x", x).digest


def test_full_digest_only_where_the_baseline_head_matches(tmp_path: Path) -> None:
    """Validation digests a tensor whole only where the previous checkpoint has the same head."""
    from safepoint.validation.validate import validate_snapshot

    moved, frozen = torch.randn(64, 1024), torch.randn(64, 1024)
    torch.save({"moved": moved, "frozen": frozen}, tmp_path / "a.pt")
    first = {s.name: s for s in validate_snapshot(tmp_path, ["a.pt"]).stats}
    assert all(s.head and s.digest is None for s in first.values())  # no baseline: heads only
    baseline = Baseline("run/1", stats={k: s.to_dict() for k, s in first.items()}, step=1)
    assert baseline_heads(baseline) == {k: s.head for k, s in first.items()}
    torch.save({"moved": moved + 1e-3, "frozen": frozen}, tmp_path / "a.pt")
    second = {s.name: s for s in validate_snapshot(tmp_path, ["a.pt"], baseline=baseline).stats}
    assert second["moved"].head != first["moved"].head and second["moved"].digest is None
    assert second["frozen"].head == first["frozen"].head
    assert second["frozen"].digest == _b3(frozen.numpy().tobytes())


def test_stat_keys_qualify_names_found_in_several_files() -> None:
    def st(name: str, file: str) -> TensorStat:
        return TensorStat(name, file, "float32", (2,), 2, 1.0, 1.0, 0, 0)

    stats = [st("w", "rank0.pt"), st("w", "rank1.pt"), st("b", "rank0.pt")]
    assert stat_keys(stats) == ["rank0.pt:w", "rank1.pt:w", "b"]
    assert [r["name"] for r in stat_rows(stats)] == ["rank0.pt:w", "rank1.pt:w", "b"]


# ---------------------------------------------------------------------------------------- norm jumps

def _st(name: str, norm: float | None, numel: int = 10, shape: tuple[int, ...] = (10,)) -> TensorStat:
    return TensorStat(name, "m.pt", "float32", shape, numel, norm, norm, 0, 0)


@pytest.mark.parametrize("prev,cur,thresholds,flagged", [
    (1.0, 5.0, Thresholds(), False),                       # x5 < x10
    (1.0, 11.0, Thresholds(), True),                       # grew
    (10.0, 0.5, Thresholds(), True),                       # shrank /20
    (0.0, 1e-7, Thresholds(), False),                      # both under the floor
    (0.0, 1.0, Thresholds(), True),                        # left zero: x1e6 against the floor
    (1.0, 11.0, Thresholds(norm_jump_factor=20.0), False),
    (1.0, 11.0, Thresholds(norm_jump_factor=None), False),  # check off
    (1.0, 11.0, Thresholds(ignore=("w*",)), False),
    (1.0, None, Thresholds(), False),                      # no stats (unsupported dtype)
])
def test_norm_jump_decisions(prev: float, cur: float | None, thresholds: Thresholds, flagged: bool) -> None:
    base = Baseline("r/1", {"w": {"name": "w", "norm": prev, "shape": [10]}})
    jumps, _ = norm_jumps([_st("w", cur)], base, thresholds)
    assert bool(jumps) is flagged


def test_norm_jump_skips_small_tensors_new_tensors_and_shape_changes() -> None:
    base = Baseline("r/1", {"step": {"norm": 1.0, "shape": []}, "w": {"norm": 1.0, "shape": [5, 2]}})
    current = [_st("step", 500.0, numel=1, shape=()), _st("w", 500.0), _st("new", 500.0)]
    jumps, compared = norm_jumps(current, base, Thresholds())
    assert jumps == [] and compared == 0
    jumps, compared = norm_jumps([_st("w", 500.0, shape=(5, 2))], base, Thresholds())
    [j] = jumps
    assert compared == 1 and j.grew and j.ratio == pytest.approx(500)
    assert j.message("r/1", 10) == "w: norm grew x500 since r/1 (1 -> 500; limit x10)"


# ---------------------------------------------------------------------------------------- settings

def test_settings_from_config_with_per_run_override() -> None:
    cfg = Config(validation={"norm_jump_factor": 4.0, "norm_jump_ignore": ["*.step"], "warn_only": ["dtype"],
                             "max_tensor_bytes": 0, "stats_chunk_elems": 4096, "threads": 2},
                 runs={"big": {"model": "pkg.mod:build", "norm_jump_factor": 50, "keep_last": 3}})
    s = ValidationSettings.from_config(cfg, "small")
    assert s.thresholds == Thresholds(norm_jump_factor=4.0, ignore=("*.step",))
    assert s.warn_only == {Problem.DTYPE} and s.model is None and s.threads == 2
    assert s.limits.max_tensor_bytes is None and s.limits.stats_chunk_elems == 4096
    assert not s.failing(Problem.DTYPE) and s.failing(Problem.NORM_JUMP) and s.failing(Problem.NAN)
    big = ValidationSettings.from_config(cfg, "big")
    assert big.model == "pkg.mod:build" and big.thresholds.norm_jump_factor == 50
    assert ValidationSettings.from_config(cfg, "big", model="other:f").model == "other:f"


@pytest.mark.parametrize("doc,needle", [
    ({"norm_jump_factr": 3}, "unknown key"),
    ({"norm_jump_factor": "big"}, "non-negative number"),
    ({"warn_only": ["unsafe"]}, "always failing"),
    ({"warn_only": ["bogus"]}, "a list of problems"),
    ({"model": "no_colon"}, "package.module:function"),
])
def test_bad_settings_are_usage_errors(doc: dict, needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        ValidationSettings.from_mapping(doc)


# ---------------------------------------------------------------------------------------- through the catalog

def _ingest(tmp_path: Path, catalog, run: str, step: int, *, scale: float = 1.0, config: Config | None = None):
    folder = tmp_path / "nvme" / run / str(step)
    path = make_torch_save_ckpt(folder, seed=step)  # each step its own state: the same bytes would be a duplicate
    if scale != 1.0:
        sd = torch.load(path, weights_only=True)
        sd["model"]["2.weight"] *= scale
        torch.save(sd, path)
    commit(folder, run, step)
    return ingest(folder, [(tmp_path / "durable").as_uri()], catalog, config)


@pytest.mark.catalog_backends
def test_norm_jump_against_previous_verified_checkpoint(tmp_path: Path, catalog_url: str) -> None:
    catalog = open_catalog(catalog_url)  # SQLite and PostgreSQL
    assert _ingest(tmp_path, catalog, "nj", 1).state is CS.VERIFIED
    first = catalog.latest_validation(catalog.get("nj", 1).id)
    stats = {r["name"]: r for r in catalog.tensor_stats(first.id)}
    assert "optimizer.state.0.exp_avg_sq" in stats and "model.2.weight" in stats and len(stats) == 16

    out = _ingest(tmp_path, catalog, "nj", 2, scale=100.0)
    assert out.state is CS.INVALID
    v = catalog.latest_validation(catalog.get("nj", 2).id)
    [f] = v.report["findings"]
    assert (f["problem"], f["tensor"], f["file"]) == ("norm_jump", "model.2.weight", "model.pt")
    assert re.search(r"grew x1\d\d since nj/1", f["message"])  # x100 on a norm of another seed's weights
    # 4 parameters compared; Adam's 8 moments are not (rules table: optimizer_state norm_jump = "off")
    assert v.report["checks"]["audit"] == {"against": "nj/1", "compared": 4, "norm_jump_factor": 10.0,
                                           "flagged": 1}
    assert "model.2.weight" in (catalog.get("nj", 2).error or "")

    # Step 3 is compared with step 1, the newest *verified* one (step 2 is invalid).
    assert _ingest(tmp_path, catalog, "nj", 3).state is CS.VERIFIED
    v3 = catalog.latest_validation(catalog.get("nj", 3).id)
    assert v3.report["checks"]["audit"]["against"] == "nj/1"


def test_norm_jump_as_warning_keeps_the_checkpoint_verified(tmp_path: Path, sqlite_catalog_url: str) -> None:
    catalog = open_catalog(sqlite_catalog_url)
    config = Config(validation={"warn_only": ["norm_jump"]})
    assert _ingest(tmp_path, catalog, "w", 1, config=config).state is CS.VERIFIED
    assert _ingest(tmp_path, catalog, "w", 2, scale=0.01, config=config).state is CS.VERIFIED
    v = catalog.latest_validation(catalog.get("w", 2).id)
    assert v.ok and v.report["findings"] == []
    [w] = v.report["warnings"]
    assert w["tensor"] == "model.2.weight" and re.search(r"shrank x\d\d(\.\d+)? since w/1", w["message"])


def test_per_run_model_in_config_runs_the_strict_load(tmp_path: Path, sqlite_catalog_url: str) -> None:
    """`[runs.NAME] model = "..."` turns on the harness for that run only (here: a changed shape)."""
    catalog = open_catalog(sqlite_catalog_url)
    config = Config(runs={"edited": {"model": "tests.test_harness:wider_model"}})
    assert _ingest(tmp_path, catalog, "edited", 2, config=config).state is CS.INVALID
    v = catalog.latest_validation(catalog.get("edited", 2).id)
    assert v.report["checks"]["harness"]["model"] == "tests.test_harness:wider_model"
    assert "model.0.weight" in {f["tensor"] for f in v.report["findings"] if f["problem"] == "shape"}
    assert _ingest(tmp_path, catalog, "other", 2, config=config).state is CS.VERIFIED


def test_whole_digests_in_the_sandbox_after_the_caller_hashed_with_threads(tmp_path: Path) -> None:
    """The sandbox child is forked from the caller; a caller that already hashed a large file with
    blake3's threads (commit, replicate) must not leave the child waiting on threads it does not have."""
    from safepoint.core.hashing import hash_path
    from safepoint.validation.validate import validate_snapshot

    big = tmp_path / "big.bin"
    big.write_bytes(b"\1" * (65 << 20))
    hash_path(big)  # >= 64 MiB: blake3's thread pool now exists in this process
    frozen = torch.randn(64, 1024)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.save({"frozen": frozen}, folder / "a.pt")
    first = validate_snapshot(folder, ["a.pt"]).stats[0]
    baseline = Baseline("run/1", stats={first.name: first.to_dict()}, step=1)
    settings = ValidationSettings.from_mapping({"sandbox_wall_seconds": 30, "sandbox_wall_seconds_per_gib": 1})
    report = validate_snapshot(folder, ["a.pt"], baseline=baseline, settings=settings)
    assert report.ok, report.summary()
    assert report.stats[0].digest == _b3(frozen.numpy().tobytes())
