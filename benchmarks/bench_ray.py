"""Ray benchmark (issue 9): sharded stores on a local multi-node Ray cluster (3 nodes on this machine).

Rows, each beside its ceiling measured in the same run:
  * ingest: aggregate rows/s and MB/s of 3 writer actors (one per node) into 1, 2 and 3 shards, through the default
    transport (shared memory when the writer's node has the shard, else Flight) and through Flight only;
    ceiling: one in-process `ExperienceStore.extend` of the same batches.
  * sample: batches/s of one learner (the driver) and aggregate of 3 learner actors (one per node) with 1, 2, 3
    shards; ceilings: in-process `store.sample` and one Flight `RemoteStore.sample` to a single shard.
  * straggler: one learner, 3 shards, shard 0 slowed by `--slow-ms` per sample, with and without a deadline.
  * failure: time from killing a shard (ray.kill, Ray restarts it) to the first batch served without it, the
    longest gap between two batches around the kill, and the time until the shard serves again.
  * broadcast: a policy-sized object to 6 actors (2 per node): one put + refs vs by value to each.

The machine has 2 cores shared by 3 raylets, the GCS, the shards, writers and learners: every row is bounded by
that, not by the network (there is none: loopback). Prints a table, writes benchmarks/out/ray.json.

    python -m benchmarks.bench_ray [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import signal
import statistics
import sys
import time

import numpy as np


import arrowbuf as ab

from .workloads import make_steps

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
NODES = 3
ALL_PHASES = ("ingest", "sample", "straggler", "failure", "broadcast")


def _schema() -> ab.ExperienceSchema:
    return ab.load_schema(ROOT / "schemas" / "mujoco.yaml")


def _row_bytes(schema: ab.ExperienceSchema) -> int:
    return sum(f.row_bytes for f in schema.fields.values())


def start_cluster(object_store_mb: int):
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": object_store_mb << 20,
                                                      "include_dashboard": False})
    for _ in range(NODES - 1):
        c.add_node(num_cpus=1, object_store_memory=object_store_mb << 20)
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
    return c


def node_ids() -> list[str]:
    import ray

    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])


def on(node: str) -> dict:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


def actors():
    """The benchmark's Ray actor classes (defined lazily: ray is imported only when the benchmark runs)."""
    import ray

    @ray.remote
    class Writer:
        def __init__(self, batch: int) -> None:
            self.pool = make_steps("mujoco", 4 * batch, seed=os.getpid() % 1000, episode_len=200)
            self.batch = batch

        def write_for(self, sharded, transport: str, seconds: float, start_at: float) -> tuple[int, float, str]:
            w = sharded.writer(transport=transport)
            while time.time() < start_at:
                time.sleep(0.001)
            t0 = time.perf_counter()
            rows, i = 0, 0
            while time.perf_counter() - t0 < seconds:
                s = (i % 4) * self.batch
                w.send({k: v[s:s + self.batch] for k, v in self.pool.items()})  # pipelined (extend waits)
                rows += self.batch
                i += 1
            w.close()
            dt = time.perf_counter() - t0
            sharded.close()
            return rows, dt, w.via

    @ray.remote
    class Learner:
        def sample_for(self, sharded, seconds: float, batch: int, start_at: float) -> tuple[int, float]:
            sharded.sample(batch)
            while time.time() < start_at:
                time.sleep(0.001)
            t0 = time.perf_counter()
            k = 0
            while time.perf_counter() - t0 < seconds:
                sharded.sample(batch)
                k += 1
            dt = time.perf_counter() - t0
            sharded.close()
            return k, dt

    @ray.remote
    class Receiver:
        def take(self, obj) -> int:
            return int(obj["w"].nbytes)

    return Writer, Learner, Receiver


def fill(sharded, rows_per_shard: int) -> None:
    pool = make_steps("mujoco", 2000, seed=1, episode_len=200)
    for k in range(sharded.num_shards):
        with sharded.writer(shard=k) as w:
            done = 0
            while done < rows_per_shard:
                w.send({c: v[:1000] for c, v in pool.items()})
                done += 1000


# ---------------------------------------------------------------------------------------------------- phases
_T0 = time.time()


def progress(row: dict) -> None:
    print(f"[{time.time() - _T0:6.0f}s] {row}", file=sys.stderr, flush=True)


