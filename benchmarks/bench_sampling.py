"""Sampling-semantics benchmark (issue: sampling): prioritized replay and sequence sampling.

Rows, measured in one run with the peers:
- PER: sample 256 + update_priorities of those 256, arrowbuf `Prioritized(alpha=0.6, beta=0.4)` against cpprb
  `PrioritizedReplayBuffer(alpha=0.6)` (`sample(beta=0.4)`, next_of="obs") and TorchRL `PrioritizedSampler` (where
  its C++ extension loads), same process, right after each other: iterations/s and the ratio to cpprb. Two
  workloads: mujoco (capacity 1M; 100k with --quick) and atari (capacity 100k, 4x84x84 uint8 frame stacks, next_obs
  derived on both sides: each iteration gathers 256 x 2 frame stacks, 14.5 MB).
- Sequences: T=20 windows, batch 64, obs float32[8], episodes of 1000 steps, with 1M and 10M stored rows: seconds per
  batch for arrowbuf's Sequence sampler and TorchRL's SliceSampler.

    python -m benchmarks.bench_sampling [--quick] [--no-peers] [--per-only] [--workloads atari,mujoco]

`ARROWBUF_BENCH_CLOCK=thread` times CPU time of the benchmark thread instead of wall time (see workloads.py); both
arrowbuf and cpprb sample in the calling thread, so page faults (system time) count on both sides.
Writes benchmarks/out/sampling.json (`per` keyed by workload, then by peer).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import statistics
import sys
import time

import numpy as np

import arrowbuf as ab

from .workloads import make_steps, median_rate

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"


PER_CAPACITY = {"mujoco": 1_000_000, "atari": 100_000}


def arrowbuf_per(capacity: int, batch: int = 256, workload: str = "mujoco", repeat: int = 5) -> dict:
    schema = ab.load_schema(ROOT / "schemas" / f"{workload}.yaml")
    store = ab.ExperienceStore(schema, capacity, sampler=ab.samplers.Prioritized(alpha=0.6, beta=0.4), seed=0)
    pool = make_steps(workload, 2000, seed=3, episode_len=500 if workload == "mujoco" else 1000)
    t0 = time.perf_counter()
    done = 0
    while done < capacity:
        s = done % 2000
        k = min(1000, 2000 - s, capacity - done)
        store.extend({c: v[s:s + k] for c, v in pool.items()})
        done += k
    fill = time.perf_counter() - t0
    del pool
    rng = np.random.default_rng(0)

    def it():
        b = store.sample(batch)
        store.update_priorities(b.indices, rng.random(batch) + 1e-3)

    r = median_rate(it, repeat=repeat, number=200, items=1, warmup=20)
    tree = median_rate(lambda: store.sampler.select(batch), repeat=repeat, number=500, items=1, warmup=20)
    outputs = store.stats().get("output_pool")
    store.close()
    gc.collect()
    return {"peer": "arrowbuf.Prioritized", "workload": workload, "capacity": capacity, "batch": batch,
            "iterations_per_s": r, "transitions_per_s": r * batch, "select_only_per_s": tree, "fill_seconds": fill,
            "output_pool": outputs,
            "note": "sample (gather of all columns incl. derived next_obs) + update_priorities, alpha=0.6 beta=0.4"}


def per_rows(workload: str, capacity: int, peers: bool, repeat: int = 5) -> dict:
    """The PER row of one workload: arrowbuf, then cpprb (and TorchRL for mujoco) in the same process."""
    out = {"arrowbuf": arrowbuf_per(capacity, workload=workload, repeat=repeat)}
    if peers:
        from . import peers as p

        out["cpprb"] = p.cpprb_per(capacity=capacity, workload=workload, repeat=repeat)
        gc.collect()
        if workload == "mujoco":
            out["torchrl"] = p.torchrl_per(capacity=capacity)
    return out


SEQ_SCHEMA = {"name": "seq", "fields": {"obs": {"dtype": "float32", "shape": [8]}, "done": {"dtype": "bool"}}}


def arrowbuf_sequences(rows: int, T: int = 20, batch: int = 64, episode_len: int = 1000,
                       max_seconds: float = 6.0) -> dict:
    store = ab.ExperienceStore(SEQ_SCHEMA, rows, sampler=ab.samplers.Sequence(length=T), seed=0)
    chunk = min(rows, 1_000_000)
    obs = np.ones((chunk, 8), np.float32)
    done = np.zeros(chunk, bool)
    done[episode_len - 1::episode_len] = True
    t0 = time.perf_counter()
    for s in range(0, rows, chunk):
        n = min(chunk, rows - s)
        store.extend({"obs": obs[:n], "done": done[:n]})
    fill = time.perf_counter() - t0
    store.sample(batch)
    times = []
    start = time.perf_counter()
    while len(times) < 50 and (len(times) < 5 or time.perf_counter() - start < max_seconds):
        t0 = time.perf_counter()
        b = store.sample(batch)
        times.append(time.perf_counter() - t0)
    assert b["obs"].shape == (batch, T, 8)
    store.close()
    gc.collect()
    return {"peer": "arrowbuf.Sequence", "rows": rows, "slice_len": T, "num_slices": batch,
            "seconds_per_batch": statistics.median(times), "fill_seconds": fill}


def run(quick: bool, peers: bool, workloads: tuple[str, ...] = ("mujoco", "atari"), sequences: bool = True) -> dict:
    res: dict = {"per": {}, "sequences": {}, "clock": os.environ.get("ARROWBUF_BENCH_CLOCK", "wall")}
    for w in workloads:
        cap = 100_000 if quick else PER_CAPACITY[w]
        res["per"][w] = per_rows(w, cap, peers)
    if not sequences:
        return res
    for rows in ([100_000, 1_000_000] if quick else [1_000_000, 10_000_000]):
        res["sequences"][rows] = {"arrowbuf": arrowbuf_sequences(rows)}
        if peers:
            from . import peers as p

            res["sequences"][rows]["torchrl"] = p.torchrl_slice(rows)
    return res


def print_table(res: dict) -> str:
    lines = [f"PER sample 256 + update 256 ({res.get('clock', 'wall')} clock): iterations/s (transitions/s)"]
    for w, per in res["per"].items():
        a = per["arrowbuf"]["iterations_per_s"]
        lines.append(f" {w}, capacity {per['arrowbuf']['capacity']:,}")
        for name, r in per.items():
            v = r.get("iterations_per_s")
            lines.append(f"  {name:10} {('-' if v is None else f'{v:,.0f}'):>10}"
                         + ("" if v is None else f" ({v * r.get('batch', 256) / 1e3:,.0f}k)")
                         + (f"   arrowbuf/{name} = {a / v:.2f}x" if v and name != "arrowbuf" else "")
                         + (f"   ({r.get('unavailable')})" if v is None else ""))
    if res["sequences"]:
        lines.append("Sequence sampling T=20, batch 64, obs float32[8]: ms per batch")
    base = None
    for rows, d in res["sequences"].items():
        a = d["arrowbuf"]["seconds_per_batch"]
        base = base or a
        t = d.get("torchrl", {}).get("seconds_per_batch")
        lines.append(f"  rows {int(rows):>11,}  arrowbuf {a * 1e3:8.3f} ms ({a / base:.2f}x of smallest)   torchrl "
                     + ("-" if t is None else f"{t * 1e3:8.1f} ms"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="mujoco at capacity 100k, smaller sequence rows")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--per-only", action="store_true", help="skip the sequence rows")
    ap.add_argument("--workloads", default="mujoco,atari", help="PER workloads, comma-separated")
    ap.add_argument("--out", default=str(OUT / "sampling.json"), help="where to write the JSON")
    args = ap.parse_args(argv)
    workloads = tuple(w for w in args.workloads.split(",") if w)
    res = run(args.quick, not args.no_peers, workloads, sequences=not args.per_only)
    print(print_table(res))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
