"""Core store benchmark (issue: core store): append, extend, uniform sample, bytes per transition.

Measures arrowbuf, its ceilings (memcpy, a numpy gather of the same rows from preallocated arrays) and the peers
(cpprb ReplayBuffer, TorchRL LazyTensorStorage / LazyMemmapStorage) in one run, on the atari and mujoco workloads.
Prints a table and writes benchmarks/out/core.json.

    python -m benchmarks.bench_core [--quick] [--workloads atari mujoco] [--no-peers]
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import platform
import statistics
import sys
import time

import numpy as np

import arrowbuf as ab

from . import ceilings
from .workloads import make_steps, median_rate, transition_bytes

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
CAPACITY = {"atari": 100_000, "mujoco": 1_000_000}


def schema_for(workload: str) -> ab.ExperienceSchema:
    return ab.load_schema(ROOT / "schemas" / f"{workload}.yaml")


def fill(store: ab.ExperienceStore, pool: dict, rows: int, chunk: int = 1000) -> float:
    """Extend `rows` rows from a repeating pool; returns seconds."""
    p = len(pool["obs"])
    t0 = time.perf_counter()
    done = 0
    while done < rows:
        s = done % p
        k = min(chunk, p - s, rows - done)
        store.extend({c: v[s:s + k] for c, v in pool.items()})
        done += k
    return time.perf_counter() - t0


def measure_arrowbuf(workload: str, capacity: int, pool: dict, memcpy_gbps: float) -> dict:
    schema = schema_for(workload)
    store = ab.ExperienceStore(schema, capacity=capacity, seed=0)
    res: dict = {"peer": "arrowbuf", "version": ab.__version__, "capacity": capacity}
    first = fill(store, pool, capacity)
    stored_row_bytes = sum(f.row_bytes for f in schema.fields.values())
    res["first_fill_mb_s"] = capacity * transition_bytes(workload) / first / 1e6
    # extend, steady state (the ring has wrapped)
    rows = min(capacity, 20_000 if workload == "atari" else 200_000)
    ext = [rows * transition_bytes(workload) / fill(store, pool, rows) / 1e6 for _ in range(3)]
    res["extend_mb_s"] = statistics.median(ext)
    res["extend_stored_gb_s"] = res["extend_mb_s"] / transition_bytes(workload) * stored_row_bytes / 1e3
    res["extend_vs_memcpy"] = res["extend_stored_gb_s"] / memcpy_gbps
    # per-step append, steady state
    steps = [{c: v[i] for c, v in pool.items()} for i in range(min(2000, len(pool["obs"])))]
    for s in steps:
        s["reward"] = float(s["reward"])
        s["terminated"] = bool(s["terminated"])
        s["truncated"] = bool(s["truncated"])
        if s["action"].shape == ():
            s["action"] = int(s["action"])
    n_app = 20_000

    def append_run():
        for i in range(n_app):
            store.append(steps[i % len(steps)])

    res["append_steps_s"] = median_rate(append_run, repeat=3, number=1, items=n_app, warmup=0)
    for b in (256, 4096):
        number = max(1, int(64e6 // (transition_bytes(workload) * b)))
        res[f"sample_{b}_per_s"] = median_rate(lambda: store.sample(b), repeat=5, number=number, items=b)
    tier_bytes = store.stats()["bytes"]["host"]
    res["bytes_per_transition"] = tier_bytes / capacity
    res["bytes_vs_separate"] = res["bytes_per_transition"] / transition_bytes(workload)
    store.close()
    del store
    gc.collect()
    return res


def run(workloads: list[str], quick: bool, peers: bool) -> dict:
    out: dict = {"machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                             "numpy": np.__version__, "cpus": __import__("os").cpu_count()},
                 "workloads": {}}
    mem = ceilings.memcpy_bandwidth(128 << 20 if quick else 256 << 20)
    out["memcpy"] = mem
    for w in workloads:
        cap = CAPACITY[w] // (10 if quick else 1)
        pool = make_steps(w, 2000, seed=0, episode_len=500)
        row: dict = {"capacity": cap}
        row["arrowbuf"] = measure_arrowbuf(w, cap, pool, mem["gbps"])
        store = ceilings.numpy_store(w, cap, pool=pool)
        row["numpy_gather"] = {b: ceilings.gather(w, b, store=store)["transitions_per_s"] for b in (256, 4096)}
        row["numpy_gather_sorted"] = {b: ceilings.gather(w, b, store=store, sorted_indices=True)["transitions_per_s"]
                                      for b in (256, 4096)}
        row["numpy_ring"] = ceilings.numpy_ring(w, store=store)
        del store
        gc.collect()
        if peers:
            from . import peers as peer_mod

            row["cpprb"] = peer_mod.cpprb_buffer(w, capacity=cap)
            gc.collect()
            row["torchrl_tensor"] = peer_mod.torchrl_buffer(w, storage="tensor", capacity=cap)
            gc.collect()
            row["torchrl_memmap"] = peer_mod.torchrl_buffer(w, storage="memmap", capacity=cap)
            gc.collect()
        out["workloads"][w] = row
    return out


def _get(d: dict | None, *keys: str) -> float | None:
    for k in keys:
        if d and isinstance(d.get(k), (int, float)):
            return float(d[k])
    return None


def print_table(res: dict) -> str:
    lines = [f"memcpy {res['memcpy']['gbps']:.1f} GB/s (first touch {res['memcpy']['first_touch_gbps']:.1f})"]
    head = f"{'workload':8} {'row':26} {'arrowbuf':>12} {'ceiling':>12} {'ratio':>6} {'cpprb':>12} {'torchrl':>12}"
    lines.append(head)
    for w, row in res["workloads"].items():
        a = row["arrowbuf"]
        cp, tr = row.get("cpprb"), row.get("torchrl_tensor")

        def fmt(v: float | None) -> str:
            return "-" if v is None else (f"{v:,.0f}" if v >= 100 else f"{v:.3f}")

        rows = [
            ("append steps/s", a["append_steps_s"], None, _get(cp, "append_steps_s"), _get(tr, "append_steps_s")),
            ("extend 1000 MB/s", a["extend_mb_s"], None, _get(cp, "extend_mb_s"), _get(tr, "extend_mb_s")),
            ("extend stored GB/s vs memcpy", a["extend_stored_gb_s"], res["memcpy"]["gbps"], None, None),
        ]
        for b in (256, 4096):
            rows.append((f"sample {b} /s (vs numpy)", a[f"sample_{b}_per_s"], row["numpy_gather"][b],
                         _get(cp, f"sample_{b}_per_s"), _get(tr, f"sample_{b}_per_s")))
        rows.append(("bytes/transition", a["bytes_per_transition"], float(transition_bytes(w)),
                     _get(cp, "bytes_per_transition"), _get(tr, "bytes_per_transition")))
        for name, v, ceil, c, t in rows:
            ratio = "-" if ceil is None else f"{v / ceil:.2f}"
            lines.append(f"{w:8} {name:26} {fmt(v):>12} {fmt(ceil):>12} {ratio:>6} {fmt(c):>12} {fmt(t):>12}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["atari", "mujoco"])
    p.add_argument("--quick", action="store_true", help="a tenth of the capacities")
    p.add_argument("--no-peers", action="store_true")
    args = p.parse_args(argv)
    res = run(args.workloads, args.quick, not args.no_peers)
    table = print_table(res)
    print(table)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "core.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
