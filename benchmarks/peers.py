"""Peer replay buffers measured on the shared workloads: cpprb and TorchRL.

Each peer function returns a plain dict
    {"peer": ..., "version": ..., <metric>: value, ..., "note": ...}
or  {"peer": ..., "unavailable": reason}
and never raises (a peer that is missing or broken is reported, not fatal).

    python -m benchmarks.peers          # everything; writes benchmarks/out/peers.json

Method (DESIGN.md, "Performance method"): each buffer is first filled once
(first_fill_mb_per_s, first touch of fresh memory), then every other number is
steady state: the ring has wrapped. Rates are medians of several repeats.
Sampling draws indices with replacement (what all three do by default).
"""
from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager

import numpy as np

from . import ceilings
from .ceilings import BENCH_CAPACITY
from .workloads import COLUMNS, WORKLOADS, column_specs, make_steps, median_rate, rss_bytes, transition_bytes

CHUNK = 1000
STEP_REPEAT = 5
STEPS = 20_000  # per-step appends measured, split over STEP_REPEAT repeats
POOL = {"atari": 2000, "mujoco": 20_000}  # source steps, cycled
EXTEND_BYTES_PER_REPEAT = 200e6


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _err(e: BaseException, limit: int = 300) -> str:
    s = f"{type(e).__name__}: {e}"
    return s if len(s) <= limit else s[:limit] + "..."


def torchrl_extension_error() -> str | None:
    """None if torchrl's C++ extension (_torchrl: segment trees for PER) loads,
    else why not (e.g. built against another torch than the one installed)."""
    try:
        import torchrl._torchrl  # noqa: F401
    except Exception as e:  # ImportError / OSError on an ABI mismatch
        return _err(e, 400)
    return None


@contextmanager
def _quiet():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# --------------------------------------------------------------------------
# Generic measuring harness over an adapter
#
# An adapter has: add_step(j) (append pool row j), extend(s) (append pool rows
# s:s+CHUNK), sample(batch), and the buffer capacity.


class _Pool:
    def __init__(self, workload: str, seed: int = 0):
        self.workload = workload
        self.n = POOL[workload]
        self.data = make_steps(workload, self.n, seed=seed, episode_len=1000)
        # Episode ends inside each CHUNK-sized chunk (for buffers that must be
        # told: cpprb's next_of needs on_episode_end()).
        term = self.data["terminated"]
        self.segments = {}
        for s in range(0, self.n, CHUNK):
            ends = np.flatnonzero(term[s:s + CHUNK]) + s
            segs, a = [], s
            for e in ends:
                segs.append((a, e + 1, True))
                a = e + 1
            if a < s + CHUNK:
                segs.append((a, s + CHUNK, False))
            self.segments[s] = segs


