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

The state_dict path (issue 29; `--state-dict`, see `statedict_main`): a real torch model's state_dict (256 MB; `--quick`
16 MB) published with `Broadcast.publish(sd, version)` to 1/4/8/16 emulated nodes, each receiver's copy loaded by
`load_into`-ready relays, under token-bucket links scaled to this machine, plus an unthrottled run, peak extra memory
per node, failover cost, and the peers (`ray.put`/`ray.get` of the state_dict; torch.distributed broadcast over gloo).

    python -m benchmarks.bench_broadcast --state-dict --quick

The failover pairs only (`--failover`, see `failover_main`): 256 MB, 1 MB buckets, a chain of 4 receivers, 3
interleaved kill/no-kill pairs; the run difference and the orphan's stall from its own timestamps, in bucket times
(~3 minutes; `--sigkill` kills the relay's process instead of `ray.kill`; `--quick` 32 MB).

    python -m benchmarks.bench_broadcast --failover [--sigkill] [--quick]
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
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--failover" in argv:
        failover_main([a for a in argv if a != "--failover"])
        return
    if "--state-dict" in argv:
        statedict_main([a for a in argv if a != "--state-dict"])
        return
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


# ----------------------------------------------------------------------------------------- the state_dict path (29)
def _sd_model(total_mb: int):
    """A real torch model of about `total_mb` MB of float32 parameters: four square Linear layers and a LayerNorm."""
    import torch

    width = int(math.sqrt((total_mb << 20) / 4 / 4))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(4)] + [torch.nn.LayerNorm(width)]
    return torch.nn.Sequential(*layers)


def _sd_bytes(sd) -> int:
    return sum(t.nbytes for t in sd.values())


class _PlasmaPeak:
    """Samples the object-store bytes in use on the (one) Ray node every few ms; `peak` after `stop`."""

    def __init__(self) -> None:
        import threading

        import ray
        from ray._private.internal_api import node_stats

        node = next(n for n in ray.nodes() if n["Alive"])
        self._ask = lambda: node_stats(node["NodeManagerAddress"], node["NodeManagerPort"]) \
            .store_stats.object_store_bytes_used
        self.base = self._ask()
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self._ask() - self.base)
            except Exception:  # noqa: BLE001 - a sample lost to a busy raylet
                pass
            self._stop.wait(0.005)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