def bench_ingest(seconds: float, capacity: int, batch: int, writers: list, repeat: int) -> list[dict]:
    import ray
    from arrowbuf.ray import ShardedStore

    schema = _schema()
    rb = _row_bytes(schema)
    rows = []
    # ceiling: one process, in-process store, the same batches, steady state (the ring has wrapped)
    pool = make_steps("mujoco", 4 * batch, seed=0, episode_len=200)
    store = ab.ExperienceStore(schema, capacity, seed=0)

    def extend_for(secs: float) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < secs:
            s = (n % 4) * batch
            store.extend({k: v[s:s + batch] for k, v in pool.items()})
            n += 1
        return n * batch / (time.perf_counter() - t0)

    while store.index.hi < 2 * capacity:
        extend_for(0.2)
    rate = statistics.median(extend_for(seconds) for _ in range(repeat))
    store.close()
    rows.append({"phase": "ingest", "case": "ceiling: 1 process, in-process extend", "shards": 0, "writers": 1,
                 "rows_s": rate, "mb_s": rate * rb / 1e6})
    progress(rows[-1])
    for transport in ("auto", "flight"):
        for k in (1, 2, 3):
            s = ShardedStore.create(schema, k, capacity, seed=0)
            rates = []
            for _ in range(repeat):
                start = time.time() + 1.5
                res = ray.get([w.write_for.remote(s, transport, seconds, start) for w in writers])
                rates.append(sum(r[0] for r in res) / max(r[1] for r in res))
            rate = statistics.median(rates)
            rows.append({"phase": "ingest", "case": f"3 writers, transport={transport}", "shards": k, "writers": 3,
                         "via": [r[2] for r in res], "rows_s": rate, "mb_s": rate * rb / 1e6,
                         "runs_rows_s": rates})
            s.shutdown()
            progress(rows[-1])
    return rows


def bench_sample(seconds: float, capacity: int, batch: int, learners: list, repeat: int) -> list[dict]:
    import ray
    from arrowbuf.ray import ShardedStore

    schema = _schema()
    rb = _row_bytes(schema) + schema.fields["obs"].row_bytes  # with the derived next_obs
    rows = []
    # ceilings: in-process sample, and one Flight client to one store over loopback
    pool = make_steps("mujoco", capacity, seed=0, episode_len=200)
    store = ab.ExperienceStore(schema, capacity, seed=0)
    store.extend(pool)

    def rate_of(fn) -> float:
        fn()
        runs = []
        for _ in range(repeat):
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                fn()
                n += 1
            runs.append(n / (time.perf_counter() - t0))
        return statistics.median(runs)

    r = rate_of(lambda: store.sample(batch))
    rows.append({"phase": "sample", "case": "ceiling: in-process sample", "shards": 0, "learners": 1,
                 "batches_s": r, "mb_s": r * batch * rb / 1e6})
    with ab.serve(store, token="t") as server:
        client = ab.connect(server.location, token="t")
        r = rate_of(lambda: client.sample(batch))
        client.close()
    store.close()
    rows.append({"phase": "sample", "case": "ceiling: one Flight client, one store", "shards": 1, "learners": 1,
                 "batches_s": r, "mb_s": r * batch * rb / 1e6})
    progress(rows[-1])
    for k in (1, 2, 3):
        s = ShardedStore.create(schema, k, capacity, seed=0)
        fill(s, min(capacity, 20_000))
        r = rate_of(lambda s=s: s.sample(batch))
        rows.append({"phase": "sample", "case": "1 learner (driver)", "shards": k, "learners": 1,
                     "batches_s": r, "mb_s": r * batch * rb / 1e6})
        runs = []
        for _ in range(repeat):
            start = time.time() + 2.0
            res = ray.get([x.sample_for.remote(s, seconds, batch, start) for x in learners])
            runs.append(sum(q[0] for q in res) / max(q[1] for q in res))
        r = statistics.median(runs)
        rows.append({"phase": "sample", "case": "3 learners (one per node), aggregate", "shards": k, "learners": 3,
                     "batches_s": r, "mb_s": r * batch * rb / 1e6})
        s.shutdown()
        progress(rows[-1])
    return rows


