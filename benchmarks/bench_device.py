"""The device ring at device speed (issue 43): `sample(4096)` on a 100k-row atari store, the old GPU path against the
device ring, PER sample + update on the device against the host, and a writer beside a sampler.

Sections (each in one run, its baselines and ceilings measured in the same run):

- ceilings: a device-to-device copy of one batch's bytes and a raw `index_select` of the batch's frames from a
  100k-row arena, timed with CUDA events;
- sample: `sample(4096)` (every column, next_obs derived), 500 calls per path: the host path plus an H2D copy
  (`to_torch("cuda")`), the old GPU path (chunk slots placed on the device, `GpuTier(ring=False)`) and the device
  ring: rows/s, GB/s of the batch as a ratio to the d2d copy, host time per call p50/p99 (no sync), device time per
  batch (CUDA events), kernel launches, memcpys and host syncs per call (torch.profiler), and 20 calls under
  `torch.cuda.set_sync_debug_mode("error")`;
- per: prioritized `sample(4096)` + `update_priorities` every step, device ring (device tensors) vs the host store
  (numpy), and the device draws' distribution against the host sampler's (chi-square over 256 position bins, same
  priorities, the same number of draws each);
- writer: a writer thread at 10k rows/s for 5 s while a sampler samples: host time p50/p99, and every batch
  checked for torn rows (each row's frame bytes encode its seq).

`--device cpu` runs the same code on torch's CPU device (smaller sizes), the old path being the host one: a sanity
check of the logic and of the device path in torch ops, not a GPU figure; CUDA-only parts say so.

    python -m benchmarks.bench_device [--device cuda|cpu] [--quick] [--only ceilings sample per writer] [--out F]

Prints a table and writes benchmarks/out/device.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

import arrowbuf as ab

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
SECTIONS = ("ceilings", "sample", "per", "writer")


class Sizes:
    """Sizes of a run: the issue's on a GPU; smaller with --quick or on the CPU."""

    def __init__(self, device: str, quick: bool) -> None:
        cuda = device.startswith("cuda")
        self.capacity = 100_000 if cuda and not quick else (20_000 if cuda else (4_000 if quick else 10_000))
        self.batch = 4096 if cuda else (256 if quick else 1024)
        self.calls = 500 if cuda and not quick else (100 if cuda else (20 if quick else 60))
        self.host_calls = 20 if cuda else (10 if quick else 20)
        self.writer_s = 5.0 if cuda and not quick else (2.0 if cuda else (1.0 if quick else 3.0))
        self.writer_rate = 10_000 if cuda else 2_000
        self.dist_draws = 100 if cuda else (10 if quick else 30)


# ---------------------------------------------------------------------- data: every row's frame encodes its seq
def encoded(k0: int, n: int, shape: tuple[int, ...], episode: int = 500) -> dict[str, np.ndarray]:
    """Atari steps k0..k0+n-1 (seqs, when written from k0 on): the first 8 bytes of each frame stack are the seq
    (int64), the rest a fixed pattern; reward = seq mod 2**20; an episode ends every `episode` steps."""
    k = np.arange(k0, k0 + n, dtype=np.int64)
    obs = np.empty((n, int(np.prod(shape))), dtype=np.uint8)
    obs[:] = np.arange(obs.shape[1], dtype=np.int64).astype(np.uint8)
    obs[:, :8] = k.view(np.uint8).reshape(n, 8)
    nxt = obs.copy()
    nxt[:, :8] = (k + 1).view(np.uint8).reshape(n, 8)
    return {"obs": obs.reshape(n, *shape), "action": k % 18, "reward": (k % (1 << 20)).astype(np.float32),
            "terminated": k % episode == episode - 1, "truncated": np.zeros(n, bool),
            "next_obs": nxt.reshape(n, *shape)}


def torn_rows(batch: ab.SampleBatch) -> int:
    """Rows of a batch that are not the row their id names (frame, next frame or reward)."""
    def host(x: Any) -> np.ndarray:
        return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)

    seq = host(batch.indices).astype(np.int64)
    n = len(seq)
    head = host(batch["obs"].reshape(n, -1)[:, :8]).copy().view(np.int64).reshape(-1)
    nhead = host(batch["next_obs"].reshape(n, -1)[:, :8]).copy().view(np.int64).reshape(-1)
    rew = host(batch["reward"])
    bad = (head != seq) | (nhead != seq + 1) | (rew != (seq % (1 << 20)).astype(np.float32))
    return int(bad.sum())


