"""The cost of observability (issue 26): metrics' latency histograms and lineage on ingest and consume, on vs off.

Each row runs the same work on a store made with `observe=True` (the default: latency histograms of extend, sample,
consume and update, lineage of every row) and with `observe=False`, interleaved (on, off, off, on, ...: drift and
other jobs on the machine hit both alike; one pair first, not counted), and reports the medians and the cost
`median(on) / median(off) - 1` in time per operation. Target: at most 5% on the GRPO workload and on per-step append.

Rows:
  append      per-step `append` of cartpole steps (the smallest row: the worst case for a per-row cost)
  extend      `extend` of 1000 cartpole steps
  sample      `sample(256)` (latency histogram only; sampling records no lineage)
  grpo        one GRPO iteration: extend 8 groups of 8 completions (ragged tokens), consume "ref", update
              `ref_logprobs` and `reward`, consume "train" requiring both (lineage records writers and consumers),
              timed after `GRPO_WARM` iterations have wrapped the ring (steady state)
  grpo toggled  GRPO iterations on one store whose recording is switched on and off between rounds (both arms
              share the memory layout: the least noisy A/B here)
  append / extend toggled  the same for per-step appends and 1000-row extends, on one cartpole store that has
              wrapped (steady state), rounds of 2000 appends or 10 extends, on/off order alternating
  grpo hooks  the same GRPO run with lineage's hooks timed where they run (plus the measured overhead of a timed
              store call per operation): the hooks' share of an iteration, independent of an A/B of noisy runs
  scrape      informational: one Prometheus scrape of the GRPO store (collector, text), and `lineage_table()`

    python -m benchmarks.bench_observe [--quick] [--repeats R] [--clock wall|thread]

Prints a table and writes benchmarks/out/observe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

import arrowbuf as ab

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
TARGET = 0.05
#: Rows with a cost target (the issue: GRPO and per-step append; the lead's follow-up: extend too).
TARGET_ROWS = ("append", "extend", "grpo")
#: The clock: wall time, or this thread's CPU time (`--clock thread`: steadier on a loaded machine, where wall time
#: also counts the time other processes held the CPU; every row here runs in one thread).
CLOCK = [time.perf_counter]


def cartpole_steps(n: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    obs = rng.random((n + 1, 4), dtype=np.float32)
    return [{"obs": obs[i], "action": int(i % 2), "reward": 1.0, "terminated": (i % 200) == 199, "truncated": False,
             "policy_version": 0, "next_obs": obs[i + 1]} for i in range(n)]


def cartpole_batch(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"obs": rng.random((n, 4), dtype=np.float32), "action": (np.arange(n) % 2).astype(np.int64),
            "reward": np.ones(n, np.float32), "terminated": (np.arange(n) % 200) == 199,
            "truncated": np.zeros(n, bool), "policy_version": np.zeros(n, np.int64),
            "next_obs": rng.random((n, 4), dtype=np.float32)}


def grpo_rows(rng: np.random.Generator, prompts: int, first_id: int, lo: int, hi: int) -> dict[str, Any]:
    n = prompts * 8
    lens = rng.integers(lo, hi + 1, n)
    offs = pa.array(np.concatenate(([0], np.cumsum(lens))).astype(np.int32))
    tokens = int(lens.sum())
    plens = pa.array(np.arange(0, 16 * n + 1, 16, dtype=np.int32))
    return {"prompt_id": np.repeat(np.arange(first_id, first_id + prompts), 8),
            "prompt_tokens": pa.ListArray.from_arrays(plens, pa.array(rng.integers(0, 151_000, 16 * n, np.int32))),
            "response_tokens": pa.ListArray.from_arrays(offs, pa.array(rng.integers(0, 151_000, tokens, np.int32))),
            "logprobs": pa.ListArray.from_arrays(offs, pa.array(-rng.random(tokens, dtype=np.float32))),
            "policy_version": np.zeros(n, np.int64), "done": np.ones(n, bool)}


# ---------------------------------------------------------------------------------------------------- one run each
def run_append(observe: bool, steps: list[dict[str, Any]]) -> float:
    store = ab.ExperienceStore(ab.load_schema("cartpole"), capacity=len(steps), seed=0, observe=observe)
    try:
        append = store.append
        t0 = CLOCK[0]()
        for s in steps:
            append(s)
        return (CLOCK[0]() - t0) / len(steps)
    finally:
        store.close()


def run_extend(observe: bool, batch: dict[str, np.ndarray], times: int) -> float:
    n = len(batch["reward"])
    store = ab.ExperienceStore(ab.load_schema("cartpole"), capacity=n * times, seed=0, observe=observe)
    try:
        t0 = CLOCK[0]()
        for _ in range(times):
            store.extend(batch)
        return (CLOCK[0]() - t0) / times
    finally:
        store.close()


def run_sample(observe: bool, batch: dict[str, np.ndarray], times: int) -> float:
    store = ab.ExperienceStore(ab.load_schema("cartpole"), capacity=len(batch["reward"]), seed=0, observe=observe)
    try:
        store.extend(batch)
        t0 = CLOCK[0]()
        for _ in range(times):
            store.sample(256)
        return (CLOCK[0]() - t0) / times
    finally:
        store.close()


#: GRPO iterations run before the clock starts: 64 rows each, so 24 wrap the 1024-row ring once and a half (a fresh
#: store's first lap pays its arena's growth and first page touches, which differ from run to run and are not what
#: recording costs in a long training run)
GRPO_WARM = 24


def run_grpo(observe: bool, iters: int, lo: int, hi: int) -> float:
    rng = np.random.default_rng(2)
    batches = [grpo_rows(rng, 8, i * 8, lo, hi) for i in range(iters + GRPO_WARM)]
    store = ab.ExperienceStore(ab.load_schema("grpo"), capacity=1024, tasks=["ref", "train"], seed=0,
                               observe=observe)
    try:
        t0 = CLOCK[0]()
        for i, rows in enumerate(batches):
            if i == GRPO_WARM:
                t0 = CLOCK[0]()
            store.extend(rows)
            ref = store.consume("ref", 64)
            n = len(ref.indices)
            lens = ref.token_counts("response_tokens")
            offs = pa.array(np.concatenate(([0], np.cumsum(lens))).astype(np.int32))
            store.update(ref.indices, {"ref_logprobs": pa.ListArray.from_arrays(
                offs, pa.array(np.zeros(int(lens.sum()), np.float32))), "reward": np.ones(n, np.float32)})
            store.consume("train", 64, require=["reward", "ref_logprobs"])
            if i % 4 == 3:
                store.policy_version = store.policy_version + 1
        return (CLOCK[0]() - t0) / iters
    finally:
        store.close()


def grpo_toggled(rounds: int, lo: int, hi: int) -> dict[str, Any]:
    """GRPO iterations on ONE store whose recording is switched on and off between rounds of 8 iterations
    (interleaved), so both arms share the store's memory layout and caches: the A/B with the least noise here.
    Switching reaches into the store's internals (lineage on `StoreCore`, `timings` on the store): measurement only."""
    rng = np.random.default_rng(2)
    batches = [grpo_rows(rng, 8, i * 8, lo, hi) for i in range(64)]
    store = ab.ExperienceStore(ab.load_schema("grpo"), capacity=1024, tasks=["ref", "train"], seed=0)
    core = store._core
    assert core is not None
    lineage, timings = core.lineage, store.timings
    on: list[float] = []
    off: list[float] = []
    try:
        for r in range(rounds):
            for mode in ((True, False) if r % 2 == 0 else (False, True)):
                core.lineage = lineage if mode else None
                store.timings = timings if mode else None
                t0 = CLOCK[0]()
                for rows in batches[(r % 8) * 8:(r % 8) * 8 + 8]:
                    store.extend(rows)
                    ref = store.consume("ref", 64)
                    lens = ref.token_counts("response_tokens")
                    offs = pa.array(np.concatenate(([0], np.cumsum(lens))).astype(np.int32))
                    store.update(ref.indices, {"ref_logprobs": pa.ListArray.from_arrays(
                        offs, pa.array(np.zeros(int(lens.sum()), np.float32))),
                        "reward": np.ones(len(ref.indices), np.float32)})
                    store.consume("train", 64, require=["reward", "ref_logprobs"])
                (on if mode else off).append((CLOCK[0]() - t0) / 8)
    finally:
        store.close()
    m_on, m_off = statistics.median(on), statistics.median(off)
    return {"on_s": m_on, "off_s": m_off, "cost": m_on / m_off - 1}


