"""Core store benchmark (issue: core store): append, extend, uniform sample, bytes per transition, per-step rows.

Measures arrowbuf, its ceilings (memcpy, a numpy gather of the same rows from preallocated arrays) and the peers
(cpprb ReplayBuffer, TorchRL LazyTensorStorage / LazyMemmapStorage) in one run, on the atari and mujoco workloads.
Prints a table and writes benchmarks/out/core.json.

    python -m benchmarks.bench_core [--quick] [--workloads atari mujoco] [--no-peers] [--steps-only]

The per-step append rows (issue 18) measure `append` in each configuration (uniform, prioritized, rate-limited,
0-d numpy scalars, float64 arrays into float32 fields) beside cpprb's and TorchRL's per-step add.

The first-fill rows (issue 18) fill a fresh atari ring once, with next_obs derived (stored once, `next_of`) and
stored as a field of its own: arrowbuf (page preparation on, and off), cpprb (`next_of="obs"` / next_obs in its
env_dict, construction counted: it zeroes its ring there) and a numpy ring of the same columns. Each one runs in a
fresh process after a pause (freed memory settles; no run inherits another's warm pages), the kinds rotating order
run by run; medians of `--ff-runs`. `python -m benchmarks.bench_core --first-fill-only [--ff-runs 3]`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import platform
import statistics
import sys
import time
import warnings
from typing import Any, Callable

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


# ---------------------------------------------------------------------- per-step append rows (issue 18)
STEP_CAP = 20_000   # ring of the per-step rows: filled first, so every measured step evicts one (steady state)
STEP_N = 5_000      # steps per repeat; the median of STEP_REPEAT repeats
STEP_REPEAT = 3


def _step_dicts(pool: dict, n: int, kind: str) -> list[dict]:
    """Steps as a user's loop makes them: "python" (Python scalars for scalar fields, as gymnasium returns), "numpy"
    (0-d numpy scalars: np.float32 reward, np.bool_ flags), "float64" (float64 arrays for float32 fields, as many
    environments return observations)."""
    out = []
    for i in range(n):
        s = {c: v[i] for c, v in pool.items()}
        if kind in ("python", "float64"):
            s["reward"] = float(s["reward"])
            s["terminated"] = bool(s["terminated"])
            s["truncated"] = bool(s["truncated"])
            if s["action"].shape == ():
                s["action"] = int(s["action"])
        if kind == "float64":
            for c in ("obs", "next_obs", "action"):
                if isinstance(s[c], np.ndarray) and s[c].dtype == np.float32:
                    s[c] = s[c].astype(np.float64)
        out.append(s)
    return out


def _per_step_rate(add: Callable[[int], None]) -> float:
    def run_steps() -> None:
        for i in range(STEP_N):
            add(i)

    return median_rate(run_steps, repeat=STEP_REPEAT, number=1, items=STEP_N, warmup=0)


def measure_step_appends(workload: str, pool: dict, peers: bool) -> dict:
    """Per-step append, steps/s, into a ring of STEP_CAP rows that has wrapped: arrowbuf in each configuration of
    issue 18, and cpprb / TorchRL doing the same (when installed)."""
    schema = schema_for(workload)
    n_pool = len(pool["obs"])
    steps = {k: _step_dicts(pool, n_pool, k) for k in ("python", "numpy", "float64")}  # built before timing
    configs = {
        "uniform": ({}, "python"),
        "prioritized": ({"sampler": ab.samplers.Prioritized(alpha=0.6, beta=0.4)}, "python"),
        "rate-limited MinSize(1000)": ({"rate_limiter": ab.rate_limiters.MinSize(1000)}, "python"),
        "rate-limited SampleToInsertRatio": (
            {"rate_limiter": ab.rate_limiters.SampleToInsertRatio(4.0, min_size=10**9)}, "python"),
        "0-d numpy scalars": ({}, "numpy"),
        "float64 arrays into float32 fields": ({}, "float64"),
    }
    if not any(f.dtype == np.float32 and f.shape for f in schema.fields.values()):
        del configs["float64 arrays into float32 fields"]  # (atari: uint8 frames, nothing to convert)
    out: dict = {"capacity": STEP_CAP}
    for name, (kw, kind) in configs.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            store = ab.ExperienceStore(schema, capacity=STEP_CAP, seed=0, **kw)
            fill(store, pool, STEP_CAP)
            out[f"arrowbuf {name}"] = _per_step_rate(
                lambda i, store=store, st=steps[kind]: store.append(st[i % n_pool]))
            slow = store.stats().get("append_slow_path")
            if slow:
                out[f"arrowbuf {name} slow_path_steps"] = slow
        store.close()
        del store
        gc.collect()
    if peers:
        out.update(_peer_step_appends(workload, pool))
    return out


def _peer_step_appends(workload: str, pool: dict) -> dict:
    out: dict = {}
    n_pool = len(pool["obs"])
    try:
        import cpprb

        from .peers import _cpprb_env_dict

        for name, cls, kw in (("cpprb ReplayBuffer", cpprb.ReplayBuffer, {}),
                              ("cpprb PrioritizedReplayBuffer", cpprb.PrioritizedReplayBuffer, {"alpha": 0.6})):
            rb = cls(STEP_CAP, _cpprb_env_dict(workload), next_of="obs", **kw)
            cols = {c: pool[c] for c in ("obs", "action", "reward", "terminated", "truncated", "next_obs")}
            term = pool["terminated"]

            def add(i: int, rb: Any = rb, cols: dict = cols, term: np.ndarray = term) -> None:
                j = i % n_pool
                rb.add(obs=cols["obs"][j], action=cols["action"][j], reward=cols["reward"][j],
                       terminated=cols["terminated"][j], truncated=cols["truncated"][j], next_obs=cols["next_obs"][j])
                if term[j]:
                    rb.on_episode_end()

            for i in range(STEP_CAP):
                add(i)
            out[name] = _per_step_rate(add)
            del rb
            gc.collect()
    except ImportError as e:
        out["cpprb unavailable"] = str(e)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch
            from tensordict import TensorDict
            from torchrl.data import LazyTensorStorage, PrioritizedSampler, ReplayBuffer

            tcols = {c: torch.from_numpy(pool[c]) for c in ("obs", "action", "reward", "terminated", "truncated",
                                                             "next_obs")}
            for name, per in (("torchrl LazyTensorStorage", False),
                              ("torchrl LazyTensorStorage+PrioritizedSampler", True)):
                try:
                    kw = {"sampler": PrioritizedSampler(STEP_CAP, alpha=0.6, beta=0.4)} if per else {}
                except RuntimeError as e:  # its C++ extension (sum trees) did not load in this install
                    out[f"{name} unavailable"] = str(e)
                    continue
                trb = ReplayBuffer(storage=LazyTensorStorage(STEP_CAP), **kw)

                def tadd(i: int, trb: Any = trb) -> None:
                    j = i % n_pool
                    trb.add(TensorDict({k: v[j] for k, v in tcols.items()}, batch_size=[]))

                for i in range(STEP_CAP):
                    tadd(i)
                out[name] = _per_step_rate(tadd)
                del trb
                gc.collect()
    except ImportError as e:
        out["torchrl unavailable"] = str(e)
    return out


def print_step_table(res: dict) -> str:
    lines = [f"per-step append, steps/s (ring of {STEP_CAP} rows, wrapped; median of {STEP_REPEAT} x {STEP_N})"]
    for w, row in res.items():
        base = row.get("cpprb ReplayBuffer")
        for k, v in row.items():
            if k == "capacity" or not isinstance(v, (int, float)):
                continue
            ratio = f"{v / base:.2f}x cpprb" if base and "slow_path" not in k else ""
            lines.append(f"{w:8} {k:48} {v:>12,.0f} {ratio}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- first-fill rows (issue 18)
FF_CAPACITY = 20_000  # atari rows: a 1.1 GB ring with next_obs stored (0.57 GB derived); short runs on a shared VM
FF_KINDS = ("arrowbuf", "arrowbuf prefault off", "cpprb", "numpy ring")
FF_LAYOUTS = ("derived", "stored")


def _ff_schema(layout: str) -> ab.ExperienceSchema:
    schema = schema_for("atari")
    if layout == "derived":
        return schema
    d = schema.to_dict()
    d.pop("derived", None)
    d["name"] = "atari_next_obs_stored"
    d["fields"]["next_obs"] = dict(d["fields"]["obs"])
    return ab.load_schema(d)


def first_fill_one(kind: str, layout: str, capacity: int, regime: str = "found") -> dict:
    """One first fill of a fresh atari ring (this process): construction + fill in chunks of 1000, then a second
    fill of the same ring (pages in place: the copy alone). MB/s of 56,466-byte transitions; writer-thread faults.

    `regime`: "found" takes memory as the machine hands it out; "recycled" first touches and frees 1.1x the
    ring's bytes in this process, so the ring gets pages the kernel just had back (the cost of a page is then the
    kernel's own fault and zeroing, as on a bare machine; on a VM that reports free memory to its host, memory
    "found" may first need the host to back it, at a tenth of that speed or less).
    """
    import resource

    from . import peers as peer_mod

    pool = peer_mod._Pool("atari")
    d = pool.data
    held: dict = {}
    cols = ("obs", "action", "reward", "terminated", "truncated") + (("next_obs",) if layout == "stored" else ())

    if kind.startswith("arrowbuf"):
        from arrowbuf.tiers.host import HostTier

        schema = _ff_schema(layout)
        src = {c: d[c] for c in (*cols, "next_obs")}

        def make() -> None:
            held["x"] = ab.ExperienceStore(schema, capacity=capacity, seed=0,
                                           tier=HostTier(prefault=kind == "arrowbuf"))

        def fill_ring() -> None:
            fill(held["x"], src, capacity)
    elif kind == "cpprb":
        import cpprb

        env = peer_mod._cpprb_env_dict("atari")
        if layout == "stored":
            env["next_obs"] = dict(env["obs"])

        def make() -> None:
            held["x"] = (cpprb.ReplayBuffer(capacity, env) if layout == "stored"
                         else cpprb.ReplayBuffer(capacity, env, next_of="obs"))

        def fill_ring() -> None:
            ad, pos = peer_mod._CpprbAdapter(held["x"], pool), 0
            for _ in range(-(-capacity // 1000)):
                ad.extend(pos)
                pos = (pos + 1000) % pool.n
    else:  # the numpy ring: the same columns as the layout stores, np.empty, sliced assignment
        def make() -> None:
            held["x"] = {c: np.empty((capacity, *d[c].shape[1:]), dtype=d[c].dtype) for c in cols}

        def fill_ring() -> None:
            ring = held["x"]
            for s in range(0, capacity, 1000):
                e = min(capacity, s + 1000)
                o = s % pool.n
                for c in cols:
                    ring[c][s:e] = d[c][o:o + e - s]

    def timed(fn: Callable[[], None]) -> tuple[float, int]:
        f0 = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0,
                resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt - f0)

    tb = transition_bytes("atari")
    out: dict = {"kind": kind, "layout": layout, "capacity": capacity, "regime": regime, "load": os.getloadavg()[0]}
    if regime == "recycled":
        ring = capacity * sum(d[c][:1].nbytes for c in cols)
        warm = np.empty(int(ring * 1.1), dtype=np.uint8)
        warm[::4096] = 1
        del warm
    out["construct_s"], out["construct_faults"] = timed(make)
    out["fill_s"], out["writer_faults"] = timed(fill_ring)
    out["mb_s"] = capacity * tb / (out["construct_s"] + out["fill_s"]) / 1e6
    if kind.startswith("arrowbuf"):
        out["prefault"] = held["x"].stats()["prefault"]
    warm_s, _ = timed(fill_ring)
    out["warm_mb_s"] = capacity * tb / warm_s / 1e6
    if kind.startswith("arrowbuf"):
        held["x"].close()
    return out


def measure_first_fill(capacity: int = FF_CAPACITY, runs: int = 1, pause: float = 3.0,
                       kinds: tuple[str, ...] = FF_KINDS, regime: str = "found") -> dict:
    """The first-fill rows: every (layout, kind) `runs` times, each in a fresh process after `pause` seconds,
    kinds rotating order run by run (`regime`: see `first_fill_one`). Returns {"runs": [...], "rows": {layout:
    {kind: median MB/s, ...}}}."""
    import subprocess

    results = []
    for r in range(runs):
        order = list(kinds[r % len(kinds):]) + list(kinds[:r % len(kinds)])
        for layout in FF_LAYOUTS:
            for kind in order:
                time.sleep(pause)
                cmd = [sys.executable, "-m", "benchmarks.bench_core", "--ff-one", kind, layout, str(capacity),
                       "--ff-regime", regime]
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                line = proc.stdout.strip().splitlines()[-1:] if proc.returncode == 0 else []
                results.append(json.loads(line[0]) if line else
                               {"kind": kind, "layout": layout, "error": proc.stderr.strip()[-500:]})
    rows: dict = {}
    for layout in FF_LAYOUTS:
        row: dict = {}
        for kind in kinds:
            got = [x for x in results if x["layout"] == layout and x["kind"] == kind and "mb_s" in x]
            if got:
                row[kind] = {"mb_s": statistics.median(x["mb_s"] for x in got),
                             "range": [min(x["mb_s"] for x in got), max(x["mb_s"] for x in got)],
                             "warm_mb_s": statistics.median(x["warm_mb_s"] for x in got),
                             "construct_s": statistics.median(x["construct_s"] for x in got),
                             "writer_faults": statistics.median(x["writer_faults"] for x in got), "runs": len(got)}
        base = row.get("cpprb", {}).get("mb_s")
        ring = row.get("numpy ring", {}).get("mb_s")
        for v in row.values():
            v["vs_cpprb"] = v["mb_s"] / base if base else None
            v["vs_numpy"] = v["mb_s"] / ring if ring else None
        rows[layout] = row
    return {"capacity": capacity, "regime": regime, "runs": results, "rows": rows, "pause_s": pause}


def print_first_fill(res: dict) -> str:
    lines = [f"first fill ({res['regime']} pages), atari {res['capacity']} rows, MB/s of transitions (construction "
             "counted; median of "
             f"{max((v['runs'] for r in res['rows'].values() for v in r.values()), default=0)} fresh processes)",
             f"{'layout':8} {'kind':22} {'MB/s':>8} {'range':>15} {'vs cpprb':>9} {'vs numpy':>9} {'construct s':>12}"
             f" {'writer faults':>14} {'warm MB/s':>10}"]
    for layout, row in res["rows"].items():
        for kind, v in row.items():
            rng = f"{v['range'][0]:,.0f}-{v['range'][1]:,.0f}"
            r1 = "-" if v["vs_cpprb"] is None else f"{v['vs_cpprb']:.2f}x"
            r2 = "-" if v["vs_numpy"] is None else f"{v['vs_numpy']:.2f}x"
            lines.append(f"{layout:8} {kind:22} {v['mb_s']:>8,.0f} {rng:>15} {r1:>9} {r2:>9} {v['construct_s']:>12.2f}"
                         f" {v['writer_faults']:>14,.0f} {v['warm_mb_s']:>10,.0f}")
    for x in res["runs"]:
        if "error" in x:
            lines.append(f"{x['layout']} {x['kind']}: failed: {x['error']}")
    return "\n".join(lines)


def run(workloads: list[str], quick: bool, peers: bool, steps: bool = True) -> dict:
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
        if steps:
            row["steps"] = measure_step_appends(w, pool, peers)
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
    p.add_argument("--steps-only", action="store_true", help="only the per-step append rows (issue 18)")
    p.add_argument("--no-steps", action="store_true", help="leave the per-step append rows out")
    p.add_argument("--first-fill-only", action="store_true", help="only the first-fill rows (issue 18)")
    p.add_argument("--no-first-fill", action="store_true", help="leave the first-fill rows out")
    p.add_argument("--ff-capacity", type=int, default=None, help=f"atari rows of the first-fill rings ({FF_CAPACITY})")
    p.add_argument("--ff-runs", type=int, default=1, help="fresh processes per (layout, kind); medians")
    p.add_argument("--ff-pause", type=float, default=3.0, help="seconds before each first-fill process")
    p.add_argument("--ff-regime", choices=("found", "recycled"), default="found",
                   help="pages as the machine hands them out, or pages this process just freed (first_fill_one)")
    p.add_argument("--ff-one", nargs=3, metavar=("KIND", "LAYOUT", "CAPACITY"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ff_one:
        print(json.dumps(first_fill_one(args.ff_one[0], args.ff_one[1], int(args.ff_one[2]), args.ff_regime),
                         default=str))
        return 0
    ff_cap = args.ff_capacity or (FF_CAPACITY // 2 if args.quick else FF_CAPACITY)
    if args.first_fill_only:
        ff = measure_first_fill(ff_cap, args.ff_runs, args.ff_pause, regime=args.ff_regime)
        print(print_first_fill(ff))
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "core_first_fill.json").write_text(json.dumps(ff, indent=1, default=str))
        return 0
    if args.steps_only:
        res = {w: measure_step_appends(w, make_steps(w, 2000, seed=0, episode_len=500), not args.no_peers)
               for w in args.workloads}
        print(print_step_table(res))
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "core_steps.json").write_text(json.dumps(res, indent=1, default=str))
        return 0
    res = run(args.workloads, args.quick, not args.no_peers, not args.no_steps)
    if not args.no_first_fill and "atari" in args.workloads:
        res["first_fill"] = measure_first_fill(
            ff_cap, args.ff_runs, args.ff_pause,
            FF_KINDS if not args.no_peers else ("arrowbuf", "arrowbuf prefault off", "numpy ring"), args.ff_regime)
    table = print_table(res)
    print(table)
    if "first_fill" in res:
        print(print_first_fill(res["first_fill"]))
    if not args.no_steps:
        print(print_step_table({w: row["steps"] for w, row in res["workloads"].items()}))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "core.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
