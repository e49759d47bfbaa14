"""Run the generated TorchRL suite (generate.py) over ArrowbufStorage and LazyTensorStorage and count the outcomes.

    python tests/compat/torchrl_suite/run.py [--out DIR] [--timeout 60] [--file test_storages.py ...]

The files run in one pytest process (torch, TorchRL and the collection are paid once: about 8 s a process here;
with --twins failed, a second one runs the LazyTensorStorage twins of ArrowbufStorage's failures only),
under report_plugin's per-phase time limit and a whole-run limit; a run killed by the latter reports its unfinished
tests as "timeout". Only the tests whose
parametrization names one of the two storages run (`-k`). Nothing is fetched: the suite is upstream/ plus the
mechanical edit of generate.py. Prints passed/failed/skipped/timeout per storage and, with --compare, every
ArrowbufStorage test that fails where its LazyTensorStorage twin passes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from types import ModuleType

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent


def _generate_module() -> ModuleType:
    # loaded by path, not through sys.path: this folder holds the suite's conftest.py, and a process started by a
    # test of the project's suite (multiprocessing's spawn copies sys.path) would import it as its `conftest`
    spec = importlib.util.spec_from_file_location("torchrl_suite_generate", HERE / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


generate = _generate_module().generate

OURS, PEER = "ArrowbufStorage", "LazyTensorStorage"


def run(out: pathlib.Path, files: list[str] | None = None, timeout: float = 60.0,
        file_timeout: float = 3600.0, root: pathlib.Path = ROOT, sum_trees: bool = False,
        shard: tuple[int, int] | None = None, twins: str = "all") -> list[dict]:
    """Generate the suite into `out`, run it with arrowbuf imported from `root`, and return the report's records
    (one per test); `shard=(i, n)`: only shard i of n of the tests (report_plugin's --ab-shard); `file_timeout`:
    each pytest run's limit. `twins="all"` runs every test of both storages in one pytest process;
    `twins="failed"` runs the ArrowbufStorage tests, then only the LazyTensorStorage twins of those that failed or
    timed out (a regression is an ArrowbufStorage failure whose twin passes: `regressions` finds the same ones, for
    about half the work)."""
    if twins not in ("all", "failed"):
        raise ValueError(f"twins must be 'all' or 'failed', not {twins!r}")
    added = generate(out)
    shutil.copy(HERE / "report_plugin.py", out / "report_plugin.py")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(out), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    sharding = [f"--ab-shard={shard[0]}/{shard[1]}"] if shard else []
    paths = [f"rb/{name}" for name in (files or sorted(added))]
    report = out / "report.jsonl"
    base = ["-p", "report_plugin", f"--ab-report={report}", f"--ab-timeout={timeout}", "-q", "-p",
            "no:cacheprovider", "-p", "no:randomly", *(["--ab-sum-trees"] if sum_trees else [])]
    if twins == "all":
        return _pytest(out, env, base, ["-k", f"{OURS} or {PEER}", *paths, *sharding], report, file_timeout)
    records = _pytest(out, env, base, ["-k", OURS, *paths, *sharding], report, file_timeout)
    failed = sorted({r["twin"] for r in records if r["storage"] == OURS and r["outcome"] in ("failed", "timeout")})
    if failed:
        only = out / "twins.txt"
        only.write_text("\n".join(failed) + "\n")
        written = len(report.read_text().splitlines()) if report.exists() else 0
        records += _pytest(out, env, base, ["-k", PEER, f"--ab-only={only}", *paths], report, file_timeout,
                           skip=written)
    return records


def _pytest(out: pathlib.Path, env: dict[str, str], base: list[str], select: list[str], report: pathlib.Path,
            file_timeout: float, skip: int = 0) -> list[dict]:
    """One pytest process over the suite; the records it added to `report` (past its first `skip` lines), with
    the tests it never finished (killed at `file_timeout`) as "timeout"."""
    cmd = [sys.executable, "-m", "pytest", *base, *select]
    try:
        subprocess.run(cmd, cwd=out, env=env, timeout=file_timeout, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, start_new_session=True)
        killed = False
    except subprocess.TimeoutExpired:
        killed = True
    lines = report.read_text().splitlines()[skip:] if report.exists() else []
    records = [json.loads(line) for line in lines]
    if killed:  # the tests it never finished: collect them and report them as timeouts
        done = {r["nodeid"] for r in records}
        listed = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "report_plugin", *select],
                                cwd=out, env=env, capture_output=True, text=True).stdout.splitlines()
        for nid in (x for x in listed if "::" in x and x not in done):
            st = OURS if OURS in nid else PEER if PEER in nid else None
            records.append({"nodeid": nid, "twin": nid.replace(OURS, PEER), "storage": st, "outcome": "timeout",
                            "message": "the run was killed"})
    return records


def counts(records: list[dict]) -> dict[str, Counter]:
    out: dict[str, Counter] = {OURS: Counter(), PEER: Counter()}
    for r in records:
        if r["storage"] in out:
            out[r["storage"]][r["outcome"]] += 1
    return out


def regressions(records: list[dict]) -> dict[str, str]:
    """ArrowbufStorage tests that failed (or timed out) where their LazyTensorStorage twin passed: {nodeid: message}.
    A test that skips itself for a storage other than LazyTensorStorage (as `test_extend_sample_recompile` does)
    is not counted."""
    peer = {r["nodeid"]: r["outcome"] for r in records if r["storage"] == PEER}
    return {r["nodeid"]: f"{r['outcome']}: {r['message']}" for r in records
            if r["storage"] == OURS and r["outcome"] in ("failed", "timeout") and peer.get(r["twin"]) == "passed"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--file", nargs="*", default=None)
    p.add_argument("--compare", action="store_true")
    p.add_argument("--json", type=pathlib.Path, default=None, help="write every record here")
    p.add_argument("--root", type=pathlib.Path, default=ROOT, help="import arrowbuf from here (default: this checkout)")
    p.add_argument("--sum-trees", action="store_true", help="TorchRL's PrioritizedSampler on arrowbuf's sum trees")
    p.add_argument("--twins", choices=("all", "failed"), default="all",
                   help="run every LazyTensorStorage twin (all) or only those of ArrowbufStorage's failures")
    args = p.parse_args(argv)
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="torchrl_suite_"))
    records = run(out, args.file, args.timeout, root=args.root, sum_trees=args.sum_trees, twins=args.twins)
    if args.json:
        args.json.write_text(json.dumps(records, indent=0))
    for storage, c in counts(records).items():
        print(f"{storage:18} " + "  ".join(f"{k} {c[k]}" for k in ("passed", "failed", "skipped", "timeout")))
    if args.compare:
        for nid, msg in sorted(regressions(records).items()):
            print(f"REGRESSION {nid}  {msg}")
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