def write_toggled(kind: str, rounds: int) -> dict[str, Any]:
    """Per-step appends (`kind` "append", per step) or 1000-row extends ("extend", per batch) on ONE cartpole store
    that has wrapped, recording switched on and off between rounds (as `grpo_toggled`)."""
    steps = cartpole_steps(2000)
    batch = cartpole_batch(1000)
    store = ab.ExperienceStore(ab.load_schema("cartpole"), capacity=50_000, seed=0)
    core = store._core
    assert core is not None
    lineage, timings = core.lineage, store.timings
    on: list[float] = []
    off: list[float] = []
    try:
        for _ in range(60):  # wrap the ring: steady state (evictions, warm pages)
            store.extend(batch)
        for r in range(rounds):
            for mode in ((True, False) if r % 2 == 0 else (False, True)):
                core.lineage = lineage if mode else None
                store.timings = timings if mode else None
                t0 = CLOCK[0]()
                if kind == "append":
                    append = store.append
                    for s in steps:
                        append(s)
                    per = (CLOCK[0]() - t0) / len(steps)
                else:
                    for _ in range(10):
                        store.extend(batch)
                    per = (CLOCK[0]() - t0) / 10
                (on if mode else off).append(per)
    finally:
        store.close()
    m_on, m_off = statistics.median(on), statistics.median(off)
    return {"on_s": m_on, "off_s": m_off, "cost": m_on / m_off - 1}


