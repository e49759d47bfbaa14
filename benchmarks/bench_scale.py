"""The scale run (issue 28): 32 writer/updater/consumer processes on a local 3-node Ray cluster, one sharded store.

What runs (every role a Ray actor, its own process, spread round-robin over the cluster's nodes):
- `writers` rollout workers: each writes one GRPO group (8 completions, `schemas/grpo.yaml`, responses of
  64-512 tokens, without the later fields) every `--period` seconds through the handle's writer, retrying when the
  ring is full of rows a task has not consumed yet (`InsertTimeout`: the store's eviction hold is the back-pressure);
- `reward` updaters: consume task "reward" (whole groups) and fill `reward` with `update`;
- `ref` updaters: consume task "ref" and fill `ref_logprobs` (a ragged field as long as the response);
- `trainers`: consume task "train" with `require=["reward", "ref_logprobs"]` and check each batch (whole groups,
  fields written, ragged lengths equal), oldest-first under a version window (`admission="oldest"`,
  `max_staleness=--window`); trainer 0 advances the policy version every `--version-every` seconds, writers tag their
  rows with the version they last read (each second; every 5th group `--window` versions older: a slow rollout, at
  the window's edge, which oldest-first admission takes before newer rows), and the rows the window holds back wait
  (counted, `stats()["admission"]`) (`--arrival`: id order, no versions).
The store: `ShardedStore.create(grpo, num_shards=3, tasks=["reward", "ref", "train"], sampler=Group(size=8),
max_staleness=--window + 1)`, one shard per node (a group lives on one shard). The store's bound is one version wider
than the trainers' window: a row the window holds back waits a version longer, and then the ring may evict it when a
writer needs the space (counted as dropped for each task that had not consumed it, docs/consume.md). Without a store
bound, rows held back hold eviction for good and, over minutes, fill the ring: every writer then waits until the end
(a 120 s run with 2-version stragglers and no bound wrote all its rows in the first ~20 s). Writers write for
`--seconds`; then the consumers drain and stop.

Checks (the run fails, exit status 1, when one does not hold):
- progress: every writer wrote rows;
- sustained writing: no stretch of the write phase longer than half of `--seconds` went by without a writer writing
  a group (a ring blocked by rows nobody will take stops the writers: this check fails then);
- exactly once per task: for each task, the ids consumed by all its processes have no duplicate, are ids written,
  and together with the rows the store counted as dropped (stale, evicted unconsumed) account for every row written
  (nothing lost uncounted, nothing twice), and every batch held whole groups with their fields written;
- oldest-first admission: at the end every row was admitted for "train" or counted as dropped, none waits;
- bounded memory: every process's peak RSS (VmHWM) is under `--max-rss-mb`, and no shard's RSS grows by more than
  `--max-growth-mb` between 40% of the write phase and its end (the ring is full by then: steady state).

Figures: rows/s and bytes/s written (Arrow buffer bytes of the written batches) and consumed per task, consume
latency per task (p50/p99 of calls that returned rows; `timeout=0` calls, one sweep of the shards), peak RSS per
role. RSS is read from /proc (a local cluster: every node is this machine). The ceiling beside them: one process
writing the same batches into an in-process store (`ExperienceStore.extend`), rows/s and bytes/s.

    python -m benchmarks.bench_scale [--quick] [--seconds S] [--writers W --updaters U --trainers T]
                                     [--window K --version-every S [--lag L] [--no-bound] | --arrival]

Prints a table and writes benchmarks/out/scale.json. `run()` is what tests/test_scale.py calls on the session's
cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
import time
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
NODES = 3
TASKS = ("reward", "ref", "train")
GROUP = 8
#: A consumer that found nothing waits this long before it asks again, doubling up to the longest.
_IDLE_MIN_S, _IDLE_MAX_S = 0.01, 0.2
#: The trainers' window in the drain: every row still in the ring, however many versions back.
_DRAIN_WINDOW = 1 << 30


def _rss(pid: int) -> tuple[int, int]:
    """(current, peak) resident set of process `pid` in bytes, from /proc; (0, 0) once it is gone."""
    try:
        text = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0, 0
    vals = {line.split(":")[0]: int(line.split()[1]) << 10 for line in text.splitlines()
            if line.startswith(("VmRSS:", "VmHWM:"))}
    return vals.get("VmRSS", 0), vals.get("VmHWM", 0)


def group_rows(rng: np.random.Generator, prompt_id: int, version: int) -> dict[str, Any]:
    """One GRPO group: 8 completions of prompt `prompt_id`, responses of 64-512 tokens, no later fields."""
    import pyarrow as pa

    lens = rng.integers(64, 513, GROUP)
    offs = pa.array(np.concatenate(([0], np.cumsum(lens))).astype(np.int32))
    tokens = int(lens.sum())
    plens = pa.array(np.arange(0, 32 * GROUP + 1, 32, dtype=np.int32))
    return {"prompt_id": np.full(GROUP, prompt_id, np.int64),
            "prompt_tokens": pa.ListArray.from_arrays(plens, pa.array(rng.integers(0, 151_000, 32 * GROUP,
                                                                                   np.int32))),
            "response_tokens": pa.ListArray.from_arrays(offs, pa.array(rng.integers(0, 151_000, tokens, np.int32))),
            "logprobs": pa.ListArray.from_arrays(offs, pa.array(-rng.random(tokens, dtype=np.float32))),
            "policy_version": np.full(GROUP, version, np.int64), "done": np.ones(GROUP, bool)}


def batch_bytes(rows: dict[str, Any]) -> int:
    """Arrow buffer bytes of a batch of `group_rows`."""
    import pyarrow as pa

    return sum(pa.array(v).nbytes if not isinstance(v, pa.Array) else v.nbytes for v in rows.values())


def actors() -> dict[str, Any]:
    """The run's Ray actor classes (made lazily: ray is imported only when the run starts)."""
    import ray

    class Role:
        """What every role shares: a stop flag, its own pid and RSS, latencies of its calls that returned rows."""

        def __init__(self, sharded: Any, index: int) -> None:
            self.sharded, self.index = sharded, index
            self.stopping = self.draining = False
            self.lat: list[float] = []
            self.errors: list[str] = []

        def pid(self) -> int:
            """This process's pid, once it has connected to every shard (before the run's clock starts)."""
            self.sharded.policy_version  # noqa: B018 - asks every shard: opens this process's connections
            return os.getpid()

        def stop(self) -> None:
            self.stopping = True

        def drain(self) -> None:
            self.draining = True

        def _report(self, **kw: Any) -> dict[str, Any]:
            _, peak = _rss(os.getpid())
            return {"pid": os.getpid(), "peak_rss": peak, "lat": self.lat, "errors": self.errors[:20], **kw}

    @ray.remote(num_cpus=0, max_concurrency=2)
    class Writer(Role):
        def run(self, start_at: float, seconds: float, period: float, lag: int = 1,
                min_groups: int = 0) -> dict[str, Any]:
            import arrowbuf as ab

            rng = np.random.default_rng(1000 + self.index)
            ids: list[np.ndarray] = []
            times: list[float] = []  # seconds since the start at each group written
            nbytes = waits = refused = 0
            version = self.sharded.policy_version
            time.sleep(max(0.0, start_at - time.time()))
            t0 = seen = time.monotonic()
            nxt, k = t0, 0
            rows = group_rows(rng, self.index * 10_000_000, version)
            while not self.stopping:
                spent = time.monotonic() - t0
                # past `seconds` only while short of `min_groups`, and never past 3 x `seconds`: a loaded machine
                # writes fewer groups at the same period, and a check that needs the ring to wrap needs enough rows
                if spent >= seconds and (len(ids) >= min_groups or spent >= 3 * seconds):
                    break
                try:  # routed by prompt_id: a group lives on one shard
                    got = self.sharded.extend(rows, timeout=1.0)
                except ab.InsertTimeout:  # the ring is full of rows a task has not consumed yet: back-pressure
                    waits += 1
                    time.sleep(0.05)
                    continue
                except ab.InvalidArgument:  # older than the store's window: a real worker drops the rollout
                    refused += 1
                    version, seen = self.sharded.policy_version, time.monotonic()
                    k += 1
                    rows = group_rows(rng, self.index * 10_000_000 + k, version)
                    continue
                ids.append(np.asarray(got, np.int64))
                times.append(time.monotonic() - t0)
                nbytes += batch_bytes(rows)
                k += 1
                if time.monotonic() - seen > 1.0:  # the policy this rollout worker runs: refreshed every second
                    version, seen = self.sharded.policy_version, time.monotonic()
                straggler = k % 5 == 4  # every 5th group: a slow rollout, started `lag` policy versions back
                rows = group_rows(rng, self.index * 10_000_000 + k, max(0, version - lag) if straggler else version)
                nxt += period
                time.sleep(max(0.0, nxt - time.monotonic()))
            elapsed = time.monotonic() - t0
            return self._report(ids=np.concatenate(ids) if ids else np.zeros(0, np.int64), bytes=nbytes,
                                elapsed=elapsed, insert_waits=waits, refused=refused,
                                times=np.asarray(times, np.float64))

    class Consumer(Role):
        task = ""
        require: list[str] | None = None

        def run(self, n: int, window: int | None = None, version_every: float | None = None) -> dict[str, Any]:
            ids: list[np.ndarray] = []
            rows = nbytes = bad = 0
            t0 = bumped = time.monotonic()
            self.window, version = window, 0
            idle = _IDLE_MIN_S
            while not self.stopping:
                if version_every and not self.draining and time.monotonic() - bumped > version_every:
                    version, bumped = version + 1, time.monotonic()  # a new policy: older rows grow stale
                    self.sharded.policy_version = version
                t = time.perf_counter()
                try:
                    b = self.sharded.consume(self.task, n, require=self.require, timeout=0, **self.options())
                except Exception as exc:  # noqa: BLE001 - counted and reported: the run's checks fail on it
                    self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                    time.sleep(0.05)
                    continue
                if not len(b):  # nothing ready: back off (32 processes polling 3 shards share 2 cores here)
                    time.sleep(idle)
                    idle = min(2 * idle, _IDLE_MAX_S)
                    continue
                idle = _IDLE_MIN_S
                self.lat.append(time.perf_counter() - t)
                ids.append(np.asarray(b.indices, np.int64))
                rows += len(b)
                nbytes += b.data.nbytes
                bad += self.check(b)
                self.fill(b)
            return self._report(ids=np.concatenate(ids) if ids else np.zeros(0, np.int64), rows=rows,
                                bytes=nbytes, bad_batches=bad, elapsed=time.monotonic() - t0)

        def check(self, b: Any) -> int:
            """1 when the batch is not whole groups (or, for the trainer, lacks a field), else 0."""
            _, counts = np.unique(b.data.column("prompt_id").to_numpy(), return_counts=True)
            return int(bool((counts != GROUP).any()))

        def fill(self, b: Any) -> None:
            return None

        def options(self) -> dict[str, Any]:
            return {}

    @ray.remote(num_cpus=0, max_concurrency=2)
    class RewardUpdater(Consumer):
        task = "reward"

        def fill(self, b: Any) -> None:
            rng = np.random.default_rng(len(self.lat))
            self.sharded.update(b.indices, {"reward": rng.random(len(b)).astype(np.float32)})

    @ray.remote(num_cpus=0, max_concurrency=2)
    class RefUpdater(Consumer):
        task = "ref"

        def fill(self, b: Any) -> None:
            import pyarrow as pa
            import pyarrow.compute as pc

            resp = b.data.column("response_tokens")
            ref = pa.ListArray.from_arrays(resp.offsets, pc.multiply(pc.cast(resp.values, pa.float32()), -1e-6))
            self.sharded.update(b.indices, {"ref_logprobs": ref})

    @ray.remote(num_cpus=0, max_concurrency=2)
    class Trainer(Consumer):
        task = "train"
        require = ["reward", "ref_logprobs"]

        def options(self) -> dict[str, Any]:
            """Oldest-first under the window while the run goes on; the drain takes what waited behind it (a window
            wide enough for any row: None would mean the store's own bound, which a store made with one keeps)."""
            if self.window is None:
                return {}
            return {"admission": "oldest", "max_staleness": _DRAIN_WINDOW if self.draining else self.window}

        def check(self, b: Any) -> int:
            import pyarrow.compute as pc

            d = b.data
            ok = d.column("reward").null_count == 0 and d.column("ref_logprobs").null_count == 0
            ok = ok and pc.all(pc.equal(pc.list_value_length(d.column("ref_logprobs")),
                                        pc.list_value_length(d.column("response_tokens")))).as_py()
            return int(not ok) + Consumer.check(self, b)

    return {"writers": Writer, "reward": RewardUpdater, "ref": RefUpdater, "train": Trainer}


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else None


