"""Broadcast benchmark (issue 20): a large object from one producer to N emulated nodes, star vs tree vs pipeline.

Every emulated node is one relay actor (`arrowbuf.ray.hoplite.relay.Relay`) on a single-node local Ray; the network is
emulated by a token bucket of B bytes/s on every relay's egress (the producer's node included), so each "node" can
upload at most B in total, however many receivers it serves. Schedules, all through the same relays and directory:

  * star:     the producer's node uploads to every receiver (root_slots=N, receivers never forward);
  * tree:     a binary tree built as receivers arrive, store-and-forward (a node forwards after it has everything);
  * pipeline: Hoplite's: one upload slot per node (a chain built as receivers arrive), blocks forwarded while later
              ones are still arriving;
  * pipeline+kill: the same with the relay nearest the producer killed when it holds 50% of the blocks;
  * ray.put: unemulated reference, one `ray.put` and N tasks that read it (on one node: shared memory, no transfer).

Models: star N*S/B; store-and-forward binary tree in rounds (see `_tree_units`);
pipeline S/B + (N-1)*b/B (b the block size).
Time is from `publish` (which packs the object into /dev/shm and hashes it) to every receiver holding a verified copy.
The machine has 2 cores shared with other work: rows are CPU-bound when N*B exceeds what Ray's actor calls move.
Prints a table, writes benchmarks/out/broadcast-<size>mb-n<nodes>-b<bw>.json.

    python -m benchmarks.bench_broadcast [--size-mb 8] [--bw-mb 4] [--block-kb 128] [--nodes 4 16]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"


def _tree_units(n: int, fanout: int = 2) -> int:
    """Store-and-forward tree in rounds of S/B: each round every holder serves up to `fanout` receivers, sharing its
    egress, so a round lasts ceil(served / holders) * S/B; returns the sum of those multiples for `n` receivers."""
    holders, left, units = 1, n, 0
    while left > 0:
        served = min(left, fanout * holders)
        units += -(-served // holders)
        holders, left = holders + served, left - served
    return units


def _run(bc, keys: list[str], version_kw: dict, obj, kill_at: float | None = None) -> tuple[float, str | None]:
    import ray

    t0 = time.perf_counter()
    v = bc.publish(obj, source="src", **version_kw)
    killed = None
    if kill_at is not None:
        nblocks = bc.wait(v, key="src")["nblocks"]
        target = max(1, int(nblocks * kill_at))
        refs = {bc.directory.wait_count.remote(k, target): k for k in keys}
        done, _ = ray.wait(list(refs), num_returns=1)
        killed = refs[done[0]]
        bc.kill_relay(killed)
    waits = [bc.relay(k).wait.remote(v) for k in keys if k != killed]
    ray.get(waits)
    return time.perf_counter() - t0, killed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=8)
    ap.add_argument("--bw-mb", type=float, default=4.0, help="emulated per-node egress bandwidth B, MB/s")
    ap.add_argument("--block-kb", type=int, default=128)
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--schedules", nargs="+", default=["ray.put", "pipeline", "pipeline+kill", "tree", "star"])
    ap.add_argument("--window", type=int, default=4, help="blocks a relay requests ahead")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()

    import ray

    from arrowbuf.ray import Broadcast

    S, B, b = args.size_mb << 20, args.bw_mb * (1 << 20), args.block_kb << 10
    rng = np.random.default_rng(0)
    obj = {f"w{i}": rng.standard_normal(S // 4 // 8).astype(np.float32) for i in range(8)}
    ray.init(address="local", num_cpus=2, object_store_memory=max(256 << 20, 2 * S), include_dashboard=False,
             logging_level="ERROR", log_to_driver=False)
    rows = []
    try:
        for n in args.nodes:
            keys = [f"n{i:02d}" for i in range(n)]
            with Broadcast.create(block_size=b, egress_bytes_per_s=B, nodes=False,
                                  window=args.window) as bc:
                for k in ["src", *keys]:
                    bc.relay(k, ray.get_runtime_context().get_node_id())
                models = {"star": n * S / B, "tree": _tree_units(n) * S / B, "pipeline": S / B + (n - 1) * b / B,
                          "pipeline+kill": None, "ray.put": None}
                for sched in args.schedules:
                    killed = None
                    if sched == "ray.put":
                        @ray.remote(num_cpus=0)
                        def touch(x):
                            return sum(a.nbytes for a in x.values())

                        # warm: start the task workers first (a cold start costs seconds on this machine)
                        ray.get([touch.remote({"x": np.zeros(1)}) for _ in range(n)])
                        t0 = time.perf_counter()
                        ref = ray.put(obj)
                        ray.get([touch.remote(ref) for _ in range(n)])
                        secs = time.perf_counter() - t0
                        del ref
                    elif sched == "star":
                        secs, _ = _run(bc, keys, {"upload_slots": 0, "root_slots": n, "pipelined": False}, obj)
                    elif sched == "tree":
                        secs, _ = _run(bc, keys, {"upload_slots": 2, "root_slots": 2, "pipelined": False}, obj)
                    elif sched == "pipeline":
                        secs, _ = _run(bc, keys, {"upload_slots": 1, "root_slots": 1, "pipelined": True}, obj)
                    else:
                        secs, killed = _run(bc, keys, {"upload_slots": 1, "root_slots": 1, "pipelined": True}, obj,
                                            kill_at=0.5)
                    model = models[sched]
                    row = {"nodes": n, "schedule": sched, "size_mb": args.size_mb, "bw_mb_s": args.bw_mb,
                           "block_kb": args.block_kb, "seconds": round(secs, 3),
                           "model_s": None if model is None else round(model, 3),
                           "vs_model": None if model is None else round(secs / model, 2), "killed": killed}
                    rows.append(row)
                    print(f"N={n:3d} {sched:14s} {secs:8.2f} s  model {row['model_s']}  x{row['vs_model']}",
                          flush=True)
    finally:
        ray.shutdown()
    by = {(r["nodes"], r["schedule"]): r["seconds"] for r in rows}
    print(f"\nS = {args.size_mb} MB, B = {args.bw_mb} MB/s per node (token bucket on each relay's egress), "
          f"b = {args.block_kb} KB, load average before/after {load0[0]:.1f}/{os.getloadavg()[0]:.1f}")
    print("| N | schedule | seconds | model (s) | measured / model | star / this | star model / this |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        star = by.get((r["nodes"], "star"))
        speed = "-" if star is None or math.isclose(r["seconds"], 0) else f"{star / r['seconds']:.1f}x"
        star_model = r["nodes"] * S / B
        print(f"| {r['nodes']} | {r['schedule']} | {r['seconds']:.2f} | {r['model_s'] if r['model_s'] else '-'} | "
              f"{r['vs_model'] if r['vs_model'] else '-'} | {speed} | {star_model / r['seconds']:.1f}x |")
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.platform(), "cpus": 2, "args": vars(args), "loadavg_before": load0,
            "loadavg_after": os.getloadavg()}
    name = f"broadcast-{args.size_mb}mb-n{'-'.join(map(str, args.nodes))}-b{args.bw_mb:g}.json"
    (OUT / name).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
