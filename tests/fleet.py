"""A simulated fleet on Prefect, for tests/test_fleet.py, tests/test_prefect_ha.py and bench/fleet.py.

Everything as a deployment would run it, on one machine:
- Prefect: one `prefect server start` whose database is a fresh PostgreSQL database (createdb,
  dropped at the end); or, with `api_servers=2`, Prefect scaled out as its self-hosting guide says:
  that many `prefect server start --no-services` on the one database (only the first migrates),
  Redis for messaging, causal ordering, lease storage and the docket (`prefect-redis`; a
  `redis-server` of the fleet's own, on a free port), the background services in a process of
  their own (`prefect server services start`), and a TCP balancer in front (`Balancer`: what a
  load balancer does; a backend that refuses connections is skipped);
- a catalog in a second fresh PostgreSQL database, shared by every node;
- per node, one of two lanes, each with the node's own SAFEPOINT_HOME and root:
  - `warm` (the fleet's default): `safepoint serve --watch ROOT`, one long-lived process that
    ingests the node's parts as ingest flow runs in itself;
  - `deploy`: a process work pool `safepoint`; `prefect deploy --prefect-file prefect-fleet.yaml`
    (deployment `ingest-NODE`, work queue NODE, a trigger on that node's events), a `prefect worker
    start --work-queue NODE` and a `safepoint watch ROOT --emit`; plus the automation of
    automations/crash-zombie-runs.yaml (runs that stop sending heartbeats are Crashed), with
    `within` set by the caller.

Every process is started in its own session and stopped by process group; `close()` stops them
all, then the servers and Redis, then drops both databases.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from tests.prefect_server import QUIET_SERVICES, PrefectServer, free_port, stop_group, stop_groups

REPO = Path(__file__).resolve().parents[1]
PG_HOST, PG_PORT, PG_USER = "127.0.0.1", "5432", "postgres"
POOL = "safepoint"


def ha_settings(redis_url: str) -> dict[str, str]:
    """Prefect's settings for several API servers (docs/v3/advanced/self-hosted.mdx): Redis for events
    messaging, causal ordering, concurrency leases and the docket; a database per purpose on one Redis."""
    return {"PREFECT_SERVER_EVENTS_MESSAGING_BROKER": "prefect_redis.messaging",
            "PREFECT_SERVER_EVENTS_MESSAGING_CACHE": "prefect_redis.messaging",
            "PREFECT_SERVER_EVENTS_CAUSAL_ORDERING": "prefect_redis.ordering",
            "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect_redis.lease_storage",
            "PREFECT_REDIS_MESSAGING_URL": f"{redis_url}/0",
            "PREFECT_SERVER_DOCKET_URL": f"{redis_url}/1"}


def pg(cmd: str, db: str) -> None:
    subprocess.run([cmd, "-h", PG_HOST, "-p", PG_PORT, "-U", PG_USER, *(["--force"] if cmd == "dropdb" else []),
                    *(["--if-exists"] if cmd == "dropdb" else []), db], check=True, capture_output=True, timeout=60)


def pg_reachable() -> bool:
    try:
        subprocess.run(["psql", "-h", PG_HOST, "-p", PG_PORT, "-U", PG_USER, "-Atc", "select 1", "postgres"],
                       check=True, capture_output=True, timeout=10)
        return True
    except (OSError, subprocess.SubprocessError):
        return False


def require(ok: bool, why: str, flag: str) -> None:
    """Skip the test when a service is missing, or fail it where `flag` is set to 1 (CI, .ci/run)."""
    if not ok:
        import pytest

        if os.environ.get(flag) == "1":
            pytest.fail(why)
        pytest.skip(why)


def require_postgres() -> None:
    require(pg_reachable(), f"PostgreSQL unreachable at {PG_HOST}:{PG_PORT} (psql)", "SAFEPOINT_REQUIRE_POSTGRES")


class Balancer:
    """A TCP round robin in front of the API servers, as a load balancer: each new connection goes to
    the next backend that accepts it; a dead one is skipped. A connection whose backend dies is
    closed, so the client retries on a fresh one (Prefect's client retries reads and resets)."""

    def __init__(self, backends: list[int]):
        self.backends = list(backends)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/api"
        self._next = 0
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="balancer", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            start = self._next
            self._next += 1
        for k in range(len(self.backends)):
            try:
                back = socket.create_connection(("127.0.0.1", self.backends[(start + k) % len(self.backends)]), 2)
                break
            except OSError:
                continue
        else:
            conn.close()
            return
        back.settimeout(None)
        threading.Thread(target=self._pump, args=(back, conn), daemon=True).start()
        self._pump(conn, back)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sk in (src, dst):
            try:
                sk.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sk.close()

    def close(self) -> None:
        self._closed = True
        self.sock.close()


class Redis:
    """A `redis-server` of the fleet's own (no persistence): restartable, on a port no one else uses."""

    def __init__(self, home: Path):
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30) -> None:
        with open(self.home / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                          "--save", "", "--appendonly", "no", "--dir", str(self.home)],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), 1) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"redis-server on {self.port} did not answer")

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace_s=5)
            self.proc = None


