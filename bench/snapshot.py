"""Benchmark: how long a checkpoint save stalls training, Snapshotter against its floor and DCP, in one run.

    flock /tmp/safepoint-bench.lock python bench/snapshot.py [--size 1GiB] [--device auto] [--dir DIR]
                                                            [--repeats 2] [--json OUT.json]

Measures, on one model-and-optimizer-shaped state of --size bytes (bf16; default 1 GiB on CPU,
8 GiB on a GPU), in one process:
  * the floor: copying every tensor into preallocated host buffers (pinned on a GPU) with torch
    copy_ (plus a single-threaded ctypes.memmove on CPU, "a plain memcpy");
  * Snapshotter.save() with a budget >= the state: the stall of the first save (pool allocated up
    front, timed apart) and of repeats, the drain rate of its writer, and the time to committed;
  * Snapshotter.save() with a budget of a quarter of the state: the stall next to the physical
    bound the drain rate implies (the bytes beyond the budget cannot be staged before the writer
    has drained as much: bound = max(S / floor rate, (S - B) / drain rate)), and the pool's peak;
  * dcp.async_save with default settings (stall = until the call returns and staging completed);
  * dcp.async_save with its best stager, BlockingAsyncStager(cache_staged_state_dict=True) (on CPU
    the same stager without pinning, which needs an accelerator), first and repeat, and its time to
    done (its own commit point: .metadata written) and to committed through safepoint's SafepointWriter;
  * synchronous torch.save (and on a GPU, a naive [t.cpu() for t in state]).
Prints a table of stalls with ratios to the floor, and the done-when checks. Saves between repeats
wait for the previous one (checkpoint intervals are much longer than a save).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2**30
MiB = 2**20


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?i?B?)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 1GiB, 512MiB)")
    unit = (m.group(2) or "B").upper().replace("I", "").replace("B", "")
    return int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit])


def make_state(size: int, device: str) -> dict[str, Any]:
    """A model + AdamW-shaped state of about `size` bytes of bf16: weights, exp_avg, exp_avg_sq, plus small entries."""
    import torch

    per = min(64 * MiB, max(1, size // 3 // 2 // 24))  # elements per big tensor: ~24 layers or more
    left, sizes = size // 2 // 3, []
    while left > 0:
        sizes.append(min(per, left))
        left -= sizes[-1]
    g = torch.Generator(device=device).manual_seed(0)

    def big(n: int) -> torch.Tensor:
        cols = 4096 if n % 4096 == 0 else 1
        return torch.empty((n // cols, cols), dtype=torch.bfloat16, device=device).normal_(generator=g)

    model = {f"layers.{i}.weight": big(n) for i, n in enumerate(sizes)}
    model.update({f"layers.{i}.bias": torch.zeros(4096, dtype=torch.bfloat16, device=device)
                  for i in range(len(sizes))})
    state = {i: {"step": torch.tensor(100.0, device=device), "exp_avg": big(n), "exp_avg_sq": big(n).abs_()}
             for i, n in enumerate(sizes)}
    optim = {"state": state, "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1,
                                               "params": list(range(len(sizes)))}]}
    return {"model": model, "optim": optim, "step": 100}


def tensors_of(obj: Any) -> list:
    import torch

    out: list = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            out.extend(tensors_of(v))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out.extend(tensors_of(v))
    return out


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def clear(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    gc.collect()


def release_host_cache() -> None:
    """Give cached pinned blocks back, so one phase's pinned copies do not crowd the next."""
    import torch

    gc.collect()
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()


