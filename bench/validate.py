"""Safepoint's validation vs the seeds' verifier on a ~4 GiB torch.save checkpoint, in one run.

The checkpoint: a GPT built from torch.nn modules (token + position embeddings, a pre-norm
nn.TransformerEncoder with a causal mask, a final LayerNorm and an untied LM head), trained for a
few real AdamW steps (two param groups: decay / no decay, like nanoGPT) on random tokens, saved as
`torch.save({"model", "optimizer", "step"})` in fp32. Model weights are a third of the bytes, AdamW's
exp_avg and exp_avg_sq the other two thirds. It is built once and cached under bench/out/validate/.

Contenders, each in its own fresh subprocess (so wall time includes interpreter start and imports,
and peak RSS is that process's own: VmHWM of its address space, read by the child as it ends; the
parent stays small, without torch, so wait4's ru_maxrss, which also counts the forked image from
before exec, agrees):

- seeds: SHA-256 of the file, then `torch.load` of the whole thing, then NaN/Inf over "model" only
  (the verifier the issue describes: it never looks at the optimizer state);
- safepoint: `validate_snapshot` at full coverage, in its sandbox (a limited child forked from the
  single-threaded caller; peak RSS is the larger of the caller's and the child's): every
  tensor of model *and* optimizer through the
  audit (NaN/Inf, norm, max |x|), plus the strict dry-run load against the model factory
  `bench.validate:build_gpt` (keys, shapes, dtypes, optimizer state vs param groups, step), against
  a baseline: the stats of the same run one step earlier (saved next to it, validated once, untimed),
  as ingest does. It records each tensor's digests for the consistency rules (a BLAKE3 of its first
  64 KiB, and of all of it where the step before has the same head); it does not hash files: the
  replicator does (BLAKE3) while it uploads and reads back;
- safepoint (no digests): the same with the digest code replaced by a no-op, for the digests' cost;
- safepoint (all unchanged): the worst case for the digests, every tensor unchanged since the
  baseline, so every one is digested whole (the baseline is this checkpoint's own stats).

Page cache: by default both run on a warm cache (the file is read once before each contender).
`--cold` evicts the file's pages before each contender instead (posix_fadvise DONTNEED: no root
needed, other files untouched). Contenders alternate order across `--repeat` rounds; the table
shows the median and the best of each.

    flock /tmp/safepoint-bench.lock python bench/validate.py            # builds the checkpoint once
    flock /tmp/safepoint-bench.lock python bench/validate.py --cold --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "validate"
GiB = 1 << 30
FACTORY = "bench.validate:build_gpt"

# ~356 M parameters: 12 bytes each (fp32 weights + AdamW exp_avg + exp_avg_sq) = ~3.98 GiB.
CFG = {"vocab": 32000, "ctx": 1024, "d_model": 1024, "heads": 16, "ff": 4096, "layers": 23}
# A smaller checkpoint for a quick run on a busy machine: SAFEPOINT_BENCH_LAYERS=4 (~1.1 GiB).
CFG["layers"] = int(os.environ.get("SAFEPOINT_BENCH_LAYERS", CFG["layers"]))
# How the contender "safepoint" is run: digests as shipped, none (their cost), every tensor digested whole.
DIGEST_MODES = {"on": "safepoint", "off": "safepoint (no digests)", "all": "safepoint (all unchanged)"}
TRAIN = {"steps": 2, "batch": 2, "seq": 64, "lr": 3e-4, "weight_decay": 0.1, "seed": 0}


def build_gpt(device: str | None = None, layers: int | None = None):  # noqa: ANN201 - returns (model, optimizer)
    """The model factory (`--model bench.validate:build_gpt`): (GPT, AdamW with two param groups)."""
    import torch
    from torch import nn

    cfg = dict(CFG, layers=layers or CFG["layers"])

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = cfg["d_model"]
            self.tok = nn.Embedding(cfg["vocab"], d)
            self.pos = nn.Embedding(cfg["ctx"], d)
            layer = nn.TransformerEncoderLayer(d, cfg["heads"], cfg["ff"], dropout=0.0, batch_first=True,
                                               norm_first=True, activation="gelu")
            self.blocks = nn.TransformerEncoder(layer, cfg["layers"], enable_nested_tensor=False)
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, cfg["vocab"], bias=False)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            t = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
            mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
            return self.head(self.ln_f(self.blocks(x, mask=mask, is_causal=True)))

    with torch.device(device or "cpu"):
        model = GPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": TRAIN["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=TRAIN["lr"], foreach=False)
    return model, opt


# ------------------------------------------------------------------------------------------ checkpoint

def checkpoint_dir() -> Path:
    return OUT / f"gpt-{CFG['layers']}L-{CFG['d_model']}d"


def previous_dir(folder: Path) -> Path:
    return folder.with_name(folder.name + "-previous")


def _save(model, opt, step: int, folder: Path) -> None:  # noqa: ANN001
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / ".safepoint-tmp-model.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, folder / "model.pt")


def ensure_checkpoint() -> tuple[Path, dict]:
    """Build (once) the trained checkpoint; returns (snapshot folder, its description)."""
    folder = checkpoint_dir()
    info_path = folder.with_suffix(".json")
    want = {"cfg": CFG, "train": TRAIN}
    if info_path.is_file() and (folder / "model.pt").is_file() and (previous_dir(folder) / "model.pt").is_file():
        info = json.loads(info_path.read_text())
        if {k: info.get(k) for k in want} == want and info.get("bytes") == (folder / "model.pt").stat().st_size:
            return folder, info
    import torch
    from torch import nn

    n_params = 0
    d, ff, L, V = CFG["d_model"], CFG["ff"], CFG["layers"], CFG["vocab"]
    n_params = 2 * V * d + CFG["ctx"] * d + L * (4 * d * d + 4 * d + 2 * d * ff + ff + d + 4 * d) + 2 * d
    need = 2 * n_params * 12 + GiB
    OUT.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(OUT).free
    if free < need:
        sys.exit(f"not enough disk under {OUT}: {free / GiB:.1f} GiB free, {need / GiB:.1f} GiB needed")
    print(f"building the checkpoint: {n_params / 1e6:.0f} M parameters, ~{n_params * 12 / GiB:.2f} GiB "
          f"(cached in {folder})", flush=True)
    t0 = time.perf_counter()
    torch.manual_seed(TRAIN["seed"])
    model, opt = build_gpt("cpu")
    gen = torch.Generator().manual_seed(TRAIN["seed"] + 1)
    losses = []
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(TRAIN["steps"]):
        if i == TRAIN["steps"] - 1:  # the step before: the baseline the consistency rules compare with
            _save(model, opt, i, previous_dir(folder))
        idx = torch.randint(0, V, (TRAIN["batch"], TRAIN["seq"] + 1), generator=gen)
        logits = model(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, V), idx[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    opt.zero_grad(set_to_none=True)
    _save(model, opt, TRAIN["steps"], folder)
    sd = model.state_dict()
    info = {**want, "params": sum(p.numel() for p in model.parameters()), "bytes": (folder / "model.pt").stat().st_size,
            "model_bytes": sum(t.numel() * t.element_size() for t in sd.values()), "losses": losses,
            "build_s": round(time.perf_counter() - t0, 1)}
    info_path.write_text(json.dumps(info, indent=1))
    print(f"built in {info['build_s']} s: {info['bytes'] / GiB:.2f} GiB, losses {losses}", flush=True)
    return folder, info


# ------------------------------------------------------------------------------------------ contenders

def child_seeds(path: Path) -> dict:
    """The seeds' verifier: SHA-256 of the file, torch.load it whole, NaN/Inf over "model" only."""
    import hashlib

    t0 = time.perf_counter()
    import torch

    t1 = time.perf_counter()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    t2 = time.perf_counter()
    sd = torch.load(path, map_location="cpu", weights_only=True)
    t3 = time.perf_counter()
    bad = [k for k, v in sd["model"].items() if torch.isnan(v).any() or torch.isinf(v).any()]
    t4 = time.perf_counter()
    checked = sum(v.numel() * v.element_size() for v in sd["model"].values())
    return {"ok": not bad, "bytes_checked": checked, "tensors": len(sd["model"]),
            "phases": {"import": t1 - t0, "sha256": t2 - t1, "load": t3 - t2, "nan_inf": t4 - t3}}


