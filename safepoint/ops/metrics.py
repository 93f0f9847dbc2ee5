"""Prometheus metrics: computed from the catalog at scrape time, plus live host memory.

Flows run in many processes (a runner starts one per flow run, on many hosts), so in-process
counters would be scattered and lost. The catalog already records every state change, replica
result and finished ingest (`ingest.done` events, with bytes, seconds and memory headroom), so a
collector derives the metrics from it: any process that can read the catalog (`safepoint serve
--metrics-port`, `safepoint metrics`) exports the same numbers. See docs/alerts.md for rules.

Metrics:
- `safepoint_checkpoints{state}`: checkpoints by state;
- `safepoint_checkpoint_window_open`: 1 while a checkpoint is between commit and a final state;
- `safepoint_replication_lag_seconds`: histogram, commit marker -> `verified`, per checkpoint;
- `safepoint_replicated_bytes_total`, `safepoint_replication_throughput_bytes_per_second` (last
  ingest per run), `safepoint_ingest_seconds` (histogram);
- `safepoint_failures_total{kind}`: checkpoints turned corrupt/invalid/incomplete, replicas
  failed/corrupt;
- `safepoint_consistency_findings_total{rule}`: consistency findings (stale_optimizer, stale_weights,
  duplicate, torn; failing or warning) of every validation (safepoint.rules.consistency);
- `safepoint_host_memory_available_ratio`: MemAvailable / MemTotal now, and
  `safepoint_checkpoint_window_memory_available_min_ratio`: the lowest value an ingest saw.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from safepoint.catalog.store import open_catalog
from safepoint.core.states import CheckpointState as CS
from safepoint.rules.consistency import RULES

LAG_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600, 7200)
INGEST_BUCKETS = LAG_BUCKETS
WINDOW_STATES = frozenset({CS.COMMITTED, CS.REPLICATING, CS.REPLICATED, CS.VALIDATING})
BAD_STATES = ("corrupt", "invalid", "incomplete")


def memory_available_ratio(meminfo: str = "/proc/meminfo") -> float | None:
    """MemAvailable / MemTotal from /proc/meminfo (None where there is no such file)."""
    try:
        with open(meminfo) as f:
            fields = {k.strip(): v for k, _, v in (line.partition(":") for line in f)}
        total = int(fields["MemTotal"].split()[0])
        avail = int(fields["MemAvailable"].split()[0])
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return avail / total if total else None


class MemorySampler:
    """Track the lowest memory headroom while a block runs (a checkpoint window), from a thread."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.min_ratio: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def _sample(self) -> None:
        r = memory_available_ratio()
        if r is not None and (self.min_ratio is None or r < self.min_ratio):
            self.min_ratio = r

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> MemorySampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sample()


def _histogram(name: str, doc: str, values: list[float], buckets: tuple[float, ...]) -> HistogramMetricFamily:
    counts = [sum(1 for v in values if v <= b) for b in buckets]
    pairs = [(str(float(b)), c) for b, c in zip(buckets, counts)] + [("+Inf", len(values))]
    return HistogramMetricFamily(name, doc, buckets=pairs, sum_value=float(sum(values)))


def _seconds(a: datetime, b: datetime) -> float:
    return max(0.0, (b - a).total_seconds())


