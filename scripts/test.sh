#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# a temporary-directory root of this run's own: pytest prunes the older roots under /tmp/pytest-of-$USER, which
# would pull the directories from under another pytest session running on the machine at the same time
base=$(mktemp -d "${TMPDIR:-/tmp}/arrowbuf-pytest.XXXXXX")
trap 'rm -rf "$base"' EXIT
.venv/bin/python -m pytest -q --durations=25 --basetemp="$base" "$@"