class _Chain:
    """One broadcast with relays "src" and n00..n<n-1> (emulated nodes on this Ray node), publishing a pipelined chain;
    reused for several runs of the same configuration (a relay killed by a run is replaced before the next)."""

    def __init__(self, n: int, bw: float | None, bucket: int, window: int) -> None:
        import ray

        from arrowbuf.ray import Broadcast

        self.bucket, self.keys = bucket, [f"n{i:02d}" for i in range(n)]
        self.here = ray.get_runtime_context().get_node_id()
        self.bc = Broadcast.create(bucket_size=bucket, egress_bytes_per_s=bw, nodes=False, window=window)
        self.relays = {k: self.bc.relay(k, self.here) for k in ["src", *self.keys]}
        self.version = 0

    def close(self) -> None:
        self.bc.close()

    def run(self, sd, kill_at: float | None = None, light: bool = False, sigkill: bool = False) -> dict:
        """One publish of `sd` to every receiver; every relay holds a verified copy at the end (each bucket checked
        against the producer's digest as it landed). With `kill_at`, the relay the source feeds is killed when it
        holds that fraction of the buckets (a fixed bucket), and replaced after the run. Returns seconds, each
        receiver's completion time, peak extra RSS per relay beyond its copy, the killed relay. `light`: no sampling
        of the object store (a thread polling the raylet: CPU that the failover mode keeps off the machine).
        `sigkill`: the relay's process is killed with SIGKILL (a crash: its sockets close at once) instead of by
        `ray.kill` (which tears the actor down first: it stops sending some tens of ms before its sockets close)."""
        import ray

        S, bc = _sd_bytes(sd), self.bc
        rss0 = dict(zip(self.relays, ray.get([r.memory.remote(reset=True) for r in self.relays.values()])))
        cpu0 = dict(zip(self.relays, ray.get([r.cpu.remote() for r in self.relays.values()])))
        plasma = None if light else _PlasmaPeak()
        self.version += 1
        t0 = time.perf_counter()
        v = bc.publish(sd, self.version, source="src", upload_slots=1, root_slots=1, pipelined=True)
        t_pub = time.perf_counter() - t0
        killed = None
        if kill_at is not None:
            ray.get([bc.directory.wait_count.remote(k, 1) for k in self.keys])  # the chain is built
            ups = bc.state()["upstream"]
            killed = next(k for k, up in ups.items() if up == "src")
            behind = next((k for k, up in ups.items() if up == killed), None)  # (before: it re-attaches in ms)
            at = max(1, int(bc.wait(v, key="src")["nblocks"] * kill_at))
            ray.get(bc.directory.wait_count.remote(killed, at))
            handle = self.relays[killed]
            pid = ray.get(handle.pid.remote()) if sigkill else None
            t_kill = time.monotonic()
            if pid is not None:
                import signal

                os.kill(pid, signal.SIGKILL)
            ray.kill(handle, no_restart=True)  # (bc.kill_relay, without its look-up of the handle)
            ray.get(bc.directory.mark_dead.remote(killed, handle))
        pending = {self.relays[k].wait.remote(v): k for k in self.keys if k != killed}
        finish: dict[str, float] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            ray.get(done[0])
            finish[pending.pop(done[0])] = time.perf_counter() - t0
        secs = time.perf_counter() - t0
        peak_plasma = 0 if plasma is None else plasma.stop()
        alive = [k for k in self.relays if k != killed]
        mem = dict(zip(alive, ray.get([self.relays[k].memory.remote() for k in alive])))
        cpu1 = dict(zip(alive, ray.get([self.relays[k].cpu.remote() for k in alive])))
        cpu = {w: sum(cpu1[k][w] - cpu0[k][w] for k in alive) for w in ("process", "loop")}
        gb = len(self.keys) * S / 2**30
        # beyond the node's one copy (its file's pages count in the relay's RSS): what the transfer added at peak;
        # `anon` is the relay's private growth (its heap)
        extra = {k: mem[k]["peak"] - rss0[k]["rss"] - S for k in alive}
        anon = {k: mem[k]["anon"] - rss0[k]["anon"] for k in alive}
        gap = None
        if killed is not None and behind is not None:
            # the receiver the killed relay fed: the time between its last bucket from the dead relay and its first
            # after re-attaching (one bucket time when nothing is lost)
            f = [x for x in ray.get(self.relays[behind].failover_log.remote()) if x["version"] == v]
            if f and "resumed" in f[-1]:
                gap = {"gap_s": f[-1]["resumed"] - f[-1]["last_bucket"], "kill_to_resume_s": f[-1]["resumed"] - t_kill,
                       "detect_s": f[-1]["detected"] - t_kill, "orphan": behind, "losses": len(f),
                       "last_to_kill_s": t_kill - f[0]["last_bucket"],
                       "attach_s": f[-1]["attached"] - f[0]["detected"] if "attached" in f[-1] else None,
                       "first_bucket_s": f[-1]["resumed"] - f[-1]["attached"] if "attached" in f[-1] else None,
                       "inter_bucket_s": f[0].get("inter_bucket_s"), "via": f[0].get("via"),
                       "new_source": f[-1].get("to"), "dead_upstream": "src",
                       "kept": f[0].get("kept"), "bucket_bytes": f[0].get("bucket_bytes"),
                       "silent_s": f[0]["detected"] - f[0]["last_bytes"] if "last_bytes" in f[0] else None}
        if killed is not None:  # the same configuration for the next run: a new relay
            self.relays[killed] = bc.relay(killed, self.here)
        # a one-bucket version to every relay: whatever the links still do for this one is done before the next run
        self.version += 1
        v = bc.publish({"drain": np.zeros(1, np.float32)}, self.version, source="src", upload_slots=1,
                       root_slots=1, pipelined=True)
        ray.get([r.wait.remote(v) for r in self.relays.values()])
        return {"seconds": secs, "publish_s": t_pub, "finish": finish, "killed": killed, "gap": gap,
                "relay_cpu_s_per_gb": cpu["process"] / gb, "loop_cpu_s_per_gb": cpu["loop"] / gb,
                "extra_rss_max": max(extra.values()), "extra_rss_by_node": extra, "anon_max": max(anon.values()),
                "plasma_peak": peak_plasma}