class CatalogCollector(Collector):
    """Collect Safepoint's metrics from a catalog on each scrape (a few queries)."""

    def __init__(self, catalog_url: str | None = None):
        self.catalog_url = catalog_url

    def collect(self) -> Iterator[Any]:
        catalog = open_catalog(self.catalog_url)
        views = catalog.list_checkpoints()
        by_state = GaugeMetricFamily("safepoint_checkpoints", "Checkpoints by state", labels=["state"])
        counts = {s.value: 0 for s in CS}
        for v in views:
            counts[v.state.value] += 1
        for state, n in counts.items():
            by_state.add_metric([state], n)
        yield by_state
        yield GaugeMetricFamily("safepoint_checkpoint_window_open",
                                "1 while some checkpoint is between its commit marker and a final state",
                                value=1 if any(v.state in WINDOW_STATES for v in views) else 0)

        created = {v.id: v.created_at for v in views}
        lags: list[float] = []
        failures = {k: 0 for k in (*BAD_STATES, "replica_failed", "replica_corrupt", "ingest_error")}
        seen_verified: set[int] = set()
        for e in catalog.events(kind="state"):
            to, cid = e["detail"].get("to"), e["checkpoint_id"]
            if to == CS.VERIFIED.value and cid in created and cid not in seen_verified:
                seen_verified.add(cid)
                lags.append(_seconds(created[cid], e["at"]))
            elif to in BAD_STATES:
                failures[to] += 1
        for e in catalog.events(kind="replica"):
            state = e["detail"].get("state")
            if state in ("failed", "corrupt"):
                failures[f"replica_{state}"] += 1
        yield _histogram("safepoint_replication_lag_seconds",
                         "Seconds from a checkpoint's commit marker to its verified state", lags, LAG_BUCKETS)

        total_bytes = 0
        durations: list[float] = []
        last_by_run: dict[str, dict[str, Any]] = {}
        min_mem: float | None = None
        for e in catalog.events(kind="ingest.done"):
            d = e["detail"]
            total_bytes += int(d.get("bytes_uploaded") or 0)
            if d.get("seconds") is not None:
                durations.append(float(d["seconds"]))
            if d.get("run"):
                last_by_run[d["run"]] = d
            if d.get("error"):
                failures["ingest_error"] += 1
            m = d.get("memory_available_min_ratio")
            if m is not None:
                min_mem = m if min_mem is None else min(min_mem, float(m))
        yield CounterMetricFamily("safepoint_replicated_bytes", "Bytes uploaded to destinations by ingests",
                                  value=total_bytes)
        yield _histogram("safepoint_ingest_seconds", "Wall time of ingest flow runs", durations, INGEST_BUCKETS)
        tput = GaugeMetricFamily("safepoint_replication_throughput_bytes_per_second",
                                 "Upload throughput of the last ingest of each run", labels=["run"])
        for run, d in sorted(last_by_run.items()):
            if d.get("throughput_bps") is not None:
                tput.add_metric([run], float(d["throughput_bps"]))
        yield tput
        consistency = CounterMetricFamily("safepoint_consistency_findings", "Consistency findings by rule (stale "
                                          "optimizer, stale weights, duplicate, torn), failing or warning",
                                          labels=["rule"])
        by_rule = dict.fromkeys(RULES, 0)
        for e in catalog.events(kind="validation"):
            for rule in e["detail"].get("consistency") or []:
                by_rule[rule] = by_rule.get(rule, 0) + 1
        for rule, n in by_rule.items():
            consistency.add_metric([rule], n)
        yield consistency
        fail = CounterMetricFamily("safepoint_failures", "Failures by kind", labels=["kind"])
        for kind, n in failures.items():
            fail.add_metric([kind], n)
        yield fail
        if min_mem is not None:
            yield GaugeMetricFamily("safepoint_checkpoint_window_memory_available_min_ratio",
                                    "Lowest MemAvailable/MemTotal any ingest saw while it ran", value=min_mem)
        now = memory_available_ratio()
        if now is not None:
            yield GaugeMetricFamily("safepoint_host_memory_available_ratio",
                                    "MemAvailable / MemTotal of this host, now", value=now)


def registry(catalog_url: str | None = None) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(CatalogCollector(catalog_url))
    return reg


def render(catalog_url: str | None = None) -> bytes:
    """The Prometheus text exposition of every metric, once."""
    return generate_latest(registry(catalog_url))


def serve(port: int, catalog_url: str | None = None, addr: str = "127.0.0.1") -> None:
    """Export the metrics over HTTP from a daemon thread (for `safepoint serve --metrics-port`)."""
    start_http_server(port, addr=addr, registry=registry(catalog_url))