def baseline_path(folder: Path) -> Path:
    return previous_dir(folder).with_suffix(".stats.json")


def child_baseline(folder: Path) -> dict:
    """Validate the step before (once) and keep its stats: the baseline of the timed runs."""
    from safepoint.validation.validate import validate_snapshot

    report = validate_snapshot(previous_dir(folder), ["model.pt"], step=TRAIN["steps"] - 1)
    rows = {s.name: s.to_dict() for s in report.stats}
    baseline_path(folder).write_text(json.dumps(rows))
    own = validate_snapshot(folder, ["model.pt"], step=TRAIN["steps"])  # for the worst case ("all")
    baseline_path(folder).with_suffix(".self.json").write_text(json.dumps({s.name: s.to_dict() for s in own.stats}))
    return {"ok": report.ok and own.ok, "tensors": len(rows)}


def child_safepoint(folder: Path, step: int, digests: str) -> dict:
    """`digests`: "on" (as shipped: heads, whole digests where the previous step's head is the same),
    "off" (the digest code replaced by a no-op: what the digests cost), "all" (every tensor unchanged
    since the baseline, the worst case: the baseline is this checkpoint's own heads)."""
    t0 = time.perf_counter()
    from safepoint.validation import audit
    from safepoint.validation.audit import Baseline
    from safepoint.validation.validate import validate_snapshot

    rows = json.loads(baseline_path(folder).read_text())
    if digests == "off":
        class _NoDigest:
            wants_bytes = False

            def __init__(self, policy: object) -> None: ...
            def update(self, data: object) -> None: ...
            def result(self) -> tuple[None, None]:
                return None, None

        audit._Digest = _NoDigest
        audit._bytes_of = lambda piece: None
    settings = None
    if digests == "all":
        from safepoint.validation.settings import ValidationSettings

        rows = json.loads(baseline_path(folder).with_suffix(".self.json").read_text())
        # Compared with itself, the checkpoint is a duplicate of its baseline: a warning here, since
        # this contender measures what the whole-tensor digests cost, not a verdict.
        settings = ValidationSettings.from_mapping({"warn_only": ["duplicate", "stale_optimizer", "stale_weights",
                                                                  "torn"]})
    baseline = Baseline(f"bench/{step - 1}", stats=rows, step=step - 1)
    t1 = time.perf_counter()
    report = validate_snapshot(folder, ["model.pt"], model=FACTORY, step=step, baseline=baseline,
                               settings=settings)
    t2 = time.perf_counter()

    d = report.to_dict()
    sandbox = (d["checks"].get("sandbox") or {}).get("usage") or {}
    return {"ok": report.ok, "sandbox_peak_rss_bytes": sandbox.get("peak_rss_bytes", 0),
            "outcome": report.outcome, "bytes_checked": d["bytes_checked"],
            "tensors": d["tensors"], "summary": report.summary(), "harness": d["checks"].get("harness"),
            "optimizer_tensors": sum(1 for s in report.stats if s.name.startswith("optimizer.")),
            "digested_whole": sum(1 for s in report.stats if s.digest and s.numel * 4 > audit.HEAD_BYTES),
            "phases": {"import": t1 - t0, "validate": t2 - t1}}