def _sd_run(sd, n: int, bw: float | None, bucket: int, window: int, kill_at: float | None = None) -> dict:
    chain = _Chain(n, bw, bucket, window)
    try:
        return chain.run(sd, kill_at)
    finally:
        chain.close()


def _rayput_peer(sd, n: int) -> float:
    """`ray.put` of the state_dict once, `ray.get` in `n` actors (they hold torch tensors at the end)."""
    import ray

    @ray.remote(num_cpus=0)
    class Getter:
        def get(self, refs):
            sd = ray.get(refs[0])
            return sum(t.numel() for t in sd.values())

    actors = [Getter.remote() for _ in range(n)]
    ray.get([a.get.remote([ray.put({})]) for a in actors])  # warm: the workers exist
    t0 = time.perf_counter()
    ref = ray.put(sd)
    ray.get([a.get.remote([ref]) for a in actors])
    secs = time.perf_counter() - t0
    del ref
    for a in actors:
        ray.kill(a)
    return secs


def _gloo_rank(rank: int, world: int, port: int, total_mb: int, q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if rank == 0:
        sd = _sd_model(total_mb).state_dict()
    else:  # the shapes only (a meta model), then empty CPU tensors: one copy per rank, not two
        with torch.device("meta"):
            shapes = _sd_model(total_mb).state_dict()
        sd = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in shapes.items()}
    dist.barrier()
    t0 = time.perf_counter()
    for k in sorted(sd):
        dist.broadcast(sd[k], src=0)
    dist.barrier()
    if rank == 0:
        q.put(time.perf_counter() - t0)
    dist.destroy_process_group()


