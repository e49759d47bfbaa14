"""Tiers and placement benchmark (issue 8): a store bigger than its host budget, cold columns, and GPU gathers.

Rows (ratios within each run, median of 3 interleaved runs):

- spill: an atari store twice its host budget (the disk tier, memory-mapped Arrow IPC files, holds the rest),
  prioritized replay where 10% of the rows hold 90% of the mass; samples/s as a ratio to the same store all in
  RAM (target >= 0.7x). "clustered": the hot rows fill 10% of the chunks (recent or surprising episodes), so
  placement can keep them on the host; "scattered": hot rows spread over every chunk (every chunk then has the same
  mass: no placement can help, the ratio shows the cost of reading half the bytes from the disk tier). "warm": the
  disk tier's pages are in the page cache (a machine with free RAM); "cold": dropped before each run (fadvise), so
  the disk is read.
- spill, uniform: samples/s, and the bytes/s read from disk-resident chunks as a ratio to the disk's read bandwidth
  (a cold sequential read of the spill directory's filesystem, measured here).
- cold columns: a schema with an `info` column ten times the size of the hot columns and a host budget that fits
  only the hot ones: `sample(columns=hot)` as a ratio to a store without `info` (target >= 0.9x); the same with the
  placement policy off (static placement) shows what the policy buys.
- gpu (only with a CUDA device, `--gpu`): atari batch 4096 from GPU-resident columns (the old path: chunk slots
  placed on the device) vs host gather + host-to-device copy, and the device ring (issue 43) vs that old path;
  gather bandwidth vs a device-to-device copy. benchmarks/bench_device.py has the issue-43 rows in full.
- device_cpu: the device ring's code on torch's CPU device vs the host path (a sanity row, not a GPU figure).

    python -m benchmarks.bench_tiers [--quick] [--spill-dir DIR] [--gpu] [--only spill cold_columns gpu device_cpu]

Prints a table and writes benchmarks/out/tiers.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

import arrowbuf as ab
from arrowbuf.placement import probe_bandwidth

from .workloads import make_steps

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
RUNS = 3


def fill(store: ab.ExperienceStore, pool: dict, rows: int, chunk: int = 500) -> None:
    p = len(pool["obs"])
    done = 0
    while done < rows:
        s = done % p
        k = min(chunk, p - s, rows - done)
        store.extend({c: v[s:s + k] for c, v in pool.items()})
        done += k


def rate(store: ab.ExperienceStore, batch: int, seconds: float, columns: list[str] | None = None,
         before: Callable[[], None] | None = None, max_batches: int | None = None) -> float:
    """Transitions sampled per second over about `seconds` (after `before()`, e.g. dropping the page cache)."""
    if before is not None:
        before()
    n, t0 = 0, time.perf_counter()
    while True:
        store.sample(batch, columns=columns)
        n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds or (max_batches is not None and n >= max_batches):
            return n * batch / dt


def read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (Linux /proc/self/io; 0 where unknown)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))
    except (OSError, StopIteration, ValueError):
        return 0


class DiskRead:
    """Wraps a cold run: the bytes it read from the disk and the seconds it took."""

    def __init__(self) -> None:
        self.bytes = 0
        self.seconds = 0.0

    def run(self, fn: Callable[[], float]) -> float:
        b0, t0 = read_bytes(), time.perf_counter()
        r = fn()
        self.seconds += time.perf_counter() - t0
        self.bytes += read_bytes() - b0
        return r


def warmed(store: ab.ExperienceStore, batch: int, seconds: float, columns: list[str] | None = None) -> float:
    """`rate` with the disk tier's files in the page cache and mapped (as after a cold run has read them all)."""
    for t in getattr(store._cols, "tiers", []):
        if t.name == "disk":
            t.load_cache()
    rate(store, batch, seconds / 4, columns)
    return rate(store, batch, seconds, columns)