def child_attribution(folder: Path, step: int) -> dict:
    """The time spent in the digest code itself, timed around each call, in one process (sandbox off,
    so the timers are in reach): a figure immune to the start-up noise that dominates the wall-clock
    comparison of "safepoint" with "safepoint (no digests)". Both baselines: the step before (as
    shipped) and the checkpoint's own stats (every tensor digested whole)."""
    from safepoint.validation import audit
    from safepoint.validation.audit import Baseline
    from safepoint.validation.settings import ValidationSettings
    from safepoint.validation.validate import validate_snapshot

    spent = [0.0]

    def timed(fn):  # noqa: ANN001, ANN202
        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t
        return wrapper

    audit._bytes_of = timed(audit._bytes_of)
    audit._Digest.update = timed(audit._Digest.update)
    audit._Digest.result = timed(audit._Digest.result)
    settings = ValidationSettings.from_mapping({"sandbox": False, "warn_only": [
        "duplicate", "stale_optimizer", "stale_weights", "torn"]})
    out = {}
    for name, rows_path in (("as shipped", baseline_path(folder)),
                            ("all unchanged", baseline_path(folder).with_suffix(".self.json"))):
        baseline = Baseline(f"bench/{step - 1}", stats=json.loads(rows_path.read_text()), step=step - 1)
        best = None
        for _ in range(2):  # the second pass is the one kept: warm
            spent[0] = 0.0
            t = time.perf_counter()
            validate_snapshot(folder, ["model.pt"], model=FACTORY, step=step, baseline=baseline, settings=settings)
            best = {"validate_s": time.perf_counter() - t, "digest_s": spent[0]}
        out[name] = best
    return out


