"""Extract and run the code blocks of Markdown files, so no snippet in README.md or docs/*.md can rot.

    python scripts/docs_blocks.py README.md docs/*.md            # run them, from a temporary directory
    python scripts/docs_blocks.py --list README.md               # what would run, what is skipped and why
    python scripts/docs_blocks.py --ray docs/ray.md              # also the blocks that need arrowbuf[ray]

Rules (what a writer of docs needs to know):
- ```python blocks run, in order, in one namespace per file (a later block may use what an earlier one defined),
  with the current directory a fresh temporary one and $ARROWBUF_SHM_DIR a private folder (shared-memory names of
  the docs cannot collide with anything else on the machine).
- ```bash / ```sh blocks run with `bash -euo pipefail` in the same directory.
- ```text, ```json, ```yaml, ```toml and ```ini blocks are not code (diagrams, output, formats): never run.
- A block preceded by `<!-- docs-blocks: skip (why) -->` is not run (a fragment, a cluster, the network, minutes of
  work); the reason is required. A bare ``` fence is an error: say what the block is.
- `<!-- docs-blocks: fresh -->` before a python block starts a new namespace.
- `<!-- docs-blocks: ray (why) -->` marks a block that needs arrowbuf[ray] (it starts a local Ray cluster, RLlib):
  it runs only with `--ray` (tests/test_docs_blocks.py installs the wheel's [ray] extra for that), and Ray is shut
  down after the file.
Exit status 1 when a block fails, naming the file and line of the block.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import traceback
from typing import Any

RUN = {"python": "python", "py": "python", "bash": "bash", "sh": "bash"}
TEXT = {"text", "json", "yaml", "toml", "ini", "console-output"}
_MARK = re.compile(r"<!--\s*docs-blocks:\s*(skip|fresh|ray)\s*(\((.+)\))?\s*-->")


@dataclasses.dataclass
class Block:
    path: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None = None  # the reason, when marked skip
    fresh: bool = False
    ray: str | None = None  # the reason, when marked ray (runs with --ray only)


def extract(path: str) -> list[Block]:
    """The fenced blocks of a Markdown file, with their markers; ValueError for a bare fence or a reasonless skip."""
    blocks: list[Block] = []
    lines = open(path, encoding="utf-8").read().splitlines()
    i = 0
    pending: tuple[str, str | None] | None = None
    while i < len(lines):
        line = lines[i]
        mark = _MARK.search(line)
        if mark:
            if mark.group(1) in ("skip", "ray") and not mark.group(3):
                raise ValueError(f"{path}:{i + 1}: docs-blocks: {mark.group(1)} needs a reason in parentheses")
            pending = (mark.group(1), mark.group(3))
        elif line.startswith("```"):
            lang = line[3:].strip().split()[0] if line[3:].strip() else ""
            start = i
            body = []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            if not lang:
                raise ValueError(f"{path}:{start + 1}: a bare ``` fence; name the block (```python, ```text, ...)")
            b = Block(path, start + 1, lang, "\n".join(body) + "\n")
            if pending is not None:
                kind, why = pending
                b.skip = why if kind == "skip" else None
                b.ray = why if kind == "ray" else None
                b.fresh = kind == "fresh"
            pending = None
            blocks.append(b)
        elif line.strip():
            pending = None if not line.strip().startswith("<!--") else pending
        i += 1
    return blocks


def run_file(path: str, python_namespace: dict[str, Any] | None = None, verbose: bool = False,
             ray: bool = False) -> list[str]:
    """Run the runnable blocks of `path` in the current directory (with `ray`, also those marked ray); the
    failures, as 'file:line: error' lines."""
    failures = []
    ns: dict[str, Any] = {"__name__": "__docs__"}
    try:
        failures = _run_blocks(path, ns, verbose, ray)
    finally:
        if ray and "ray" in sys.modules:  # a block's cluster ends with its file
            sys.modules["ray"].shutdown()
    return failures


def _run_blocks(path: str, ns: dict[str, Any], verbose: bool, ray: bool) -> list[str]:
    failures = []
    for b in extract(path):
        if b.skip is not None or b.lang in TEXT or (b.ray is not None and not ray):
            continue
        if b.lang not in RUN:
            failures.append(f"{b.path}:{b.line}: unknown block language {b.lang!r} (python, bash, text, ...)")
            continue
        if verbose:
            print(f"-- {b.path}:{b.line} ({b.lang})", flush=True)
        if RUN[b.lang] == "bash":
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", b.code], capture_output=True, text=True)
            if r.returncode:
                failures.append(f"{b.path}:{b.line}: exit status {r.returncode}: {r.stderr.strip()[-2000:]}")
            continue
        if b.fresh:
            ns = {"__name__": "__docs__"}
        try:
            exec(compile(b.code, f"{b.path}:{b.line}", "exec"), ns)
        except BaseException:  # noqa: BLE001 - any failure of a block is reported with its place
            failures.append(f"{b.path}:{b.line}: {traceback.format_exc()}")
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run the code blocks of Markdown files (see the module docstring).")
    p.add_argument("files", nargs="+")
    p.add_argument("--list", action="store_true", help="list the blocks and whether they run")
    p.add_argument("--in-place", action="store_true", help="run in the current directory, not a temporary one")
    p.add_argument("--ray", action="store_true", help="also run the blocks marked ray (needs arrowbuf[ray])")
    args = p.parse_args(argv)
    files = [os.path.abspath(f) for f in args.files]
    if args.list:
        for f in files:
            for b in extract(f):
                what = ("skip: " + b.skip if b.skip is not None else "ray: " + b.ray if b.ray is not None
                        else "text" if b.lang in TEXT else "run")
                print(f"{f}:{b.line} {b.lang:<7} {what}")
        return 0
    failures: list[str] = []
    for f in files:
        with tempfile.TemporaryDirectory(prefix="arrowbuf-docs-") as tmp:
            cwd = os.getcwd()
            os.makedirs(os.path.join(tmp, ".shm"))
            os.environ["ARROWBUF_SHM_DIR"] = os.path.join(tmp, ".shm")
            if not args.in_place:
                os.chdir(tmp)
            try:
                failures += run_file(f, verbose=True, ray=args.ray)
            finally:
                os.chdir(cwd)
    for line in failures:
        print("FAILED " + line, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