def fill(store: ab.ExperienceStore, rows: int, shape: tuple[int, ...], chunk: int = 2000) -> None:
    k = int(store.index.hi)
    end = k + rows
    while k < end:
        n = min(chunk, end - k)
        store.extend(encoded(k, n, shape))
        k += n


# ---------------------------------------------------------------------- timing helpers
class Clock:
    """Wall clock for the host, CUDA events for the device (the CPU: wall clock for both)."""

    def __init__(self, torch: Any, cuda: bool) -> None:
        self.torch, self.cuda = torch, cuda

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def device_ms(self, fn: Callable[[], Any], reps: int) -> list[float]:
        """Device time of each of `reps` calls of `fn` (ms): CUDA events around each, read after one sync."""
        if not self.cuda:
            out = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e3)
            return out
        ev = [(self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
        self.sync()
        for a, b in ev:
            a.record()
            fn()
            b.record()
        self.sync()
        return [a.elapsed_time(b) for a, b in ev]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def profile_counts(torch: Any, fn: Callable[[], Any], calls: int) -> dict[str, float]:
    """Per call: kernel launches, memcpys and host syncs the CUDA runtime saw (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    counts = {"launches": 0, "graph_launches": 0, "memcpys": 0, "syncs": 0}
    for e in prof.key_averages():
        name = e.key
        if name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"):
            counts["launches"] += e.count
        elif name in ("cudaGraphLaunch", "cuGraphLaunch"):
            counts["graph_launches"] += e.count
        elif name.startswith("cudaMemcpy") or name.startswith("cuMemcpy"):
            counts["memcpys"] += e.count
        elif name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                      "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize"):
            counts["syncs"] += e.count
    counts["syncs"] -= 1  # the profiler's own synchronize at the end
    return {k: v / calls for k, v in counts.items()}


def sync_debug(torch: Any, fn: Callable[[], Any], calls: int = 20) -> dict[str, Any]:
    """`calls` calls of `fn` under `torch.cuda.set_sync_debug_mode("error")`: ok, or the first error."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(calls):
            fn()
        return {"ok": True, "calls": calls}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---------------------------------------------------------------------- stores
def atari() -> ab.ExperienceSchema:
    return ab.load_schema(ROOT / "schemas" / "atari.yaml")


def ring_store(device: str, cap: int, sampler: Any = "uniform", seed: int = 0) -> ab.ExperienceStore:
    from arrowbuf.tiers import GpuTier

    # no placement thread: with the ring the GPU tier holds no chunk slots, and a background probe would add its
    # own syncs to the profiler's counts
    return ab.ExperienceStore(atari(), cap, seed=seed, sampler=sampler,
                              tiers={"gpu": GpuTier(device=device, ring=True), "host": None},
                              placement=ab.placement.BandwidthAware(interval=None))


def slot_store(device: str, cap: int, host_bytes: int) -> ab.ExperienceStore:
    """The old GPU path: chunk slots on the device, placed by the policy (needs CUDA)."""
    from arrowbuf.tiers import GpuTier

    return ab.ExperienceStore(atari(), cap, seed=0, tiers={"gpu": GpuTier(int(host_bytes * 1.2), device=device,
                                                                          ring=False), "host": None},
                              placement=ab.placement.BandwidthAware(interval=None))


def settle(store: ab.ExperienceStore, batch: int, max_steps: int = 40) -> int:
    for i in range(max_steps):
        for _ in range(4):
            store.sample(batch)
        if store.placement_policy.step() == 0 and i >= 2:
            return i + 1
    return max_steps


def row_bytes(schema: ab.ExperienceSchema) -> int:
    """Bytes of one delivered transition (every field and next_obs)."""
    return sum(f.row_bytes for f in schema.fields.values()) + schema.fields["obs"].row_bytes


# ---------------------------------------------------------------------- sections
def ceilings(torch: Any, device: str, sz: Sizes, clock: Clock) -> dict[str, Any]:
    schema = atari()
    rb = row_bytes(schema)
    nbytes = sz.batch * rb
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    reps = 50
    for _ in range(3):
        dst.copy_(src)
    copy_ms = statistics.median(clock.device_ms(lambda: dst.copy_(src), reps))
    obs = schema.fields["obs"]
    arena = torch.randint(0, 255, (sz.capacity, *obs.shape), dtype=torch.uint8, device=device)
    idx = torch.sort(torch.randint(0, sz.capacity, (sz.batch,), device=device)).values
    out = torch.empty((sz.batch, *obs.shape), dtype=torch.uint8, device=device)
    for _ in range(3):
        torch.index_select(arena, 0, idx, out=out)
    take_ms = statistics.median(clock.device_ms(lambda: torch.index_select(arena, 0, idx, out=out), reps))
    return {"batch_bytes": nbytes, "d2d_copy_ms": copy_ms, "d2d_copy_gbps": nbytes / copy_ms / 1e6,
            "index_select_obs_ms": take_ms, "index_select_obs_gbps": sz.batch * obs.row_bytes / take_ms / 1e6}


def measure_path(torch: Any, name: str, fn: Callable[[], Any], sz: Sizes, clock: Clock, rb: int,
                 cuda: bool, keep: Callable[[Any], None] | None = None, calls: int | None = None) -> dict[str, Any]:
    """`calls` (default `sz.calls`) calls of `fn`: host time per call, total rate, device time per batch; profiler
    and sync-debug calls on CUDA."""
    calls = sz.calls if calls is None else calls
    for _ in range(5):
        keep(fn()) if keep else fn()
    clock.sync()
    host_s: list[float] = []
    t_all = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        b = fn()
        host_s.append(time.perf_counter() - t0)
        if keep:
            keep(b)
        del b
    clock.sync()
    wall = time.perf_counter() - t_all
    dev_ms = clock.device_ms(fn, min(100, calls))
    rows_s = calls * sz.batch / wall
    out: dict[str, Any] = {"path": name, "calls": calls, "rows_per_s": rows_s, "gbps": rows_s * rb / 1e9,
                           "host_us_p50": pct(host_s, 50) * 1e6, "host_us_p99": pct(host_s, 99) * 1e6,
                           "device_ms_p50": statistics.median(dev_ms), "device_ms_p99": pct(dev_ms, 99)}
    if cuda:
        try:
            out["per_call"] = profile_counts(torch, fn, 20)
        except Exception as exc:  # the profiler is optional: record why it did not run
            out["per_call"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        out["sync_debug"] = sync_debug(torch, fn)
    return out


def sample_section(torch: Any, device: str, sz: Sizes, clock: Clock, ceil: dict[str, Any] | None) -> dict[str, Any]:
    cuda = device.startswith("cuda")
    schema = atari()
    rb = row_bytes(schema)
    shape = tuple(schema.fields["obs"].shape)
    res: dict[str, Any] = {"capacity": sz.capacity, "batch": sz.batch, "row_bytes": rb}
    t0 = time.perf_counter()
    host = ab.ExperienceStore(schema, sz.capacity, seed=0)
    fill(host, sz.capacity, shape)
    ring = ring_store(device, sz.capacity)
    fill(ring, sz.capacity, shape)
    paths: dict[str, Callable[[], Any]] = {}
    if cuda:
        paths["host_h2d"] = lambda: host.sample(sz.batch).to_torch(device)
        slots = slot_store(device, sz.capacity, host._tier.nbytes())
        fill(slots, sz.capacity, shape)
        res["old_settle_steps"] = settle(slots, 1024)
        paths["old_gpu_slots"] = lambda: slots.sample(sz.batch)
    else:
        paths["host"] = lambda: host.sample(sz.batch)
    paths["ring"] = lambda: ring.sample(sz.batch)
    res["setup_s"] = time.perf_counter() - t0
    torn = [0]

    def check(b: Any) -> None:
        if isinstance(b, ab.SampleBatch) and np.random.default_rng().random() < 0.05:
            torn[0] += torn_rows(b)

    for name, fn in paths.items():
        calls = sz.host_calls if name.startswith("host") and cuda else None  # ~70 ms a call: 20 of them
        res[name] = measure_path(torch, name, fn, sz, clock, rb, cuda, keep=check, calls=calls)
    res["torn_rows"] = torn[0]
    base = "old_gpu_slots" if cuda else "host"
    res["ring_vs_old"] = res["ring"]["rows_per_s"] / res[base]["rows_per_s"]
    if cuda and "host_h2d" in res:
        res["ring_vs_host_h2d"] = res["ring"]["rows_per_s"] / res["host_h2d"]["rows_per_s"]
    if ceil is not None:
        for name in paths:
            res[name]["vs_d2d"] = res[name]["gbps"] / ceil["d2d_copy_gbps"]
            res[name]["device_vs_d2d"] = ceil["d2d_copy_ms"] / res[name]["device_ms_p50"]
    res["ring_stats"] = ring.stats().get("device")
    for s in (host, ring, *([slots] if cuda else [])):
        s.close()
    return res


def per_section(torch: Any, device: str, sz: Sizes, clock: Clock) -> dict[str, Any]:
    schema = atari()
    shape = tuple(schema.fields["obs"].shape)
    res: dict[str, Any] = {"capacity": sz.capacity, "batch": sz.batch}
    dev = ring_store(device, sz.capacity, sampler=ab.samplers.Prioritized(alpha=0.6, beta=0.4), seed=1)
    host = ab.ExperienceStore(schema, sz.capacity, seed=1, sampler=ab.samplers.Prioritized(alpha=0.6, beta=0.4))
    for s in (dev, host):
        fill(s, sz.capacity, shape)
    # the same priorities on both (set on the host arrays): a smooth ramp with a few hot rows
    live = np.arange(dev.index.lo, dev.index.hi, dtype=np.int64)
    pri = 0.1 + (live % 1000) / 250.0
    pri[::997] = 50.0
    for s in (dev, host):
        s.update_priorities(live, pri)
    # distribution: 256 bins of ring positions, device draws vs the host sampler's, same number of draws
    bins = 256
    mass = host.sampler.mass(np.arange(host.arena_rows))
    expect = np.bincount(np.arange(host.arena_rows) * bins // host.arena_rows, weights=mass, minlength=bins)
    expect = expect / expect.sum()
    counts = {"device": np.zeros(bins), "host": np.zeros(bins)}
    for _ in range(sz.dist_draws):
        for name, s in (("device", dev), ("host", host)):
            ids = s.sample(sz.batch, columns=["reward"]).indices
            ids = ids.detach().cpu().numpy() if hasattr(ids, "detach") else ids
            counts[name] += np.bincount((ids % s.arena_rows) * bins // s.arena_rows, minlength=bins)
    draws = sz.dist_draws * sz.batch
    keep = expect > 0
    dof = int(keep.sum()) - 1
    crit = dof * (1 - 2 / (9 * dof) + 4.0 * (2 / (9 * dof)) ** 0.5) ** 3
    for name, c in counts.items():
        e = expect[keep] * draws
        chi2 = float(((c[keep] - e) ** 2 / e).sum())
        res[f"chi2_{name}"] = chi2
    res["chi2_dof"] = dof
    res["chi2_critical"] = crit
    res["distribution_ok"] = res["chi2_device"] < crit
    # sample + update every step
    def dev_step() -> None:
        b = dev.sample(sz.batch)
        dev.update_priorities(b.indices, torch.rand(sz.batch, device=device) + 0.05)

    rng = np.random.default_rng(0)

    def host_step() -> None:
        b = host.sample(sz.batch)
        host.update_priorities(b.indices, rng.random(sz.batch) + 0.05)

    for _ in range(3):
        dev_step()
        host_step()
    clock.sync()
    t0 = time.perf_counter()
    for _ in range(sz.calls):
        dev_step()
    clock.sync()
    dev_rate = sz.calls * sz.batch / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(sz.host_calls):
        host_step()
    host_rate = sz.host_calls * sz.batch / (time.perf_counter() - t0)
    res.update({"device_rows_per_s": dev_rate, "host_rows_per_s": host_rate, "device_vs_host": dev_rate / host_rate})
    if device.startswith("cuda"):
        res["sync_debug"] = sync_debug(torch, dev_step)
    res["ring_stats"] = dev.stats().get("device")
    dev.close()
    host.close()
    return res


def writer_section(torch: Any, device: str, sz: Sizes, clock: Clock) -> dict[str, Any]:
    schema = atari()
    shape = tuple(schema.fields["obs"].shape)
    store = ring_store(device, sz.capacity)
    fill(store, sz.capacity, shape)
    stop = threading.Event()
    written = [0]
    errors: list[str] = []
    per_tick = max(1, sz.writer_rate // 100)

    def write() -> None:
        k = int(store.index.hi)
        nxt = time.perf_counter()
        try:
            while not stop.is_set():
                store.extend(encoded(k, per_tick, shape))
                k += per_tick
                written[0] += per_tick
                nxt += 0.01
                delay = nxt - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
        except Exception:
            errors.append(traceback.format_exc()[-400:])

    for _ in range(5):
        store.sample(sz.batch)
    host_s: list[float] = []
    torn = checked = 0
    t = threading.Thread(target=write, daemon=True)
    t.start()
    t0 = time.perf_counter()
    i = 0
    while time.perf_counter() - t0 < sz.writer_s:
        a = time.perf_counter()
        b = store.sample(sz.batch)
        host_s.append(time.perf_counter() - a)
        if i % 10 == 0:
            torn += torn_rows(b)
            checked += len(b)
        i += 1
        del b
    stop.set()
    t.join()
    clock.sync()
    elapsed = time.perf_counter() - t0
    out = {"seconds": elapsed, "rows_written": written[0], "write_rows_per_s": written[0] / elapsed,
           "samples": len(host_s), "host_us_p50": pct(host_s, 50) * 1e6, "host_us_p99": pct(host_s, 99) * 1e6,
           "rows_checked": checked, "torn_rows": torn, "writer_errors": errors,
           "ring_stats": store.stats().get("device")}
    store.close()
    return out


# ---------------------------------------------------------------------- report
def environment(torch: Any, device: str) -> dict[str, Any]:
    import pyarrow as pa

    from arrowbuf.tiers.gpu import gpu_environment

    env: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(), "numpy": np.__version__,
                           "pyarrow": pa.__version__, "torch": torch.__version__, "device": device,
                           "gpu_environment": gpu_environment(), "cpus": os.cpu_count()}
    if device.startswith("cuda"):
        env["device_name"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    try:
        env["loadavg"] = os.getloadavg()
    except OSError:
        pass
    return env


def verdict(res: dict[str, Any]) -> dict[str, Any]:
    """The issue's Done-when items a run can judge (on a GPU; a CPU run judges none: it says so)."""
    if not str(res["env"].get("device", "")).startswith("cuda"):
        return {"judged": False, "why": "no CUDA device: a CPU run checks the logic only; the device figures are owed"}
    out: dict[str, Any] = {"judged": True, "card": res["env"].get("device_name")}
    s = res.get("sample", {})
    ring = s.get("ring", {})
    if "vs_d2d" in ring:
        out["sample_4096_vs_d2d>=0.5"] = (round(ring["vs_d2d"], 3), ring["vs_d2d"] >= 0.5)
        out["sample_4096_device_time_vs_d2d"] = round(ring.get("device_vs_d2d", float("nan")), 3)
    if "host_us_p99" in ring:
        out["host_time_p99<100us"] = (round(ring["host_us_p99"], 1), ring["host_us_p99"] < 100)
    sd = ring.get("sync_debug", {})
    pc = ring.get("per_call", {})
    if sd or pc:
        out["no_host_sync_in_sample"] = (sd.get("ok") is True and pc.get("syncs", 1) <= 0, {"sync_debug": sd,
                                                                                            "profiler": pc})
    p = res.get("per", {})
    if "device_vs_host" in p:
        out["per_vs_host>=10x"] = (round(p["device_vs_host"], 2), p["device_vs_host"] >= 10)
        out["per_distribution_ok"] = p.get("distribution_ok")
    w = res.get("writer", {})
    if "torn_rows" in w:
        out["no_torn_rows"] = (s.get("torn_rows", 0) + w["torn_rows"]) == 0
        out["writer_host_p99_us"] = round(w["host_us_p99"], 1)
    return out


def table(res: dict[str, Any]) -> str:
    lines = [f"{'row':58} {'arrowbuf':>12} {'baseline':>12} {'ratio':>7}"]

    def f(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"

    def add(name: str, value: Any, base: Any = None, ratio: Any = None) -> None:
        lines.append(f"{name:58} {f(value):>12} {f(base):>12} {('-' if ratio is None else f'{ratio:.3g}'):>7}")

    c = res.get("ceilings")
    if c and "error" not in c:
        add("d2d copy of one batch, GB/s", c["d2d_copy_gbps"])
        add("index_select of the batch's frames, GB/s (vs d2d)", c["index_select_obs_gbps"], c["d2d_copy_gbps"],
            c["index_select_obs_gbps"] / c["d2d_copy_gbps"])
    s = res.get("sample")
    if s and "error" not in s:
        old = "old_gpu_slots" if "old_gpu_slots" in s else "host"
        add(f"sample({s['batch']}) rows/s: device ring vs {old}", s["ring"]["rows_per_s"], s[old]["rows_per_s"],
            s["ring_vs_old"])
        if "host_h2d" in s:
            add("sample rows/s: device ring vs host gather + H2D", s["ring"]["rows_per_s"],
                s["host_h2d"]["rows_per_s"], s["ring_vs_host_h2d"])
        for name in [k for k in ("ring", "old_gpu_slots", "host_h2d", "host") if k in s]:
            p = s[name]
            if "vs_d2d" in p:
                add(f"{name}: batch GB/s vs d2d copy", p["gbps"], p["gbps"] / p["vs_d2d"], p["vs_d2d"])
            add(f"{name}: host time per call p50 / p99 (us)", p["host_us_p50"], p["host_us_p99"])
            add(f"{name}: device time per batch p50 (ms)", p["device_ms_p50"])
            pc = p.get("per_call")
            if pc and "error" not in pc:
                lines.append(f"  {name} per call: {pc['launches']:.1f} launches, {pc['graph_launches']:.1f} graph "
                             f"launches, {pc['memcpys']:.1f} memcpys, {pc['syncs']:.1f} syncs")
            if "sync_debug" in p:
                lines.append(f"  {name} under set_sync_debug_mode('error'): {p['sync_debug']}")
        lines.append(f"  torn rows in checked batches: {s['torn_rows']}")
    p = res.get("per")
    if p and "error" not in p:
        add("PER sample + update rows/s: device vs host", p["device_rows_per_s"], p["host_rows_per_s"],
            p["device_vs_host"])
        lines.append(f"  PER draws vs the host sampler's mass, chi2 over {p['chi2_dof']} dof: device "
                     f"{p['chi2_device']:.0f}, host {p['chi2_host']:.0f} (critical {p['chi2_critical']:.0f}): "
                     f"{'ok' if p['distribution_ok'] else 'FAILED'}")
    w = res.get("writer")
    if w and "error" not in w:
        add("writer beside sampler: host time p50 / p99 (us)", w["host_us_p50"], w["host_us_p99"])
        lines.append(f"  writer {w['write_rows_per_s']:,.0f} rows/s, {w['samples']} samples, "
                     f"{w['rows_checked']} rows checked, torn {w['torn_rows']}, errors {len(w['writer_errors'])}")
    for k in SECTIONS:
        if isinstance(res.get(k), dict) and "error" in res[k]:
            lines.append(f"{k}: ERROR {res[k]['error'][-300:]}")
    v = res.get("verdict")
    if v:
        lines.append("Done-when (issue 43): " + ("; ".join(f"{k}: {val}" for k, val in v.items() if k != "judged")))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda (default when a GPU is visible) or cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="+", choices=SECTIONS)
    ap.add_argument("--out", default=str(OUT / "device.json"))
    args = ap.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    if not cuda:  # numpy's host gathers use one thread; torch's OpenMP threads spin against a busy small machine
        torch.set_num_threads(1)
    sz = Sizes(device, args.quick)
    clock = Clock(torch, cuda)
    res: dict[str, Any] = {"env": environment(torch, device), "quick": args.quick}
    only = args.only or list(SECTIONS)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in SECTIONS:
        if name not in only:
            continue
        t0 = time.perf_counter()
        try:
            if name == "ceilings":
                res[name] = ceilings(torch, device, sz, clock)
            elif name == "sample":
                res[name] = sample_section(torch, device, sz, clock, res.get("ceilings"))
            elif name == "per":
                res[name] = per_section(torch, device, sz, clock)
            else:
                res[name] = writer_section(torch, device, sz, clock)
        except Exception:  # one failed section leaves the others' figures
            res[name] = {"error": traceback.format_exc()[-2000:]}
        res[name]["section_s"] = time.perf_counter() - t0
        out.write_text(json.dumps(res, indent=2, default=float))  # after each section: a timeout keeps the rest
        print(f"[{name}: {res[name]['section_s']:.1f}s]", flush=True)
    res["verdict"] = verdict(res)
    print(table(res))
    out.write_text(json.dumps(res, indent=2, default=float))
    return 1 if any("error" in res[k] for k in only) else 0


if __name__ == "__main__":
    raise SystemExit(main())
