"""Safepoint as a Prefect user sees it, on a real `prefect server start` (SQLite under a temporary PREFECT_HOME).

Done-when of issue 24 (part 2):
- after real ingests with credentials in `--to s3://KEY:SECRET@bucket/p` and `--catalog
  postgresql://u:PASSWORD@host/db`, no secret is in Prefect's database files (WAL included) or its
  log, while the flow runs' parameters are there (by reference);
- an `S3Bucket` block (prefect-aws) is a destination, `--to block:NAME/sub`, against SeaweedFS with
  no AWS variable in the environment;
- the proactive automation (committed, no verified within N s) fires within a short window (10 s,
  Prefect's floor), for the unverified checkpoints only; the reactive one for an invalid one.

One server for the module, stopped at the end; SeaweedFS is the session's (tests/conftest_s3.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from safepoint import commit
from tests.helpers_ckpt import make_safetensors_ckpt
from tests.prefect_server import PrefectServer, stop_group

pytestmark = [pytest.mark.slow, pytest.mark.s3]

AWS_VARS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = PrefectServer(tmp_path_factory.mktemp("prefect-home"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client_env(server, monkeypatch, tmp_path):
    """This process as a client of the module's server (for the Prefect client calls of the test).

    The environment alone is not enough: a session fixture's `prefect_test_harness` holds a settings
    context naming its own server, and that context wins over the environment in this process."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SAFEPOINT_HOME", str(tmp_path / "home"))
    with temporary_settings({PREFECT_API_URL: server.url}):
        yield server


def cli_env(server: PrefectServer, home: Path, drop_aws: tuple[str, ...] = ()) -> dict[str, str]:
    env = {**os.environ, **server.env(), "SAFEPOINT_HOME": str(home), "PREFECT_LOGGING_TO_API_ENABLED": "true"}
    for k in (*drop_aws, "SAFEPOINT_CONFIG"):
        env.pop(k, None)
    return env


def cli(server: PrefectServer, home: Path, *args: str, drop_aws: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "safepoint.cli", *args], env=cli_env(server, home, drop_aws),
                          capture_output=True, text=True, timeout=300)


def snapshot(base: Path, run: str, step: int) -> Path:
    folder = base / run / f"s{step}"
    make_safetensors_ckpt(folder, seed=step)
    commit(folder, run, step)
    return folder


def flow_run_parameters(server: PrefectServer) -> list[dict]:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def read() -> list[dict]:
        async with get_client() as c:
            return [r.parameters for r in await c.read_flow_runs()]

    with temporary_settings({PREFECT_API_URL: server.url}):  # this module's server, whatever ran before
        return asyncio.run(read())


def global_limit(server: PrefectServer, name: str):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.url}), get_client(sync_client=True) as c:
        return c.read_global_concurrency_limit_by_name(name)


