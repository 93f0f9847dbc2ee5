"""Fan-out: batching (pure, tables and properties) and verification spread over a local Dask cluster."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from safepoint import commit
from safepoint.core.config import Config
from safepoint.core.errors import UsageError
from safepoint.core.format import FileEntry
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.flows import fanout
from safepoint.ops.ingest import ingest
from safepoint.rules.batching import batches


def files(*sizes: int) -> list[FileEntry]:
    return [FileEntry(f"f{i:03d}", s, "0" * 64) for i, s in enumerate(sizes)]


@pytest.mark.parametrize(("sizes", "batch_bytes", "batch_files", "expected"), [
    ((), 10, 10, []),
    ((1, 1, 1), 10, 10, [3]),              # everything fits in one batch
    ((5, 5, 5, 5), 10, 10, [2, 2]),        # by bytes
    ((1,) * 7, 100, 3, [3, 2, 2]),         # by count: ceil(7/3) = 3 batches, balanced
    ((100, 1, 1), 10, 10, None),           # a file larger than a batch still gets scheduled
])
def test_batches_table(sizes, batch_bytes, batch_files, expected):
    out = batches(files(*sizes), batch_bytes, batch_files)
    if expected is not None:
        assert sorted(len(b) for b in out) == sorted(expected)
    assert sorted(f.path for b in out for f in b) == [f.path for f in files(*sizes)]


@given(st.lists(st.integers(0, 10**6), max_size=60), st.integers(1, 3 * 10**6), st.integers(1, 20))
@settings(max_examples=200, deadline=None)
def test_batches_properties(sizes, batch_bytes, batch_files):
    fs = files(*sizes)
    out = batches(fs, batch_bytes, batch_files)
    assert sorted(f.path for b in out for f in b) == [f.path for f in fs]       # a partition
    assert all(b for b in out) and all(len(b) <= batch_files for b in out)
    assert out == batches(list(reversed(fs)), batch_bytes, batch_files)  # deterministic
    total = sum(sizes)
    if fs:
        assert len(out) <= min(len(fs), max(1, -(-total // batch_bytes), -(-len(fs) // batch_files)))
    else:
        assert out == []


def test_runner_is_chosen_in_config(monkeypatch):
    from prefect.task_runners import ThreadPoolTaskRunner

    assert isinstance(fanout.task_runner(Config()), ThreadPoolTaskRunner)  # the embedded default
    pytest.importorskip("prefect_dask")
    from prefect_dask import DaskTaskRunner

    assert isinstance(fanout.task_runner(Config(sections={"fanout": {"runner": "dask"}})), DaskTaskRunner)
    monkeypatch.setenv("SAFEPOINT_FANOUT_RUNNER", "ray?")
    with pytest.raises(UsageError):
        fanout.task_runner(Config())


@pytest.fixture
def dask_cluster():
    distributed = pytest.importorskip("distributed")
    pytest.importorskip("prefect_dask")
    from distributed.diagnostics.task_stream import TaskStreamPlugin

    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  host="127.0.0.1") as cluster:
        stream = TaskStreamPlugin(cluster.scheduler)
        cluster.scheduler.add_plugin(stream)
        yield cluster, stream


def test_verification_fans_out_over_two_dask_workers(tmp_path, prefect_api, sqlite_catalog_url, sqlite_catalog,
                                                     safepoint_home, dask_cluster):
    from safepoint.flows.scrub import verify_fanout

    cluster, stream = dask_cluster
    (safepoint_home / "config.toml").write_text(
        f'[fanout]\nrunner = "dask"\naddress = "{cluster.scheduler_address}"\nbatch_files = 2\n')
    folder = tmp_path / "nvme" / "big"
    folder.mkdir(parents=True)
    for i in range(8):
        torch.save({"w": torch.full((64,), float(i))}, folder / f"shard-{i}.pt")
    commit(folder, "fan", 1)
    durable = (tmp_path / "durable").as_uri()
    assert ingest(folder, [durable], sqlite_catalog, Config()).state is CS.VERIFIED

    out = verify_fanout(f"{durable}/fan/1", catalog_url=sqlite_catalog_url)
    assert (out["outcome"], out["batches"]) == ("verified", 4)
    ran = [e for e in stream.buffer if "verify" in str(e.get("key", ""))]
    assert len(ran) >= 4 and len({e["worker"] for e in ran}) == 2  # both workers hashed batches

    # Rot in the replica is found by the fanned-out hashing and recorded.
    victim = tmp_path / "durable" / "fan" / "1" / "shard-5.pt"
    data = bytearray(victim.read_bytes())
    data[10] ^= 1
    victim.write_bytes(bytes(data))
    out = verify_fanout(f"{durable}/fan/1", catalog_url=sqlite_catalog_url)
    assert out["outcome"] == "corrupt" and "shard-5.pt" in out["summary"]
    (rep,) = sqlite_catalog.replicas(sqlite_catalog.get("fan", 1).id)
    assert rep.state is RS.CORRUPT

    # A local snapshot folder fans out the same way.
    out = verify_fanout(str(folder), catalog_url=sqlite_catalog_url)
    assert (out["outcome"], out["batches"]) == ("verified", 4)