class ApiServer(PrefectServer):
    """`prefect server start --no-services`: one of several API servers on one database and Redis."""

    def start(self, timeout_s: float = 120.0) -> None:
        env = dict(os.environ, **self.env())
        env.update({"PREFECT_SERVER_DATABASE_CONNECTION_URL": self.database_url, "PREFECT_SERVER_UI_ENABLED": "false",
                    "PREFECT_SERVER_LOGGING_LEVEL": "WARNING", **self.settings})
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port),
                 "--no-ui", "--analytics-off", "--no-services"],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect API server exited: {self.log.read_text()[-3000:]}")
            if self.healthy():
                return
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"prefect API server not healthy after {timeout_s}s: {self.log.read_text()[-3000:]}")


class Fleet:
    def __init__(self, base: Path, nodes: list[str], *, zombie_within_s: float = 90.0, heartbeat_s: int = 30,
                 query_s: float = 1.0, worker_limit: int = 4, server_settings: dict[str, str] | None = None,
                 lane: str = "deploy", api_servers: int = 1):
        assert lane in ("deploy", "warm"), lane
        self.base = Path(base)
        self.nodes = list(nodes)
        self.lane = lane
        tag = uuid.uuid4().hex[:10]
        self.prefect_db, self.catalog_db = f"sp_fleet_prefect_{tag}", f"sp_fleet_catalog_{tag}"
        prefect_db_url = f"postgresql+asyncpg://{PG_USER}@{PG_HOST}:{PG_PORT}/{self.prefect_db}"
        settings = {"PREFECT_SERVER_EVENTS_PROACTIVE_GRANULARITY": "PT2S", **(server_settings or {})}
        self.redis: Redis | None = None
        self.apis: list[ApiServer] = []
        self.services: subprocess.Popen | None = None
        self.balancer: Balancer | None = None
        if api_servers > 1:
            self.redis = Redis(self.base / "redis")
            settings.update(ha_settings(self.redis.url))
            self.apis = [ApiServer(self.base / f"prefect-api{i}", database_url=prefect_db_url,
                                   settings={**settings, "PREFECT_SERVER_DATABASE_MIGRATE_ON_START": str(i == 0)})
                         for i in range(api_servers)]
        self.server = self.apis[0] if self.apis else PrefectServer(self.base / "prefect", database_url=prefect_db_url,
                                                                    settings=settings)
        self.server_settings = settings
        self.catalog_url = f"postgresql+psycopg://{PG_USER}@{PG_HOST}:{PG_PORT}/{self.catalog_db}"
        self.durable_dir = self.base / "durable"
        self.durable = self.durable_dir.as_uri()
        self.zombie_within_s, self.heartbeat_s, self.query_s = zombie_within_s, heartbeat_s, query_s
        self.worker_limit = worker_limit
        self.workers: dict[str, subprocess.Popen] = {}
        self.watchers: dict[str, subprocess.Popen] = {}
        self.executors: dict[str, subprocess.Popen] = {}
        self._procs: list[subprocess.Popen] = []
        self._dbs: list[str] = []
        self.timings: dict[str, float] = {}

    # -- places and environments ------------------------------------------------------------------

    def root(self, node: str) -> Path:
        """The node's NVMe root (what its trainer writes and its watcher watches)."""
        return self.base / "nodes" / node / "nvme"

    @property
    def api_url(self) -> str:
        return self.balancer.url if self.balancer else self.server.url

    def env(self, node: str | None = None) -> dict[str, str]:
        env = dict(os.environ, **self.server.env())
        env["PREFECT_API_URL"] = self.api_url
        env.pop("SAFEPOINT_CONFIG", None)
        home = self.base / "nodes" / (node or "admin") / "home"
        home.mkdir(parents=True, exist_ok=True)
        env.update({"SAFEPOINT_HOME": str(home), "SAFEPOINT_CATALOG_URL": self.catalog_url,
                    "SAFEPOINT_SOURCE_DIR": str(REPO), "PREFECT_LOGGING_LEVEL": "WARNING",
                    "PREFECT_WORKER_QUERY_SECONDS": str(self.query_s)})
        if self.lane == "deploy":  # the zombie automation's input; the warm lane's liveness is its watcher
            env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = str(self.heartbeat_s)
        if node:
            env["SAFEPOINT_NODE"] = node
        return env

    def log(self, name: str) -> str:
        p = self.base / f"{name}.log"
        return p.read_text(errors="replace")[-4000:] if p.exists() else ""

    def logs(self) -> str:
        names = [f"{k}-{n}" for n in self.nodes for k in ("worker", "watch", "serve")] + ["services"]
        servers = "".join(f"\n--- prefect server {a.port}\n" + a.log.read_text(errors="replace")[-3000:]
                          for a in (self.apis or [self.server]) if a.log.exists())
        return "\n".join(f"--- {n}.log\n{self.log(n)}" for n in names if self.log(n)) + servers

    def _spawn(self, name: str, argv: list[str], node: str | None) -> subprocess.Popen:
        log = open(self.base / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(argv, env=self.env(node), stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO),
                             start_new_session=True)
        self._procs.append(p)
        return p

    def prefect(self, *args: str, node: str | None = None, timeout_s: float = 180) -> str:
        p = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", *args], env=self.env(node), cwd=REPO,
                           capture_output=True, text=True, timeout=timeout_s)
        if p.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)}: exit {p.returncode}\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
        return p.stdout

    # -- the fleet --------------------------------------------------------------------------------

    def start(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        for db in (self.prefect_db, self.catalog_db):
            pg("createdb", db)
            self._dbs.append(db)
        t0 = time.monotonic()
        if self.apis:
            self.start_ha()
        else:
            self.server.start(timeout_s=180)
        self.timings["server"] = time.monotonic() - t0
        if self.lane == "deploy":
            self.prefect("work-pool", "create", POOL, "--type", "process")
            self.deploy(self.nodes)
            self.create_zombie_automation()
        self.timings["deploy"] = time.monotonic() - t0 - self.timings["server"]
        for n in self.nodes:
            if self.lane == "deploy":
                self.start_worker(n)
                self.start_watcher(n)
            else:
                self.start_executor(n)

    def start_ha(self) -> None:
        """Redis, the first API server (it migrates the database), the others and the services, the balancer."""
        self.redis.start()
        self.apis[0].start(timeout_s=180)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(self.apis)) as pool:
            list(pool.map(lambda a: a.start(timeout_s=180), self.apis[1:]))
        self.balancer = Balancer([a.port for a in self.apis])
        self.start_services()

    def start_services(self) -> subprocess.Popen:
        """`prefect server services start`: scheduler, triggers, event persister... in one process of their own."""
        env = self.env()
        env.update({"PREFECT_SERVER_DATABASE_CONNECTION_URL": self.server.database_url,
                    "PREFECT_SERVER_LOGGING_LEVEL": "WARNING", "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5"})
        env.update(self.server_settings)
        env["PREFECT_SERVER_DATABASE_MIGRATE_ON_START"] = "false"
        for name in QUIET_SERVICES:
            env[f"PREFECT_SERVER_SERVICES_{name}_ENABLED"] = "false"
        log = open(self.base / "services.log", "ab")  # noqa: SIM115 - closed with the process
        self.services = subprocess.Popen([sys.executable, "-m", "prefect", "server", "services", "start"], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True)
        self._procs.append(self.services)
        return self.services

    def kill_api(self, i: int) -> None:
        """SIGKILL one API server (its whole process group), as a machine dying would."""
        a = self.apis[i]
        if a.proc is not None:
            os.killpg(a.proc.pid, signal.SIGKILL)
            a.proc.wait(timeout=30)
            a.proc = None

    def start_executor(self, node: str) -> subprocess.Popen:
        """The warm lane: `safepoint serve --watch ROOT`, this node's ingests as flow runs in one process."""
        root = self.root(node)
        root.mkdir(parents=True, exist_ok=True)
        p = self._spawn(f"serve-{node}", [sys.executable, "-m", "safepoint.cli", "serve", "--watch", str(root),
                                          "--to", self.durable, "--poll", "1", "--completeness-every", "10"], node)
        self.executors[node] = p
        return p

    def kill_executor(self, node: str) -> None:
        """SIGKILL the node's warm executor (its process group), as a node losing the process would."""
        p = self.executors.pop(node)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)

    def deploy(self, nodes: list[str]) -> None:
        """`prefect deploy` of prefect-fleet.yaml once per node (in parallel: each is an interpreter)."""
        procs = {n: subprocess.Popen([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file",
                                      "prefect-fleet.yaml", "--all"], env=self.env(n), cwd=REPO, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for n in nodes}
        for n, p in procs.items():
            out, _ = p.communicate(timeout=300)
            if p.returncode != 0:
                raise RuntimeError(f"prefect deploy for {n}: exit {p.returncode}\n{out[-3000:]}")

    def create_zombie_automation(self) -> None:
        import yaml

        spec = yaml.safe_load((REPO / "automations" / "crash-zombie-runs.yaml").read_text())
        spec["trigger"]["within"] = self.zombie_within_s
        self.prefect("automation", "create", "--from-json", json.dumps(spec))

    def start_worker(self, node: str) -> subprocess.Popen:
        p = self._spawn(f"worker-{node}", [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL,
                                           "--work-queue", node, "--type", "process", "--name", f"worker-{node}",
                                           "--limit", str(self.worker_limit)], node)
        self.workers[node] = p
        return p

    def kill_worker(self, node: str) -> list[int]:
        """SIGKILL the node's worker and every process under it, as a node dying would: the flow-run
        processes a process worker starts are in sessions of their own, so a process group is not
        enough. Returns the pids killed."""
        import psutil

        p = self.workers.pop(node)
        try:
            tree = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for proc in tree:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        p.wait(timeout=30)
        psutil.wait_procs(tree, timeout=30)
        return [proc.pid for proc in tree]

    def start_watcher(self, node: str) -> subprocess.Popen:
        root = self.root(node)
        root.mkdir(parents=True, exist_ok=True)
        p = self._spawn(f"watch-{node}", [sys.executable, "-m", "safepoint.cli", "watch", str(root), "--emit",
                                          "--to", self.durable, "--node", node,
                                          "--deployment", f"safepoint-ingest/ingest-{node}",
                                          "--interval", "1", "--retry-max", "2", "--confirm-after", "20"], node)
        self.watchers[node] = p
        return p

    def close(self) -> None:
        import psutil

        stray = []  # flow-run processes of live workers (each in a session of its own)
        for p in self.workers.values():
            try:
                stray += psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        stop_groups(list(reversed(self._procs)), grace_s=5)
        for proc in stray:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if self.balancer is not None:
            self.balancer.close()
        for a in self.apis or [self.server]:
            a.stop()
        if self.redis is not None:
            self.redis.stop()
        from safepoint.catalog import db

        db.dispose(self.catalog_url)
        for name in self._dbs:
            try:
                pg("dropdb", name)
            except subprocess.SubprocessError:
                pass

    # -- looking at it ----------------------------------------------------------------------------

    def catalog(self):
        from safepoint.catalog.store import open_catalog

        return open_catalog(self.catalog_url)

    def state(self, run: str, step: int) -> str | None:
        row = self.catalog().get(run, step)
        return row.state.value if row else None

    def api(self, coro_fn: Callable[..., object]) -> object:
        """`coro_fn(client)` against this fleet's server."""
        import asyncio

        from prefect.client.orchestration import PrefectClient

        async def go():
            async with PrefectClient(api=self.api_url) as c:
                return await coro_fn(c)

        return asyncio.run(go())

    def events(self, name: str, resource_id: str) -> list[dict]:
        """Events named `name` about one resource, from this fleet's server."""
        import httpx

        flt = {"event": {"name": [name]}, "resource": {"id": [resource_id]}}
        r = httpx.post(f"{self.api_url}/events/filter", json={"filter": flt, "limit": 50}, timeout=10)
        r.raise_for_status()
        return r.json()["events"]

    def ingest_runs(self) -> list:
        from prefect.client.schemas.filters import FlowFilter, FlowFilterName

        return self.api(lambda c: c.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["safepoint-ingest"])), limit=200))

    def wait_for(self, what: str, check: Callable[[], object], timeout_s: float, poll_s: float = 0.25) -> object:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = check()
            if got:
                return got
            time.sleep(poll_s)
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{self.logs()}")