def test_no_secret_reaches_prefects_database(client_env, s3_env, postgres_catalog_url, tmp_path):
    server = client_env
    key, secret, pg_password = (f"AKIA{uuid.uuid4().hex[:16].upper()}", f"sEcReT{uuid.uuid4().hex}",
                                f"pgPw{uuid.uuid4().hex}")
    dest = f"s3://{key}:{secret}@{s3_env.bucket}/{s3_env.prefix}/ckpt"
    assert "postgres@" in postgres_catalog_url  # trust auth: the password is carried, never checked
    catalog = postgres_catalog_url.replace("postgres@", f"postgres:{pg_password}@", 1)
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text("[limits]\nuploads_per_host = 3\n")
    for step in (1, 2):
        # No AWS keys in the environment: the URL's own keys must be what reaches the store.
        r = cli(server, home, "--catalog", catalog, "ingest", str(snapshot(tmp_path / "nvme", "sec", step)),
                "--to", dest, "--json", drop_aws=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))
        assert r.returncode == 0, r.stdout + r.stderr
        result = json.loads(r.stdout)
        assert result["state"] == "verified"
        assert [x["url"] for x in result["replicas"]] == [f"s3://{s3_env.bucket}/{s3_env.prefix}/ckpt/sec/{step}"]
        for text in (r.stdout, r.stderr):
            assert secret not in text and pg_password not in text

    # `watch --emit`: the event's payload names the destination by reference too.
    root = tmp_path / "watched"
    snapshot(root, "sec", 3)
    log = tmp_path / "watch.log"
    with open(log, "wb") as out:  # no deployment here: the watcher emits, then waits for a run; stopped below
        watcher = subprocess.Popen([sys.executable, "-m", "safepoint.cli", "--catalog", catalog, "watch", str(root),
                                    "--emit", "--to", dest, "--spool", str(tmp_path / "spool"), "--interval", "1"],
                                   env=cli_env(server, home), stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline, committed = time.monotonic() + 120, []
        while time.monotonic() < deadline and not committed and watcher.poll() is None:
            time.sleep(1)
            committed = events(server, "safepoint.checkpoint.committed", "safepoint.checkpoint.sec.3")
    finally:
        stop_group(watcher)
    assert committed, log.read_text()
    assert secret not in log.read_text()

    # The runs are in Prefect's database, named by reference: the grep below looks where parameters live.
    params = [p for p in flow_run_parameters(server) if "snapshot" in p]
    assert len(params) == 2
    for p in params:
        assert p["to"][0].startswith("s3://safepoint-ref-") and p["catalog_url"].startswith(
            "postgresql+psycopg://safepoint-ref-")
    assert committed[0]["payload"]["to"] == params[0]["to"]  # the same reference: sealing is deterministic
    refs = home / "credentials"
    assert stat.S_IMODE(refs.stat().st_mode) == 0o700
    sealed = [f for f in refs.iterdir() if not f.name.startswith(".")]
    assert sorted(f.read_text() for f in sealed) == sorted([dest, catalog])
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in refs.iterdir())

    # Events reach the database a moment after the runs end (in batches): wait for the last ones,
    # each ingest's verdict and its run's final state, before reading the files.
    def persisted() -> bool:
        verdicts = {e["resource"]["prefect.resource.id"] for e in events(server, "safepoint.checkpoint.verified")}
        return ({"safepoint.checkpoint.sec.1", "safepoint.checkpoint.sec.2"} <= verdicts
                and len(events(server, "prefect.flow-run.Completed")) >= 2)

    deadline = time.monotonic() + 60
    while not persisted() and time.monotonic() < deadline:
        time.sleep(0.5)
    files = [f for f in server.home.rglob("*") if f.is_file()]
    db = [f for f in files if f.name.startswith("prefect.db")]
    assert any(f.name.endswith("-wal") for f in db) or db
    seen_ref = False
    for f in files:
        data = f.read_bytes()
        seen_ref = seen_ref or b"safepoint-ref-" in data
        for s in (secret, pg_password, key):
            assert s.encode() not in data, f"{s[:6]}... found in {f}"
    assert seen_ref  # the parameters were written to these files
    verdicts = {e["resource"]["prefect.resource.id"] for e in events(server, "safepoint.checkpoint.verified")}
    assert {"safepoint.checkpoint.sec.1", "safepoint.checkpoint.sec.2"} <= verdicts
    # The uploads per host were a Prefect global concurrency limit ([limits] uploads_per_host), all released.
    limit = global_limit(server, f"safepoint-uploads-{socket.gethostname()}")
    assert (limit.limit, limit.active_slots) == (3, 0)


def test_the_upload_slot_is_prefects_held_renewed_and_released(client_env, monkeypatch):
    """tasks/host_slot.py: the slot is a lease on Prefect's global limit, renewed while held, freed after;
    with every slot taken the next one waits as the server says and then gives up with LeaseBusy."""
    from prefect.client.orchestration import SyncPrefectClient

    from safepoint.ops.leases import LeaseBusy
    from safepoint.tasks import host_slot as hs

    server, name = client_env, f"safepoint-uploads-t{uuid.uuid4().hex[:8]}"
    renewed: list[int] = []
    real_renew = SyncPrefectClient.renew_concurrency_lease
    monkeypatch.setattr(SyncPrefectClient, "renew_concurrency_lease",
                        lambda self, **kw: renewed.append(real_renew(self, **kw).status_code))
    monkeypatch.setattr(hs, "RENEW_FRACTION", 0.5 / 60)  # every 0.5 s of a 60 s lease
    with hs.host_slot(name, 1, wait_s=10, lease_s=60):
        assert (global_limit(server, name).limit, global_limit(server, name).active_slots) == (1, 1)
        t0 = time.monotonic()
        with pytest.raises(LeaseBusy, match="all 1 slots stayed busy for 1s"), hs.host_slot(name, 1, wait_s=1.0):
            pytest.fail("a second holder of a one-slot limit")
        assert 1.0 <= time.monotonic() - t0 < 6
        time.sleep(0.6)
    assert renewed and set(renewed) == {204}
    assert global_limit(server, name).active_slots == 0
    with hs.host_slot(name, 2, wait_s=5):  # resized, and free again
        assert (global_limit(server, name).limit, global_limit(server, name).active_slots) == (2, 1)