def _measure(adapter, pool: _Pool, capacity: int, rss0: int, construct_s: float,
             batches=(256, 4096)) -> dict:
    """rss0: the process RSS taken before the buffer was constructed;
    construct_s: seconds the constructor took (counted in the first fill:
    some peers allocate and zero their whole ring up front)."""
    w = pool.workload
    tb = transition_bytes(w)
    res: dict = {"capacity": capacity, "construct_seconds": construct_s}

    # First fill (fresh memory).
    pos = [0]

    def next_chunk():
        s = pos[0]
        pos[0] = (s + CHUNK) % pool.n
        return s

    t0 = time.perf_counter()
    n_chunks = -(-capacity // CHUNK)
    for _ in range(n_chunks):
        adapter.extend(next_chunk())
    dt = time.perf_counter() - t0 + construct_s
    res["first_fill_mb_per_s"] = n_chunks * CHUNK * tb / dt / 1e6
    rss1 = rss_bytes()
    if rss0 and rss1:
        res["rss_bytes_per_transition"] = (rss1 - rss0) / capacity

    # Steady-state extend (the ring has wrapped).
    number = max(1, int(EXTEND_BYTES_PER_REPEAT // (tb * CHUNK)))
    r = median_rate(lambda: adapter.extend(next_chunk()), repeat=5, number=number,
                    items=CHUNK, warmup=1)
    res["extend_steps_per_s"] = r
    res["extend_mb_per_s"] = r * tb / 1e6

    # Per-step append.
    j = [0]

    def steps(n):
        k = j[0]
        for _ in range(n):
            adapter.add_step(k)
            k += 1
            if k == pool.n:
                k = 0
        j[0] = k

    steps(1000)  # warm-up
    per = STEPS // STEP_REPEAT
    res["step_per_s"] = median_rate(lambda: steps(per), repeat=STEP_REPEAT, number=1,
                                    items=per, warmup=0)
    if hasattr(adapter, "add_prebuilt"):
        # Variant: the step already arrives in the peer's container type.
        n_pre = min(pool.n, per)
        items = adapter.prebuild(n_pre)

        def pre():
            for it in items:
                adapter.add_prebuilt(it)

        res["step_prebuilt_per_s"] = median_rate(pre, repeat=STEP_REPEAT, number=1,
                                                 items=n_pre, warmup=0)
        del items

    # Uniform sampling.
    for b in batches:
        number = max(1, int(60e6 // (tb * b)))
        res[f"sample{b}_per_s"] = median_rate(lambda b=b: adapter.sample(b), repeat=7,
                                              number=number, items=b, warmup=1)
    # Aliases under the names benchmarks/bench_core.py reads.
    res["append_steps_s"] = res["step_per_s"]
    res["extend_mb_s"] = res["extend_mb_per_s"]
    res["first_fill_mb_s"] = res["first_fill_mb_per_s"]
    for b in batches:
        res[f"sample_{b}_per_s"] = res[f"sample{b}_per_s"]
    return res


# --------------------------------------------------------------------------
# cpprb


def _cpprb_env_dict(workload: str) -> dict:
    specs = column_specs(workload)
    env = {}
    for c in ("obs", "action", "reward", "terminated", "truncated"):
        shape, dtype = specs[c]
        env[c] = {"shape": shape if shape else 1, "dtype": dtype}
    return env


class _CpprbAdapter:
    def __init__(self, rb, pool: _Pool):
        self.rb = rb
        self.pool = pool
        d = pool.data
        self.cols = {c: d[c] for c in COLUMNS}
        self.term = d["terminated"]

    def add_step(self, j):
        c = self.cols
        self.rb.add(obs=c["obs"][j], action=c["action"][j], reward=c["reward"][j],
                    terminated=c["terminated"][j], truncated=c["truncated"][j],
                    next_obs=c["next_obs"][j])
        if self.term[j]:
            self.rb.on_episode_end()

    def extend(self, s):
        c = self.cols
        rb = self.rb
        for a, b, end in self.pool.segments[s]:
            rb.add(obs=c["obs"][a:b], action=c["action"][a:b], reward=c["reward"][a:b],
                   terminated=c["terminated"][a:b], truncated=c["truncated"][a:b],
                   next_obs=c["next_obs"][a:b])
            if end:
                rb.on_episode_end()

    def sample(self, b):
        return self.rb.sample(b)


def cpprb_buffer(workload: str, capacity: int | None = None, pool: _Pool | None = None) -> dict:
    """cpprb.ReplayBuffer with next_of="obs" (next_obs shares obs's ring)."""
    out = {"peer": "cpprb.ReplayBuffer", "workload": workload}
    try:
        import cpprb
    except Exception as e:
        out["unavailable"] = _err(e)
        return out
    try:
        capacity = int(capacity or BENCH_CAPACITY[workload])
        pool = pool or _Pool(workload)
        gc.collect()
        rss0 = rss_bytes()
        t0 = time.perf_counter()
        rb = cpprb.ReplayBuffer(capacity, _cpprb_env_dict(workload), next_of="obs")
        construct_s = time.perf_counter() - t0
        out["version"] = _version("cpprb")
        out.update(_measure(_CpprbAdapter(rb, pool), pool, capacity, rss0, construct_s))
        specs = column_specs(workload)
        row = {c: int(np.prod(s, dtype=np.int64)) * d.itemsize for c, (s, d) in specs.items()}
        stored = (capacity + 1) * row["obs"] + capacity * (
            row["action"] + row["reward"] + row["terminated"] + row["truncated"])
        out["bytes_per_transition"] = stored / capacity
        out["note"] = (
            "next_of='obs' (obs ring of capacity+1 rows holds next_obs); "
            "stack_compress not used: it needs the frame-stack axis last and "
            "sliding-window frames, our atari obs is (4,84,84) random frames; "
            "episode ends reported with on_episode_end(), chunks split there; "
            f"capacity {capacity}"
            + (f" (nominal {WORKLOADS[workload]['capacity']})"
               if capacity != WORKLOADS[workload]["capacity"] else "")
        )
        del rb
    except Exception as e:
        out["unavailable"] = _err(e)
    gc.collect()
    return out


def cpprb_per(capacity: int = 1_000_000, batch: int = 256, workload: str = "mujoco",
              repeat: int = 5) -> dict:
    """cpprb.PrioritizedReplayBuffer: iterations/s of sample(batch) + update_priorities."""
    out = {"peer": "cpprb.PrioritizedReplayBuffer", "workload": workload}
    try:
        import cpprb
    except Exception as e:
        out["unavailable"] = _err(e)
        return out
    try:
        pool = _Pool(workload, seed=3)
        rb = cpprb.PrioritizedReplayBuffer(capacity, _cpprb_env_dict(workload), next_of="obs",
                                           alpha=0.6)
        ad = _CpprbAdapter(rb, pool)
        t0 = time.perf_counter()
        for i in range(capacity // CHUNK):
            ad.extend((i * CHUNK) % pool.n)
        fill = time.perf_counter() - t0
        rng = np.random.default_rng(0)

        def it():
            s = rb.sample(batch, beta=0.4)
            rb.update_priorities(s["indexes"], rng.random(batch) + 1e-3)

        r = median_rate(it, repeat=repeat, number=200, items=1, warmup=20)
        out.update(version=_version("cpprb"), capacity=capacity, batch=batch,
                   iterations_per_s=r, fill_seconds=fill,
                   note="sample (with transition gather, next_of obs) + update_priorities, alpha=0.6 beta=0.4")
    except Exception as e:
        out["unavailable"] = _err(e)
    gc.collect()
    return out


# --------------------------------------------------------------------------
# TorchRL


def _torch_import():
    import torch
    with _quiet():
        import tensordict
        import torchrl  # noqa: F401
        from torchrl.data import ReplayBuffer  # noqa: F401
    import logging

    logging.getLogger("torchrl").setLevel(logging.WARNING)
    return torch, tensordict


def _torchrl_versions() -> str:
    return (f"torchrl {_version('torchrl')}, tensordict {_version('tensordict')}, "
            f"torch {_version('torch')}")


class _TorchRLAdapter:
    def __init__(self, rb, pool: _Pool):
        import torch
        from tensordict import TensorDict

        self.TD = TensorDict
        self.rb = rb
        self.cols = {c: torch.from_numpy(pool.data[c]) for c in COLUMNS}

    def add_step(self, j):
        c = self.cols
        self.rb.add(self.TD({k: v[j] for k, v in c.items()}, batch_size=[]))

    def prebuild(self, n):
        c = self.cols
        return [self.TD({k: v[j] for k, v in c.items()}, batch_size=[]) for j in range(n)]

    def add_prebuilt(self, td):
        self.rb.add(td)

    def extend(self, s):
        e = s + CHUNK
        self.rb.extend(self.TD({k: v[s:e] for k, v in self.cols.items()}, batch_size=[CHUNK]))

    def sample(self, b):
        return self.rb.sample(b)


def _td_nbytes(td) -> int:
    try:
        return int(td.bytes())
    except Exception:
        return sum(int(v.numel() * v.element_size())
                   for v in td.values(include_nested=True, leaves_only=True))


def torchrl_buffer(workload: str, storage: str = "tensor", capacity: int | None = None,
                   pool: _Pool | None = None) -> dict:
    """torchrl.data.ReplayBuffer + LazyTensorStorage ("tensor") or
    LazyMemmapStorage ("memmap", scratch dir under the system temp dir)."""
    name = {"tensor": "LazyTensorStorage", "memmap": "LazyMemmapStorage"}[storage]
    out = {"peer": f"torchrl.ReplayBuffer+{name}", "workload": workload}
    try:
        torch, _ = _torch_import()
        from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer
    except Exception as e:
        out["unavailable"] = _err(e)
        return out
    tmp = None
    try:
        capacity = int(capacity or BENCH_CAPACITY[workload])
        pool = pool or _Pool(workload)
        gc.collect()
        rss0 = rss_bytes()
        t0 = time.perf_counter()
        if storage == "memmap":
            tmp = tempfile.TemporaryDirectory(prefix="torchrl_memmap_")
            st = LazyMemmapStorage(capacity, scratch_dir=tmp.name)
        else:
            st = LazyTensorStorage(capacity)
        with _quiet():
            rb = ReplayBuffer(storage=st)
            construct_s = time.perf_counter() - t0  # lazy: storage made on first extend
            out["version"] = _torchrl_versions()
            out.update(_measure(_TorchRLAdapter(rb, pool), pool, capacity, rss0, construct_s))
            try:
                out["bytes_per_transition"] = _td_nbytes(rb.storage._storage) / capacity
            except Exception as e:  # private attribute: best effort
                out["bytes_per_transition"] = None
                out["bytes_note"] = _err(e)
        out["note"] = (
            "flat keys obs/action/reward/terminated/truncated/next_obs, next_obs stored "
            "separately; step_per_s: per-step add builds a TensorDict(batch_size=[]) from "
            "torch views of the source row (timed); step_prebuilt_per_s: rb.add of "
            "TensorDicts built beforehand; extend builds one TensorDict of batch 1000; "
            f"torch threads {torch.get_num_threads()}; capacity {capacity}"
            + (f" (nominal {WORKLOADS[workload]['capacity']})"
               if capacity != WORKLOADS[workload]["capacity"] else "")
            + ("; memmap files in a temp dir on the local disk (page cache)" if tmp else "")
        )
        del rb, st
    except Exception as e:
        out["unavailable"] = _err(e)
    gc.collect()
    if tmp is not None:
        tmp.cleanup()
    return out


def torchrl_per(capacity: int = 1_000_000, batch: int = 256, workload: str = "mujoco",
                repeat: int = 5) -> dict:
    """TorchRL ReplayBuffer + LazyTensorStorage + PrioritizedSampler:
    iterations/s of sample(batch) + update_priority."""
    out = {"peer": "torchrl.PrioritizedSampler+LazyTensorStorage", "workload": workload}
    try:
        torch, _ = _torch_import()
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, PrioritizedSampler, ReplayBuffer
    except Exception as e:
        out["unavailable"] = _err(e)
        return out
    try:
        with _quiet():
            sampler = PrioritizedSampler(capacity, alpha=0.6, beta=0.4)
    except Exception as e:
        ext = torchrl_extension_error()
        out["version"] = _torchrl_versions()
        out["unavailable"] = _err(e) + (f" | torchrl C++ extension: {ext}" if ext else "")
        return out
    try:
        pool = _Pool(workload, seed=3)
        with _quiet():
            rb = ReplayBuffer(storage=LazyTensorStorage(capacity), sampler=sampler)
            cols = {c: torch.from_numpy(pool.data[c]) for c in COLUMNS}
            t0 = time.perf_counter()
            for i in range(capacity // CHUNK):
                s = (i * CHUNK) % pool.n
                rb.extend(TensorDict({k: v[s:s + CHUNK] for k, v in cols.items()},
                                     batch_size=[CHUNK]))
            fill = time.perf_counter() - t0
            gen = torch.Generator().manual_seed(0)

            def it():
                _, info = rb.sample(batch, return_info=True)
                rb.update_priority(info["index"], torch.rand(batch, generator=gen) + 1e-3)

            r = median_rate(it, repeat=repeat, number=200, items=1, warmup=20)
        out.update(version=_torchrl_versions(), capacity=capacity, batch=batch,
                   iterations_per_s=r, fill_seconds=fill,
                   note="sample (with transition gather) + update_priority, alpha=0.6 beta=0.4")
    except Exception as e:
        out["unavailable"] = _err(e)
    gc.collect()
    return out


def torchrl_slice(rows: int, slice_len: int = 20, num_slices: int = 64, obs_dim: int = 8,
                  episode_len: int = 1000, cache_values: bool = False,
                  max_seconds: float = 6.0) -> dict:
    """TorchRL SliceSampler over LazyTensorStorage of `rows` rows of
    obs float32[obs_dim] + ("next","done"): seconds per batch of num_slices
    slices of slice_len steps (batch_size = num_slices * slice_len)."""
    out = {"peer": "torchrl.SliceSampler+LazyTensorStorage", "rows": rows,
           "slice_len": slice_len, "num_slices": num_slices, "cache_values": cache_values}
    try:
        torch, _ = _torch_import()
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, ReplayBuffer, SliceSampler
    except Exception as e:
        out["unavailable"] = _err(e)
        return out
    try:
        out["version"] = _torchrl_versions()
        with _quiet():
            rb = ReplayBuffer(
                storage=LazyTensorStorage(rows),
                sampler=SliceSampler(slice_len=slice_len, end_key=("next", "done"),
                                     cache_values=cache_values),
                batch_size=slice_len * num_slices,
            )
            chunk = min(rows, 1_000_000)
            obs = torch.ones(chunk, obs_dim, dtype=torch.float32)
            done = torch.zeros(chunk, 1, dtype=torch.bool)
            done[episode_len - 1::episode_len] = True
            t0 = time.perf_counter()
            for s in range(0, rows, chunk):
                n = min(chunk, rows - s)
                rb.extend(TensorDict({"obs": obs[:n], "next": {"done": done[:n]}},
                                     batch_size=[n]))
            out["fill_seconds"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            rb.sample()  # warm-up (and, with cache_values, the one-off scan)
            out["first_batch_seconds"] = time.perf_counter() - t0
            times = []
            start = time.perf_counter()
            while len(times) < 20 and (len(times) < 3 or time.perf_counter() - start < max_seconds):
                t0 = time.perf_counter()
                b = rb.sample()
                times.append(time.perf_counter() - t0)
            assert b.shape[0] == slice_len * num_slices
        out["seconds_per_batch"] = statistics.median(times)
        out["batches_timed"] = len(times)
        out["note"] = (f"episodes of {episode_len} steps, end_key=('next','done'), "
                       "strict_length=True (default)")
        del rb, obs, done
    except Exception as e:
        out["unavailable"] = _err(e)
    gc.collect()
    return out


# --------------------------------------------------------------------------
# Run everything


def _fmt(v, unit=""):
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if v >= 1e6:
        return f"{v / 1e6:.2f}M{unit}"
    if v >= 1e4:
        return f"{v / 1e3:.0f}k{unit}"
    if v >= 100:
        return f"{v:.0f}{unit}"
    return f"{v:.3g}{unit}"


def _busy_seconds() -> float | None:
    """CPU seconds all CPUs spent busy since boot (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def run_all(verbose: bool = True) -> dict:
    t_start = time.perf_counter()
    busy0, own0 = _busy_seconds(), os.times()
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if verbose else (lambda *a: None)
    res: dict = {
        "host": {"python": platform.python_version(), "numpy": np.__version__,
                 "cpus": os.cpu_count(), "machine": platform.machine()},
        "versions": {d: _version(d) for d in ("cpprb", "torchrl", "tensordict", "torch", "numpy")},
        "torchrl_extension_error": None,
        "ceilings": {},
        "buffers": [],
    }
    try:
        res["torchrl_extension_error"] = torchrl_extension_error()
    except Exception as e:
        res["torchrl_extension_error"] = _err(e)

    log("ceilings: memcpy")
    res["ceilings"]["memcpy"] = [ceilings.memcpy_bandwidth(4 << 20), ceilings.memcpy_bandwidth(256 << 20)]
    for w in ("atari", "mujoco"):
        cap = BENCH_CAPACITY[w]
        log(f"ceilings: numpy {w}")
        c = {"transition_bytes": transition_bytes(w), "capacity": cap}
        c["first_fill"] = ceilings.first_fill(w, cap)
        store = ceilings.numpy_store(w, cap)
        c["gather"] = [ceilings.gather(w, b, store=store, sorted_indices=s, reuse_out=o, repeat=7)
                       for b in (256, 4096) for s, o in ((False, False), (True, False), (False, True))]
        c["ring"] = ceilings.numpy_ring(w, store=store)
        del store
        gc.collect()
        res["ceilings"][w] = c

        pool = _Pool(w)
        for fn, args in ((cpprb_buffer, (w, cap, pool)),
                         (torchrl_buffer, (w, "tensor", cap, pool)),
                         (torchrl_buffer, (w, "memmap", cap, pool))):
            r = fn(*args)
            log(f"  {r['peer']} {w}: {'unavailable' if 'unavailable' in r else 'ok'}")
            res["buffers"].append(r)
        del pool
        gc.collect()

    log("PER")
    res["per"] = [cpprb_per(), torchrl_per()]
    log("slice")
    res["slice"] = []
    for rows in (1_000_000, 10_000_000):
        res["slice"].append(torchrl_slice(rows))
        res["slice"].append(torchrl_slice(rows, cache_values=True))
        res["slice"].append({"peer": "numpy slice gather (ceiling)",
                             **ceilings.slice_gather(rows)})
        gc.collect()
    wall = time.perf_counter() - t_start
    res["total_seconds"] = wall
    busy1, own1 = _busy_seconds(), os.times()
    if busy0 is not None and busy1 is not None:
        own = (own1.user + own1.system) - (own0.user + own0.system)
        # Share of the machine's CPU time used by *other* processes during the
        # run: well above 0 means the numbers were taken on a contended host.
        res["other_cpu_share"] = max(0.0, (busy1 - busy0 - own) / (wall * (os.cpu_count() or 1)))
    return res


def print_table(res: dict, file=sys.stdout) -> None:
    p = lambda *a: print(*a, file=file)  # noqa: E731
    v = res["versions"]
    p(f"versions: {', '.join(f'{k} {x}' for k, x in v.items())}")
    if res.get("torchrl_extension_error"):
        p(f"torchrl C++ extension: {res['torchrl_extension_error'][:160]}")
    for m in res["ceilings"]["memcpy"]:
        p(f"memcpy {m['bytes'] >> 20} MiB: {m['gbps']:.1f} GB/s (best {m['gbps_best']:.1f}), "
          f"first touch {m['first_touch_gbps']:.1f} GB/s")
    hdr = ("workload", "store", "cap", "step/s", "ext MB/s", "fill MB/s", "s256/s", "s4096/s", "B/trans")
    p("")
    p("{:<7} {:<40} {:>7} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8}".format(*hdr))
    for w in ("atari", "mujoco"):
        c = res["ceilings"][w]
        g = {(x["batch"], x["sorted_indices"], x["reuse_out"]): x["transitions_per_s"] for x in c["gather"]}
        ring = c["ring"]
        p("{:<7} {:<40} {:>7} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8}".format(
            w, "numpy ring (ceiling)", _fmt(c["capacity"]), _fmt(ring["step_per_s"]),
            _fmt(ring["extend_mb_per_s"]), _fmt(c["first_fill"]["first_fill_mb_per_s"]),
            _fmt(g[(256, False, False)]), _fmt(g[(4096, False, False)]), c["transition_bytes"]))
        p("{:<7} {:<40} {:>7} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8}".format(
            w, "  numpy gather, sorted idx", "", "", "", "",
            _fmt(g[(256, True, False)]), _fmt(g[(4096, True, False)]), ""))
        p("{:<7} {:<40} {:>7} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8}".format(
            w, "  numpy gather, reused out buffers", "", "", "", "",
            _fmt(g[(256, False, True)]), _fmt(g[(4096, False, True)]), ""))
        for r in res["buffers"]:
            if r["workload"] != w:
                continue
            if "unavailable" in r:
                p(f"{w:<7} {r['peer']:<40} unavailable: {r['unavailable'][:120]}")
                continue
            pre = r.get("step_prebuilt_per_s")
            p("{:<7} {:<40} {:>7} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8}".format(
                w, r["peer"], _fmt(r["capacity"]), _fmt(r["step_per_s"]), _fmt(r["extend_mb_per_s"]),
                _fmt(r["first_fill_mb_per_s"]), _fmt(r["sample256_per_s"]), _fmt(r["sample4096_per_s"]),
                _fmt(r.get("bytes_per_transition"))))
            if pre:
                p(f"{w:<7} {'  ...rb.add of prebuilt TensorDicts':<40} {'':>7} {_fmt(pre):>8}")
    p("")
    p("PER (mujoco, capacity 1M, sample 256 + update priorities):")
    for r in res["per"]:
        if "unavailable" in r:
            p(f"  {r['peer']:<46} unavailable: {r['unavailable'][:200]}")
        else:
            p(f"  {r['peer']:<46} {r['iterations_per_s']:,.0f} it/s")
    p("")
    p("Sequence sampling (64 slices x 20 steps, obs float32[8]):")
    for r in res["slice"]:
        tag = r["peer"] + (" cache_values" if r.get("cache_values") else "")
        rows = _fmt(r["rows"])
        if "unavailable" in r:
            p(f"  {tag:<52} rows {rows:>6}: unavailable: {r['unavailable'][:160]}")
        else:
            p(f"  {tag:<52} rows {rows:>6}: {r['seconds_per_batch'] * 1e3:.3f} ms/batch")
    p(f"\ntotal {res['total_seconds']:.0f} s; other processes' share of CPU during the run: "
      f"{res.get('other_cpu_share', float('nan')):.0%}")


def main() -> None:
    res = run_all()
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "peers.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=float)
    print_table(res)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