def interleaved(fn: Callable[[bool], float], repeats: int) -> dict[str, Any]:
    """`repeats` pairs of runs, on/off order alternating, after one pair not counted (the process's own warm-up:
    imports, caches, the allocator's first growth)."""
    on: list[float] = []
    off: list[float] = []
    fn(True)
    fn(False)
    for r in range(repeats):
        order = (True, False) if r % 2 == 0 else (False, True)
        for mode in order:
            (on if mode else off).append(fn(mode))
    m_on, m_off = statistics.median(on), statistics.median(off)
    return {"on_s": m_on, "off_s": m_off, "cost": m_on / m_off - 1, "on_all": on, "off_all": off}


def hooks_inside(iters: int, lo: int, hi: int, per_op: float) -> dict[str, Any]:
    """The observability hooks' own time inside a GRPO run (observe=True): lineage's write and consume hooks timed
    where they run, plus `per_op` (a timed call's overhead, measured apart) per store operation; a share of the
    iteration that does not depend on an A/B of two noisy runs."""
    from arrowbuf.observe.lineage import Lineage

    spent = [0.0]
    originals = {name: getattr(Lineage, name) for name in ("wrote", "consumed")}

    def timed_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*a: Any, **k: Any) -> Any:
            t0 = CLOCK[0]()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += CLOCK[0]() - t0
        return inner

    for name, fn in originals.items():
        setattr(Lineage, name, timed_hook(fn))
    try:
        per_iter = run_grpo(True, iters, lo, hi)
    finally:
        for name, fn in originals.items():
            setattr(Lineage, name, fn)
    hooks = spent[0] / iters + 4 * per_op  # extend, update and two consumes per iteration
    return {"iteration_s": per_iter, "hooks_s": hooks, "share": hooks / per_iter}


def timed_overhead() -> float:
    """Seconds a `@timed` store method adds to a call (with a `Timings`), measured on a trivial method."""
    from arrowbuf.observe.timings import Timings, timed

    class Probe:
        def __init__(self, t: Any) -> None:
            self.timings = t

        @timed("probe")
        def f(self) -> int:
            return 1

        def g(self) -> int:
            return 1

    on = Probe(Timings())
    n = 100_000
    best = []
    for fn in (on.f, on.g):
        runs = []
        for _ in range(5):
            t0 = CLOCK[0]()
            for _ in range(n):
                fn()
            runs.append((CLOCK[0]() - t0) / n)
        best.append(min(runs))
    return max(0.0, best[0] - best[1])


