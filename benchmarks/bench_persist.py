"""Persistence benchmark (issue 15): checkpoint, incremental checkpoint, background checkpoint, restore.

Each row is measured in one run beside its ceiling and its peers, on an atari-like store (uint8 4x84x84 frames):

- full checkpoint GB/s vs the sequential write bandwidth of the same disk (same bytes, 8 MiB writes, fsync), vs
  pickle of the same arrays (the SB3/tianshou way), torch.save of the same arrays as tensors (a TorchRL storage's
  way), and cpprb's save_transitions when cpprb is installed; peak RSS during each, over the store's resident size
  (each in its own process, so one's peak does not colour another's);
- incremental checkpoint after 10% new rows, as a share of the full one;
- sample and insert rates while a background checkpoint runs, as a ratio to the same rates without one;
- restore time vs reading the same bytes (page cache of those files dropped with posix_fadvise before both), and
  the time to the first batch after restore.

    python -m benchmarks.bench_persist [--gb 0.5] [--dir /tmp]

The issue asks for a 2 GB store; the default here is 0.5 GB because the benchmark machine is a shared 2-core box
(`--gb 2` runs the full size). Writes benchmarks/out/persist.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import pickle
import resource
import shutil
import sys
import tempfile
import time

import numpy as np

import arrowbuf as ab

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
ROW_BYTES = 4 * 84 * 84 + 8 + 4 + 2


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    """Start a new peak-RSS window (Linux: VmHWM resets to the current RSS)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    """Peak RSS since `reset_peak` (VmHWM), or of the process's life where that is not available."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_store(rows: int, seed: int = 0) -> ab.ExperienceStore:
    store = ab.ExperienceStore(ab.load_schema(ROOT / "schemas" / "atari.yaml"), capacity=rows, seed=seed,
                               sampler=ab.samplers.Prioritized())
    fill(store, rows, 0)
    return store


def fill(store: ab.ExperienceStore, rows: int, start: int, batch: int = 500) -> None:
    rng = np.random.default_rng(start)
    frames = rng.integers(0, 255, size=(batch, 4, 84, 84), dtype=np.uint8)
    for k in range(start, start + rows, batch):
        n = min(batch, start + rows - k)
        ends = (np.arange(k, k + n) % 1000) == 999
        store.extend({"obs": frames[:n], "action": np.arange(n, dtype=np.int64) % 6,
                      "reward": np.ones(n, np.float32), "terminated": ends, "truncated": np.zeros(n, bool),
                      "next_obs": frames[:n]})


def fsync_tree(path: str) -> None:
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def drop_cache(path: str) -> None:
    """Evict the files under `path` from the page cache (only these files: others' caches stay)."""
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def disk_write_ceiling(nbytes: int, where: str) -> float:
    """Sequential write of `nbytes` in 8 MiB writes, then fsync: bytes/s."""
    buf = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes()
    path = os.path.join(where, "ceiling.bin")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = nbytes
    while left > 0:
        left -= os.write(fd, buf[:min(left, len(buf))])
    os.fsync(fd)
    os.close(fd)
    dt = time.perf_counter() - t0
    os.unlink(path)
    return nbytes / dt


def read_ceiling(path: str) -> tuple[float, int]:
    """Read every file under `path` once (after dropping them from the page cache): (seconds, bytes)."""
    drop_cache(path)
    total = 0
    t0 = time.perf_counter()
    for d, _, files in os.walk(path):
        for f in sorted(files):
            with open(os.path.join(d, f), "rb", buffering=0) as fh:
                while True:
                    b = fh.read(8 << 20)
                    if not b:
                        break
                    total += len(b)
    return time.perf_counter() - t0, total


# ------------------------------------------------------------------------------------------------ one process each
def _child(method: str, rows: int, where: str, q) -> None:
    import pyarrow as pa

    pa.array(np.zeros(1, np.uint8), type=pa.uint8())  # a one-time import inside pyarrow (~1 s) is not the write
    store = make_store(rows)
    base = rss()
    path = os.path.join(where, method)
    arrays = {"obs": store.to_table(["obs"])["obs"].combine_chunks().to_numpy_ndarray(),
              "action": store.to_table(["action"])["action"].to_numpy(),
              "reward": store.to_table(["reward"])["reward"].to_numpy()} if method != "arrowbuf" else None
    if arrays is not None:  # the peers hold their own numpy copy of the buffer (as SB3/tianshou buffers do)
        base = rss()
    res: dict = {"method": method, "store_bytes": rows * ROW_BYTES}
    reset_peak()
    t0 = time.perf_counter()
    if method == "arrowbuf":
        info = store.checkpoint(path)
        res["bytes"] = info["row_bytes"]
    elif method == "pickle":
        with open(path, "wb") as f:
            pickle.dump(arrays, f, protocol=4)
            f.flush()
            os.fsync(f.fileno())
        res["bytes"] = os.path.getsize(path)
    elif method == "torch.save":
        import torch

        with open(path, "wb") as f:
            torch.save({k: torch.from_numpy(np.require(v, requirements='W')) for k, v in arrays.items()}, f)
            f.flush()
            os.fsync(f.fileno())
        res["bytes"] = os.path.getsize(path)
    elif method == "cpprb":
        import cpprb

        assert arrays is not None
        rb = cpprb.ReplayBuffer(rows, {"obs": {"shape": (4, 84, 84), "dtype": np.uint8}, "act": {}, "rew": {}})
        rb.add(obs=arrays["obs"], act=arrays["action"], rew=arrays["reward"])
        base = rss()
        reset_peak()
        t0 = time.perf_counter()
        rb.save_transitions(path, safe=False)
        fsync_tree(where)
        res["bytes"] = sum(os.path.getsize(os.path.join(where, f)) for f in os.listdir(where) if "cpprb" in f)
    res["seconds"] = time.perf_counter() - t0
    res["peak_over_resident"] = peak_rss() / base
    store.close()
    q.put(res)


def run_child(method: str, rows: int, where: str) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(method, rows, where, q))
    p.start()
    try:
        res = q.get(timeout=600)
    finally:
        p.join(60)
    return res