def bench_straggler(seconds: float, capacity: int, batch: int, slow_ms: float, deadline_ms: float) -> list[dict]:
    import ray
    from arrowbuf.ray import ShardedStore, shard_of

    schema = _schema()
    s = ShardedStore.create(schema, 3, capacity, seed=0, _test_hooks=True)  # the straggler's delay: a test hook
    fill(s, min(capacity, 10_000))
    rows = []
    for label, delay, deadline in (("no slow shard", 0.0, None), (f"shard 0 +{slow_ms:g} ms, no deadline",
                                   slow_ms / 1e3, None),
                                   (f"shard 0 +{slow_ms:g} ms, deadline {deadline_ms:g} ms", slow_ms / 1e3,
                                    deadline_ms / 1e3)):
        ray.get(s.actors[0].set_delay.remote(delay))
        time.sleep(max(0.2, 2 * delay))  # a late call of the previous case ends
        s.sample(batch)
        n, from_slow, lat = 0, 0, []
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            t = time.perf_counter()
            b = s.sample(batch, deadline=deadline)
            lat.append(time.perf_counter() - t)
            from_slow += int((shard_of(b.indices) == 0).sum())
            n += 1
        dt = time.perf_counter() - t0
        rows.append({"phase": "straggler", "case": label, "shards": 3, "batches_s": n / dt,
                     "p50_ms": 1e3 * statistics.median(lat), "p99_ms": 1e3 * float(np.percentile(lat, 99)),
                     "slow_shard_row_share": from_slow / (n * batch)})
    ray.get(s.actors[0].set_delay.remote(0.0))
    s.shutdown()
    return rows


def bench_failure(capacity: int, batch: int, kills: int) -> list[dict]:
    from arrowbuf.ray import ShardedStore, shard_of

    schema = _schema()
    s = ShardedStore.create(schema, 3, capacity, seed=0, failure_timeout=60.0)
    fill(s, min(capacity, 5_000))
    rows = []
    victim = 1
    for _ in range(kills):
        t_end = time.monotonic() + 1.0
        stamps = []
        while time.monotonic() < t_end:  # steady state before the kill
            s.sample(batch)
            stamps.append(time.monotonic())
        old = s.infos[victim]
        t_kill = time.monotonic()
        os.kill(old["pid"], signal.SIGKILL)  # a crash (same machine): Ray sees the process die and restarts it
        first_without = None
        back = serving = None
        fill_pool = make_steps("mujoco", 1000, seed=2, episode_len=200)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            b = s.sample(batch)
            now = time.monotonic()
            stamps.append(now)
            owners = set(shard_of(b.indices).tolist())
            if first_without is None and victim not in owners:
                first_without = now - t_kill
            info = s.infos[victim]
            if back is None and info is not None and info["generation"] != old["generation"] and not \
                    s.members.shards[victim].down:
                back = now - t_kill
                with s.writer(shard=victim) as w:  # the restarted shard is empty: give it data to serve
                    w.extend(fill_pool)
            if back is not None and victim in owners:
                serving = now - t_kill
                break
        until = t_kill + back if back is not None else float("inf")  # not counting the refill of the new shard
        gaps = np.diff([t for t in stamps if t_kill - 0.5 <= t <= until])
        rows.append({"phase": "failure", "case": "kill 1 of 3 shards under sampling", "shards": 3,
                     "first_batch_without_ms": None if first_without is None else 1e3 * first_without,
                     "max_gap_ms": 1e3 * float(gaps.max()) if len(gaps) else None,
                     "shard_back_s": back, "serving_again_s": serving})
        s.wait_for_shards(30)
    s.shutdown()
    return rows


