"""Prometheus metrics from the catalog, memory headroom, the documented alert rules, the progress hook."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from safepoint import commit
from safepoint.core.config import Config
from safepoint.core.states import CheckpointState as CS
from safepoint.ops import metrics
from safepoint.ops import progress as progress_
from safepoint.ops.ingest import ingest


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def snapshot(root: Path, step: int, *, rot: bool = False) -> Path:
    folder = root / f"step-{step}"
    folder.mkdir(parents=True)
    torch.save({"w": torch.ones(32) * step}, folder / "model.pt")
    commit(folder, "m", step)
    if rot:
        data = bytearray((folder / "model.pt").read_bytes())
        data[-3] ^= 1
        (folder / "model.pt").write_bytes(bytes(data))
    return folder


def test_metrics_reflect_the_catalog(tmp_path, sqlite_catalog, sqlite_catalog_url):
    durable = (tmp_path / "durable").as_uri()
    assert ingest(snapshot(tmp_path, 1), [durable], sqlite_catalog, Config()).state is CS.VERIFIED
    assert ingest(snapshot(tmp_path, 2, rot=True), [durable], sqlite_catalog, Config()).state is CS.CORRUPT
    row = sqlite_catalog.get("m", 1)
    # every ingest records `ingest.done` with what it uploaded (inline too); one more, with known figures
    uploaded = sum(e["detail"]["bytes_uploaded"] or 0 for e in sqlite_catalog.events(kind="ingest.done"))
    assert uploaded > 0
    sqlite_catalog.add_event("ingest.done", checkpoint_id=row.id, detail={
        "run": "m", "step": 1, "bytes_uploaded": 1000, "seconds": 2.0, "throughput_bps": 500.0,
        "memory_available_min_ratio": 0.2, "error": None})
    got = samples(metrics.render(sqlite_catalog_url).decode())
    assert got[("safepoint_checkpoints", (("state", "verified"),))] == 1
    assert got[("safepoint_checkpoints", (("state", "corrupt"),))] == 1
    assert got[("safepoint_checkpoints", (("state", "pruned"),))] == 0
    assert got[("safepoint_failures_total", (("kind", "corrupt"),))] == 1
    assert got[("safepoint_replication_lag_seconds_count", ())] == 1  # only the verified one
    assert got[("safepoint_replication_lag_seconds_bucket", (("le", "+Inf"),))] == 1
    assert got[("safepoint_replicated_bytes_total", ())] == uploaded + 1000
    assert got[("safepoint_replication_throughput_bytes_per_second", (("run", "m"),))] == 500.0
    assert got[("safepoint_checkpoint_window_memory_available_min_ratio", ())] == pytest.approx(0.2)
    assert got[("safepoint_checkpoint_window_open", ())] == 0
    if Path("/proc/meminfo").exists():
        assert 0 < got[("safepoint_host_memory_available_ratio", ())] <= 1


def test_memory_ratio_and_sampler(tmp_path):
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    250 kB\n")
    assert metrics.memory_available_ratio(str(fake)) == 0.25
    assert metrics.memory_available_ratio(str(tmp_path / "absent")) is None
    if Path("/proc/meminfo").exists():
        with metrics.MemorySampler(interval_s=0.01) as s:
            _ = bytearray(10 * 2**20)
        assert s.min_ratio is not None and 0 < s.min_ratio <= 1


def test_documented_alert_rules_are_valid_yaml_with_the_25_percent_rule():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "alerts.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", doc, re.S).group(1)
    rules = yaml.safe_load(block)["groups"][0]["rules"]
    by_name = {r["alert"]: r for r in rules}
    low = by_name["SafepointLowMemoryDuringCheckpoint"]
    assert "safepoint_host_memory_available_ratio < 0.25" in low["expr"]
    assert "safepoint_checkpoint_window_open == 1" in low["expr"]
    exported = {f.name for f in text_string_to_metric_families(
        "# TYPE safepoint_host_memory_available_ratio gauge\nsafepoint_host_memory_available_ratio 0.5\n")}
    assert exported == {"safepoint_host_memory_available_ratio"}
    for r in rules:  # every rule names only metrics this module exports
        for name in re.findall(r"safepoint_[a-z_]+", r["expr"]):
            base = re.sub(r"_(bucket|count|sum)$", "", name)
            assert base in metrics.__doc__ or base.removesuffix("_total") in metrics.__doc__, name


def test_progress_hook_is_routed_to_the_bar_and_restored():
    from rich.console import Console

    assert progress_.hook() is None
    seen = []
    with progress_.bar("x", 100, Console(file=open("/dev/null", "w"), force_terminal=False)):  # noqa: SIM115
        hook = progress_.hook()
        assert hook is not None
        hook(40)
        seen.append(hook)
    assert progress_.hook() is None
    with progress_.bar("x", 1, enabled=False):
        assert progress_.hook() is None
