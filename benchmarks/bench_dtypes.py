"""A bfloat16 field costs what a uint16 field of the same shape costs (issue 40): extend and sample of a [B, 4096]
field of dtype bfloat16 (from torch bfloat16 tensors, the bits as uint16), float16 and uint16, in one store each.

Rows: `extend` of a 256-row batch into a wrapped ring (steady state) and `sample(256)` + `to_torch()` (the learner's
path); ceilings measured in the same run: `np.copyto` of the batch's bytes (extend) and a numpy `take` of 256 random
rows into a reused output (sample). The variants alternate call by call in a shuffled order each round, so the
machine's drifting load colours them alike; medians of per-call times. Prints a table and writes
benchmarks/out/dtypes.json.

    python -m benchmarks.bench_dtypes [--quick] [--width 4096] [--batch 256] [--calls 200]
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


def measure(width: int, batch: int, calls: int) -> dict[str, Any]:
    import torch

    import arrowbuf as ab

    capacity = 8 * batch
    warm = 10
    rng = np.random.default_rng(0)
    f32 = torch.from_numpy(rng.standard_normal((batch, width), dtype=np.float32))
    inputs = {"bfloat16 (torch)": f32.to(torch.bfloat16), "bfloat16 (uint16 bits)":
              f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
              "float16": f32.to(torch.float16).numpy(), "uint16": f32.to(torch.bfloat16).view(torch.int16).numpy()
              .view(np.uint16)}
    dtype = {"bfloat16 (torch)": "bfloat16", "bfloat16 (uint16 bits)": "bfloat16", "float16": "float16",
             "uint16": "uint16"}
    stores = {v: ab.ExperienceStore({"name": "dt", "fields": {"x": {"dtype": dtype[v], "shape": [width]}}},
                                    capacity, seed=0) for v in inputs}
    for v, s in stores.items():
        for _ in range(capacity // batch + 1):  # the ring has wrapped: steady state
            s.extend({"x": inputs[v]})
    src = np.ascontiguousarray(inputs["uint16"])
    dst = np.empty_like(src)
    arena = np.ascontiguousarray(np.tile(src, (capacity // batch, 1)))
    out = np.empty_like(src)
    fns: dict[str, Callable[[], Any]] = {"extend ceiling: memcpy": lambda: np.copyto(dst, src),
                                         "sample ceiling: numpy take":
                                         lambda: np.take(arena, rng.integers(0, capacity, batch), axis=0, out=out)}
    for v, s in stores.items():
        fns[f"extend {v}"] = (lambda s=s, x=inputs[v]: s.extend({"x": x}))
        if v != "bfloat16 (uint16 bits)":
            fns[f"sample+to_torch {v.split(' ')[0]}"] = (lambda s=s: s.sample(batch).to_torch()["x"])
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    shuffle = random.Random(0)
    for i in range(calls + warm):
        shuffle.shuffle(order)
        for k in order:
            t0 = time.perf_counter()
            fns[k]()
            if i >= warm:
                times[k].append(time.perf_counter() - t0)
    for s in stores.values():
        s.close()
    nbytes = batch * width * 2
    res: dict[str, Any] = {"width": width, "batch": batch, "calls": calls, "bytes_per_batch": nbytes,
                           "load": os.getloadavg()}
    for k, ts in times.items():
        p50 = float(np.median(ts))
        res[k] = {"p50_us": p50 * 1e6, "gbps": nbytes / p50 / 1e9}
    for k in fns:
        kind = "extend" if k.startswith("extend") else "sample"
        ceiling = res["extend ceiling: memcpy" if kind == "extend" else "sample ceiling: numpy take"]["p50_us"]
        peer = res["extend uint16" if kind == "extend" else "sample+to_torch uint16"]["p50_us"]
        res[k]["x_ceiling"] = res[k]["p50_us"] / ceiling
        res[k]["x_uint16"] = res[k]["p50_us"] / peer
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--calls", type=int, default=None)
    args = ap.parse_args(argv)
    calls = args.calls or (40 if args.quick else 200)
    res = measure(args.width, args.batch, calls)
    print(f"dtypes: [{args.batch}, {args.width}] 2-byte field ({res['bytes_per_batch'] / 2**20:.1f} MiB per batch), "
          f"{calls} calls per row alternated, load {res['load'][0]:.1f}")
    print(f"{'call':<36} {'p50 us':>9} {'GB/s':>7} {'x ceiling':>10} {'x uint16':>9}")
    for k, v in res.items():
        if isinstance(v, dict) and "p50_us" in v:
            print(f"{k:<36} {v['p50_us']:>9.0f} {v['gbps']:>7.2f} {v['x_ceiling']:>10.2f} {v['x_uint16']:>9.2f}")
    print("ceilings: np.copyto of the batch (extend), np.take of random rows into a reused array (sample)")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "dtypes.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
