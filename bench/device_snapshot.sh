#!/usr/bin/env bash
# One-shot GPU run for issue 7 (Snapshotter): a CUDA isolation check, then bench/snapshot.py at 8 GiB of bf16
# state on the GPU, in one go (about 3-5 minutes on an H200 host).
#
# The device image has torch, safetensors and numpy but not blake3: carry a cp312 wheel. Once, here, in the
# repository root (the folder is ignored through .git/info/exclude):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl blake3==1.0.11
# Then, with the device tool:
#   run(command="bash bench/device_snapshot.sh", carry=[".whl"], timeout_s=560)
# Results come back in $OUT: snapshot.json (every figure), snapshot.log (the table), check.log.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/sp-device-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

if ! python3 -c "import blake3" 2>/dev/null; then
  if ls .whl/blake3-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/blake3-*.whl || exit 3
    export PYTHONPATH=/tmp/site
  else
    echo "blake3 is missing and no .whl/blake3-*.whl was carried: see this script's header" >&2
    exit 3
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, safetensors, blake3; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'safetensors', safetensors.__version__, 'blake3', blake3.__version__)"
  nproc; free -g | head -2; df -h /tmp | tail -1
} 2>&1 | tee "$OUT/env.log"

# 1. Isolation with CUDA tensors: the copy sees kernels queued before save(), and not the ones queued after it,
#    with a budget >= the state and with a budget 8x smaller (backpressure).
timeout 180 python3 - <<'EOF' 2>&1 | tee "$OUT/check.log"
import shutil, tempfile, time
import torch
from safepoint.snapshotter import Snapshotter, load
from safepoint.validation.validate import validate_snapshot

dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
state = {"w": torch.randn(96 << 20, device=dev, generator=g).to(torch.bfloat16),         # 192 MiB
         "strided": torch.randn(8192, 4096, device=dev, generator=g)[:, ::2],             # 64 MiB, not contiguous
         "opt": {"m": torch.randn(16 << 20, device=dev, generator=g), "step": torch.tensor(3.0, device=dev)},
         "host": torch.randn(1 << 20), "meta": {"lr": 0.1}}
size = sum(t.numel() * t.element_size() for t in [state["w"], state["strided"], state["opt"]["m"]])
x = torch.randn(8192, 8192, device=dev)
root = tempfile.mkdtemp(prefix="sp-check-")
ok = True
for step, budget in enumerate([1 << 30, size // 8]):
    new = torch.randn(state["w"].shape, device=dev, generator=g).to(torch.bfloat16)
    want = {"strided": state["strided"].clone().cpu(), "m": state["opt"]["m"].clone().cpu(),
            "host": state["host"].clone()}
    torch.cuda.synchronize()
    for _ in range(30):
        y = x @ x                      # a long queue of kernels ...
    state["w"].copy_(new)              # ... then the last write before save(): save() must see it
    with Snapshotter(root, "check", budget_bytes=budget) as snap:
        h = snap.save(step, state)
        for t in (state["w"], state["strided"], state["opt"]["m"]):
            t.add_(1)                  # the next step, queued at once
        state["host"].add_(1)
        h.wait()
    torch.cuda.synchronize()
    back = load(h.folder)
    exact = (torch.equal(back["w"], new.cpu()) and torch.equal(back["strided"], want["strided"])
             and torch.equal(back["opt"]["m"], want["m"]) and torch.equal(back["host"], want["host"])
             and back["meta"] == {"lr": 0.1} and not torch.equal(back["opt"]["m"], state["opt"]["m"].cpu()))
    report = validate_snapshot(h.folder)
    print(f"budget {budget / 2**20:.0f} MiB for {size / 2**20:.0f} MiB: bit-exact {exact}, validate {report.ok}, "
          f"stall {h.stats.stall_s:.3f} s, backpressure {h.stats.backpressure_s:.3f} s, "
          f"pool peak {snap.pool.high_water_in_use / 2**20:.0f} MiB")
    ok = ok and exact and report.ok and snap.pool.high_water_in_use <= budget
shutil.rmtree(root, ignore_errors=True)
print("CUDA isolation check:", "PASS" if ok else "FAIL")
EOF

# 2. The benchmark: floor, Snapshotter (budget = state, state/4), DCP default and best stager, torch.save.
rm -rf /tmp/sp-bench
timeout 420 python3 bench/snapshot.py --device cuda --size 8GiB --repeats 2 --dir /tmp/sp-bench \
  --json "$OUT/snapshot.json" 2>&1 | tee "$OUT/snapshot.log"
rc=$?
rm -rf /tmp/sp-bench
exit $rc