def _gloo_peer(n: int, total_mb: int) -> float:
    """torch.distributed broadcast over gloo (loopback TCP) of every tensor of the state_dict to `n` processes."""
    import multiprocessing as mp
    import socket

    ctx = mp.get_context("spawn")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    q = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, n + 1, port, total_mb, q)) for r in range(n + 1)]
    for p in procs:
        p.start()
    try:
        return float(q.get(timeout=600))
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def statedict_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description="state_dict broadcast (issue 29)")
    ap.add_argument("--quick", action="store_true", help="16 MB, buckets of 128 KB (a check that it runs)")
    ap.add_argument("--size-mb", type=int, default=None, help="state_dict size (default 256; quick 16)")
    ap.add_argument("--bucket-kb", type=int, default=None, help="bucket size (default 1024; quick 128)")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--peer-nodes", type=int, nargs="+", default=None, help="receivers for the peers (default --nodes)")
    ap.add_argument("--window", type=int, default=4, help="k: buckets a relay requests ahead")
    ap.add_argument("--no-peers", action="store_true", help="skip the ray.put and gloo peers")
    ap.add_argument("--reps", type=int, default=2, help="failover pairs (no kill, kill) at the largest N")
    ap.add_argument("--fill", type=float, default=0.5,
                    help="N_max x B as a fraction of the measured unthrottled aggregate")
    args = ap.parse_args(argv)
    size_mb = args.size_mb or (16 if args.quick else 256)
    bucket = (args.bucket_kb or (128 if args.quick else 1024)) << 10
    peer_nodes = [] if args.no_peers else (args.peer_nodes or args.nodes)
    load0 = os.getloadavg()

    import ray

    sd = _sd_model(size_mb).state_dict()
    S = _sd_bytes(sd)
    nmax = max(args.nodes)
    ray.init(address="local", num_cpus=2, object_store_memory=max(256 << 20, 2 * S), include_dashboard=False,
             logging_level="ERROR", log_to_driver=False)
    rows: list[dict] = []
    pairs: list[tuple[float, float]] = []
    gaps: list[dict] = []
    try:
        # the ceiling: unthrottled, every receiver; its aggregate (N x S / t) scales the emulated links
        unthr = _sd_run(sd, nmax, None, bucket, args.window)
        aggregate = nmax * S / unthr["seconds"]
        B = args.fill * aggregate / nmax
        rows.append({"run": "arrowbuf unthrottled", "nodes": nmax, "seconds": unthr["seconds"],
                     "per_receiver_mb_s": S / unthr["seconds"] / 2**20, "aggregate_mb_s": aggregate / 2**20,
                     "extra_rss_mb": unthr["extra_rss_max"] / 2**20, "anon_mb": unthr["anon_max"] / 2**20,
                     "relay_cpu_s_per_gb": unthr["relay_cpu_s_per_gb"],
                     "loop_cpu_s_per_gb": unthr["loop_cpu_s_per_gb"]})
        bucket_s = bucket / B
        for n in args.nodes:
            chain = _Chain(n, B, bucket, args.window)
            try:
                r = chain.run(sd)
                model = S / B + (n - 1) * bucket / B
                rates = [S / (t - r["publish_s"]) / B for t in r["finish"].values()]  # from the source's copy
                rows.append({"run": "arrowbuf throttled", "nodes": n, "seconds": r["seconds"], "model_s": model,
                             "vs_model": r["seconds"] / model, "publish_s": r["publish_s"],
                             "min_rate_vs_link": min(rates), "relay_cpu_s_per_gb": r["relay_cpu_s_per_gb"],
                             "loop_cpu_s_per_gb": r["loop_cpu_s_per_gb"],
                             "extra_rss_mb": r["extra_rss_max"] / 2**20, "anon_mb": r["anon_max"] / 2**20,
                             "extra_rss_buckets": r["extra_rss_max"] / bucket, "anon_buckets": r["anon_max"] / bucket,
                             "plasma_peak_buckets_per_node": r["plasma_peak"] / bucket / n})
                if n == nmax:
                    # failover: the relay the source feeds killed at a fixed bucket (half way), interleaved with
                    # runs of the same configuration without a kill
                    for _ in range(args.reps):
                        br = chain.run(sd)
                        base = br["seconds"]
                        kr = chain.run(sd, kill_at=0.5)
                        killed = kr["seconds"]
                        pairs.append((base, killed))
                        if kr["gap"] is not None:
                            gaps.append(kr["gap"])
                        rows.append({"run": "arrowbuf throttled, no kill (failover pair)", "nodes": n,
                                     "seconds": base, "extra_rss_mb": br["extra_rss_max"] / 2**20,
                                     "extra_rss_buckets": br["extra_rss_max"] / bucket,
                                     "anon_mb": br["anon_max"] / 2**20})
                        rows.append({"run": "arrowbuf throttled, relay fed by the source killed at 50%",
                                     "nodes": n, "seconds": killed, "failover_s": killed - base,
                                     "failover_vs_bucket": (killed - base) / bucket_s, "gap": kr["gap"]})
            finally:
                chain.close()
        for n in peer_nodes:
            rows.append({"run": "peer ray.put/ray.get (unthrottled)", "nodes": n, "seconds": _rayput_peer(sd, n)})
    finally:
        ray.shutdown()
    for n in peer_nodes:
        rows.append({"run": "peer torch.distributed gloo broadcast (unthrottled)", "nodes": n,
                     "seconds": _gloo_peer(n, size_mb)})
    t1 = next(x["seconds"] for x in rows if x["run"] == "arrowbuf throttled" and x["nodes"] == min(args.nodes))
    tN = next(x["seconds"] for x in rows if x["run"] == "arrowbuf throttled" and x["nodes"] == nmax)
    load1 = os.getloadavg()
    print(f"\nstate_dict {S / 2**20:.1f} MB ({len(sd)} tensors), buckets of {bucket >> 10} KB, k = {args.window}; "
          f"unthrottled aggregate {aggregate / 2**20:.0f} MB/s at N={nmax}, so B = {B / 2**20:.1f} MB/s per "
          f"emulated link (N x B = {args.fill:g} of it); one bucket = {bucket_s * 1e3:.0f} ms at B; "
          f"load average before/after {load0[0]:.1f}/{load1[0]:.1f}")
    print("| run | N | seconds | model (s) | measured / model | slowest receiver / B | relay peak RSS beyond the copy "
          "(MB / buckets) | relay private growth (MB) | object store peak per node (buckets) | failover / one bucket "
          "| relay CPU s per GB received: processes / event loops |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def f(x: dict, key: str, fmt: str) -> str:
        return "-" if x.get(key) is None else format(x[key], fmt)

    for x in rows:
        print(f"| {x['run']} | {x['nodes']} | {x['seconds']:.2f} | {f(x, 'model_s', '.2f')} | "
              f"{f(x, 'vs_model', '.2f')} | {f(x, 'min_rate_vs_link', '.2f')} | {f(x, 'extra_rss_mb', '.1f')} / "
              f"{f(x, 'extra_rss_buckets', '.1f')} | {f(x, 'anon_mb', '.1f')} | "
              f"{f(x, 'plasma_peak_buckets_per_node', '.1f')} | {f(x, 'failover_vs_bucket', '.2f')} | "
              f"{f(x, 'relay_cpu_s_per_gb', '.2f')} / {f(x, 'loop_cpu_s_per_gb', '.2f')} |")
    print(f"\ntime at N={nmax} / time at N={min(args.nodes)}: {tN / t1:.2f} (checkpoint-engine shape: <= 1.15)")
    failover = sorted((k - b) / bucket_s for b, k in pairs)
    if failover:
        print(f"failover (kill run - the no-kill run before it, in bucket times of {bucket_s * 1e3:.0f} ms), "
              f"{len(pairs)} interleaved pairs: {', '.join(f'{x:.2f}' for x in failover)}; "
              f"median {failover[len(failover) // 2]:.2f}; no-kill runs "
              f"{', '.join(f'{b:.2f}' for b, _ in pairs)} s")
    if gaps:
        print("failover at the receiver the killed relay fed: gap between its last bucket from the dead relay and its "
              "first after re-attaching, minus one bucket time (the cost), in bucket times: "
              + ", ".join(f"{(g['gap_s'] - bucket_s) / bucket_s:.2f}" for g in gaps)
              + "; kill to detection (ms): " + ", ".join(f"{g['detect_s'] * 1e3:.0f}" for g in gaps)
              + "; kill to its next bucket (ms): " + ", ".join(f"{g['kill_to_resume_s'] * 1e3:.0f}" for g in gaps))
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.platform(), "cpus": os.cpu_count(), "args": vars(args), "size_bytes": S,
            "bucket": bucket, "B": B, "aggregate": aggregate, "t_max_over_t_min": tN / t1,
            "failover_pairs_s": pairs, "failover_buckets": failover, "failover_gaps": gaps,
            "loadavg_before": load0, "loadavg_after": load1}
    name = f"broadcast-statedict-{size_mb}mb{'-quick' if args.quick else ''}.json"
    (OUT / name).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))


