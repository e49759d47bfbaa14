"""What a lease costs a consumer (issue 25): `consume(task, B, lease=s)` + `ack` against `consume(task, B)`.

Rows: in process, `consume` without a lease (the ceiling: the old path, same store, same run) and with a lease plus
its `ack`; over Flight on loopback (server in this process), `remote.sample(B)` of the same store (the ceiling: one
DoGet of the same rows, no consumption), `remote.consume(task, B)` (served under a guard lease since issue 25: a call
cancelled meanwhile consumes nothing), and `remote.consume(task, B, lease=s)` plus the `ack` action (a second call).
The variants alternate call by call (in a shuffled order each round), so the machine's drifting load colours them
alike; medians of per-call times. Prints a table and writes benchmarks/out/leases.json.

    python -m benchmarks.bench_leases [--quick] [--batch 64] [--calls 400]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
SCHEMA = {"name": "leasebench", "fields": {
    "prompt_id": {"dtype": "int64"},
    "response_tokens": {"dtype": "int32", "ragged": True},
    "reward": {"dtype": "float32"},
    "policy_version": {"dtype": "int64"},
}}


def _rows(n: int, start: int) -> dict[str, Any]:
    i = np.arange(start, start + n)
    return {"prompt_id": i, "response_tokens": [np.arange(64, dtype=np.int32)] * n,
            "reward": i.astype(np.float32), "policy_version": np.zeros(n, np.int64)}


def measure(batch: int, calls: int) -> dict[str, Any]:
    import arrowbuf as ab

    variants = ["local consume", "local consume(lease)+ack", "flight sample (ceiling)", "flight consume",
                "flight consume(lease)+ack"]
    tasks = {v: f"t{k}" for k, v in enumerate(variants)}
    warm = 20
    rows = (calls + warm) * batch
    times: dict[str, list[float]] = {v: [] for v in variants}
    with ab.ExperienceStore(SCHEMA, capacity=max(1 << 10, rows), tasks=list(tasks.values())) as store, \
            ab.serve(store) as server, ab.connect(server.location) as remote:
        for k in range(0, rows, 4096):
            store.extend(_rows(min(4096, rows - k), k))
        fns: dict[str, Callable[[], Any]] = {
            "local consume": lambda: store.consume(tasks["local consume"], batch),
            "local consume(lease)+ack": lambda: store.consume(tasks["local consume(lease)+ack"], batch,
                                                              lease=60).ack(),
            "flight sample (ceiling)": lambda: remote.sample(batch),
            "flight consume": lambda: remote.consume(tasks["flight consume"], batch),
            "flight consume(lease)+ack": lambda: remote.consume(tasks["flight consume(lease)+ack"], batch,
                                                                lease=60).ack(),
        }
        order = list(fns)
        rng = random.Random(0)
        for i in range(calls + warm):
            rng.shuffle(order)  # no variant always runs right after another
            for v in order:
                fn = fns[v]
                t0 = time.perf_counter()
                fn()
                if i >= warm:
                    times[v].append(time.perf_counter() - t0)
        consumed = store.stats()["consumed"]
    out: dict[str, Any] = {"batch": batch, "calls": calls, "load": os.getloadavg()}
    for v in variants:
        us = np.asarray(times[v]) * 1e6
        out[v] = {"p50_us": float(np.median(us)), "p99_us": float(np.percentile(us, 99))}
    local, flight = out["local consume"]["p50_us"], out["flight sample (ceiling)"]["p50_us"]
    for v in variants:
        base = flight if v.startswith("flight") else local
        out[v]["x_ceiling"] = out[v]["p50_us"] / base
    out["rows_consumed"] = {v: int(consumed[tasks[v]]) for v in variants if not v.startswith("flight sample")}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--calls", type=int, default=None)
    args = ap.parse_args(argv)
    calls = args.calls or (100 if args.quick else 400)
    res = measure(args.batch, calls)
    print(f"leases: {args.batch}-row batches, {calls} calls per row alternated, load {res['load'][0]:.1f}")
    print(f"{'call':<28} {'p50 us':>9} {'p99 us':>9} {'x ceiling':>10}")
    for k, v in res.items():
        if isinstance(v, dict) and "p50_us" in v:
            print(f"{k:<28} {v['p50_us']:>9.0f} {v['p99_us']:>9.0f} {v['x_ceiling']:>10.2f}")
    print("ceilings: in process, consume without a lease; over Flight, remote.sample of the same rows")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "leases.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
