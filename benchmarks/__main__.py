"""Run every benchmark of the project and write benchmarks/RESULTS.md (tables) and benchmarks/out/*.json.

    python -m benchmarks                 # everything, full sizes
    python -m benchmarks --quick         # smaller capacities, for a smoke run
    python -m benchmarks --only core sampling

Each benchmark runs in its own process (so one's memory does not colour the next) and prints its table; this runner
collects the tables with the machine and library versions. Machines here are shared and noisy: run it more than once
and compare medians.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import pathlib
import platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
# name -> (module, extra args for --quick, title)
BENCHMARKS = {
    "core": ("benchmarks.bench_core", ["--quick"], "Core store: append, extend, uniform sample, bytes"),
    "sampling": ("benchmarks.bench_sampling", ["--quick"], "Sampling: prioritized replay and sequences"),
    "shm": ("benchmarks.bench_shm", ["--quick"], "Shared memory: writer processes and a sampler"),
    "flight": ("benchmarks.bench_flight", ["--quick"], "Flight: remote sampling and ingest over loopback"),
    "loader": ("benchmarks.bench_loader", ["--quick"], "Loader: exposed experience-path latency"),
    "tiers": ("benchmarks.bench_tiers", ["--quick"], "Tiers and placement: spill and cold columns"),
    "ray": ("benchmarks.bench_ray", ["--quick"], "Ray: sharded stores"),
    "persist": ("benchmarks.bench_persist", ["--quick"], "Persistence: checkpoint, incremental, background, restore"),
    "llm": ("benchmarks.bench_llm", ["--quick"], "LLM data path: TransferQueue's workload, ragged, GRPO-shaped rows"),
    "leases": ("benchmarks.bench_leases", ["--quick"], "Leases: consume(lease)+ack against consume"),
    "shm_consume": ("benchmarks.bench_shm_consume", ["--quick"], "consume over shared memory against in process"),
    "observe": ("benchmarks.bench_observe", ["--quick"], "Observability: metrics and lineage on vs off"),
    "scale": ("benchmarks.bench_scale", ["--quick"], "The 32-process scale run on a local 3-node Ray cluster"),
    "tq_xproc": ("benchmarks.bench_tq_xproc", ["--quick"],
                 "TransferQueue's workload across processes: shared memory, Flight, raw Flight (TransferQueue: full)"),
    "parts_cpu": ("benchmarks.bench_parts_cpu", ["--quick"],
                  "CPU of a parted Flight PUT (direct into the ring, assembled) against raw DoPut, one process"),
    "torchrl": ("benchmarks.bench_torchrl", ["--quick"],
                "TorchRL ReplayBuffer over ArrowbufStorage against LazyTensorStorage: extend and sample"),
    "peers": ("benchmarks.peers", [], "Peers and ceilings alone"),
}
DEFAULT = ["core", "sampling", "shm", "flight", "loader", "tiers", "ray", "persist", "llm", "leases", "shm_consume",
           "observe"]


def versions() -> str:
    out = []
    for dist in ["arrowbuf", "pyarrow", "numpy", "torch", "cpprb", "torchrl", "duckdb", "ray"]:
        try:
            out.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{dist} -")
    return ", ".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark")
    args = ap.parse_args(argv)
    names = args.only or DEFAULT
    sections = []
    from arrowbuf.observe.meter import ProgressMeter

    # each benchmark runs for minutes with its output captured: a bar (a terminal) or a line every 2 s (a log) says
    # which one runs, how many are done and about how long the rest takes
    bar = ProgressMeter(len(names), "benchmarks", "benchmark")
    for name in names:
        module, quick_args, title = BENCHMARKS[name]
        spec = module.replace(".", "/") + ".py"
        if not (ROOT / spec).exists():
            sections.append(f"## {title}\n\nnot available yet ({spec} missing)\n")
            bar.update(1)
            continue
        cmd = [sys.executable, "-m", module, *(quick_args if args.quick else [])]
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        bar.note(f"running {name}")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
            body, rc = proc.stdout, proc.returncode
            if rc:
                body += f"\n(exit {rc})\n{proc.stderr[-2000:]}"
        except subprocess.TimeoutExpired:
            body, rc = f"timed out after {args.timeout:.0f}s", -1
        print(body, flush=True)
        bar.update(1)
        sections.append(f"## {title}\n\n`python -m {module}{' --quick' if args.quick else ''}` "
                        f"({time.perf_counter() - t0:.0f}s)\n\n```\n{body.strip()}\n```\n")
    head = (f"# Benchmark results\n\nWritten by `python -m benchmarks{' --quick' if args.quick else ''}` on "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.\n\n"
            f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}.\n"
            f"Versions: {versions()}.\n\nRatios are to the ceiling measured in the same run (memcpy, a numpy gather "
            "of the same rows, raw Flight); see benchmarks/README.md for the targets and the discussion.\n\n")
    bar.close()
    (ROOT / "benchmarks" / "RESULTS.md").write_text(head + "\n".join(sections))
    print(f"wrote {ROOT / 'benchmarks' / 'RESULTS.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
