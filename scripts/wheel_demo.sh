#!/usr/bin/env bash
# What a new user gets: build the wheel, install it with only its [demo] extra (torch pinned to the CPU wheel on the
# same command line) into a clean venv outside the repository, then run the demo and load a shipped schema from a
# folder outside the repository. Run by .ci/run. Usage: bash scripts/wheel_demo.sh [demo flags, default --steps 2000]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
TMP=$(mktemp -d "${TMPDIR:-/tmp}/arrowbuf-wheel.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
unset PYTHONPATH  # nothing from the repository may leak into the clean venv
t0=$(date +%s)
# a clean copy of the tree (tracked and new files, nothing ignored): no stale build/ output can reach the wheel
mkdir "$TMP/src"
(cd "$ROOT" && git ls-files -z -co --exclude-standard | tar --null -T - -cf -) | tar -C "$TMP/src" -xf -
"$PY" -m venv "$TMP/venv"
"$TMP/venv/bin/python" -m pip wheel -q --no-deps -w "$TMP/dist" "$TMP/src"
wheel=$(ls "$TMP"/dist/arrowbuf-*.whl)
# (pip warns once per package about an empty local index of this machine: noise, filtered)
# (--no-compile: byte-compiling every installed module, torch's thousands, was most of the install's CPU time; the
# demo compiles what it imports. The installed files are the same)
"$TMP/venv/bin/python" -m pip install -q --no-compile "${wheel}[demo]" 'torch==2.13.0' 2>&1 \
  | grep -v "is ignored: it is neither" || true
"$TMP/venv/bin/python" -m pip check
t1=$(date +%s)
mkdir "$TMP/run"
cd "$TMP/run"
"$TMP/venv/bin/python" - "$TMP/venv" <<'PY'
import sys, arrowbuf as ab
arrowbuf_file = ab.__file__
assert arrowbuf_file.startswith(sys.argv[1]), f"arrowbuf imported from {arrowbuf_file}, not from the clean venv"
print("installed:", arrowbuf_file, "schemas:", [ab.load_schema(n).name for n in ("atari", "cartpole", "tokens")])
PY
if [ $# -eq 0 ]; then set -- --steps 2000; fi
"$TMP/venv/bin/python" -m arrowbuf.demo --no-progress --out "$TMP/run/out" "$@"
test -s "$TMP/run/out/returns.png"
t2=$(date +%s)
echo "wheel demo: build + install $((t1 - t0))s, demo $((t2 - t1))s"
