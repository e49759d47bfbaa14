"""TorchRL's `ReplayBuffer` over `ArrowbufStorage` against the same buffer over `LazyTensorStorage` (issue 41).

Rows, per workload: `rb.extend(batch)` of 256 transitions into a ring that has wrapped (steady state; transitions
per second) and `rb.sample()` of 256 (RandomSampler; batches per second), each with ArrowbufStorage and with
LazyTensorStorage, plus the arrowbuf store's own `store.sample(256)` + `to_torch()` under the same ArrowbufStorage
(what the adapter costs above the store). Workloads: "vector" (CartPole/MuJoCo-like transitions: observation
float32[17] twice, action, reward, done; capacity 100,000, TorchRL's tutorial size) and "pixels" (observation
uint8[4,84,84] twice; capacity 10,000). The variants alternate call by call in a shuffled order, so the machine's
drifting load colours them alike; medians of per-call times. torch runs one intra-op thread (`--threads`): on this
shared 2-core VM, TorchRL's indexing with torch's default thread pool ran 10x slower under load (15 ms against
1.4 ms per LazyTensorStorage sample of 256 at load 10), which would flatter arrowbuf. Prints a table and writes
benchmarks/out/torchrl.json.

    python -m benchmarks.bench_torchrl [--quick] [--calls 300] [--batch 256]
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
WORKLOADS = {"vector": ((17,), "float32", 100_000), "pixels": ((4, 84, 84), "uint8", 10_000)}


def _batch(torch: Any, TensorDict: Any, n: int, obs_shape: tuple[int, ...], dtype: str, start: int) -> Any:
    k = torch.arange(start, start + n)
    if dtype == "uint8":
        obs = (k % 255).to(torch.uint8).view(n, *([1] * len(obs_shape))).expand(n, *obs_shape).clone()
    else:
        obs = k.float().view(n, 1).expand(n, *obs_shape).clone()
    return TensorDict({"observation": obs, "action": k % 4, "next": {
        "observation": obs.clone(), "reward": k.float()[:, None], "done": (k % 50 == 49)[:, None]}}, batch_size=[n])


def measure(workload: str, batch: int, calls: int, quick: bool) -> dict[str, Any]:
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data.replay_buffers.samplers import RandomSampler

    from arrowbuf.compat.torchrl import ArrowbufStorage

    obs_shape, dtype, capacity = WORKLOADS[workload]
    if quick:
        capacity //= 10
    buffers = {"arrowbuf": ReplayBuffer(storage=ArrowbufStorage(capacity), sampler=RandomSampler(), batch_size=batch),
               "lazy_tensor": ReplayBuffer(storage=LazyTensorStorage(capacity), sampler=RandomSampler(),
                                           batch_size=batch)}
    chunk = 4096 if dtype == "float32" else 512
    for rb in buffers.values():  # fill the ring, then wrap it once more: steady state
        for start in range(0, capacity + chunk, chunk):
            rb.extend(_batch(torch, TensorDict, chunk, obs_shape, dtype, start))
    data = [_batch(torch, TensorDict, batch, obs_shape, dtype, 10 * capacity + i * batch) for i in range(8)]
    store = buffers["arrowbuf"].storage.store
    fns: dict[str, Callable[[int], Any]] = {
        "extend arrowbuf": lambda i: buffers["arrowbuf"].extend(data[i % 8]),
        "extend lazy_tensor": lambda i: buffers["lazy_tensor"].extend(data[i % 8]),
        "sample arrowbuf": lambda i: buffers["arrowbuf"].sample(),
        "sample lazy_tensor": lambda i: buffers["lazy_tensor"].sample(),
        "sample store.sample+to_torch": lambda i: store.sample(batch).to_torch(),
    }
    warm = 20
    times: dict[str, list[float]] = {v: [] for v in fns}
    order = list(fns)
    rng = random.Random(0)
    for i in range(calls + warm):
        rng.shuffle(order)
        for v in order:
            t0 = time.perf_counter()
            fns[v](i)
            if i >= warm:
                times[v].append(time.perf_counter() - t0)
    out: dict[str, Any] = {"workload": workload, "capacity": capacity, "batch": batch, "calls": calls,
                           "obs": [list(obs_shape), dtype], "load": os.getloadavg()}
    for v, ts in times.items():
        p50 = float(np.median(ts))
        out[v] = {"p50_us": p50 * 1e6, "per_s": (batch if v.startswith("extend") else 1) / p50}
    for op in ("extend", "sample"):
        out[f"{op} ratio arrowbuf/lazy_tensor"] = out[f"{op} arrowbuf"]["per_s"] / out[f"{op} lazy_tensor"]["per_s"]
    out["sample ratio arrowbuf/store"] = out["sample arrowbuf"]["per_s"] / out["sample store.sample+to_torch"]["per_s"]
    buffers["arrowbuf"].storage.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tenth of the capacities, fewer calls")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--calls", type=int, default=None)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    calls = args.calls or (60 if args.quick else 300)
    results = [measure(w, args.batch, calls, args.quick) for w in args.workloads]
    load = os.getloadavg()[0]
    print(f"TorchRL ReplayBuffer: ArrowbufStorage vs LazyTensorStorage, batch {args.batch}, {calls} alternated calls "
          f"per row, torch threads {args.threads}, load {load:.1f}")
    print(f"{'workload':<8} {'row':<32} {'arrowbuf':>12} {'lazy_tensor':>12} {'ratio':>7} {'store ceil':>11} "
          f"{'x ceil':>7}")
    for r in results:
        ext_a, ext_l = r["extend arrowbuf"]["per_s"], r["extend lazy_tensor"]["per_s"]
        print(f"{r['workload']:<8} {'extend 256 (transitions/s)':<32} {ext_a:>12,.0f} {ext_l:>12,.0f} "
              f"{ext_a / ext_l:>7.2f} {'':>11} {'':>7}")
        sa, sl, ss = (r[k]["per_s"] for k in ("sample arrowbuf", "sample lazy_tensor", "sample store.sample+to_torch"))
        print(f"{r['workload']:<8} {'sample 256 (batches/s)':<32} {sa:>12,.0f} {sl:>12,.0f} {sa / sl:>7.2f} "
              f"{ss:>11,.0f} {sa / ss:>7.2f}")
    print("ratio: arrowbuf / lazy_tensor (same run, alternated); store ceil: the store's own sample+to_torch of the "
          "same rows")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "torchrl.json").write_text(json.dumps({"threads": args.threads, "results": results}, indent=1))


if __name__ == "__main__":
    main()
