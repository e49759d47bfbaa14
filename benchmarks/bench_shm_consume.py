"""consume over shared memory (issue 28): per-task consumption of a `tier="shm"` store from an attached handle.

Rows (`consume("train", 64)`: 8 whole groups of GRPO rows of 64-256 tokens, `ab.samplers.Group(size=8)`):
- in process, a host store (the ceiling: the same call with its state in this process's heap), and over shared
  memory, an attached handle (`ExperienceStore.attach`) of a `tier="shm"` store, alternating call by call so that
  the machine's drifting load colours both alike; each store is full and is refilled outside the timed calls; the
  `where=` variants alternate with them (the predicate passes every row);
- over shared memory with 2 writer processes attached to the same store, pushing groups while this process consumes
  with a 50 ms trainer step between consumes (a consume measures its own cost under concurrent writes; `waited`
  counts calls that found fewer than 64 rows ready).

Prints a table and writes benchmarks/out/shm_consume.json.

    python -m benchmarks.bench_shm_consume [--quick] [--calls N]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import time
import uuid
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
WHERE = "reward >= 0.0 AND policy_version >= 0 AND prompt_id >= 0"
STEP_S = 0.05
CAPACITY = 1024


def _rows(rng: np.random.Generator, prompts: int, first: int) -> dict[str, Any]:
    from benchmarks.bench_llm import _grpo_rows

    return _grpo_rows(rng, prompts, first, 64, 256)


def _stats(xs: list[float]) -> dict[str, float]:
    ms = np.asarray(xs) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "calls": len(ms)}


def full_store(calls: int) -> dict[str, Any]:
    """Host vs attached shared memory, with and without where=, alternating; refilled outside the timed calls."""
    import arrowbuf as ab

    schema = ab.load_schema("grpo")
    name = f"bench-consume-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    host = ab.ExperienceStore(schema, capacity=CAPACITY, tasks=["train"], sampler=ab.samplers.Group("prompt_id", 8))
    creator = ab.ExperienceStore(schema, capacity=CAPACITY, tier="shm", name=name, tasks=["train"],
                                 sampler=ab.samplers.Group("prompt_id", 8))
    shm = ab.ExperienceStore.attach(name)
    variants = {"host": (host, host, None), "host where": (host, host, WHERE), "shm": (shm, creator, None),
                "shm where": (shm, creator, WHERE)}
    lat: dict[str, list[float]] = {v: [] for v in variants}
    rng = np.random.default_rng(0)
    first = {v: 0 for v in variants}
    try:
        for i in range(calls + 4):
            for v, (reader, writer, where) in variants.items():
                if reader.stats()["next_seq"] - reader.stats()["consumed"]["train"] < 64:
                    writer.extend(_rows(rng, 16, first[v]))
                    first[v] += 16
                t0 = time.perf_counter()
                b = reader.consume("train", 64, timeout=0, where=where)
                dt = time.perf_counter() - t0
                assert len(b) == 64, (v, len(b))
                if i >= 4:  # the first calls validate the predicate and warm up
                    lat[v].append(dt)
    finally:
        shm.close()
        creator.close()
        host.close()
    out = {v: _stats(xs) for v, xs in lat.items()}
    for v in variants:
        out[v]["x_host"] = out[v]["p50_ms"] / out["host where" if "where" in v else "host"]["p50_ms"]
    return out


def _writer(name: str, seed: int, stop: Any) -> None:
    import arrowbuf as ab

    store = ab.ExperienceStore.attach(name, timeout=30)
    rng = np.random.default_rng(seed)
    first = seed * 1_000_000
    while not stop.is_set():
        try:
            store.extend(_rows(rng, 2, first), timeout=0.2)
            first += 2
        except ab.InsertTimeout:  # the ring is full of rows the trainer has not consumed yet
            continue
    store.close()


def with_writers(calls: int) -> dict[str, Any]:
    """2 writer processes attached to the store; this process consumes through its own attached handle."""
    import arrowbuf as ab

    name = f"bench-consume-w-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    creator = ab.ExperienceStore(ab.load_schema("grpo"), capacity=CAPACITY, tier="shm", name=name,
                                 tasks=["train"], sampler=ab.samplers.Group("prompt_id", 8))
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(name, i + 1, stop), daemon=True) for i in range(2)]
    for p in procs:
        p.start()
    store = ab.ExperienceStore.attach(name)
    lat: list[float] = []
    waited = 0
    try:
        store.consume("train", 64, timeout=120.0)  # the writers are up
        for _ in range(calls):
            time.sleep(STEP_S)
            st = store.stats()
            waited += st["next_seq"] - st["consumed"]["train"] < 64
            t0 = time.perf_counter()
            b = store.consume("train", 64, timeout=60.0)
            lat.append(time.perf_counter() - t0)
            assert len(b) == 64
        consumed = store.stats()["consumed"]["train"]
    finally:
        stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        store.close()
        creator.close()
    return {**_stats(lat), "waited": int(waited), "rows_consumed": int(consumed), "writers": len(procs)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--calls", type=int, default=None)
    args = ap.parse_args(argv)
    calls = args.calls or (60 if args.quick else 400)
    load0 = os.getloadavg()
    res: dict[str, Any] = {"calls": calls, "rows_per_call": 64, "capacity": CAPACITY, "where": WHERE,
                           "full": full_store(calls), "writers": with_writers(max(16, calls // 4))}
    res["load"] = [load0, os.getloadavg()]
    print(f"consume over shared memory: 64 rows (8 groups) per call, {calls} calls per row alternated; load "
          f"{load0[0]:.1f} -> {res['load'][1][0]:.1f}")
    print(f"{'row':<44} {'p50 ms':>8} {'p99 ms':>8} {'x host':>7}")
    labels = {"host": "in process (host store, the ceiling)", "shm": "shared memory, attached handle",
              "host where": "in process, where=", "shm where": "shared memory, where="}
    for v, label in labels.items():
        r = res["full"][v]
        print(f"{label:<44} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['x_host']:>7.2f}")
    w = res["writers"]
    print(f"{'shared memory, 2 writer processes':<44} {w['p50_ms']:>8.2f} {w['p99_ms']:>8.2f} {'':>7}"
          f"  ({w['waited']} of {w['calls']} calls waited for rows)")
    print("target: without where=, p50 < 2 ms in process and over shared memory")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "shm_consume.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