# ----------------------------------------------------------------------------------------- failover only (29)
def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def failover_main(argv: list[str]) -> None:
    """`--failover`: only the failover pairs (issue 29's "failover cost under one bucket's time"), measured two ways.

    One pipelined chain src -> n00 -> ... (the state_dict of a real torch model), `--pairs` interleaved pairs of runs:
    no kill, then the relay the source feeds killed when it holds `--kill-at` of the buckets (its downstream, the
    orphan, has children of its own). Per pair: (a) the kill run's time minus the no-kill run's, in bucket times
    (b / B: noisy on a loaded machine, it swings by more than a bucket); (b) the orphan's stall, from its own
    timestamps: the time between its last bucket from the dead relay and its next bucket, minus its normal
    inter-bucket time (the median of its last few before the loss), in bucket times; and where that time went:
    kill -> the orphan notices (the socket closes), -> it is connected to its new source (backup: no directory
    round trip), -> the bucket in flight lands; and the bytes of the cut bucket it kept (resume) and the source it
    switched to (the dead relay's upstream, whose upload slot the death freed).
    """
    ap = argparse.ArgumentParser(description="broadcast failover pairs (issue 29)")
    ap.add_argument("--quick", action="store_true", help="32 MB (a check that it runs)")
    ap.add_argument("--size-mb", type=int, default=None, help="state_dict size (default 256; quick 32)")
    ap.add_argument("--bucket-kb", type=int, default=1024)
    ap.add_argument("--nodes", type=int, default=4, help="receivers in the chain")
    ap.add_argument("--bw-mb", type=float, default=12.0, help="emulated per-node egress B, MB/s")
    ap.add_argument("--window", type=int, default=4, help="k: buckets a relay requests ahead")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--kill-at", type=float, default=0.5)
    ap.add_argument("--sigkill", action="store_true",
                    help="kill the relay's process with SIGKILL (a crash) instead of ray.kill")
    args = ap.parse_args(argv)
    size_mb = args.size_mb or (32 if args.quick else 256)
    bucket, B = args.bucket_kb << 10, args.bw_mb * 2**20
    bucket_s = bucket / B
    load0 = os.getloadavg()
    t_start = time.perf_counter()

    import ray

    sd = _sd_model(size_mb).state_dict()
    S = _sd_bytes(sd)
    ray.init(address="local", num_cpus=2, object_store_memory=max(256 << 20, 2 * S), include_dashboard=False,
             logging_level="ERROR", log_to_driver=False)
    pairs: list[dict] = []

    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    try:
        chain = _Chain(args.nodes, B, bucket, args.window)
        try:
            for _ in range(args.pairs):
                base = chain.run(sd, light=True)
                kill = chain.run(sd, kill_at=args.kill_at, light=True, sigkill=args.sigkill)
                g = kill["gap"] or {}
                normal = g.get("inter_bucket_s") or bucket_s
                pairs.append({
                    "no_kill_s": base["seconds"], "kill_s": kill["seconds"],
                    "run_diff_buckets": (kill["seconds"] - base["seconds"]) / bucket_s,
                    "stall_buckets": None if "gap_s" not in g else (g["gap_s"] - normal) / bucket_s,
                    "normal_inter_bucket_ms": normal * 1e3,
                    "kill_to_notice_ms": None if "detect_s" not in g else g["detect_s"] * 1e3,
                    "notice_to_attached_ms": None if g.get("attach_s") is None else g["attach_s"] * 1e3,
                    "attached_to_bucket_ms": None if g.get("first_bucket_s") is None else g["first_bucket_s"] * 1e3,
                    "last_bucket_to_kill_ms": None if "last_to_kill_s" not in g else g["last_to_kill_s"] * 1e3,
                    "last_bytes_to_noticed_ms": None if g.get("silent_s") is None else g["silent_s"] * 1e3,
                    "kept_kb": None if g.get("kept") is None else g["kept"] / 1024,
                    "via": g.get("via"), "new_source": g.get("new_source"), "losses": g.get("losses"),
                    "killed": kill["killed"], "orphan": g.get("orphan"),
                    # the receivers' completion times, sorted (each run builds its chain anew, in arrival order, so
                    # a receiver's place differs between runs; the kill run has one receiver fewer)
                    "finish_no_kill_s": sorted(base["finish"].values()),
                    "finish_kill_s": sorted(kill["finish"].values()),
                    "publish_diff_buckets": (kill["publish_s"] - base["publish_s"]) / bucket_s})
                p = pairs[-1]
                print(f"pair {len(pairs)}: no kill {p['no_kill_s']:.2f} s, kill {p['kill_s']:.2f} s, "
                      f"diff {p['run_diff_buckets']:.2f} buckets, orphan stall {f(p['stall_buckets'], '.2f')} "
                      "buckets", flush=True)
        finally:
            chain.close()
    finally:
        ray.shutdown()
    load1 = os.getloadavg()
    wall = time.perf_counter() - t_start

    print(f"\nstate_dict {S / 2**20:.1f} MB, buckets of {bucket >> 10} KB, k = {args.window}, {args.nodes} receivers "
          f"in a chain, B = {args.bw_mb:g} MB/s per emulated link: one bucket = {bucket_s * 1e3:.0f} ms; the relay "
          f"the source feeds killed ({'SIGKILL' if args.sigkill else 'ray.kill'}) at {args.kill_at:.0%}; "
          f"load average before/after {load0[0]:.1f}/{load1[0]:.1f}; "
          f"{wall:.0f} s in all")
    print("| pair | no kill (s) | kill (s) | (a) run difference (buckets) | (b) orphan stall (buckets) | "
          "orphan's normal inter-bucket (ms) | last bucket -> kill (ms) | kill -> noticed (ms) | "
          "last bytes from the dead relay -> noticed (ms) | "
          "noticed -> attached (ms) | attached -> bucket (ms) | cut bucket kept (KB) | new source (via) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, p in enumerate(pairs, 1):
        print(f"| {i} | {p['no_kill_s']:.2f} | {p['kill_s']:.2f} | {p['run_diff_buckets']:.2f} | "
              f"{f(p['stall_buckets'], '.2f')} | {p['normal_inter_bucket_ms']:.0f} | "
              f"{f(p['last_bucket_to_kill_ms'], '.0f')} | {f(p['kill_to_notice_ms'], '.1f')} | "
              f"{f(p['last_bytes_to_noticed_ms'], '.1f')} | "
              f"{f(p['notice_to_attached_ms'], '.1f')} | {f(p['attached_to_bucket_ms'], '.0f')} | "
              f"{f(p['kept_kb'], '.0f')} | {p['new_source']} ({p['via']}) |")
    med_a = _median([p["run_diff_buckets"] for p in pairs])
    med_b = _median([p["stall_buckets"] for p in pairs])
    print(f"\nmedians over {len(pairs)} pairs, in bucket times of {bucket_s * 1e3:.0f} ms: (a) run difference "
          f"{f(med_a, '.2f')}, (b) orphan stall {f(med_b, '.2f')} (target: under 1)")
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.platform(), "cpus": os.cpu_count(), "args": vars(args), "size_bytes": S,
            "bucket": bucket, "B": B, "bucket_s": bucket_s, "median_run_diff_buckets": med_a,
            "median_stall_buckets": med_b, "loadavg_before": load0, "loadavg_after": load1, "wall_s": wall}
    name = f"broadcast-failover-{size_mb}mb{'-sigkill' if args.sigkill else ''}{'-quick' if args.quick else ''}.json"
    (OUT / name).write_text(json.dumps({"meta": meta, "pairs": pairs}, indent=1, default=str))


if __name__ == "__main__":
    main()
