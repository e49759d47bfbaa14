#!/usr/bin/env bash
# Device check for the GPU tier (issue 8), for a machine with a CUDA GPU (the `device` tool's machine: run it as
# `bash benchmarks/gpu_check.sh` from the repository root; it writes under $OUT).
#
#   1. installs the gpu extra (cupy, cuDF) and a pinned CUDA build of torch unless one is already importable;
#   2. runs the GPU tests (tests/test_tiers.py and tests/test_placement.py: with a GPU nothing is skipped);
#   3. runs the GPU benchmark rows: atari batch 4096 gathered from GPU-resident columns vs a host gather plus a
#      host-to-device copy, and gather bandwidth vs a device-to-device copy (benchmarks/bench_tiers.py --only gpu).
#
# Everything goes to $OUT: env.txt (nvidia-smi, versions), install.log, tests.log, tiers_gpu.json, bench.log,
# summary.txt. Each stage has its own time limit so one stuck stage leaves time for the rest; the exit status is
# that of the tests.
set -uo pipefail

OUT=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}   # never an unpinned torch

{
  date -u
  nvidia-smi || echo "nvidia-smi: not found"
  "$PY" --version
} > "$OUT/env.txt" 2>&1

# 1. environment: a venv that sees the system packages (a preinstalled CUDA torch is reused, not replaced)
# (GPU_CHECK_SKIP_INSTALL=1: use $PYTHON as it is, e.g. to try the script on a machine without a GPU)
if [ "${GPU_CHECK_SKIP_INSTALL:-0}" = 1 ]; then
  VPY=$PY
  echo "install skipped (GPU_CHECK_SKIP_INSTALL=1)" > "$OUT/install.log"
else
  VENV=${GPU_VENV:-${TMPDIR:-/tmp}/arrowbuf-gpu-venv}   # outside the tree and $OUT
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages "$VENV" >> "$OUT/install.log" 2>&1
  fi
  VPY=$VENV/bin/python
  {
    if ! "$VPY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
      timeout 420 "$VPY" -m pip install "$TORCH_PIN"
    fi
    timeout 300 "$VPY" -m pip install -e ".[gpu,dev,query]" --extra-index-url https://pypi.nvidia.com
  } >> "$OUT/install.log" 2>&1
fi
"$VPY" - >> "$OUT/env.txt" 2>&1 <<'EOF'
from arrowbuf.tiers.gpu import gpu_environment
print("gpu environment:", gpu_environment())
EOF

# 2. tests (GPU cases run only with a CUDA device; without one they skip, and env.txt says why)
timeout 300 "$VPY" -m pytest tests/test_tiers.py tests/test_placement.py -q -rs -p no:cacheprovider --durations=8 \
  > "$OUT/tests.log" 2>&1
tests_rc=$?

# 3. the GPU benchmark rows
timeout 300 "$VPY" -m benchmarks.bench_tiers --only gpu --out "$OUT/tiers_gpu.json" > "$OUT/bench.log" 2>&1
bench_rc=$?

{
  echo "tests: exit $tests_rc"
  tail -n 3 "$OUT/tests.log"
  echo "bench: exit $bench_rc"
  cat "$OUT/bench.log"
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit $tests_rc