class Bench:
    def __init__(self, args: argparse.Namespace, device: str) -> None:
        self.args, self.device = args, device
        self.rows: list[dict[str, Any]] = []
        self.facts: dict[str, Any] = {}
        self.work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="sp-bench-snapshot-"))
        self.work.mkdir(parents=True, exist_ok=True)

    def row(self, name: str, stalls: list[float], **extra: Any) -> None:
        r = {"name": name, "first": stalls[0] if stalls else None,
             "repeat": min(stalls[1:]) if len(stalls) > 1 else None, **extra}
        self.rows.append(r)
        shown = ", ".join(f"{s:.3f}" for s in stalls)
        print(f"  {name}: stall {shown} s {json.dumps(extra, default=str) if extra else ''}", flush=True)

    # -- the floor ------------------------------------------------------------------------------

    def floor(self, state: dict) -> None:
        """Preallocate the floor's buffers and time a few copies; more are timed next to each save."""
        import torch

        pin = self.device == "cuda"
        self.srcs = tensors_of(state)
        self.dsts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in self.srcs]
        if not pin:
            for d in self.dsts:
                d.fill_(0)
        self.copies: list[float] = []
        self.moves: list[float] = []
        for _ in range(self.args.repeats + 1):
            self.floor_once()

    def floor_once(self) -> float:
        """One copy of the state into the floor's buffers (copy_, and memmove on CPU); the faster one."""
        pin = self.device == "cuda"
        sync(self.device)
        t0 = time.perf_counter()
        for s, d in zip(self.srcs, self.dsts):
            d.copy_(s, non_blocking=pin)
        sync(self.device)
        self.copies.append(time.perf_counter() - t0)
        if self.device != "cpu":
            return self.copies[-1]
        t0 = time.perf_counter()
        for s, d in zip(self.srcs, self.dsts):
            ctypes.memmove(d.data_ptr(), s.data_ptr(), s.numel() * s.element_size())
        self.moves.append(time.perf_counter() - t0)
        return min(self.copies[-1], self.moves[-1])

    def floor_done(self) -> None:
        pin = self.device == "cuda"
        self.row("floor: copy_ into preallocated" + (" pinned" if pin else ""), self.copies)
        floor = min(self.copies)
        if self.moves:
            self.row("floor: memcpy (ctypes.memmove, 1 thread)", self.moves)
            self.facts["memcpy_s"] = min(self.moves)
            floor = min(floor, min(self.moves))
        self.facts["floor_s"] = floor
        self.facts["copy_rate"] = self.facts["bytes"] / floor
        del self.dsts
        release_host_cache()

    # -- Snapshotter --------------------------------------------------------------------------

    def snapshotter(self, state: dict, budget: int, label: str, saves: int, paired: bool = False) -> dict[str, Any]:
        """`saves` saves, each waited for; with `paired`, a floor copy is timed just before each (same conditions)."""
        from safepoint.snapshotter import Snapshotter

        root = self.work / f"snap-{label}"
        t0 = time.perf_counter()
        snap = Snapshotter(root, "bench", budget_bytes=budget, memory_floor=self.args.memory_floor)
        alloc = time.perf_counter() - t0
        stalls, stats, floors = [], [], []
        try:
            for step in range(saves):
                if paired:
                    floors.append(self.floor_once())
                sync(self.device)
                h = snap.save(step, state)
                h.wait()
                stalls.append(h.stats.stall_s)
                stats.append(h.stats)
                clear(h.folder)
        finally:
            snap.close()
            clear(root)
        return {"alloc_s": alloc, "stalls": stalls, "stats": stats, "pool_high_water": snap.pool.high_water_in_use,
                "pool_allocated": snap.pool.high_water_allocated, "budget": budget, "floors": floors}

    # -- DCP ----------------------------------------------------------------------------------

    def dcp_async(self, state: dict, label: str, runs: int, stager_factory=None, safepoint_writer: bool = False):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import BlockingAsyncStager  # noqa: F401

        from safepoint.snapshotter.dcp_writer import SafepointWriter

        stager = stager_factory() if stager_factory else None
        stalls, dones = [], []
        for i in range(runs):
            folder = self.work / f"dcp-{label}" / "bench" / str(i)
            kwargs: dict[str, Any] = {}
            if safepoint_writer:
                kwargs["storage_writer"] = SafepointWriter(folder, run="bench")
            elif stager is not None:
                kwargs["storage_writer"] = dcp.FileSystemWriter(folder)
            else:
                kwargs["checkpoint_id"] = str(folder)
            if stager is not None:
                kwargs["async_stager"] = stager
            sync(self.device)
            t0 = time.perf_counter()
            resp = dcp.async_save(state, **kwargs)
            fut = getattr(resp, "upload_completion", resp)
            staging = getattr(resp, "staging_completion", None)
            if staging is not None:
                staging.result()  # training must not step before staging completed
            stalls.append(time.perf_counter() - t0)
            fut.result()
            dones.append(time.perf_counter() - t0)
            clear(folder)
        clear(self.work / f"dcp-{label}")
        if stager is not None and hasattr(stager, "close"):
            stager.close()
        del stager
        release_host_cache()
        return stalls, dones

    # -- torch.save ---------------------------------------------------------------------------

    def torch_save(self, state: dict) -> None:
        import torch

        path = self.work / "torch-save" / "model.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        sync(self.device)
        t0 = time.perf_counter()
        torch.save(state, path)
        stall = time.perf_counter() - t0
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        self.row("torch.save (synchronous)", [stall], durable_s=round(time.perf_counter() - t0, 3))
        clear(path.parent)

    def naive_cpu(self, state: dict) -> None:
        srcs = tensors_of(state)
        t0 = time.perf_counter()
        out = [t.cpu() for t in srcs]
        self.row("naive [t.cpu() for t in state]", [time.perf_counter() - t0])
        del out
        release_host_cache()


