#!/usr/bin/env bash
# Create .venv (once) and install arrowbuf with the extras the demo, tests and benchmarks use. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# torch is pinned: the CPU wheel 2.13.0 lies on this machine; an unpinned torch would pull a multi-GB CUDA build.
# transferqueue==0.1.11: its wheel ships the tests tests/test_compat_tq_suite.py runs against arrowbuf.compat (and
# tests/test_compat_tq_diff.py compares the two); with these pins it adds only leaf packages (hydra-core, omegaconf,
# msgspec, pyzmq, psutil) and changes no version of torch, tensordict, ray, numpy or pyarrow.
.venv/bin/python -m pip install -q -e '.[query,dev,demo,ray,compat,metrics,uitest,fast]' 'torch==2.13.0' cryptography \
  'prometheus-client==0.26.0' 'isal==1.9.1' 'transferqueue==0.1.11'
