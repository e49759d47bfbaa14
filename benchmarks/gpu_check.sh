#!/usr/bin/env bash
# Device check of the GPU tier and its device ring (issues 8 and 43), for a machine with a CUDA GPU: the `device`
# tool's machine runs it as `bash benchmarks/gpu_check.sh` from the repository root and it writes under $OUT.
# Under 5 minutes: each stage has its own time limit, so one stuck stage leaves time for the rest.
#
#   1. env.json: versions (python, torch, CUDA, the GPU, numpy, pyarrow, cupy, cuDF, RMM) and the commit;
#   2. tests.log: the GPU-marked tests (tests/test_device_ring.py, tests/test_tiers.py, tests/test_placement.py;
#      with a GPU nothing is skipped but cuDF's, which the device image lacks);
#   3. device.json + bench.log: benchmarks/bench_device.py, baselines in the same run: d2d copy and index_select
#      ceilings (CUDA events); sample(4096) on a 100k-row atari store, the host path + H2D, the old GPU path
#      (chunk slots) and the device ring, 500 calls: rows/s, GB/s vs d2d, host time p50/p99, device time per batch,
#      launches/memcpys/syncs per call (torch.profiler), 20 calls under set_sync_debug_mode("error"); PER sample +
#      update every step vs the host, with a distribution check against the host sampler; a writer at 10k rows/s
#      for 5 s beside the sampler (host time p99, torn rows);
#   4. summary.txt: the test counts, the benchmark table and the issue's Done-when verdicts (device.json "verdict").
#
# The device machine has no network: the script uses $PYTHON (default python3, the image's CUDA torch) as it is,
# with this checkout on PYTHONPATH. GPU_CHECK_INSTALL=1 installs the gpu extra first (a machine with a registry).
# Without a CUDA device (e.g. here, to try the script) the tests skip their CUDA cases and the benchmark runs on
# torch's CPU device with small sizes: a check of the script and the logic, not a GPU figure (summary.txt says so).
set -uo pipefail

OUT=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}   # never an unpinned torch

# 0. optional install (GPU_CHECK_SKIP_INSTALL=1, the old switch, still means: do not install)
if [ "${GPU_CHECK_INSTALL:-0}" = 1 ] && [ "${GPU_CHECK_SKIP_INSTALL:-0}" != 1 ]; then
  VENV=${GPU_VENV:-${TMPDIR:-/tmp}/arrowbuf-gpu-venv}   # outside the tree and $OUT
  [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV" > "$OUT/install.log" 2>&1
  PY=$VENV/bin/python
  {
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || timeout 300 "$PY" -m pip install "$TORCH_PIN"
    timeout 200 "$PY" -m pip install -e ".[gpu,dev]" --extra-index-url https://pypi.nvidia.com
  } >> "$OUT/install.log" 2>&1
fi

# 1. environment
timeout 60 "$PY" - > "$OUT/env.json" 2> "$OUT/env.err" <<'EOF'
import importlib, json, platform, subprocess, sys
env = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform()}
for mod in ("torch", "numpy", "pyarrow", "cupy", "cudf", "rmm", "pytest", "yaml"):
    try:
        env[mod] = getattr(importlib.import_module(mod), "__version__", "?")
    except Exception as exc:  # cupy/cudf raise more than ImportError without CUDA
        env[mod] = f"missing ({type(exc).__name__})"
try:
    import torch
    env["cuda"] = torch.version.cuda
    env["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count}
except Exception as exc:
    env["cuda_available"] = False
    env["torch_error"] = repr(exc)
try:
    import arrowbuf
    from arrowbuf.tiers.gpu import gpu_environment
    env["arrowbuf"] = arrowbuf.__file__
    env["gpu_environment"] = gpu_environment()
except Exception as exc:
    env["arrowbuf_error"] = repr(exc)
try:
    env["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
except Exception:
    pass
try:
    env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm",
                                        "--format=csv,noheader"], capture_output=True, text=True,
                                       timeout=20).stdout.strip()
except Exception as exc:
    env["nvidia_smi"] = f"not run ({type(exc).__name__})"
print(json.dumps(env, indent=2))
EOF
CUDA=$("$PY" -c "import json,sys; print(1 if json.load(open(sys.argv[1])).get('cuda_available') else 0)" \
        "$OUT/env.json" 2>/dev/null || echo 0)

# 2. tests (CUDA cases skip without a device)
timeout 170 "$PY" -m pytest tests/test_device_ring.py tests/test_tiers.py tests/test_placement.py -q -rs \
  -p no:cacheprovider --durations=8 > "$OUT/tests.log" 2>&1
tests_rc=$?

# 3. the device benchmark (with CUDA: the issue's sizes; without: torch's CPU device, small, a logic check)
if [ "$CUDA" = 1 ]; then
  BENCH_ARGS=(--device cuda)
else
  BENCH_ARGS=(--device cpu --quick)
fi
timeout 240 "$PY" -m benchmarks.bench_device "${BENCH_ARGS[@]}" --out "$OUT/device.json" > "$OUT/bench.log" 2>&1
bench_rc=$?

# 4. summary
{
  echo "gpu_check: CUDA device: $([ "$CUDA" = 1 ] && echo yes || echo 'NO: tests skipped their CUDA cases; the benchmark ran on the CPU (no GPU figure)')"
  echo "tests: exit $tests_rc"
  tail -n 3 "$OUT/tests.log"
  echo "bench: exit $bench_rc (${BENCH_ARGS[*]})"
  cat "$OUT/bench.log"
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