def _vm_hwm() -> int:
    """Peak RSS of this process's own address space (bytes)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def run_child(args: list[str]) -> dict:
    """Run one contender in a fresh process; wall time and peak RSS of that process alone."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, env=env, cwd=ROOT)
    out = p.stdout.read() if p.stdout else b""
    _, status, rusage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"contender {args} failed with exit code {p.returncode}")
    result = json.loads(out.decode().strip().splitlines()[-1])
    result.update(wall_s=wall, cpu_s=rusage.ru_utime + rusage.ru_stime, peak_rss_bytes=result["vm_hwm"],
                  ru_maxrss_bytes=rusage.ru_maxrss * 1024)
    return result


def prepare_cache(path: Path, cold: bool) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if cold:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        else:
            while os.read(fd, 16 << 20):
                pass
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="rounds (contenders alternate order)")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds of pause before each contender")
    ap.add_argument("--cold", action="store_true", help="evict the file from the page cache before each contender")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", choices=["seeds", "safepoint", "baseline", "attribution"], help=argparse.SUPPRESS)
    ap.add_argument("--digests", choices=list(DIGEST_MODES), default="on", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--step", type=int, default=TRAIN["steps"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "seeds":
        print(json.dumps({**child_seeds(Path(args.path)), "vm_hwm": _vm_hwm()}))
        return 0
    if args.child == "safepoint":
        print(json.dumps({**child_safepoint(Path(args.path), args.step, args.digests), "vm_hwm": _vm_hwm()}))
        return 0
    if args.child == "attribution":
        print(json.dumps({**child_attribution(Path(args.path), args.step), "vm_hwm": _vm_hwm()}))
        return 0
    if args.child == "baseline":
        print(json.dumps({**child_baseline(Path(args.path)), "vm_hwm": _vm_hwm()}))
        return 0

    folder, info = ensure_checkpoint()
    if not baseline_path(folder).is_file() or not baseline_path(folder).with_suffix(".self.json").is_file():
        run_child(["--child", "baseline", "--path", str(folder)])
    if args.build_only:
        return 0
    path = folder / "model.pt"
    from importlib.metadata import version

    print(f"checkpoint {path}: {info['bytes'] / GiB:.2f} GiB, {info['params'] / 1e6:.0f} M parameters, model "
          f"{info['model_bytes'] / GiB:.2f} GiB + AdamW state; torch {version('torch')}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}; page cache: {'cold (evicted before each)' if args.cold else 'warm'}"
          f"; baseline: the same run one step earlier")
    names = ["seeds", *DIGEST_MODES.values()]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.repeat):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            time.sleep(args.settle)  # the seeds' verifier leaves 4.4 GiB to reclaim: let the next one start clean
            prepare_cache(path, args.cold)
            if name == "seeds":
                child = ["--child", "seeds", "--path", str(path)]
            else:
                mode = next(k for k, v in DIGEST_MODES.items() if v == name)
                child = ["--child", "safepoint", "--path", str(folder), "--digests", mode]
            res = run_child(child)
            # validation reads in a sandboxed child (safepoint.sandbox): its peak counts, not just the caller's
            res["peak_rss_bytes"] = max(res["peak_rss_bytes"], res.get("sandbox_peak_rss_bytes", 0))
            runs[name].append(res)
            print(f"  round {r + 1} {name:20s}: {res['wall_s']:6.2f} s (CPU {res['cpu_s']:5.2f} s), "
                  f"peak RSS {res['peak_rss_bytes'] / GiB:5.2f} GiB (ru_maxrss {res['ru_maxrss_bytes'] / GiB:.2f}), "
                  "phases "
                  f"{', '.join(f'{k} {v:.2f}' for k, v in res['phases'].items())}", flush=True)
    for name in names[1:]:
        if not runs[name][-1]["ok"]:
            print(f"{name}: validation did not pass: {runs[name][-1]['summary']}")
            return 1
    sp = runs["safepoint"][-1]

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[name])

    def best(name: str, key: str) -> float:
        return min(x[key] for x in runs[name])

    covers = {"seeds": "SHA-256 + torch.load + NaN/Inf over model only",
              "safepoint": "model + optimizer: NaN/Inf, norm, max|x|, digests; strict load vs factory",
              "safepoint (no digests)": "the same without tensor digests",
              "safepoint (all unchanged)": "worst case: every tensor digested whole"}
    print()
    print(f"| contender | wall s (median of {args.repeat}) | wall s (best) | CPU s (median) | peak RSS GiB (max) "
          "| bytes checked | tensors | digested whole | coverage |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name in names:
        x = runs[name][-1]
        print(f"| {name} | {med(name, 'wall_s'):.2f} | {best(name, 'wall_s'):.2f} | {med(name, 'cpu_s'):.2f} | "
              f"{max(r['peak_rss_bytes'] for r in runs[name]) / GiB:.2f} | {x['bytes_checked'] / GiB:.2f} GiB | "
              f"{x['tensors']} | {x.get('digested_whole', '-')} | {covers[name]} |")
    speed = med("seeds", "wall_s") / med("safepoint", "wall_s")
    rss = max(r["peak_rss_bytes"] for r in runs["safepoint"])
    print()
    print(f"speed-up (median wall, seeds / safepoint): {speed:.2f}x  (target >= 3x); best wall: "
          f"{best('seeds', 'wall_s') / best('safepoint', 'wall_s'):.2f}x; CPU time: "
          f"{med('seeds', 'cpu_s') / med('safepoint', 'cpu_s'):.2f}x")
    print(f"safepoint peak RSS: {rss / GiB:.2f} GiB  (target <= 1 GiB); seeds: "
          f"{max(r['peak_rss_bytes'] for r in runs['seeds']) / GiB:.2f} GiB")
    on, off, worst = (med(n, "wall_s") for n in names[1:])  # names[1:] follows DIGEST_MODES: on, off, all
    on_v, off_v, worst_v = (statistics.median(x["phases"]["validate"] for x in runs[n]) for n in names[1:])
    print(f"digest cost (median wall, safepoint vs no digests): {(on - off) / on:+.1%} of validation wall time "
          f"(target <= 10%); of the validate phase alone: {(on_v - off_v) / on_v:+.1%}; worst case, every tensor "
          f"unchanged and digested whole: {(worst - off) / worst:+.1%} "
          f"(validate phase {(worst_v - off_v) / worst_v:+.1%})")
    attr = run_child(["--child", "attribution", "--path", str(folder)])
    for name in ("as shipped", "all unchanged"):
        a = attr[name]
        print(f"digest code, timed around each call (one process, sandbox off, warm), {name}: "
              f"{a['digest_s']:.3f} s of {a['validate_s']:.2f} s of validation = {a['digest_s'] / a['validate_s']:.1%}"
              + ("  (target <= 10%)" if name == "as shipped" else ""))
    print(f"coverage: safepoint checked {sp['bytes_checked'] / runs['seeds'][-1]['bytes_checked']:.1f}x the bytes "
          f"the seeds' verifier checked ({sp['optimizer_tensors']} optimizer tensors); harness: "
          f"{json.dumps(sp['harness'])}")
    if args.json:
        doc = {"info": info, "cold": args.cold, "runs": runs, "speedup": speed}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
