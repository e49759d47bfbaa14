"""Flight per-call cost (issue 18): raw DoGet and `remote.sample(B)` alternated call by call, sessions block by block.

bench_flight measures each row as one timed loop after another; on a shared 2-core machine the load drifts between
the two loops. Here the ceiling and arrowbuf alternate at the finest grain (one call each; sessions: 20 batches of a
raw DoGet stream, then 20 of the session), and the medians of the per-call times are compared. It also reports the
CPU time each call costs the client (this process) and the server (its process, from /proc, 10 ms ticks summed over
all calls), which the machine's load changes less than wall time. The servers are bench_flight's (a subprocess with
the arrowbuf server and the raw server).

    python -m benchmarks.bench_flight_percall [--workload mujoco] [--batch 256] [--calls 500]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np
import pyarrow.flight as flight

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCK = 20


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        parts = fh.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def measure(workload: str, n: int, calls: int) -> dict[str, Any]:
    import arrowbuf as ab

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_flight", "--serve", workload], cwd=ROOT,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        locations = json.loads(proc.stdout.readline())
        raw = flight.FlightClient(locations["raw"])
        remote = ab.connect(locations["ab"], store=workload)
        ticket = flight.Ticket(json.dumps({"key": f"{workload}:{n}", "count": 1}).encode())

        def raw_get() -> None:
            reader = raw.do_get(ticket)
            reader.read_chunk()
            with contextlib.suppress(StopIteration):
                reader.read_chunk()

        fns: dict[str, Callable[[], Any]] = {"raw": raw_get, "arrowbuf": lambda: remote.sample(n)}
        for _ in range(10):
            for fn in fns.values():
                fn()
        times: dict[str, list[float]] = {k: [] for k in fns}
        cpu = {k: [0.0, 0.0] for k in fns}
        for _ in range(calls):
            for name, fn in fns.items():
                c0, s0, t0 = time.process_time(), _proc_cpu(proc.pid), time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                cpu[name][0] += time.process_time() - c0
                cpu[name][1] += _proc_cpu(proc.pid) - s0
        out: dict[str, Any] = {"workload": workload, "batch": n, "calls": calls}
        for name in fns:
            out[f"doget_{name}_us"] = float(np.median(times[name]) * 1e6)
            out[f"cpu_{name}_client_us"] = cpu[name][0] / calls * 1e6
            out[f"cpu_{name}_server_us"] = cpu[name][1] / calls * 1e6
        out["doget_ratio"] = out["doget_raw_us"] / out["doget_arrowbuf_us"]
        stream = flight.Ticket(json.dumps({"key": f"{workload}:{n}", "count": BLOCK}).encode())
        blocks: dict[str, list[float]] = {"raw": [], "prefetch2": [], "prefetch0": []}
        for prefetch in (2, 0):
            with remote.session(n, prefetch=prefetch, ahead=2) as session:
                next(session)
                for _ in range(max(3, calls // BLOCK)):
                    t0 = time.perf_counter()
                    for _ in raw.do_get(stream):
                        pass
                    blocks["raw"].append((time.perf_counter() - t0) / BLOCK)
                    t0 = time.perf_counter()
                    for _ in range(BLOCK):
                        next(session)
                    blocks[f"prefetch{prefetch}"].append((time.perf_counter() - t0) / BLOCK)
        for name, values in blocks.items():
            out[f"session_{name}_us"] = float(np.median(values) * 1e6)
        for name in ("prefetch2", "prefetch0"):
            out[f"session_{name}_ratio"] = out["session_raw_us"] / out[f"session_{name}_us"]
        remote.close()
        raw.close()
        return out
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(60)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="mujoco", choices=["atari", "mujoco"])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--calls", type=int, default=500)
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    r = measure(args.workload, args.batch, args.calls)
    print(f"{r['workload']} b{r['batch']} DoGet: raw {r['doget_raw_us']:.0f} us, arrowbuf "
          f"{r['doget_arrowbuf_us']:.0f} us per call (median of {r['calls']} alternated), ratio "
          f"{r['doget_ratio']:.2f}; CPU us per call client/server:"
          f" raw {r['cpu_raw_client_us']:.0f}/{r['cpu_raw_server_us']:.0f}, arrowbuf {r['cpu_arrowbuf_client_us']:.0f}"
          f"/{r['cpu_arrowbuf_server_us']:.0f}")
    print(f"{r['workload']} b{r['batch']} session: raw stream {r['session_raw_us']:.0f} us per batch, prefetch 2 "
          f"{r['session_prefetch2_us']:.0f} ({r['session_prefetch2_ratio']:.2f}), prefetch 0 "
          f"{r['session_prefetch0_us']:.0f} ({r['session_prefetch0_ratio']:.2f}); load average {load:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