def interleaved(fns: dict[str, Callable[[], float]], base: str, runs: int = RUNS, slices: int = 1) -> dict:
    """`runs` runs; in each, every fn measured `slices` times in turn (A B A B ...), so that machine noise hits all
    alike. Returns the median rate per fn, `<fn>_ratio`: the median over runs of the ratio to `base` within a run,
    and `runs`: every run's rates."""
    rates: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        acc = dict.fromkeys(fns, 0.0)
        for _ in range(slices):
            for k, fn in fns.items():
                acc[k] += fn() / slices
        for k in fns:
            rates[k].append(acc[k])
    out: dict = {k: statistics.median(v) for k, v in rates.items()}
    for k in fns:
        if k != base:
            out[f"{k}_ratio"] = statistics.median(r / b for r, b in zip(rates[k], rates[base]))
    out["runs"] = rates
    return out


def settle(store: ab.ExperienceStore, columns: list[str] | None, batch: int = 256, max_steps: int = 30) -> int:
    """Sample (so placement sees the access pattern) and step the policy until nothing moves; returns steps."""
    for i in range(max_steps):
        for _ in range(4):
            store.sample(batch, columns=columns)
        if store.placement_policy.step() == 0 and i >= 2:
            return i + 1
    return max_steps


def disk_tier(store: ab.ExperienceStore) -> Any:
    return next(t for t in store._cols.tiers if t.name == "disk")


def host_share(store: ab.ExperienceStore, columns: list[str]) -> float:
    p = store.placement().to_pandas()
    p = p[p["column"].isin(columns)]
    return float(p[p["tier"] == "host"]["bytes"].sum() / max(1, p["bytes"].sum()))