def save_bucket_block(s3_env) -> str:
    """An `S3Bucket` block (prefect-aws) for the test's prefix of the session's SeaweedFS; returns its name."""
    from prefect_aws import AwsCredentials, S3Bucket
    from prefect_aws.credentials import AwsClientParameters

    name = f"ckpt-{uuid.uuid4().hex[:8]}"
    creds = AwsCredentials(aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                           aws_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1",
                           aws_client_parameters=AwsClientParameters(endpoint_url=s3_env.server.endpoint))
    S3Bucket(bucket_name=s3_env.bucket, bucket_folder=s3_env.prefix, credentials=creds).save(name)
    return name


def test_s3_bucket_block_is_a_destination(client_env, s3_env, tmp_path):
    """`--to block:NAME/sub`: bucket, folder, keys and endpoint from prefect-aws blocks; no AWS variable set."""
    server = client_env
    name = save_bucket_block(s3_env)
    cat = f"sqlite:///{tmp_path / 'catalog.db'}"
    folder = snapshot(tmp_path / "nvme", "blk", 3)
    r = cli(server, tmp_path / "home", "--catalog", cat, "ingest", str(folder), "--to", f"block:{name}/ckpt",
            "--json", drop_aws=AWS_VARS)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout)
    assert result["state"] == "verified"
    # The catalog names the block, so later operations open it through the block (test_hostile_round4_block.py).
    assert [x["url"] for x in result["replicas"]] == [f"block://{name}/ckpt/blk/3"]
    keys = [o["Key"] for o in s3_env.server.client().list_objects_v2(
        Bucket=s3_env.bucket, Prefix=f"{s3_env.prefix}/ckpt/")["Contents"]]
    assert any(k.endswith("model.safetensors") for k in keys)

    r = cli(server, tmp_path / "home", "--catalog", cat, "ingest", str(folder), "--to", "block:no-such-block/x",
            drop_aws=AWS_VARS)
    assert r.returncode == 2 and "no-such-block" in r.stderr


def events(server: PrefectServer, prefix: str, resource_id: str | None = None) -> list[dict]:
    """Events whose name starts with `prefix` (of one resource), from the server's API (oldest first)."""
    import httpx

    flt: dict = {"event": {"prefix": [prefix]}}
    if resource_id:
        flt["resource"] = {"id": [resource_id]}
    r = httpx.post(f"{server.url}/events/filter", json={"filter": flt, "limit": 50}, timeout=10)
    r.raise_for_status()
    return sorted(r.json()["events"], key=lambda e: e["occurred"])


def emit(*evs: tuple[str, str]) -> None:
    from prefect.events import Event
    from prefect.events.clients import get_events_client

    from safepoint.events.markers import resource

    async def send() -> None:
        async with get_events_client() as c:
            for name, res in evs:
                run, _, step = res.removeprefix("safepoint.checkpoint.").rpartition(".")
                await c.emit(Event(event=name, resource=resource(run, int(step), "n1")))

    asyncio.run(send())


def test_shipped_automations_fire(client_env, tmp_path):
    server = client_env
    r = cli(server, tmp_path / "home", "automations", "apply", "--within", "10")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "created automation safepoint-checkpoint-not-verified" in r.stdout
    again = cli(server, tmp_path / "home", "automations", "apply", "--within", "10")  # by name: no duplicates
    assert again.returncode == 0 and "updated automation safepoint-checkpoint-not-verified" in again.stdout
    ident = again.stdout.split("safepoint-checkpoint-not-verified (", 1)[1].split(")", 1)[0]
    rejected = again.stdout.split("safepoint-checkpoint-rejected (", 1)[1].split(")", 1)[0]

    run = f"auto-{uuid.uuid4().hex[:8]}"
    stuck, fine, bad, last = (f"safepoint.checkpoint.{run}.{n}" for n in (1, 2, 3, 4))
    # `last` is committed after `fine` and never verified: once it has fired, `fine`'s window (opened
    # before it) has closed too, and `fine` must not have fired (no fixed sleep for that window).
    emit(("safepoint.checkpoint.committed", stuck), ("safepoint.checkpoint.committed", fine),
         ("safepoint.checkpoint.verified", fine), ("safepoint.checkpoint.invalid", bad),
         ("safepoint.checkpoint.committed", last))

    def fired() -> list[str]:
        return sorted(e["payload"]["triggering_labels"]["prefect.resource.id"]
                      for e in events(server, "prefect.automation.triggered", f"prefect.automation.{ident}")
                      if run in e["payload"]["triggering_labels"]["prefect.resource.id"])

    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and last not in fired():
        time.sleep(1)
    assert stuck in fired() and last in fired(), "the proactive automation did not fire"
    assert fired() == sorted([stuck, last])  # not for the verified checkpoint, not twice
    # The reactive one: the invalid checkpoint, and only it.
    assert [e["payload"]["triggering_labels"]["prefect.resource.id"]
            for e in events(server, "prefect.automation.triggered", f"prefect.automation.{rejected}")] == [bad]