def best_stager_factory(device: str):
    """BlockingAsyncStager(cache_staged_state_dict=True); on CPU the same without pinning (pinning needs CUDA)."""
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    if device == "cuda":
        return lambda: BlockingAsyncStager(cache_staged_state_dict=True)

    class CachedUnpinnedStager(BlockingAsyncStager):
        def stage(self, state_dict):
            if self.state_dict_cache is None:
                self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=False)
            return _copy_state_dict(state_dict, self.state_dict_cache)

    return lambda: CachedUnpinnedStager(cache_staged_state_dict=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=None, help="state size (default 1GiB on CPU, 8GiB on GPU)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dir", default=None, help="local disk folder for the checkpoints (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=2, help="saves after the first, for the repeat stalls")
    ap.add_argument("--memory-floor", type=float, default=0.25, help="Snapshotter memory_floor")
    ap.add_argument("--skip", default="", help="comma list of: dcp_default,dcp_best,torch_save,quarter")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")

    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    size = args.size or (8 * GiB if device == "cuda" else GiB)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    b = Bench(args, device)
    print(f"# bench/snapshot.py: {size / GiB:.2f} GiB bf16 state on {device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if device == 'cuda' else ''}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, checkpoints in {b.work}", flush=True)
    state = make_state(size, device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors_of(state))
    b.facts.update(bytes=nbytes, tensors=len(tensors_of(state)), device=device)
    print(f"  state: {nbytes / GiB:.3f} GiB in {b.facts['tensors']} tensors", flush=True)
    try:
        b.floor(state)
        full = b.snapshotter(state, nbytes, "full", 1 + args.repeats, paired=True)
        b.floor_done()
        st = full["stats"]
        b.facts["paired"] = [{"floor_s": f, "stall_s": x, "ratio": x / f}
                             for f, x in zip(full["floors"], full["stalls"])]
        b.facts["deferred"] = [s.deferred for s in st]
        drain = [s.bytes / s.drain_s for s in st if s.drain_s > 0]
        b.facts["drain_rate"] = max(drain) if drain else None
        b.facts["pool_alloc_s"] = full["alloc_s"]
        b.row("Snapshotter.save, budget = state", full["stalls"], pool_alloc_s=round(full["alloc_s"], 3),
              to_committed_s=[round(s.to_committed_s, 3) for s in st],
              drain_GBps=round(b.facts["drain_rate"] / 1e9, 2) if b.facts["drain_rate"] else None)
        b.facts["snap_to_committed_s"] = min(s.to_committed_s for s in st)
        if "quarter" not in skip:
            q = b.snapshotter(state, nbytes // 4, "quarter", 1 + min(1, args.repeats))
            qs = q["stats"]
            bound = max(nbytes / b.facts["copy_rate"],
                        (nbytes - q["budget"]) / b.facts["drain_rate"] if b.facts["drain_rate"] else 0.0)
            b.facts.update(quarter_bound_s=bound, quarter_peak=q["pool_high_water"], quarter_budget=q["budget"],
                           quarter_allocated=q["pool_allocated"])
            b.row("Snapshotter.save, budget = state/4", q["stalls"], bound_s=round(bound, 3),
                  backpressure_s=[round(s.backpressure_s, 3) for s in qs],
                  peak_pool_MiB=round(q["pool_high_water"] / MiB, 1), budget_MiB=round(q["budget"] / MiB, 1),
                  to_committed_s=[round(s.to_committed_s, 3) for s in qs])
            b.facts["quarter_stall_s"] = min(q["stalls"])
        if "dcp_default" not in skip:
            stalls, dones = b.dcp_async(state, "default", 1)
            b.row("dcp.async_save, default settings", stalls, done_s=[round(d, 3) for d in dones])
        if "dcp_best" not in skip:
            factory = best_stager_factory(device)
            stalls, dones = b.dcp_async(state, "best", 1 + args.repeats, factory)
            b.row("dcp.async_save, BlockingAsyncStager(cache=True)", stalls, done_s=[round(d, 3) for d in dones])
            b.facts["dcp_best_first_s"], b.facts["dcp_best_repeat_s"] = stalls[0], min(stalls[1:] or stalls)
            b.facts["dcp_done_s"] = min(dones)
            stalls, dones = b.dcp_async(state, "best-sp", 2, factory, safepoint_writer=True)
            b.row("dcp.async_save, best stager + SafepointWriter (committed)", stalls,
                  committed_s=[round(d, 3) for d in dones])
            b.facts["dcp_committed_s"] = min(dones)
        if "torch_save" not in skip:
            b.torch_save(state)
        if device == "cuda":
            b.naive_cpu(state)
    finally:
        if not args.dir:
            shutil.rmtree(b.work, ignore_errors=True)
    report(b)
    if args.json:
        Path(args.json).write_text(json.dumps({"facts": b.facts, "rows": b.rows}, indent=1, default=str))
    return 0


def report(b: Bench) -> None:
    f = b.facts
    floor = f["floor_s"]
    print(f"\n## {f['bytes'] / GiB:.2f} GiB on {f['device']}; floor {floor:.3f} s "
          f"({f['copy_rate'] / 1e9:.1f} GB/s); ratios are stall / floor\n")
    print(f"| {'method':<58} | {'first s':>8} | {'repeat s':>8} | {'first/floor':>11} | {'repeat/floor':>12} |")
    print(f"|{'-' * 60}|{'-' * 10}|{'-' * 10}|{'-' * 13}|{'-' * 14}|")
    for r in b.rows:
        first, rep = r["first"], r["repeat"]
        cells = [f"{first:8.3f}" if first is not None else f"{'':>8}", f"{rep:8.3f}" if rep is not None else f"{'':>8}",
                 f"{first / floor:11.2f}" if first is not None else f"{'':>11}",
                 f"{rep / floor:12.2f}" if rep is not None else f"{'':>12}"]
        print(f"| {r['name']:<58} | " + " | ".join(cells) + " |")
    snap = next(r for r in b.rows if r["name"].startswith("Snapshotter.save, budget = state"))
    print("\n## checks")
    pairs = f["paired"]
    first_r = pairs[0]["ratio"]
    rep_r = sorted(p["ratio"] for p in pairs[1:])[len(pairs[1:]) // 2] if len(pairs) > 1 else first_r
    shown = ", ".join(f"{p['stall_s']:.3f}/{p['floor_s']:.3f}" for p in pairs)
    print(f"- each save timed right after a floor copy (stall/floor s: {shown}); all deferred (whole state in the "
          f"pool): {all(f['deferred'])}")
    if f["device"] == "cpu":
        memcpy = f["memcpy_s"]
        print(f"- save() stall / plain memcpy of the same bytes: first {first_r:.2f}x, repeats (median) {rep_r:.2f}x "
              f"paired; against the best memcpy of the run {snap['first'] / memcpy:.2f}x and "
              f"{(snap['repeat'] or snap['first']) / memcpy:.2f}x (done when <= 2x): "
              f"{'PASS' if max(first_r, rep_r) <= 2 else 'FAIL'}")
    else:
        print(f"- budget >= state: first {first_r:.3f}x, repeats (median) {rep_r:.3f}x of the pinned-copy floor timed "
              f"just before; {snap['first'] / floor:.3f}x and {(snap['repeat'] or 0) / floor:.3f}x of the run's best "
              f"floor (done when <= 1.1x): {'PASS' if max(first_r, rep_r) <= 1.1 else 'FAIL'}")
        if "dcp_best_first_s" in f:
            print(f"- vs DCP best stager: first {snap['first']:.3f} s vs {f['dcp_best_first_s']:.3f} s, repeat "
                  f"{(snap['repeat'] or 0):.3f} s vs {f['dcp_best_repeat_s']:.3f} s")
    if "quarter_bound_s" in f:
        ok = f["quarter_peak"] <= f["quarter_budget"] and f["quarter_allocated"] <= f["quarter_budget"]
        print(f"- budget = state/4: pool peak {f['quarter_peak'] / MiB:.0f} MiB, allocated "
              f"{f['quarter_allocated'] / MiB:.0f} MiB, budget {f['quarter_budget'] / MiB:.0f} MiB "
              f"({'within' if ok else 'OVER'}); stall {f['quarter_stall_s']:.3f} s vs physical bound "
              f"{f['quarter_bound_s']:.3f} s ({f['quarter_stall_s'] / f['quarter_bound_s']:.2f}x), drain rate "
              f"{(f['drain_rate'] or 0) / 1e9:.2f} GB/s")
    if "dcp_done_s" in f:
        print(f"- time to committed: Snapshotter {f['snap_to_committed_s']:.3f} s; DCP best stager to done "
              f"(.metadata) {f['dcp_done_s']:.3f} s ({f['snap_to_committed_s'] / f['dcp_done_s']:.2f}x), "
              f"to committed via SafepointWriter {f['dcp_committed_s']:.3f} s "
              f"({f['snap_to_committed_s'] / f['dcp_committed_s']:.2f}x) (done when <= 1x of DCP's)")


if __name__ == "__main__":
    sys.exit(main())
