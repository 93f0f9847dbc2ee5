"""Dry-run load validation with real checkpoints: torch.save, safetensors, DCP from 2 real ranks."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from safepoint.validation.loaders import DcpCheckpoint, iter_file_tensors
from safepoint.validation.validate import (
    Limits,
    Problem,
    ValidationReport,
    iter_tensors,
    tensor_stat,
    validate_snapshot,
)
from tests.helpers_ckpt import (
    DCP_SHARDED_KEY,
    dcp_sharded_reference,
    make_dcp_ckpt,
    make_malicious_pickle,
    make_safetensors_ckpt,
    make_torch_save_ckpt,
    trained_model_and_optimizer,
)


def _stats(report: ValidationReport) -> dict[str, object]:
    return {s.name: s for s in report.stats}


def _assert_jsonable(report: ValidationReport) -> None:
    json.dumps(report.to_dict(include_stats=True))
    assert "\n" not in report.summary()


# ---------------------------------------------------------------------------------------- torch.save

def test_torch_save_model_and_optimizer_ok(tmp_path: Path) -> None:
    make_torch_save_ckpt(tmp_path, seed=0)  # compared with trained_model_and_optimizer() below
    (tmp_path / "config.json").write_text("{}")
    report = validate_snapshot(tmp_path)
    assert report.ok and report.outcome == "verified", report.summary()
    assert report.files == {"model.pt": "ok", "config.json": "ok"}  # JSON is parsed
    stats = _stats(report)
    for name in ("model.0.weight", "model.2.bias", "optimizer.state.0.exp_avg", "optimizer.state.3.exp_avg_sq",
                 "optimizer.state.1.step"):
        assert name in stats, sorted(stats)
    model, opt = trained_model_and_optimizer()
    expected = opt.state_dict()["state"][0]["exp_avg_sq"].double().norm().item()
    assert stats["optimizer.state.0.exp_avg_sq"].norm == pytest.approx(expected)
    assert stats["model.0.weight"].shape == (16, 8) and stats["model.0.weight"].file == "model.pt"
    _assert_jsonable(report)


def test_nan_in_optimizer_state_is_invalid(tmp_path: Path) -> None:
    make_torch_save_ckpt(tmp_path, nan_in_optimizer=True)
    report = validate_snapshot(tmp_path, ["model.pt"])
    assert report.outcome == "invalid"
    assert report.files == {"model.pt": "invalid"}
    [f] = report.findings
    assert f.problem is Problem.NAN and f.tensor == "optimizer.state.0.exp_avg_sq"
    assert "optimizer.state.0.exp_avg_sq: 3 NaN values" in f.message
    assert "exp_avg_sq" in report.summary()


def test_inf_in_model_weight_is_invalid(tmp_path: Path) -> None:
    make_torch_save_ckpt(tmp_path, inf_in_weight=True)
    report = validate_snapshot(tmp_path)
    assert report.outcome == "invalid"
    [f] = report.findings
    assert (f.problem, f.tensor) == (Problem.INF, "model.0.weight")
    assert _stats(report)["model.0.weight"].inf_count == 1


def test_malicious_pickle_is_refused_and_never_executed(tmp_path: Path) -> None:
    snap = tmp_path / "snap"
    sentinel = tmp_path / "SENTINEL"
    make_malicious_pickle(snap / "evil.pt", sentinel)
    report = validate_snapshot(snap)
    assert not sentinel.exists()
    assert report.outcome == "invalid" and report.files == {"evil.pt": "invalid"}
    [f] = report.findings
    assert f.problem is Problem.UNSAFE
    assert "weights-only" in f.message and "system" in f.message and "\n" not in f.message


def test_malicious_pickle_under_other_name_is_sniffed(tmp_path: Path) -> None:
    sentinel = tmp_path / "SENTINEL"
    make_malicious_pickle(tmp_path / "snap" / "weights.data", sentinel)
    report = validate_snapshot(tmp_path / "snap")
    assert not sentinel.exists()
    assert report.files == {"weights.data": "invalid"} and report.findings[0].problem is Problem.UNSAFE


def test_truncated_and_garbage_torch_files_are_unloadable(tmp_path: Path) -> None:
    path = make_torch_save_ckpt(tmp_path)
    data = path.read_bytes()
    (tmp_path / "trunc.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pth").write_bytes(os.urandom(1000))
    torch.save({"a": torch.ones(3)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    report = validate_snapshot(tmp_path)
    assert report.files["model.pt"] == "ok" and report.files["legacy.pt"] == "ok"
    assert report.files["trunc.pt"] == "invalid" and report.files["garbage.pth"] == "invalid"
    assert {f.problem for f in report.findings} == {Problem.UNLOADABLE}
    assert all("\n" not in f.message and len(f.message) < 400 for f in report.findings)


def test_missing_listed_file_is_incomplete(tmp_path: Path) -> None:
    make_torch_save_ckpt(tmp_path)
    report = validate_snapshot(tmp_path, ["model.pt", "shards/other.pt"])
    assert report.outcome == "incomplete"
    assert report.files == {"model.pt": "ok", "shards/other.pt": "missing"}


def test_unsafe_listed_path_is_invalid(tmp_path: Path) -> None:
    report = validate_snapshot(tmp_path, ["../outside.pt"])
    assert report.outcome == "invalid" and report.findings[0].problem is Problem.UNSAFE


# ---------------------------------------------------------------------------------------- safetensors

def test_safetensors_ok(tmp_path: Path) -> None:
    make_safetensors_ckpt(tmp_path, seed=0)  # compared with trained_model_and_optimizer() below
    report = validate_snapshot(tmp_path)
    assert report.ok, report.summary()
    stats = _stats(report)
    assert stats["extra.bf16"].dtype == "bfloat16" and stats["extra.bf16"].max_abs == pytest.approx(2.0)
    model, _ = trained_model_and_optimizer()
    assert stats["0.weight"].norm == pytest.approx(model.state_dict()["0.weight"].double().norm().item())


def _rewrite_header(path: Path, mutate) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8: 8 + n])
    mutate(header)
    raw = json.dumps(header).encode()
    raw += b" " * (n - len(raw)) if len(raw) <= n else b""
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def test_safetensors_huge_header_length_is_refused_before_reading(tmp_path: Path) -> None:
    path = make_safetensors_ckpt(tmp_path)
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**40) + data[8:])
    report = validate_snapshot(tmp_path)
    assert report.outcome == "invalid"
    [f] = report.findings
    assert f.problem is Problem.MALFORMED and "header length" in f.message


def test_safetensors_header_longer_than_file(tmp_path: Path) -> None:
    path = make_safetensors_ckpt(tmp_path)
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(data)) + data[8:])
    report = validate_snapshot(tmp_path, limits=Limits(max_safetensors_header_bytes=10**9))
    assert report.outcome == "invalid" and "header length" in report.findings[0].message


def test_safetensors_overlapping_offsets(tmp_path: Path) -> None:
    path = make_safetensors_ckpt(tmp_path)

    def overlap(h: dict) -> None:
        begin, end = h["0.bias"]["data_offsets"]
        h["2.bias"]["data_offsets"] = [begin, begin + (h["2.bias"]["data_offsets"][1] - h["2.bias"]["data_offsets"][0])]

    _rewrite_header(path, overlap)
    report = validate_snapshot(tmp_path)
    assert report.outcome == "invalid"
    assert report.findings[0].problem is Problem.MALFORMED and "overlap" in report.findings[0].message


@pytest.mark.parametrize("mutate,needle", [
    (lambda h: h["0.bias"].update(dtype="Q7"), "unknown dtype"),
    (lambda h: h["0.bias"].update(shape=[17]), "bytes but data_offsets"),
    (lambda h: h["0.bias"].update(data_offsets=[0, 10**9]), "outside the data section"),
])
def test_safetensors_bad_entries(tmp_path: Path, mutate, needle: str) -> None:
    _rewrite_header(make_safetensors_ckpt(tmp_path), mutate)
    report = validate_snapshot(tmp_path)
    assert report.outcome == "invalid" and needle in report.findings[0].message, report.summary()


def test_safetensors_nan(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.tensor([1.0, float("nan")], dtype=torch.float16)}, str(tmp_path / "m.safetensors"))
    report = validate_snapshot(tmp_path)
    assert report.outcome == "invalid" and report.findings[0].tensor == "w"


# ---------------------------------------------------------------------------------------- DCP

@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dcp_ckpt(tmp_path_factory.mktemp("dcp") / "ckpt", world_size=2, seed=0)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_dcp_two_ranks_ok_without_process_group(dcp_folder: Path) -> None:
    assert not torch.distributed.is_initialized()
    assert sorted(p.name for p in dcp_folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    report = validate_snapshot(dcp_folder)
    assert report.ok, report.summary()
    assert report.files == {".metadata": "ok", "__0_0.distcp": "ok", "__1_0.distcp": "ok"}
    stats = _stats(report)
    ref = dcp_sharded_reference()
    assert stats[DCP_SHARDED_KEY].shape == tuple(ref.shape)
    assert stats[DCP_SHARDED_KEY].norm == pytest.approx(ref.double().norm().item())
    assert "optimizer.state.0.exp_avg_sq" in stats and "model.0.weight" in stats
    tensors = dict(iter_file_tensors(dcp_folder))
    torch.testing.assert_close(tensors[DCP_SHARDED_KEY], ref, rtol=0, atol=0)
    model, opt = trained_model_and_optimizer()
    torch.testing.assert_close(tensors["extra.sharded_weight"], model.state_dict()["0.weight"], rtol=0, atol=0)
    torch.testing.assert_close(tensors["optimizer.state.2.exp_avg"], opt.state_dict()["state"][2]["exp_avg"])


def test_dcp_in_subfolder_next_to_other_files(dcp_folder: Path, tmp_path: Path) -> None:
    snap = tmp_path / "snap"
    _copy(dcp_folder, snap / "dcp")
    make_torch_save_ckpt(snap, name="extra.pt")
    (snap / "MANIFEST.json").write_text("{}")
    report = validate_snapshot(snap)
    assert report.ok, report.summary()
    assert report.files == {"dcp/.metadata": "ok", "dcp/__0_0.distcp": "ok", "dcp/__1_0.distcp": "ok",
                            "extra.pt": "ok"}
    assert {s.file for s in report.stats} == {"dcp/.metadata", "extra.pt"}


def test_dcp_missing_rank_file_is_incomplete(dcp_folder: Path, tmp_path: Path) -> None:
    snap = _copy(dcp_folder, tmp_path / "snap")
    (snap / "__1_0.distcp").unlink()
    report = validate_snapshot(snap)
    assert report.outcome == "incomplete", report.summary()
    assert report.files["__1_0.distcp"] == "missing"
    assert [f.problem for f in report.findings] == [Problem.MISSING]
    # the same with the manifest's file list
    report = validate_snapshot(snap, [".metadata", "__0_0.distcp", "__1_0.distcp"])
    assert report.outcome == "incomplete" and report.files["__1_0.distcp"] == "missing"


def test_dcp_truncated_metadata_is_invalid(dcp_folder: Path, tmp_path: Path) -> None:
    snap = _copy(dcp_folder, tmp_path / "snap")
    data = (snap / ".metadata").read_bytes()
    (snap / ".metadata").write_bytes(data[: len(data) // 2])
    report = validate_snapshot(snap)
    assert report.outcome == "invalid"
    assert report.files[".metadata"] == "invalid"
    [f] = report.findings
    assert f.problem is Problem.MALFORMED and ".metadata" in f.message and "truncated" in f.message


def test_dcp_truncated_rank_file_is_invalid(dcp_folder: Path, tmp_path: Path) -> None:
    snap = _copy(dcp_folder, tmp_path / "snap")
    data = (snap / "__1_0.distcp").read_bytes()
    (snap / "__1_0.distcp").write_bytes(data[:100])
    report = validate_snapshot(snap)
    assert report.outcome == "invalid" and report.files["__1_0.distcp"] == "invalid"
    assert "truncated" in report.findings[0].message


def test_dcp_corrupt_chunk_is_unloadable(dcp_folder: Path, tmp_path: Path) -> None:
    snap = _copy(dcp_folder, tmp_path / "snap")
    path = snap / "__1_0.distcp"
    path.write_bytes(b"\0" * path.stat().st_size)
    report = validate_snapshot(snap)
    assert report.outcome == "invalid" and report.files["__1_0.distcp"] == "invalid"
    assert report.files["__0_0.distcp"] == "ok"
    assert all(f.file == "__1_0.distcp" and f.tensor for f in report.findings)


def test_dcp_malicious_metadata_is_refused(tmp_path: Path) -> None:
    import pickle

    sentinel = tmp_path / "SENTINEL"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch '{sentinel}'",))

    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / ".metadata").write_bytes(pickle.dumps(Evil(), protocol=4))
    report = validate_snapshot(snap)
    assert not sentinel.exists()
    assert report.outcome == "invalid" and report.findings[0].problem is Problem.UNSAFE
    assert "not allowed" in report.findings[0].message


def test_dcp_metadata_path_escape_is_unsafe(dcp_folder: Path, tmp_path: Path) -> None:
    import pickle

    snap = _copy(dcp_folder, tmp_path / "snap")
    md = DcpCheckpoint.open(snap).metadata
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../etc/passwd"
    (snap / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    report = validate_snapshot(snap)
    assert report.outcome == "invalid" and report.findings[0].problem is Problem.UNSAFE


# ---------------------------------------------------------------------------------------- helpers

def test_iter_tensors_names_nested_paths() -> None:
    t = torch.zeros(1)
    obj = {"model": {"w": t}, "optimizer": {"state": {3: {"exp_avg_sq": t}}, "param_groups": [{"lr": 1.0}]},
           "list": [t, (t,)]}
    names = [n for n, _ in iter_tensors(obj)]
    assert names == ["model.w", "optimizer.state.3.exp_avg_sq", "list.0", "list.1.0"]
    assert [n for n, _ in iter_tensors(t, "x")] == ["x"]


def test_tensor_stat_chunks_match_whole() -> None:
    torch.manual_seed(0)
    t = torch.randn(37, 11)
    t[3, 4] = float("nan")
    t[5, 5] = float("-inf")
    whole = tensor_stat("t", t)
    for c in (1, 7, 100):
        for x in (t, t.t()):
            s = tensor_stat("t", x, chunk_elems=c)
            assert (s.nan_count, s.inf_count) == (1, 1)
            assert s.norm == pytest.approx(whole.norm) and s.max_abs == pytest.approx(whole.max_abs)
    finite = t.clone()
    finite[~torch.isfinite(finite)] = 0
    assert whole.norm == pytest.approx(finite.double().norm().item())
    assert tensor_stat("i", torch.tensor([3, -4])).norm == pytest.approx(5.0)
    assert tensor_stat("b", torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)).nan_count == 1


def test_missing_folder_is_data_not_exception(tmp_path: Path) -> None:
    report = validate_snapshot(tmp_path / "nope")
    assert report.outcome == "incomplete" and not report.ok


# ---------------------------------------------------------------------------------------- streaming leaves

def test_leaf_names_are_the_same_for_torch_save_and_dcp(dcp_folder: Path, tmp_path: Path) -> None:
    """One naming for every format (DCP's flattening), so the harness and the audit see the same names."""
    from safepoint.validation.loaders import TensorSource, iter_file_leaves

    make_torch_save_ckpt(tmp_path)
    pt = dict(iter_file_leaves(tmp_path / "model.pt"))
    dcp = dict(iter_file_leaves(dcp_folder))
    assert pt["optimizer.param_groups.0.params"] == dcp["optimizer.param_groups.0.params"] == [0, 1, 2, 3]
    assert pt["optimizer.param_groups.0.betas"] == dcp["optimizer.param_groups.0.betas"]
    shared = {k for k in pt if not k.startswith("extra.") and k != "step"}
    assert shared == {k for k in dcp if not k.startswith("extra.")}
    for k in shared:
        assert isinstance(pt[k], TensorSource) == isinstance(dcp[k], TensorSource), k
        if isinstance(pt[k], TensorSource):
            assert (pt[k].shape, pt[k].dtype) == (dcp[k].shape, dcp[k].dtype), k


def test_safetensors_pieces_reuse_one_buffer(tmp_path: Path) -> None:
    from safepoint.validation.loaders import iter_file_leaves

    make_safetensors_ckpt(tmp_path)
    leaves = iter_file_leaves(tmp_path / "model.safetensors")
    ptrs = set()
    for _name, src in leaves:
        for piece in src.pieces(8):
            ptrs.add(piece.data_ptr())
    assert len(ptrs) == 1  # every piece of every tensor was read into the same memory


def test_cli_validate_with_model_checks_the_manifest_step(tmp_path: Path, capsys) -> None:
    from safepoint.cli.main import main
    from safepoint.local.commit import commit

    make_torch_save_ckpt(tmp_path)  # records "step": 2
    commit(tmp_path, "cli", 100)
    assert main(["validate", str(tmp_path)]) == 0
    assert main(["validate", str(tmp_path), "--model", "tests.test_harness:model_and_adamw"]) == 1
    assert "the checkpoint records step 2, the catalog says step 100" in capsys.readouterr().err


def test_cli_validate_json_carries_the_findings(tmp_path: Path, capsys) -> None:
    import json

    from safepoint.cli.main import main
    from safepoint.local.commit import commit

    make_torch_save_ckpt(tmp_path)
    commit(tmp_path, "cli", 100)
    assert main(["validate", str(tmp_path), "--json", "--model", "tests.test_harness:model_and_adamw"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and any("records step 2" in f["message"] for f in doc["findings"])
