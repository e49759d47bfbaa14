#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# .ci/run has just run it (ARROWBUF_SETUP_DONE=1): a second pass resolves every requirement again and rebuilds the
# editable install, for nothing
if [ -z "${ARROWBUF_SETUP_DONE:-}" ]; then
  bash scripts/setup.sh
fi
# a temporary-directory root of this run's own: pytest prunes the older roots under /tmp/pytest-of-$USER, which
# would pull the directories from under another pytest session running on the machine at the same time
base=$(mktemp -d "${TMPDIR:-/tmp}/arrowbuf-pytest.XXXXXX")
trap 'rm -rf "$base"' EXIT
# the suite runs in pytest-xdist workers, one per core (most tests wait on processes, servers and disks): a group of
# tests that must share one worker says so with xdist_group (the Ray tests: tests/conftest.py). ARROWBUF_TEST_WORKERS
# overrides the count ("0": in this process, as plain pytest). Not more than the cores: with 3 workers on 2 cores the
# other tests were done in 465 s but the Ray group, slowed by the third worker, took 664 s (678 s in all, against 620
# s with 2)
workers=${ARROWBUF_TEST_WORKERS:-$(nproc)}
# bytecode caches written (gitignored __pycache__): the suite starts hundreds of Python processes that import
# arrowbuf (servers, writers, crash and soak workers, Ray actors), and where PYTHONDONTWRITEBYTECODE is set (as on
# this project's machines) each compiled every module it imported from source again (0.56 against 0.33 CPU-s for
# arrowbuf, its Ray and TransferQueue parts), and each pytest worker rewrote the asserts of every test module again
unset PYTHONDONTWRITEBYTECODE
.venv/bin/python -m pytest -q --durations=25 --basetemp="$base" -n "$workers" --dist loadgroup "$@"