def scrape_cost(lo: int, hi: int) -> dict[str, Any]:
    from arrowbuf.observe.metrics import MetricsEndpoint

    rng = np.random.default_rng(3)
    store = ab.ExperienceStore(ab.load_schema("grpo"), capacity=1024, tasks=["ref", "train"], seed=0)
    try:
        for i in range(16):
            store.extend(grpo_rows(rng, 8, i * 8, lo, hi))
            store.consume("ref", 64)
        with MetricsEndpoint.start("127.0.0.1:0", stores={"grpo": store}) as ep:
            times, text = [], ""
            for _ in range(5):
                t0 = CLOCK[0]()
                text = ep.scrape()
                times.append(CLOCK[0]() - t0)
        lt = []
        for _ in range(5):
            t0 = CLOCK[0]()
            store.lineage_table()
            lt.append(CLOCK[0]() - t0)
        return {"scrape_ms": statistics.median(times) * 1e3, "scrape_bytes": len(text),
                "lineage_table_ms": statistics.median(lt) * 1e3, "rows": len(store)}
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall")
    args = ap.parse_args(argv)
    if args.clock == "thread":
        CLOCK[0] = time.thread_time
    q = args.quick
    repeats = args.repeats or (6 if q else 10)
    steps = cartpole_steps(20_000 if q else 100_000)
    batch = cartpole_batch(1000)
    lo, hi = (100, 400) if q else (1024, 4096)
    res: dict[str, Any] = {"quick": q, "repeats": repeats, "clock": args.clock, "load": os.getloadavg()}
    res["append"] = interleaved(lambda m: run_append(m, steps), repeats)
    res["extend"] = interleaved(lambda m: run_extend(m, batch, 50 if q else 200), repeats)
    res["sample"] = interleaved(lambda m: run_sample(m, batch, 500 if q else 2000), repeats)
    res["grpo"] = interleaved(lambda m: run_grpo(m, 48 if q else 128, lo, hi), repeats)
    res["grpo_toggled"] = grpo_toggled(40 if q else 100, lo, hi)
    res["append_toggled"] = write_toggled("append", 40 if q else 150)
    res["extend_toggled"] = write_toggled("extend", 40 if q else 150)
    res["timed_overhead_s"] = timed_overhead()
    res["grpo_hooks"] = hooks_inside(48 if q else 128, lo, hi, res["timed_overhead_s"])
    res["scrape"] = scrape_cost(lo, hi)
    units = {"append": ("steps/s", 1.0), "extend": ("batches/s", 1.0), "sample": ("batches/s", 1.0),
             "grpo": ("iterations/s", 1.0)}
    print(f"observability on vs off, interleaved, medians of {repeats}, {args.clock} clock "
          f"(load {res['load'][0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end)")
    print("| row | unit | off | on | cost (time) | target |\n|---|---|---:|---:|---:|---|")
    for row, (unit, _) in units.items():
        r = res[row]
        target = f"<= {TARGET:.0%}: {'met' if r['cost'] <= TARGET else 'not met'}" if row in TARGET_ROWS else ""
        print(f"| {row} | {unit} | {1 / r['off_s']:,.0f} | {1 / r['on_s']:,.0f} | {r['cost']:+.1%} | {target} |")
    for key, label, unit in (("append_toggled", "append, one store toggled", "steps/s"),
                             ("extend_toggled", "extend, one store toggled", "batches/s"),
                             ("grpo_toggled", "grpo, one store toggled", "iterations/s")):
        g = res[key]
        verdict = "met" if g["cost"] <= TARGET else "not met"
        print(f"| {label} | {unit} | {1 / g['off_s']:,.0f} | {1 / g['on_s']:,.0f} | "
              f"{g['cost']:+.1%} | <= {TARGET:.0%}: {verdict} |")
    h = res["grpo_hooks"]
    verdict = "met" if h["share"] <= TARGET else "not met"
    print(f"| grpo, hooks timed inside | us per iteration | | {h['hooks_s'] * 1e6:.1f} of "
          f"{h['iteration_s'] * 1e6:.0f} | {h['share']:+.1%} | <= {TARGET:.0%}: {verdict} |")
    print(f"| @timed overhead | ns per store call | | {res['timed_overhead_s'] * 1e9:.0f} | | |")
    s = res["scrape"]
    print(f"| scrape | ms per /metrics of the GRPO store ({s['rows']} rows, {s['scrape_bytes']:,} bytes) | | "
          f"{s['scrape_ms']:.2f} | | |")
    print(f"| lineage_table | ms ({s['rows']} rows x 2 tasks) | | {s['lineage_table_ms']:.2f} | | |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "observe.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
