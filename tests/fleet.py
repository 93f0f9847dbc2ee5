"""A simulated fleet on Prefect's own workers, for tests/test_fleet.py and bench/fleet.py.

Everything as a deployment would run it, on one machine:
- a `prefect server start` whose database is a fresh PostgreSQL database (createdb, dropped at
  the end), and a catalog in a second fresh PostgreSQL database, shared by every node;
- a process work pool `safepoint`; per node, `prefect deploy --prefect-file prefect-fleet.yaml`
  (deployment `ingest-NODE`, work queue NODE, a trigger on that node's events), a
  `prefect worker start --work-queue NODE` and a `safepoint watch ROOT --emit` on the node's own
  root, each with the node's own SAFEPOINT_HOME;
- the automation of automations/crash-zombie-runs.yaml (runs that stop sending heartbeats are
  Crashed), with `within` set by the caller.

Every process is started in its own session and stopped by process group; `close()` stops them
all, then the server, then drops both databases.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from tests.prefect_server import PrefectServer, stop_groups

REPO = Path(__file__).resolve().parents[1]
PG_HOST, PG_PORT, PG_USER = "127.0.0.1", "5432", "postgres"
POOL = "safepoint"


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


class Fleet:
    def __init__(self, base: Path, nodes: list[str], *, zombie_within_s: float = 90.0, heartbeat_s: int = 30,
                 query_s: float = 1.0, worker_limit: int = 4, server_settings: dict[str, str] | None = None):
        self.base = Path(base)
        self.nodes = list(nodes)
        tag = uuid.uuid4().hex[:10]
        self.prefect_db, self.catalog_db = f"sp_fleet_prefect_{tag}", f"sp_fleet_catalog_{tag}"
        self.server = PrefectServer(
            self.base / "prefect", database_url=f"postgresql+asyncpg://{PG_USER}@{PG_HOST}:{PG_PORT}/{self.prefect_db}",
            settings={"PREFECT_SERVER_EVENTS_PROACTIVE_GRANULARITY": "PT2S", **(server_settings or {})})
        self.catalog_url = f"postgresql+psycopg://{PG_USER}@{PG_HOST}:{PG_PORT}/{self.catalog_db}"
        self.durable_dir = self.base / "durable"
        self.durable = self.durable_dir.as_uri()
        self.zombie_within_s, self.heartbeat_s, self.query_s = zombie_within_s, heartbeat_s, query_s
        self.worker_limit = worker_limit
        self.workers: dict[str, subprocess.Popen] = {}
        self.watchers: dict[str, subprocess.Popen] = {}
        self._procs: list[subprocess.Popen] = []
        self._dbs: list[str] = []
        self.timings: dict[str, float] = {}

    # -- places and environments ------------------------------------------------------------------

    def root(self, node: str) -> Path:
        """The node's NVMe root (what its trainer writes and its watcher watches)."""
        return self.base / "nodes" / node / "nvme"

    def env(self, node: str | None = None) -> dict[str, str]:
        env = dict(os.environ, **self.server.env())
        env.pop("SAFEPOINT_CONFIG", None)
        home = self.base / "nodes" / (node or "admin") / "home"
        home.mkdir(parents=True, exist_ok=True)
        env.update({"SAFEPOINT_HOME": str(home), "SAFEPOINT_CATALOG_URL": self.catalog_url,
                    "SAFEPOINT_SOURCE_DIR": str(REPO), "PREFECT_LOGGING_LEVEL": "WARNING",
                    "PREFECT_WORKER_QUERY_SECONDS": str(self.query_s),
                    "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(self.heartbeat_s)})
        if node:
            env["SAFEPOINT_NODE"] = node
        return env

    def log(self, name: str) -> str:
        p = self.base / f"{name}.log"
        return p.read_text(errors="replace")[-4000:] if p.exists() else ""

    def logs(self) -> str:
        names = [f"{k}-{n}" for n in self.nodes for k in ("worker", "watch")]
        server = self.server.log.read_text(errors="replace")[-3000:] if self.server.log.exists() else ""
        return "\n".join(f"--- {n}.log\n{self.log(n)}" for n in names) + f"\n--- prefect server\n{server}"

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
        self.server.start(timeout_s=180)
        self.timings["server"] = time.monotonic() - t0
        self.prefect("work-pool", "create", POOL, "--type", "process")
        self.deploy(self.nodes)
        self.create_zombie_automation()
        self.timings["deploy"] = time.monotonic() - t0 - self.timings["server"]
        for n in self.nodes:
            self.start_worker(n)
            self.start_watcher(n)

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
        self.server.stop()
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
            async with PrefectClient(api=self.server.url) as c:
                return await coro_fn(c)

        return asyncio.run(go())

    def events(self, name: str, resource_id: str) -> list[dict]:
        """Events named `name` about one resource, from this fleet's server."""
        import httpx

        flt = {"event": {"name": [name]}, "resource": {"id": [resource_id]}}
        r = httpx.post(f"{self.server.url}/events/filter", json={"filter": flt, "limit": 50}, timeout=10)
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