# ---------------------------------------------------------------------- spill
def skewed_priorities(cap: int, chunk_rows: int, clustered: bool, rng: np.random.Generator) -> np.ndarray:
    """Priorities over seqs 0..cap-1 where 10% of the rows hold 90% of the mass (alpha=1)."""
    if clustered:
        chunks = cap // chunk_rows
        hot_chunks = rng.choice(chunks, size=max(1, chunks // 10), replace=False)
        hot = np.isin(np.arange(cap) // chunk_rows, hot_chunks)
    else:
        hot = np.zeros(cap, bool)
        hot[rng.choice(cap, size=cap // 10, replace=False)] = True
    return np.where(hot, 9.0 * (~hot).sum() / max(1, hot.sum()), 1.0)


def spill(quick: bool, spill_dir: str) -> dict:
    schema = ab.load_schema(ROOT / "schemas" / "atari.yaml")
    cap = 6_000 if quick else 20_000
    pool = make_steps("atari", 1000, seed=0, episode_len=500)
    secs = 1.0 if quick else 2.0
    out: dict = {"capacity": cap, "row_bytes": schema.row_bytes}
    disk_bw = probe_bandwidth(ab.tiers.DiskTier(spill_dir))  # cold sequential read of that filesystem
    out["disk_read_gbps"] = disk_bw / 1e9
    for case in ("clustered", "scattered", "uniform"):
        out[case] = _spill_case(case, schema, cap, pool, secs, spill_dir, disk_bw)
        gc.collect()
    return out


def _spill_case(case: str, schema: ab.ExperienceSchema, cap: int, pool: dict, secs: float, spill_dir: str,
                disk_bw: float) -> dict:
    def sampler() -> Any:
        return ab.samplers.Prioritized(alpha=1.0) if case != "uniform" else "uniform"

    ram = ab.ExperienceStore(schema, cap, sampler(), seed=0)
    fill(ram, pool, cap)
    total = ram._tier.nbytes()
    budget = total // 2  # the store is twice its host budget
    tiered = ab.ExperienceStore(schema, cap, sampler(), seed=0, chunk_rows=ram.chunk_rows,
                                tiers={"host": budget, "disk": spill_dir},
                                placement=ab.placement.BandwidthAware(interval=None))
    try:
        fill(tiered, pool, cap)
        if case != "uniform":
            pri = skewed_priorities(cap, tiered.chunk_rows, case == "clustered", np.random.default_rng(0))
            for s in (ram, tiered):
                s.update_priorities(np.arange(cap), pri)
        steps = settle(tiered, None)
        drop = disk_tier(tiered).drop_cache
        disk = DiskRead()
        res = interleaved({
            "ram": lambda: rate(ram, 256, secs),
            "warm": lambda: warmed(tiered, 256, secs),
            "cold": lambda: disk.run(lambda: rate(tiered, 256, secs, before=drop, max_batches=50)),
        }, base="ram")
        from_disk = 1.0 - host_share(tiered, ["obs"])
        row = {"ram_per_s": res["ram"], "warm_per_s": res["warm"], "cold_per_s": res["cold"],
               "warm_ratio": res["warm_ratio"], "cold_ratio": res["cold_ratio"], "runs": res["runs"],
               "host_budget": budget, "store_bytes": total, "obs_bytes_on_disk_share": from_disk,
               "mass_on_host": _mass_on_host(tiered), "settle_steps": steps, "host_bytes": tiered._tier.nbytes(),
               "within_budget": tiered._tier.nbytes() <= budget,
               "migrations": tiered.stats()["placement"]["migrations"]}
        # bytes the cold runs fetched from the disk (/proc/self/io) per second, vs the disk's read bandwidth
        row["cold_disk_gbps"] = disk.bytes / max(disk.seconds, 1e-9) / 1e9
        row["cold_vs_disk_bw"] = row["cold_disk_gbps"] * 1e9 / disk_bw
        return row
    finally:
        ram.close()
        tiered.close()


def _mass_on_host(store: ab.ExperienceStore) -> float:
    """Share of the sampling mass in chunks whose obs is on the host."""
    from arrowbuf.placement import chunk_mass

    cols = store._cols
    mass = chunk_mass(store, cols.chunk_rows, cols.num_slots)
    on_host = cols.res[cols.ci["obs"]] == cols.tiers.index(store._tier)
    return float(mass[on_host].sum() / max(mass.sum(), 1e-12))


# ---------------------------------------------------------------------- cold columns
def cold_columns(quick: bool, spill_dir: str) -> dict:
    hot_fields = {"obs": {"dtype": "float32", "shape": [64]}, "action": {"dtype": "int64"},
                  "reward": {"dtype": "float32"}, "terminated": {"dtype": "bool"}, "truncated": {"dtype": "bool"}}
    hot_bytes = 64 * 4 + 8 + 4 + 1 + 1
    info_floats = 10 * hot_bytes // 4
    with_info = {"name": "cold", "fields": {**hot_fields, "info": {"dtype": "float32", "shape": [info_floats]}}}
    without = {"name": "hot", "fields": hot_fields}
    hot = list(hot_fields)
    cap = 40_000 if quick else 200_000
    secs = 1.0 if quick else 2.0
    rng = np.random.default_rng(0)
    n = 5_000
    data = {"obs": rng.standard_normal((n, 64), dtype=np.float32), "action": rng.integers(0, 18, n),
            "reward": rng.standard_normal(n, dtype=np.float32), "terminated": np.arange(n) % 500 == 499,
            "truncated": np.zeros(n, bool), "info": rng.standard_normal((n, info_floats), dtype=np.float32)}

    def load(store: ab.ExperienceStore, with_info: bool) -> None:
        pool = data if with_info else {k: v for k, v in data.items() if k != "info"}
        done = 0
        while done < cap:
            k = min(n, cap - done)
            store.extend({c: v[:k] for c, v in pool.items()})
            done += k

    base = ab.ExperienceStore(without, cap, seed=0)
    load(base, False)
    probe = ab.ExperienceStore(with_info, cap, seed=0, tiers={"host": None, "disk": spill_dir}, placement="static",
                               chunk_rows=base.chunk_rows)
    meta = probe._tier.nbytes() - sum(s.held_pages * 4096 for s in probe._tier._sparse.values())
    probe.close()
    budget = meta + probe.arena_rows * hot_bytes + 64 * 4096  # the index and the hot columns, not info
    stores = {}
    for kind, pol in (("policy", ab.placement.BandwidthAware(interval=None)), ("static", "static")):
        s = ab.ExperienceStore(with_info, cap, seed=0, chunk_rows=base.chunk_rows,
                               tiers={"host": budget, "disk": spill_dir}, placement=pol)
        load(s, True)
        if kind == "policy":
            settle(s, hot)
        stores[kind] = s
    drop = disk_tier(stores["static"]).drop_cache
    part = secs / 4  # four alternating slices per run: the two stores differ by a few percent at most
    res = interleaved({
        "base": lambda: rate(base, 256, part, hot),
        "policy": lambda: rate(stores["policy"], 256, part, hot),
    }, base="base", slices=4)
    static = interleaved({
        "base": lambda: rate(base, 256, secs, hot),
        "static_warm": lambda: warmed(stores["static"], 256, secs, hot),
        "static_cold": lambda: rate(stores["static"], 256, secs, hot, before=drop, max_batches=50),
    }, base="base")
    out = {"capacity": cap, "hot_row_bytes": hot_bytes, "info_row_bytes": info_floats * 4, "host_budget": budget,
           "base_per_s": res["base"], "policy_per_s": res["policy"], "ratio": res["policy_ratio"],
           "runs": res["runs"], "static_warm_ratio": static["static_warm_ratio"],
           "static_cold_ratio": static["static_cold_ratio"],
           "hot_on_host": host_share(stores["policy"], hot), "info_on_host": host_share(stores["policy"], ["info"]),
           "static_hot_on_host": host_share(stores["static"], hot),
           "within_budget": all(s._tier.nbytes() <= budget for s in stores.values())}
    for s in (base, *stores.values()):
        s.close()
    return out


# ---------------------------------------------------------------------- gpu
def gpu(quick: bool) -> dict:
    """Atari batch 4096 from GPU-resident columns vs host gather + host-to-device copy (needs a CUDA device)."""
    try:
        import torch
    except ImportError:
        return {"skipped": "torch not installed"}
    if not torch.cuda.is_available():
        from arrowbuf.tiers.gpu import gpu_environment

        return {"skipped": f"no CUDA device ({gpu_environment()})"}
    schema = ab.load_schema(ROOT / "schemas" / "atari.yaml")
    cap = 20_000 if quick else 100_000
    pool = make_steps("atari", 1000, seed=0, episode_len=500)
    host = ab.ExperienceStore(schema, cap, seed=0)
    fill(host, pool, cap)
    from arrowbuf.tiers import GpuTier

    dev = ab.ExperienceStore(schema, cap, seed=0, chunk_rows=host.chunk_rows,
                             tiers={"gpu": GpuTier(int(host._tier.nbytes() * 1.2), ring=False), "host": None},
                             placement=ab.placement.BandwidthAware(interval=None))
    fill(dev, pool, cap)
    settle(dev, None, batch=4096)
    ring = ab.ExperienceStore(schema, cap, seed=0, chunk_rows=host.chunk_rows,
                              tiers={"gpu": GpuTier(ring=True), "host": None},
                              placement=ab.placement.BandwidthAware(interval=None))
    fill(ring, pool, cap)
    sync = torch.cuda.synchronize
    batch = 4096
    row_bytes = 2 * schema.fields["obs"].row_bytes + 8 + 4 + 2

    def via_host() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            host.sample(batch).to_torch("cuda", non_blocking=False)
        sync()
        return 10 * batch / (time.perf_counter() - t0)

    def on_device() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            dev.sample(batch).to_torch("cuda")
        sync()
        return 10 * batch / (time.perf_counter() - t0)

    def on_ring() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            ring.sample(batch)
        sync()
        return 10 * batch / (time.perf_counter() - t0)

    def d2d() -> float:
        src = torch.empty(batch * row_bytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        sync()
        return 10 * batch / (time.perf_counter() - t0)

    # the kernel alone: one column's gather from a tier arena (GpuTier.take) against a device copy of the same bytes;
    # the whole-batch row above adds the store's per-batch work (sampling, six columns, rows still on the host)
    obs = schema.fields["obs"]
    tier = GpuTier(device="cuda")
    arena = tier.allocate("obs", obs.dtype, cap, tuple(obs.shape))
    arena.random_(0, 255)
    pos = np.sort(np.random.default_rng(0).integers(0, cap, batch))
    flat = torch.empty(batch * obs.row_bytes, dtype=torch.uint8, device="cuda")
    flat2 = torch.empty_like(flat)

    def timed(fn: Callable[[], object]) -> float:
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        sync()
        return 20 * batch / (time.perf_counter() - t0)

    kernel = interleaved({"take": lambda: timed(lambda: tier.take(arena, pos, obs.dtype)),
                          "copy": lambda: timed(lambda: flat2.copy_(flat))}, base="copy")
    tier.close()
    res = interleaved({"host_h2d": via_host, "device": on_device, "ring": on_ring, "d2d": d2d}, base="host_h2d")
    out = {"device": torch.cuda.get_device_name(0), "capacity": cap, "batch": batch,
           "host_gather_h2d_per_s": res["host_h2d"], "device_gather_per_s": res["device"],
           "speedup_vs_host_h2d": res["device_ratio"],
           "device_gather_gbps": res["device"] * row_bytes / 1e9, "d2d_copy_gbps": res["d2d"] * row_bytes / 1e9,
           "gather_vs_d2d": res["device"] / res["d2d"],
           "obs_take_gbps": kernel["take"] * obs.row_bytes / 1e9,
           "obs_copy_gbps": kernel["copy"] * obs.row_bytes / 1e9,
           "obs_take_vs_copy": kernel["take_ratio"],
           "obs_on_gpu": float(dev.placement().to_pandas().query("column == 'obs' and tier == 'gpu'")["bytes"].sum()
                               / max(1, dev.placement().to_pandas().query("column == 'obs'")["bytes"].sum())),
           # the device ring (issue 43): the same batch drawn and gathered on the device, no host sync
           "ring_per_s": res["ring"], "ring_vs_old": statistics.median(
               r / o for r, o in zip(res["runs"]["ring"], res["runs"]["device"])),
           "ring_gbps": res["ring"] * row_bytes / 1e9, "ring_vs_d2d": res["ring"] / res["d2d"]}
    host.close()
    dev.close()
    ring.close()
    return out


def device_cpu(quick: bool) -> dict:
    """The device ring's code on torch's CPU device vs the host path (numpy), atari: a sanity row of the device path
    in torch ops (same data, same batch), not a GPU figure."""
    try:
        import torch
    except ImportError:
        return {"skipped": "torch not installed"}
    from arrowbuf.tiers import GpuTier

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # numpy gathers on one thread; OpenMP's spinning threads on a busy 2-core VM: 10x slower
    schema = ab.load_schema(ROOT / "schemas" / "atari.yaml")
    cap, batch = (4_000, 256) if quick else (10_000, 1024)
    pool = make_steps("atari", 1000, seed=0, episode_len=500)
    host = ab.ExperienceStore(schema, cap, seed=0)
    ring = ab.ExperienceStore(schema, cap, seed=0, chunk_rows=host.chunk_rows,
                              tiers={"gpu": GpuTier(device="cpu", ring=True), "host": None},
                              placement=ab.placement.BandwidthAware(interval=None))
    for s in (host, ring):
        fill(s, pool, cap)
        for _ in range(3):  # the ring's first sample copies the whole ring to the device: not the steady state
            s.sample(batch)
    secs = 0.5 if quick else 1.5
    res = interleaved({"host": lambda: rate(host, batch, secs), "ring": lambda: rate(ring, batch, secs)}, base="host")
    host.close()
    ring.close()
    torch.set_num_threads(threads)
    return {"capacity": cap, "batch": batch, "torch_threads": 1, "host_per_s": res["host"], "ring_per_s": res["ring"],
            "ring_vs_host": res["ring_ratio"], "runs": res["runs"]}


# ---------------------------------------------------------------------- report
def table(res: dict) -> str:
    lines = [f"{'row':52} {'arrowbuf':>10} {'baseline':>10} {'ratio':>6} {'target':>7}"]

    def add(name: str, value: float | None, base: float | None, ratio: float | None, target: str = "") -> None:
        def f(v: float | None) -> str:
            return "-" if v is None else (f"{v:,.0f}" if v >= 100 else f"{v:.2f}")

        lines.append(f"{name:52} {f(value):>10} {f(base):>10} {('-' if ratio is None else f'{ratio:.2f}'):>6} "
                     f"{target:>7}")

    sp = res.get("spill")
    if sp:
        for case, label in (("clustered", "prioritized, hot chunks"), ("scattered", "prioritized, hot rows spread"),
                            ("uniform", "uniform")):
            r = sp[case]
            tgt = ">=0.7" if case == "clustered" else ""
            add(f"spill 2x host, {label}: warm, samples/s vs RAM", r["warm_per_s"], r["ram_per_s"], r["warm_ratio"],
                tgt)
            add(f"spill 2x host, {label}: cold disk, vs RAM", r["cold_per_s"], r["ram_per_s"], r["cold_ratio"], tgt)
        for case in ("uniform", "clustered"):
            u = sp[case]
            add(f"spill {case} cold: GB/s read from disk vs its bandwidth", u["cold_disk_gbps"],
                sp["disk_read_gbps"], u["cold_vs_disk_bw"])
    cc = res.get("cold_columns")
    if cc:
        add("cold columns: sample(hot) vs store without info", cc["policy_per_s"], cc["base_per_s"], cc["ratio"],
            ">=0.9")
        add("cold columns, static placement: warm, vs without info", None, cc["base_per_s"], cc["static_warm_ratio"])
        add("cold columns, static placement: cold disk, vs without", None, cc["base_per_s"], cc["static_cold_ratio"])
    g = res.get("gpu")
    if g and "skipped" not in g:
        add("gpu atari 4096: device gather vs host gather + H2D", g["device_gather_per_s"],
            g["host_gather_h2d_per_s"], g["speedup_vs_host_h2d"])
        add("gpu gather GB/s vs device-to-device copy", g["device_gather_gbps"], g["d2d_copy_gbps"],
            g["gather_vs_d2d"])
        add("gpu obs column gather GB/s (tier take) vs copy", g["obs_take_gbps"], g["obs_copy_gbps"],
            g["obs_take_vs_copy"])
    elif g:
        lines.append(f"gpu: skipped: {g['skipped']}")
    if g and "ring_per_s" in g:
        add("gpu atari 4096: device ring vs old GPU path (chunk slots)", g["ring_per_s"], g["device_gather_per_s"],
            g["ring_vs_old"])
        add("gpu device ring GB/s vs device-to-device copy", g["ring_gbps"], g["d2d_copy_gbps"], g["ring_vs_d2d"])
    d = res.get("device_cpu")
    if d and "skipped" not in d:
        add(f"device ring on torch's CPU vs host path, atari {d['batch']} (sanity)", d["ring_per_s"],
            d["host_per_s"], d["ring_vs_host"])
    elif d:
        lines.append(f"device_cpu: skipped: {d['skipped']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--spill-dir", default=None, help="directory on the disk to spill to (default: a temp dir)")
    ap.add_argument("--gpu", action="store_true", help="also the GPU rows (needs a CUDA device)")
    ap.add_argument("--only", nargs="+", choices=["spill", "cold_columns", "gpu", "device_cpu"],
                    help="run only these sections")
    ap.add_argument("--out", default=str(OUT / "tiers.json"))
    args = ap.parse_args(argv)
    spill_dir = args.spill_dir or tempfile.mkdtemp(prefix="arrowbuf-bench-spill-", dir=os.environ.get("TMPDIR"))
    res: dict = {"machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                             "cpus": os.cpu_count(), "numpy": np.__version__, "quick": args.quick,
                             "spill_dir": spill_dir, "runs": RUNS}}
    only = set(args.only or ["spill", "cold_columns", *(["gpu"] if args.gpu else [])])
    try:
        if "spill" in only:
            res["spill"] = spill(args.quick, spill_dir)
        if "cold_columns" in only:
            res["cold_columns"] = cold_columns(args.quick, spill_dir)
        if "gpu" in only:
            res["gpu"] = gpu(args.quick)
        if "device_cpu" in only:
            res["device_cpu"] = device_cpu(args.quick)
    finally:
        if args.spill_dir is None:
            shutil.rmtree(spill_dir, ignore_errors=True)
    text = table(res)
    print(text)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