def bench_broadcast(sizes_mb: list[int], receivers_per_node: int = 2) -> list[dict]:
    import ray
    from arrowbuf.ray import broadcast

    _, _, Receiver = actors()
    recv = [Receiver.options(**on(node)).remote() for node in node_ids() for _ in range(receivers_per_node)]
    ray.get([r.take.remote({"w": np.zeros(1)}) for r in recv])
    rows = []
    for mb in sizes_mb:
        obj = {"w": np.random.default_rng(0).standard_normal(mb * (1 << 20) // 4, dtype=np.float32)}
        res = {}
        for how in ("by value to each", "broadcast (one put)") * 2:  # twice each; keep the better (warm) run
            t0 = time.perf_counter()
            if how.startswith("broadcast"):
                out = ray.get(broadcast(obj, recv, "take"))
            else:
                out = ray.get([r.take.remote(obj) for r in recv])
            dt = time.perf_counter() - t0
            assert all(o == obj["w"].nbytes for o in out)
            res[how] = min(res.get(how, float("inf")), dt)
        for how, dt in res.items():
            rows.append({"phase": "broadcast", "case": how, "mb": mb, "receivers": len(recv), "ms": 1e3 * dt})
        rows.append({"phase": "broadcast", "case": "speedup of broadcast", "mb": mb, "receivers": len(recv),
                     "ratio": res["by value to each"] / res["broadcast (one put)"]})
    for r in recv:
        ray.kill(r)
    return rows


# ---------------------------------------------------------------------------------------------------- report
def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f} ms"


def _sec(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f} s"


def table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        p = r["phase"]
        if p == "ingest":
            out.append(f"ingest    | {r['case']:<42} | shards {r['shards']} | {r['rows_s']:>10,.0f} rows/s | "
                       f"{r['mb_s']:>7.0f} MB/s" + (f" | via {','.join(r['via'])}" if "via" in r else ""))
        elif p == "sample":
            out.append(f"sample    | {r['case']:<42} | shards {r['shards']} | {r['batches_s']:>8.1f} batch/s | "
                       f"{r['mb_s']:>7.0f} MB/s")
        elif p == "straggler":
            out.append(f"straggler | {r['case']:<42} | shards 3 | {r['batches_s']:>8.1f} batch/s | "
                       f"p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms | slow-shard rows "
                       f"{100 * r['slow_shard_row_share']:.1f}%")
        elif p == "failure":
            out.append(f"failure   | {r['case']:<42} | first batch without it {_ms(r['first_batch_without_ms'])} | "
                       f"longest gap {_ms(r['max_gap_ms'])} | back after {_sec(r['shard_back_s'])} | "
                       f"serving again {_sec(r['serving_again_s'])}")
        elif p == "broadcast":
            if "ratio" in r:
                out.append(f"broadcast | {r['case']:<42} | {r['mb']:>4} MB to {r['receivers']} | x{r['ratio']:.2f}")
            else:
                out.append(f"broadcast | {r['case']:<42} | {r['mb']:>4} MB to {r['receivers']} | {r['ms']:>8.1f} ms")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter phases, smaller stores")
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--batch", type=int, default=256, help="sample batch size")
    ap.add_argument("--write-batch", type=int, default=500, help="rows per writer extend")
    ap.add_argument("--slow-ms", type=float, default=100.0)
    ap.add_argument("--deadline-ms", type=float, default=30.0)
    ap.add_argument("--repeat", type=int, default=None, help="runs per case (median); default 1 quick, 3 full")
    ap.add_argument("--only", nargs="*", default=list(ALL_PHASES), choices=ALL_PHASES)
    args = ap.parse_args(argv)
    seconds = args.seconds or (2.0 if args.quick else 4.0)
    repeat = args.repeat or (1 if args.quick else 3)
    capacity = 20_000 if args.quick else 50_000
    sizes = [4, 32] if args.quick else [4, 32, 64]
    import ray

    t0 = time.time()
    load0 = os.getloadavg()
    cluster = start_cluster(max(256, 6 * max(sizes) + 64))  # by value: one copy per receiver on the driver node
    rows: list[dict] = []
    try:
        Writer, Learner, _ = actors()
        writers = [Writer.options(**on(node)).remote(args.write_batch) for node in node_ids()]
        learners = [Learner.options(**on(node)).remote() for node in node_ids()]
        if "ingest" in args.only:
            rows += bench_ingest(seconds, capacity, args.write_batch, writers, repeat)
        if "sample" in args.only:
            rows += bench_sample(seconds, capacity, args.batch, learners, repeat)
        for a in writers + learners:
            ray.kill(a)
        if "straggler" in args.only:
            rows += bench_straggler(seconds, capacity, args.batch, args.slow_ms, args.deadline_ms)
        if "failure" in args.only:
            rows += bench_failure(capacity, args.batch, 1 if args.quick else 3)
        if "broadcast" in args.only:
            rows += bench_broadcast(sizes)
    finally:
        ray.shutdown()
        cluster.shutdown()
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "ray.json"
    if path.exists() and set(args.only) != set(ALL_PHASES):  # a partial run replaces only its phases
        kept = [r for r in json.loads(path.read_text())["rows"] if r["phase"] not in args.only]
        order = {p: i for i, p in enumerate(ALL_PHASES)}
        rows = sorted(kept + rows, key=lambda r: order[r["phase"]])
    text = table(rows)
    print(text)
    meta = {"machine": platform.platform(), "cpus": os.cpu_count(), "nodes": NODES, "ray": ray.__version__,
            "workload": "mujoco (obs float32[376], action float32[17])", "seconds_per_phase": seconds,
            "batch": args.batch, "write_batch": args.write_batch, "repeat": repeat,
            "load_average_at_start": load0, "load_average_at_end": os.getloadavg(), "wall_s": time.time() - t0}
    if set(args.only) != set(ALL_PHASES) and path.exists():  # keep the full run's description
        meta = {**json.loads(path.read_text())["meta"], f"rerun_{'_'.join(args.only)}": meta}
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=float))


if __name__ == "__main__":
    main()
