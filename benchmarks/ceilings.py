"""Host ceilings: what plain numpy on this machine can do for the same bytes.

Every function returns a plain dict of numbers (plus a few descriptive
strings). Rates are medians over several repeats (see workloads.median_rate).
"""
from __future__ import annotations

import gc
import statistics
import time

import numpy as np

from .workloads import (
    COLUMNS,
    column_specs,
    make_steps,
    median_rate,
    rates,
    transition_bytes,
)

# Capacities the benchmarks use by default (same for ceilings and peers so
# the ratios compare like with like). Atari is below its nominal 100k to keep
# each fill short: any capacity whose bytes dwarf the 32 MiB L3 behaves alike
# for gathers (30k atari rows stored separately = 1.7 GB).
BENCH_CAPACITY = {"atari": 30_000, "mujoco": 1_000_000}


# --------------------------------------------------------------------------
# memcpy


def memcpy_bandwidth(nbytes: int = 256 << 20, repeat: int = 7) -> dict:
    """np.copyto between two preallocated, already-touched uint8 buffers.

    gbps = bytes copied per second / 1e9 (one direction: a copy reads and
    writes nbytes each). first_touch_gbps copies into freshly allocated
    memory (page faults included), for comparison with a ring's first fill.
    """
    nbytes = int(nbytes)
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)  # touched: steady state
    number = max(1, (1 << 30) // nbytes)  # ~1 GiB per repeat
    r = rates(lambda: np.copyto(dst, src), repeat=repeat, number=number, items=nbytes, warmup=1)
    dst = None  # noqa: F841  (free it before the first-touch copies)
    ft = []
    for _ in range(3):
        t0 = time.perf_counter()
        fresh = np.empty(nbytes, dtype=np.uint8)
        np.copyto(fresh, src)
        ft.append(nbytes / (time.perf_counter() - t0))
        del fresh
    return {
        "bytes": nbytes,
        "gbps": statistics.median(r) / 1e9,
        "gbps_best": max(r) / 1e9,
        "first_touch_gbps": statistics.median(ft) / 1e9,
    }


# --------------------------------------------------------------------------
# A numpy store: one preallocated array per column (obs and next_obs apart)


def numpy_store(workload: str, capacity: int | None = None, pool: dict | None = None,
                seed: int = 0) -> dict:
    """Preallocated, fully written column arrays of `capacity` rows.

    Filled by tiling a pool of make_steps rows, so every page is touched
    (np.zeros pages would read as the shared zero page and flatter gathers).
    """
    capacity = int(capacity or BENCH_CAPACITY[workload])
    specs = column_specs(workload)
    if pool is None:
        pool = make_steps(workload, min(capacity, 2000), seed=seed)
    p = len(pool["obs"])
    store = {}
    for col in COLUMNS:
        shape, dtype = specs[col]
        arr = np.empty((capacity, *shape), dtype=dtype)
        for s in range(0, capacity, p):
            e = min(capacity, s + p)
            arr[s:e] = pool[col][: e - s]
        store[col] = arr
    return store


def _store_bytes(store: dict) -> int:
    return sum(a.nbytes for a in store.values())


def gather(workload: str, batch: int, capacity: int | None = None, store: dict | None = None,
           sorted_indices: bool = False, reuse_out: bool = False, repeat: int = 5,
           seed: int = 0) -> dict:
    """numpy fancy-index gather ceiling: np.take per column of B random row
    indices (with replacement, drawn inside the timed loop like a sampler).
    sorted_indices sorts them first (sort included in the time); reuse_out
    writes into preallocated output arrays (np.take(..., out=))."""
    own = store is None
    if own:
        store = numpy_store(workload, capacity, seed=seed)
    cap = len(store["obs"])
    rng = np.random.default_rng(seed + 1)
    outs = {c: np.empty((batch, *a.shape[1:]), dtype=a.dtype) for c, a in store.items()}

    def one():
        idx = rng.integers(0, cap, size=batch)
        if sorted_indices:
            idx.sort()
        if reuse_out:
            for c, a in store.items():
                # mode="clip": with out= the default mode="raise" buffers
                # the result (an extra copy); indices are in range anyway.
                np.take(a, idx, axis=0, out=outs[c], mode="clip")
            return outs
        return {c: np.take(a, idx, axis=0) for c, a in store.items()}

    tb = transition_bytes(workload)
    number = max(1, int(64e6 // (tb * batch)))  # ~64 MB gathered per repeat
    r = median_rate(one, repeat=repeat, number=number, items=batch, warmup=1)
    res = {
        "workload": workload,
        "capacity": cap,
        "batch": batch,
        "sorted_indices": bool(sorted_indices),
        "reuse_out": bool(reuse_out),
        "transitions_per_s": r,
        "gbps": r * tb / 1e9,
    }
    if own:
        del store
        gc.collect()
    return res


def numpy_ring(workload: str, capacity: int | None = None, store: dict | None = None,
               steps: int = 20_000, chunk: int = 1000, repeat: int = 5, seed: int = 0) -> dict:
    """A numpy ring as the append ceiling, steady state (ring already full).

    step_per_s: write one step (6 columns, one row each) per call, the way a
    Python actor loop hands steps over. extend_*: write `chunk` rows per
    column per call, ring wrap handled.
    """
    own = store is None
    if own:
        store = numpy_store(workload, capacity, seed=seed)
    cap = len(store["obs"])
    pool = make_steps(workload, min(4000 if workload == "atari" else 20_000, cap), seed=seed + 2)
    p = len(pool["obs"])
    cols = [(store[c], pool[c]) for c in COLUMNS]
    state = {"i": 0, "j": 0}

    def step_n(n):
        i, j = state["i"], state["j"]
        for _ in range(n):
            for dst, src in cols:
                dst[i] = src[j]
            i += 1
            if i == cap:
                i = 0
            j += 1
            if j == p:
                j = 0
        state["i"], state["j"] = i, j

    per = max(1, steps // repeat)
    step_rate = median_rate(lambda: step_n(per), repeat=repeat, number=1, items=per, warmup=1)

    chunk = min(chunk, p)

    def extend_one():
        i, j = state["i"], state["j"]
        if j + chunk > p:
            j = 0
        first = min(chunk, cap - i)
        for dst, src in cols:
            dst[i:i + first] = src[j:j + first]
            if first < chunk:
                dst[: chunk - first] = src[j + first:j + chunk]
        state["i"] = (i + chunk) % cap
        state["j"] = j + chunk

    tb = transition_bytes(workload)
    number = max(1, int(256e6 // (tb * chunk)))  # ~256 MB per repeat
    ext_rate = median_rate(extend_one, repeat=repeat, number=number, items=chunk, warmup=1)
    res = {
        "workload": workload,
        "capacity": cap,
        "step_per_s": step_rate,
        "extend_chunk": chunk,
        "extend_steps_per_s": ext_rate,
        "extend_mb_per_s": ext_rate * tb / 1e6,
    }
    if own:
        del store
        gc.collect()
    return res


def first_fill(workload: str, capacity: int | None = None, chunk: int = 1000, seed: int = 0) -> dict:
    """Time to write a fresh numpy ring once (first touch) in chunks of `chunk`."""
    capacity = int(capacity or BENCH_CAPACITY[workload])
    specs = column_specs(workload)
    pool = make_steps(workload, min(2000, capacity), seed=seed)
    p = len(pool["obs"])
    t0 = time.perf_counter()
    store = {c: np.empty((capacity, *specs[c][0]), dtype=specs[c][1]) for c in COLUMNS}
    for s in range(0, capacity, chunk):
        e = min(capacity, s + chunk)
        o = s % p
        if o + (e - s) > p:
            o = 0
        for c in COLUMNS:
            store[c][s:e] = pool[c][o:o + e - s]
    dt = time.perf_counter() - t0
    tb = transition_bytes(workload)
    del store
    gc.collect()
    return {"workload": workload, "capacity": capacity,
            "first_fill_mb_per_s": capacity * tb / dt / 1e6, "seconds": dt}


def slice_gather(n_rows: int = 1_000_000, slice_len: int = 20, batch: int = 64,
                 episode_len: int = 1000, obs_dim: int = 8, repeat: int = 5, seed: int = 0) -> dict:
    """Sequence-sampling ceiling: `batch` slices of `slice_len` consecutive rows
    that stay inside one episode, from a float32[obs_dim] column of n_rows
    rows with precomputed episode starts. One np.take per column."""
    rng = np.random.default_rng(seed)
    obs = np.empty((n_rows, obs_dim), dtype=np.float32)
    obs[:] = 1.0
    n_eps = -(-n_rows // episode_len)
    starts = np.arange(n_eps, dtype=np.int64) * episode_len
    lens = np.minimum(episode_len, n_rows - starts)
    ok = lens >= slice_len
    starts, lens = starts[ok], lens[ok]
    offs = np.arange(slice_len, dtype=np.int64)

    def one():
        e = rng.integers(0, len(starts), size=batch)
        s = starts[e] + (rng.random(batch) * (lens[e] - slice_len + 1)).astype(np.int64)
        idx = (s[:, None] + offs).ravel()
        return np.take(obs, idx, axis=0)

    r = median_rate(one, repeat=repeat, number=50, items=1, warmup=1)
    return {"rows": n_rows, "slice_len": slice_len, "batch": batch,
            "seconds_per_batch": 1.0 / r, "batches_per_s": r}


def run_all(workloads=("atari", "mujoco")) -> dict:
    out = {"memcpy": [memcpy_bandwidth(4 << 20), memcpy_bandwidth(256 << 20)]}
    for w in workloads:
        cap = BENCH_CAPACITY[w]
        res = {"transition_bytes": transition_bytes(w), "first_fill": first_fill(w, cap)}
        store = numpy_store(w, cap)
        res["store_bytes_per_transition"] = _store_bytes(store) / cap
        res["gather"] = [
            gather(w, b, store=store, sorted_indices=s, reuse_out=o)
            for b in (256, 4096) for s, o in ((False, False), (True, False), (False, True))
        ]
        res["ring"] = numpy_ring(w, store=store)
        del store
        gc.collect()
        out[w] = res
    out["slice"] = slice_gather(1_000_000)
    return out


if __name__ == "__main__":  # pragma: no cover
    import json

    print(json.dumps(run_all(), indent=1, default=float))