def rates(store: ab.ExperienceStore, seconds: float, until=None) -> tuple[float, float]:
    """Samples/s (batches of 32 rows) and inserted rows/s in an alternating loop, for `seconds` or until `until()`."""
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 255, size=(64, 4, 84, 84), dtype=np.uint8)
    batch = {"obs": frames, "action": np.zeros(64, np.int64), "reward": np.ones(64, np.float32),
             "terminated": np.zeros(64, bool), "truncated": np.zeros(64, bool), "next_obs": frames}
    batch["terminated"][-1] = True
    ts = ti = 0.0
    ns = ni = 0
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end and (until is None or not until()):
        t0 = time.perf_counter()
        store.sample(32)
        t1 = time.perf_counter()
        store.extend(batch)
        t2 = time.perf_counter()
        ts += t1 - t0
        ti += t2 - t1
        ns += 32
        ni += 64
    return ns / max(ts, 1e-9), ni / max(ti, 1e-9)


def run(gb: float, where: str) -> dict:
    rows = int(gb * 1e9 / ROW_BYTES)
    res: dict = {"rows": rows, "store_gb": rows * ROW_BYTES / 1e9, "note": f"scaled to {gb} GB (issue: 2 GB)"}
    tmp = tempfile.mkdtemp(prefix="bench_persist_", dir=where)
    try:
        res["disk_write_gbps"] = disk_write_ceiling(rows * ROW_BYTES, tmp) / 1e9
        peers = ["arrowbuf", "pickle", "torch.save"]
        try:
            import cpprb  # noqa: F401

            peers.append("cpprb")
        except ImportError:
            res["cpprb"] = "not installed"
        res["full"] = {}
        for m in peers:
            sub = os.path.join(tmp, m + "_dir")
            os.makedirs(sub)
            r = run_child(m, rows, sub)
            r["gbps"] = r["store_bytes"] / r["seconds"] / 1e9
            res["full"][m] = r
            shutil.rmtree(sub)
        # in this process: incremental, background, restore
        store = make_store(rows)
        ck = os.path.join(tmp, "ckpt")
        t0 = time.perf_counter()
        full = store.checkpoint(ck)
        full_s = time.perf_counter() - t0
        fill(store, rows // 10, rows)
        t0 = time.perf_counter()
        inc = store.checkpoint(ck)
        inc_s = time.perf_counter() - t0
        res["incremental"] = {"full_s": full_s, "incremental_s": inc_s, "share": inc_s / full_s,
                              "files_written": inc["files_written"], "files_reused": inc["files_reused"],
                              "bytes_share": inc["bytes_written"] / full["bytes_written"]}
        base_s, base_i = rates(store, 4.0)
        bg = os.path.join(tmp, "bg")
        h = store.checkpoint(bg, background=True)
        during_s, during_i = rates(store, 120.0, until=lambda: h.done)
        h.wait()
        res["background"] = {"sample_rows_per_s": base_s, "insert_rows_per_s": base_i,
                             "sample_during": during_s, "insert_during": during_i,
                             "sample_ratio": during_s / base_s, "insert_ratio": during_i / base_i}
        resident = rows * ROW_BYTES
        store.close()
        read_s, read_bytes = read_ceiling(ck)
        drop_cache(ck)
        t0 = time.perf_counter()
        again = ab.ExperienceStore.restore(ck)
        restore_s = time.perf_counter() - t0
        again.sample(32)
        first_batch_s = time.perf_counter() - t0
        again.close()
        res["restore"] = {"restore_s": restore_s, "read_ceiling_s": read_s, "read_bytes": read_bytes,
                          "ratio_to_read_ceiling": read_s / restore_s, "first_batch_s": first_batch_s,
                          "restore_gbps": resident / restore_s / 1e9, "read_gbps": read_bytes / read_s / 1e9}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def table(res: dict) -> str:
    lines = [f"persist: {res['rows']:,} atari rows = {res['store_gb']:.2f} GB ({res['note']})",
             f"{'row':44} {'value':>10} {'ceiling':>10} {'ratio':>7}"]
    ceil = res["disk_write_gbps"]
    for m, r in res["full"].items():
        lines.append(f"{'full checkpoint, ' + m + ' (GB/s)':44} {r['gbps']:>10.2f} {ceil:>10.2f} "
                     f"{r['gbps'] / ceil:>7.2f}")
    for m, r in res["full"].items():
        lines.append(f"{'peak RSS / resident, ' + m:44} {r['peak_over_resident']:>10.2f} {'1.10':>10} "
                     f"{'':>7}")
    inc = res["incremental"]
    lines.append(f"{'incremental (10% new rows), share of full':44} {inc['share']:>10.3f} {'0.15':>10} "
                 f"{'':>7}  ({inc['files_written']} files written, {inc['files_reused']} reused)")
    bg = res["background"]
    lines.append(f"{'sample rate during background ckpt (ratio)':44} {bg['sample_ratio']:>10.2f} {'0.80':>10}")
    lines.append(f"{'insert rate during background ckpt (ratio)':44} {bg['insert_ratio']:>10.2f} {'0.80':>10}")
    rs = res["restore"]
    lines.append(f"{'restore GB/s (vs cold read of the files)':44} {rs['restore_gbps']:>10.2f} "
                 f"{rs['read_gbps']:>10.2f} {rs['ratio_to_read_ceiling']:>7.2f}")
    lines.append(f"{'time to first batch after restore (s)':44} {rs['first_batch_s']:>10.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=0.5, help="store size in GB (the issue's size is 2)")
    p.add_argument("--quick", action="store_true", help="0.1 GB")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk to measure")
    args = p.parse_args(argv)
    res = run(0.1 if args.quick else args.gb, args.dir)
    print(table(res))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "persist.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