def ceiling(seconds: float, rng_seed: int = 0) -> dict[str, float]:
    """One process writing the same groups into an in-process store (no tasks: nothing holds eviction)."""
    import arrowbuf as ab

    rng = np.random.default_rng(rng_seed)
    store = ab.ExperienceStore("grpo", capacity=4096, sampler=ab.samplers.Group(key="prompt_id", size=GROUP))
    pool = [group_rows(rng, k, 0) for k in range(64)]
    size = [batch_bytes(r) for r in pool]
    rows = nbytes = k = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        store.extend(pool[k % 64])
        rows += GROUP
        nbytes += size[k % 64]
        k += 1
    el = time.perf_counter() - t0
    store.close()
    return {"rows_s": rows / el, "bytes_s": nbytes / el}


def run(seconds: float = 30.0, writers: int = 8, updaters: int = 8, trainers: int = 8, period: float = 0.25,
        capacity_per_shard: int = 1024, batch: int = 32, drain_s: float = 60.0, max_rss_mb: float = 2048.0,
        max_growth_mb: float = 256.0, window: int | None = 1, version_every: float | None = 4.0,
        lag: int | None = None, bound: bool = True, min_groups: int = 0) -> dict[str, Any]:
    """The scale run on the Ray cluster this process is connected to (`ray.init` done; at least one node).

    Trainers consume oldest-first (`admission="oldest"`) under the version window `window` (None: in id order, no
    window) while trainer 0 advances the policy version every `version_every` seconds and writers tag their rows with
    the version they last read (each second), every 5th group `lag` versions older (a slow rollout; default: `window`,
    the window's edge); once the writers are done the trainers drain without a lower bound, so rows that waited
    behind the window and are still in the ring are delivered. With `bound` (and a window) the store is made with
    `max_staleness=window + 1`: rows held back longer than that may be evicted when a writer needs the space, counted
    as dropped per task; without it they hold eviction until the drain (writers wait for them). A writer short of
    `min_groups` groups after `seconds` goes on until it has them (at most 3 x `seconds`).

    `updaters` processes per updating task ("reward", "ref"): writers + 2 * updaters + trainers processes in all.
    Every actor and the store are ended before it returns, also when it fails. Returns the figures and `checks`
    ({name: [failures]}, all empty when every check holds).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import arrowbuf as ab
    from arrowbuf.ray import ShardedStore

    phases = {"begin": time.monotonic()}  # seconds of each phase: shards, actors up, writing, drain
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    shards = min(NODES, len(nodes))
    lag = (window or 0) if lag is None else lag
    store_bound = window + 1 if bound and window is not None else None
    sharded = ShardedStore.create("grpo", num_shards=shards, capacity_per_shard=capacity_per_shard,
                                  sampler=ab.samplers.Group(key="prompt_id", size=GROUP), tasks=list(TASKS),
                                  shard_cpus=0.1, failure_timeout=60.0, max_staleness=store_bound)
    made: list[tuple[str, Any]] = []
    phases["shards"] = time.monotonic()
    try:
        cls = actors()
        counts = {"writers": writers, "reward": updaters, "ref": updaters, "train": trainers}
        i = 0
        for role, count in counts.items():
            for k in range(count):
                where = NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=False)
                made.append((role, cls[role].options(scheduling_strategy=where).remote(sharded, k)))
                i += 1
        ray.get([a.pid.remote() for _, a in made], timeout=600)  # every process is up before the clock starts
        phases["actors"] = time.monotonic()
        shard_pids = [int(info["pid"]) for info in sharded.infos if info is not None]
        start_at = time.time() + 1.0
        bumper = next((a for role, a in made if role == "train"), None)  # trainer 0 advances the policy version
        consumers = [(role, a.run.remote(batch, window, version_every if a is bumper else None)
                      if role == "train" else a.run.remote(batch)) for role, a in made if role != "writers"]
        wrefs = [a.run.remote(start_at, seconds, period, lag, min_groups) for role, a in made if role == "writers"]
        series: list[tuple[float, list[int]]] = []  # (seconds since start, shard RSS)
        t0 = time.monotonic() + max(0.0, start_at - time.time())
        pending = list(wrefs)
        waited = {"waiting": 0, "waiting_stale": 0, "waiting_ahead": 0}  # the most the trainers' window held back
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            series.append((time.monotonic() - t0, [_rss(p)[0] for p in shard_pids]))
            if window is not None and len(series) % 2 == 0:
                now = sharded.stats().get("admission", {}).get("train", {})
                waited = {k: max(v, int(now.get(k, 0))) for k, v in waited.items()}
        wres = ray.get(wrefs)
        phases["writing"] = time.monotonic()
        for role, a in made:
            if role == "train":
                a.drain.remote()  # what waited behind the window comes now
        written = np.concatenate([r["ids"] for r in wres])
        end = time.monotonic() + drain_s  # the consumers drain what is left, then stop
        while time.monotonic() < end:
            st = sharded.stats()
            dropped = st.get("stale_dropped_by_task", {})
            if all(st.get("consumed", {}).get(t, 0) + dropped.get(t, 0) >= len(written) for t in TASKS):
                break
            time.sleep(0.5)
        phases["drain"] = time.monotonic()
        for _, a in made:
            a.stop.remote()
        cres = list(zip([role for role, _ in consumers], ray.get([ref for _, ref in consumers], timeout=120)))
        shard_peaks = [_rss(p)[1] for p in shard_pids]
        stats = sharded.stats()
    finally:
        for _, a in made:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        sharded.shutdown()
    res = _report(seconds, wres, cres, written, series, shard_peaks, stats, len(nodes), max_rss_mb, max_growth_mb)
    keys = list(phases)
    res["phases_s"] = {k: round(phases[k] - phases[p], 1) for p, k in zip(keys, keys[1:])}
    adm = stats.get("admission", {}).get("train")
    if window is not None:
        res["admission"] = {"window": window, "version_every_s": version_every, "most_waiting": waited, "end": adm,
                            "straggler_lag": lag, "store_max_staleness": store_bound}
        if adm is None or adm["waiting"] or adm["admitted"] + adm["dropped"] != len(written):
            res["checks"]["admission"] = [f"train: at the end {adm} (expected every row admitted or counted as "
                                          "dropped, none waiting)"]
            res["ok"] = False
    return res


def _longest_silence(times: np.ndarray, end: float) -> float:
    """The longest time between two groups written (by any writer), or from the last one to `end`; 0 without
    groups (the progress check covers a run that wrote nothing)."""
    if not len(times):
        return 0.0
    t = np.sort(times)
    return float(max(np.diff(t).max(initial=0.0), end - t[-1]))


def _report(seconds: float, wres: list[dict[str, Any]], cres: list[tuple[str, dict[str, Any]]], written: np.ndarray,
            series: list[tuple[float, list[int]]], shard_peaks: list[int], stats: dict[str, Any], nodes: int,
            max_rss_mb: float, max_growth_mb: float) -> dict[str, Any]:
    checks: dict[str, list[str]] = {"exactly_once": [], "whole_groups_and_fields": [], "bounded_memory": [],
                                    "errors": [], "progress": [], "sustained": []}
    idle = [k for k, r in enumerate(wres) if not len(r["ids"])]
    if idle:  # a run that wrote nothing would pass every other check
        checks["progress"].append(f"writers {idle} wrote no row in {seconds} s")
    write_s = max(r["elapsed"] for r in wres)
    span = min(write_s, seconds)  # writers that went on for `min_groups` are judged on the nominal phase
    times = np.concatenate([r["times"] for r in wres]) if wres else np.zeros(0)
    thirds = [int(((times >= span * k / 3) & (times < span * (k + 1) / 3)).sum()) for k in range(3)]
    # stalled = a stretch of the write phase in which no writer wrote, longer than half the nominal phase (a ring
    # blocked for good by rows nobody takes stops every writer until the end); a loaded machine writes unevenly
    # (CI: [21, 53, 4] groups per third, then 13 more past the phase) and is not stalled
    silence = _longest_silence(times, write_s)
    if silence > seconds / 2:
        checks["sustained"].append(f"no writer wrote for {silence:.1f} s of the {write_s:.1f} s write phase (groups "
                                   f"per third {thirds}): the writers stalled")
    dropped = stats.get("stale_dropped_by_task", {})
    roles: dict[str, Any] = {"writers": {"processes": len(wres), "rows": len(written),
                                         "bytes": sum(r["bytes"] for r in wres),
                                         "insert_waits": sum(r["insert_waits"] for r in wres),
                                         "refused_stale": sum(r["refused"] for r in wres), "groups_per_third": thirds,
                                         "peak_rss": [r["peak_rss"] for r in wres]}}
    roles["writers"].update(rows_s=len(written) / write_s, bytes_s=roles["writers"]["bytes"] / write_s)
    for w in wres:
        checks["errors"] += w["errors"]
    for task in TASKS:
        mine = [res for role, res in cres if role == task]
        got = np.concatenate([r["ids"] for r in mine]) if mine else np.zeros(0, np.int64)
        uniq = np.unique(got)
        if len(uniq) != len(got):
            checks["exactly_once"].append(f"{task}: {len(got) - len(uniq)} rows delivered twice")
        missing, extra = np.setdiff1d(written, uniq), np.setdiff1d(uniq, written)
        lost = len(missing) - int(dropped.get(task, 0))  # rows evicted stale are counted by the store, not lost
        if lost or len(extra):
            checks["exactly_once"].append(f"{task}: {len(missing)} written rows never delivered ({dropped.get(task, 0)}"
                                          f" counted as dropped), {len(extra)} delivered rows never written")
        bad = sum(r["bad_batches"] for r in mine)
        if bad:
            checks["whole_groups_and_fields"].append(f"{task}: {bad} batches with a split group or a missing field")
        for r in mine:
            checks["errors"] += r["errors"]
        lat = [x for r in mine for x in r["lat"]]
        elapsed = max((r["elapsed"] for r in mine), default=1.0)
        roles[task] = {"processes": len(mine), "rows": int(len(got)), "dropped": int(dropped.get(task, 0)),
                       "bytes": sum(r["bytes"] for r in mine),
                       "rows_s": len(got) / elapsed, "bytes_s": sum(r["bytes"] for r in mine) / elapsed,
                       "consume_calls": len(lat), "consume_p50_ms": _pct(lat, 50), "consume_p99_ms": _pct(lat, 99),
                       "peak_rss": [r["peak_rss"] for r in mine]}
    roles["shards"] = {"processes": len(shard_peaks), "peak_rss": shard_peaks}
    limit = int(max_rss_mb * (1 << 20))
    for role, r in roles.items():
        over = [p for p in r["peak_rss"] if p > limit]
        if over:
            checks["bounded_memory"].append(f"{role}: peak RSS {max(over) >> 20} MiB over {max_rss_mb:.0f} MiB")
    growth = []
    if series:
        warm = [rss for t, rss in series if t >= 0.4 * write_s]
        if warm:
            first = np.asarray(warm[0])
            growth = [int(v) for v in np.max(np.asarray(warm), axis=0) - first]
            for k, g in enumerate(growth):
                if g > max_growth_mb * (1 << 20):
                    checks["bounded_memory"].append(f"shard {k}: RSS grew {g >> 20} MiB after the ring filled")
    roles["shards"]["rss_growth_after_40pct"] = growth
    return {"seconds": seconds, "write_s": write_s, "processes": len(wres) + len(cres), "nodes": nodes,
            "shards": len(shard_peaks), "roles": roles,
            "consumed": stats.get("consumed"), "checks": checks, "ok": not any(checks.values())}


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def table(res: dict[str, Any], ceil: dict[str, float] | None) -> str:
    lines = [f"{'role':10} {'procs':>5} {'rows':>7} {'dropped':>7} {'rows/s':>8} {'MB/s':>7} {'p50 ms':>7} "
             f"{'p99 ms':>7} {'peak RSS MiB max/mean':>22}"]
    for role, r in res["roles"].items():
        peaks = np.asarray(r["peak_rss"], dtype=np.float64) / (1 << 20)
        p50, p99 = r.get("consume_p50_ms"), r.get("consume_p99_ms")
        rate = f"{r['rows_s']:.0f}" if "rows_s" in r else "-"
        lines.append(f"{role:10} {r['processes']:>5} {r.get('rows', '-'):>7} {r.get('dropped', '-'):>7} "
                     f"{rate:>8} {_mb(r.get('bytes_s')):>7} "
                     f"{'-' if p50 is None else f'{p50:.1f}':>7} {'-' if p99 is None else f'{p99:.1f}':>7} "
                     f"{f'{peaks.max():.0f} / {peaks.mean():.0f}' if len(peaks) else '-':>22}")
    if ceil is not None:
        w = res["roles"]["writers"]
        lines.append(f"{'ceiling':10} {1:>5} {'':>7} {'':>7} {ceil['rows_s']:>8.0f} {_mb(ceil['bytes_s']):>7}   "
                     f"(one process, in-process extend of the same groups; the run writes at "
                     f"{w['rows_s'] / ceil['rows_s']:.3f}x of it, rate-limited by --period)")
        lines.append(f"writers: groups written per third of the write phase {w.get('groups_per_third')}, "
                     f"{w['insert_waits']} waits on a full ring, {w.get('refused_stale', 0)} rollouts refused as "
                     "older than the store's window")
    if "admission" in res:
        a = res["admission"]
        lines.append(f"train oldest-first, window {a['window']}, a new policy version every {a['version_every_s']} s: "
                     f"at most {a['most_waiting']['waiting']} rows waited behind or ahead of the window "
                     f"({a['most_waiting']['waiting_stale']} stale, {a['most_waiting']['waiting_ahead']} ahead); at "
                     f"the end {a['end']}; stragglers {a.get('straggler_lag')} versions back, the store's "
                     f"max_staleness {a.get('store_max_staleness')}")
    if "phases_s" in res:
        lines.append("seconds per phase: " + ", ".join(f"{k} {v}" for k, v in res["phases_s"].items()))
    lines.append(f"checks: {'all hold' if res['ok'] else json.dumps(res['checks'])[:2000]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 20 s write phase")
    ap.add_argument("--seconds", type=float, default=None, help="write phase (default 120, quick 20)")
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--updaters", type=int, default=8, help="per updating task (reward, ref)")
    ap.add_argument("--trainers", type=int, default=8)
    ap.add_argument("--period", type=float, default=0.25, help="seconds between a writer's groups")
    ap.add_argument("--capacity", type=int, default=1024, help="rows per shard")
    ap.add_argument("--max-rss-mb", type=float, default=2048.0)
    ap.add_argument("--window", type=int, default=1, help="trainers' version window (oldest-first admission)")
    ap.add_argument("--version-every", type=float, default=4.0, help="seconds between policy versions")
    ap.add_argument("--arrival", action="store_true", help="trainers consume in id order, no window, no versions")
    ap.add_argument("--lag", type=int, default=None, help="versions a slow rollout starts back (default: --window)")
    ap.add_argument("--no-bound", action="store_true",
                    help="no store max_staleness: rows held back by the window hold eviction until the drain")
    args = ap.parse_args(argv)
    seconds = args.seconds or (20.0 if args.quick else 120.0)
    import ray
    from ray.cluster_utils import Cluster

    load0 = os.getloadavg()
    ceil = ceiling(2.0 if args.quick else 5.0)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 128 << 20,
                                                            "include_dashboard": False})
    try:
        for _ in range(NODES - 1):
            cluster.add_node(num_cpus=1, object_store_memory=128 << 20)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        res = run(seconds, args.writers, args.updaters, args.trainers, args.period, args.capacity,
                  max_rss_mb=args.max_rss_mb, window=None if args.arrival else args.window,
                  version_every=None if args.arrival else args.version_every, lag=args.lag,
                  bound=not args.no_bound)
    finally:
        ray.shutdown()
        cluster.shutdown()
    res.update(ceiling=ceil, load_before=load0, load_after=os.getloadavg(), quick=args.quick)
    print(table(res, ceil))
    print(f"load average before {load0[0]:.2f}, after {res['load_after'][0]:.2f}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scale.json").write_text(json.dumps(res, indent=1, default=str))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
