"""Crash-consistency harness for durable stores (issue 38): real processes, real files, SIGKILL, and a check of every
restore against a side log of what was acknowledged.

How a run goes (`KillRun`, one durable directory, several generations):

1. A worker process (`crash.worker`) opens the durable store (`ExperienceStore(schema, capacity=small so the ring
   wraps, durable=DIR, durability=policy, tasks=..., sampler=PrioritizedSampler)`), or restores DIR if it holds
   one, and runs writer threads (rows whose content is a function of a unique row id, `crash.workload`), an updater
   (`update` of a field filled later, `update_priorities`, `policy_version`), consumers (`consume(task, n)`, and
   `consume(task, n, lease=s)` followed by `ack`, `nack` or abandoning the lease) and `checkpoint()` every
   0.2-0.8 s. Every call is logged before it starts and after it returns (the acknowledgement) in a side log.
   Variants (`crash.workload.VARIANTS`): "ragged" (a ragged field, a tensor field, two tasks with their eviction hold,
   consumers) and "fixed" (fixed-size fields only and no tasks: rows are copied outside the writer's lock). The
   tests run "fixed" with its directory in /dev/shm (`fs="tmpfs"`): an fsync costs nothing there, so a checkpoint's
   journal rotation is shorter than a batch's copy, as on a fast NVMe disk, and a checkpoint that races a copy is
   common (on this VM's disk a rotation takes 3-100 ms and one rarely does); "ragged" runs on the disk.
2. The harness SIGKILLs it: every other kill while a checkpoint is in progress (it waits for the worker's "checkpoint
   started" line and kills after a random 0-30 ms; whether the checkpoint was still running is read back from the
   log: `kills_during_checkpoint` counts those), half of the others 0-50 ms after a checkpoint returned (a checkpoint
   that lost rows shows it only until the next one commits or the ring evicts them), the rest at a random moment.
3. It copies DIR, restores the copy in this process and checks it against the side logs of every generation so far
   (`crash.oracle`: every acknowledged row present unless the ring could evict it, byte-exact; no row nobody sent;
   the latest acknowledged update and priority of each live row; rows consumed for good stay consumed; rows of
   unacked leases come back; ids never reused; the policy version). The copy is needed because reading consumption
   back consumes. The next generation's worker restores DIR itself and logs what it found, which must equal the
   check's restore ("restore differs" otherwise).
4. Repeat: several kills per run.

Served (`mode="served"`): the store lives in a server process (`ab.serve(store, "grpc://127.0.0.1:0")`, checkpoints
in a thread there) and the writers, updater and consumers are Flight clients (`ab.connect`, one connection per
thread) in a second process; the server process is the one SIGKILLed (the client process goes right after, its
calls in flight unknown). Ray shards (`run_ray`): a `ShardedStore.create(..., durable=ROOT, checkpoint_every=...)`
shard whose actor process is SIGKILLed while the threads of this process write, update and consume through the
handle (and, for every other kill, while an explicit `checkpoint()` runs); after Ray restarts it, its rows and later
field are checked through the handle, and at the end the directory is restored here and checked in full. The
power-loss model is `crash.powerloss`.

What is provable, and so what the oracle checks, is in `crash.oracle`'s docstring; in short, the live window after a
restore is `[next_seq - capacity, next_seq)` whatever the restored store says its oldest row is, so a row dropped by a
checkpoint is reported even when the checkpoint moved its first seq up.

Bounds: the CI runs are short (a few kills each; see the tests). `ARROWBUF_TEST_CRASH_LONG=1` (read only by these
tests) runs the long variant: `LONG_KILLS` kills per in-process run (3 policies x 2 variants), `LONG_SERVED_KILLS`
per served run (3 policies) and `LONG_RAY_KILLS` per Ray run, i.e. well over 60 kills, half of them during a
checkpoint; each run prints its counts, and the session prints one summary line (kills, kills during a checkpoint,
acknowledged rows checked, updates, priorities, leases, violations by kind). `ARROWBUF_TEST_CRASH_OUT=PATH` writes
that summary as JSON. A test fails on any violation; its message lists each violation with its kind, generation,
policy, seq, rid and task.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import arrowbuf as ab
from crash import oracle as orc
from crash import workload as wl

LONG = os.environ.get("ARROWBUF_TEST_CRASH_LONG") == "1"
OUT = os.environ.get("ARROWBUF_TEST_CRASH_OUT")
#: kills per run in the long variant
LONG_KILLS, LONG_SERVED_KILLS, LONG_RAY_KILLS = 8, 6, 8

_HERE = os.path.dirname(os.path.abspath(__file__))
_PERSIST = os.path.dirname(_HERE)
ROOT = os.path.dirname(os.path.dirname(_PERSIST))


# ------------------------------------------------------------------------------------------------ the summary
@dataclass
class RunResult:
    mode: str
    policy: str
    variant: str
    kills: int = 0
    kills_during_checkpoint: int = 0
    counts: collections.Counter = field(default_factory=collections.Counter)
    violations: list[orc.Violation] = field(default_factory=list)
    seconds: float = 0.0
    #: seconds spent starting workers (up to their "open" line), running them, and checking restores
    timing: collections.Counter = field(default_factory=collections.Counter)

    def by_kind(self) -> dict[str, int]:
        return {k.split(":", 1)[1]: n for k, n in self.counts.items() if k.startswith("violation:")}

    def line(self) -> str:
        """The run's counts. "acknowledged rows checked" counts a row once per restore it was found in."""
        c = self.counts
        what = (f"images restored {c['images']} of {c['images_taken']} taken ({c['images_with_violations']} "
                f"with violations)" if self.mode == "powerloss" else
                f"kills {self.kills} (during a checkpoint {self.kills_during_checkpoint})")
        timing = ", ".join(f"{k} {v:.1f}" for k, v in self.timing.items())
        return (f"crash {self.mode}/{self.policy}/{self.variant}: {what}, acknowledged rows {c['acked_rows']}, "
                f"acknowledged rows checked {c['rows_checked']}, updates {c['updates']}, priorities "
                f"{c['priorities']}, leases {c['leases']} ({c['leased_rows']} rows, {c['acks']} acked, {c['nacks']} "
                f"nacked, {c['abandons']} abandoned), checkpoints {c['checkpoints']}, violations "
                f"{self.by_kind() or 0}, {self.seconds:.1f} s" + (f" ({timing})" if timing else ""))

    def message(self) -> str:
        """The assertion message: the counts and every violation kept."""
        return "\n".join([self.line(), *map(str, self.violations)])


RESULTS: list[RunResult] = []


def assert_clean(result: RunResult) -> None:
    """Fail the test with every violation (kind, generation, policy, seq, rid, task), if any."""
    if result.violations:
        import pytest

        pytest.fail(result.message(), pytrace=False)


def record(result: RunResult) -> RunResult:
    RESULTS.append(result)
    print("\n" + result.line(), flush=True)
    return result


def summary() -> dict[str, Any]:
    """Totals over every run of this session (what the long variant prints and writes). Violations count
    instances (a row, a call, an image), per kind."""
    total: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    for r in RESULTS:
        total.update(r.counts)
        kinds.update(r.by_kind())
    return {"runs": len(RESULTS), "kills": sum(r.kills for r in RESULTS),
            "kills_during_checkpoint": sum(r.kills_during_checkpoint for r in RESULTS),
            "acked_rows": total["acked_rows"], "acked_rows_checked": total["rows_checked"],
            "updates": total["updates"], "priorities": total["priorities"], "leases": total["leases"],
            "leased_rows": total["leased_rows"], "acks": total["acks"], "checkpoints": total["checkpoints"],
            "powerloss_images": total["images"], "violations": dict(kinds),
            "by_run": [{"mode": r.mode, "policy": r.policy, "variant": r.variant, "kills": r.kills,
                        "kills_during_checkpoint": r.kills_during_checkpoint, "seconds": round(r.seconds, 1),
                        "counts": {k: v for k, v in r.counts.items() if not k.startswith("violation:")},
                        "violations": r.by_kind(), "examples": [str(v) for v in r.violations[:40]]}
                       for r in RESULTS]}


def summary_line(s: dict[str, Any]) -> str:
    return (f"crash harness: {s['runs']} runs, kills {s['kills']} (during checkpoint {s['kills_during_checkpoint']}), "
            f"acknowledged rows checked {s['acked_rows_checked']}, updates {s['updates']}, priorities "
            f"{s['priorities']}, leases {s['leases']}, power-loss images {s['powerloss_images']}, violations "
            f"{s['violations'] or 0}")


def write_summary() -> None:
    if OUT and RESULTS:
        with open(OUT, "w") as f:
            json.dump(summary(), f, indent=1)


# ------------------------------------------------------------------------------------------------ processes
def child_env() -> dict[str, str]:
    path = os.pathsep.join([ROOT, _PERSIST, os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def spawn(config: dict[str, Any], stderr_path: str) -> subprocess.Popen:
    with open(stderr_path, "ab") as err:
        return subprocess.Popen([sys.executable, "-m", "crash.worker", json.dumps(config)], cwd=ROOT,
                                env=child_env(), stdin=subprocess.DEVNULL, stdout=err, stderr=err)


def kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    if proc is not None:
        proc.wait(30)


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")
    except OSError:
        return ""


class Tail:
    """Follows a side log as it grows: `new()` parses only the complete lines written since the last call."""

    def __init__(self, path: str) -> None:
        self.path, self.offset, self.rest = path, 0, b""

    def new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.rest + data).split(b"\n")
        self.rest = lines.pop()
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out


def wait_line(tail: Tail, match: Callable[[dict[str, Any]], bool], timeout: float,
              procs: list[tuple[subprocess.Popen, str]]) -> dict[str, Any] | None:
    """The first line from here on of the side log `tail` follows that `match`es, polling; None at the timeout.
    Raises if a process of `procs` ended meanwhile (its stderr tail in the message): a worker only ends by our
    SIGKILL."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for e in tail.new():
            if match(e):
                return e
        for p, err in procs:
            if p.poll() is not None:
                raise AssertionError(f"a worker process ended on its own (status {p.returncode}):\n{_tail(err)}")
        time.sleep(0.005)
    return None


# ------------------------------------------------------------------------------------------------ kill runs
class KillRun:
    """One durable directory, `kills` generations, each ended by a SIGKILL (module docstring)."""

    def __init__(self, tmp: str, mode: str, policy: str, variant: str, kills: int, seed: int = 0,
                 fs: str = "disk") -> None:
        assert mode in ("inproc", "served") and fs in ("disk", "tmpfs")
        self.tmp, self.mode, self.policy, self.kills = tmp, mode, policy, kills
        self.variant = wl.VARIANTS[variant]
        self.rng = random.Random(f"{mode}-{policy}-{variant}-{seed}")
        self.seed = seed
        # "tmpfs": the durable directory in /dev/shm, where an fsync costs nothing: a checkpoint's journal rotation
        # then takes well under a batch's copy, as on a fast NVMe disk (on this VM's disk it takes 3-100 ms, and a
        # batch copy rarely spans it). A process kill loses nothing there either: the files outlive the process
        self.fsdir = tempfile.mkdtemp(prefix="arrowbuf-crash-", dir="/dev/shm") if fs == "tmpfs" else None
        self.dir = os.path.join(self.fsdir or tmp, "run")
        self.logs = os.path.join(tmp, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.result = RunResult(mode, policy, variant + ("" if fs == "disk" else "/tmpfs"))
        self.oracle = orc.Oracle(self.variant, {"mode": mode, "policy": policy, "variant": variant})
        self.procs: list[subprocess.Popen] = []
        self.timing = self.result.timing

    def run(self) -> RunResult:
        t0 = time.monotonic()
        try:
            for gen in range(self.kills):
                self.oracle.where["gen"] = gen
                if not self._generation(gen):
                    break
        finally:
            for p in self.procs:
                kill(p)
            if self.fsdir is not None:
                shutil.rmtree(self.fsdir, ignore_errors=True)
            self.result.seconds = time.monotonic() - t0
            self.result.counts.update(self.oracle.counts)
        return record(self.result)

    def _config(self, gen: int, mode: str, log: str, **more: Any) -> dict[str, Any]:
        return {"mode": mode, "dir": self.dir, "log": log, "gen": gen, "policy": self.policy,
                "variant": self.variant.name, "seed": self.seed * 1000 + gen, "max_s": 240, **more}

    def _generation(self, gen: int) -> bool:
        """Run, kill and check generation `gen`; False when the directory cannot be restored any more."""
        main_log = os.path.join(self.logs, f"g{gen}-{'worker' if self.mode == 'inproc' else 'server'}.jsonl")
        err = os.path.join(self.logs, f"g{gen}.stderr")
        logs = [main_log]
        t_spawn = time.monotonic()
        main = spawn(self._config(gen, "inproc" if self.mode == "inproc" else "server", main_log), err)
        self.procs.append(main)
        watched = [(main, err)]
        client = None
        main_tail = Tail(main_log)
        opened = wait_line(main_tail, lambda e: e["op"] == "open", 120, watched)
        assert opened is not None, f"generation {gen}: the worker did not open the store in 120 s:\n{_tail(err)}"
        if self.mode == "served":
            client_log = os.path.join(self.logs, f"g{gen}-client.jsonl")
            logs.append(client_log)
            client = spawn(self._config(gen, "client", client_log, location=opened["loc"]), err + ".client")
            self.procs.append(client)
            watched.append((client, err + ".client"))
            ready = wait_line(Tail(client_log), lambda e: e["op"] == "ready", 120, watched)
            assert ready is not None, f"generation {gen}: the client did not connect:\n{_tail(err + '.client')}"
        # every other kill lands in a checkpoint; of the others, every other one right after a checkpoint returned
        # (a checkpoint that lost rows shows them lost only until the next one commits), the rest anywhere
        how = "during" if gen % 2 == 0 else "after" if gen % 4 == 1 else "random"
        started = time.monotonic()
        self.timing["open"] += started - t_spawn
        time.sleep(self.rng.uniform(0.4, 1.2) if how != "random" else self.rng.uniform(0.4, 2.0))
        ckpt = None
        if how != "random":
            ph = "s" if how == "during" else "d"  # the next checkpoint that starts (or returns) from now on
            main_tail.new()
            ckpt = wait_line(main_tail, lambda e: e["op"] == "ckpt" and e["ph"] == ph, 10, watched)
            time.sleep(self.rng.uniform(0.0, 0.03 if how == "during" else 0.05))
            if how == "after":
                ckpt = None
        kill(main)
        kill(client)
        for p, _ in watched:
            assert p.returncode == -signal.SIGKILL, f"generation {gen}: status {p.returncode}:\n{_tail(err)}"
        self.result.kills += 1
        events = [e for path in logs for e in wl.read_log(path)]
        if ckpt is not None and not any(e["op"] == "ckpt" and e["k"] == ckpt["k"] and e["ph"] != "s"
                                        for e in events):
            self.result.kills_during_checkpoint += 1
        self.timing["run"] += time.monotonic() - started
        t_check = time.monotonic()
        self.result.violations += self.oracle.ingest(events)
        try:
            return self._check(gen)
        finally:
            self.timing["check"] += time.monotonic() - t_check

    def _check(self, gen: int) -> bool:
        copy = os.path.join(self.fsdir or self.tmp, "check")
        shutil.rmtree(copy, ignore_errors=True)
        t = time.monotonic()
        shutil.copytree(self.dir, copy)
        self.timing["check.copy"] += time.monotonic() - t
        try:
            try:
                t = time.monotonic()
                store = ab.ExperienceStore.restore(copy)
                self.timing["check.restore"] += time.monotonic() - t
            except Exception as exc:  # noqa: BLE001 - reported as a violation: nothing acknowledged may be lost
                self.oracle.counts["violation:restore failed"] += 1
                self.result.violations.append(self.oracle._v("restore failed", detail=f"{type(exc).__name__}: "
                                                                                       f"{str(exc)[:500]}"))
                return False
            try:
                got = orc.snapshot(store, self.variant.tasks)
                got.checkpoint = _checkpoint_of(copy)
                # what the next generation's worker must find when it restores the directory itself
                self.oracle.expect_open = (got.next_seq, got.table.num_rows, int(got.policy_version or 0))
                self.result.violations += self.oracle.check(got)
            finally:
                store.close()
        finally:
            shutil.rmtree(copy, ignore_errors=True)
        return True


def _checkpoint_of(path: str) -> dict[str, Any] | None:
    """The `rows` entry (and the journal's `from_lsn`) of the checkpoint a durable directory restores from."""
    try:
        with open(os.path.join(path, "_manifest.json")) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    return {**{k: m["rows"].get(k) for k in ("first_seq", "next_seq", "dropped_rows")},
            "generation": m.get("generation"), "from_lsn": (m.get("journal") or {}).get("from_lsn")}


def pick(ci: int, long: int) -> int:
    """`ci` in the CI variant, `long` with ARROWBUF_TEST_CRASH_LONG=1."""
    return long if LONG else ci


# ------------------------------------------------------------------------------------------------ Ray shards
def _actor_info(ray: Any, actor: Any, other_than: int | None = None) -> dict[str, Any]:
    """The shard actor's current incarnation's info; with `other_than`, waits for an incarnation with another pid
    (Ray restarting it). Bounded: 60 tries of at most 60 s."""
    for _ in range(60):
        try:
            info = ray.get(actor.get_info.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - dying or restarting: ask again
            time.sleep(0.5)
            continue
        if other_than is None or info["pid"] != other_than:
            return dict(info)
        time.sleep(0.2)
    raise AssertionError("the shard actor did not come back")


def _own_handle(store: Any, handles: list[Any]) -> Any:
    """A handle of its own on sharded `store` (its own connections, as another process would have)."""
    import pickle

    h = pickle.loads(pickle.dumps(store))
    handles.append(h)
    return h


def run_ray(tmp: str, policy: str, kills: int, seed: int = 0) -> RunResult:
    """A durable `ShardedStore` shard (one shard, the "ragged" variant, `checkpoint_every`) whose actor process is
    SIGKILLed `kills` times while threads of this process write, update and consume through their own handles and
    another calls `checkpoint()` (every other kill lands in one of those). After each restart its rows and later
    field are checked through the handle (a partial check: reading consumption back would consume); at the end the
    shard is shut down and its directory restored here and checked in full (module docstring)."""
    import ray

    from arrowbuf.ray import ShardedStore
    from arrowbuf.ray.ids import decode_ids

    variant = wl.VARIANTS["ragged"]
    rng = random.Random(f"ray-{policy}-{seed}")
    result = RunResult("ray", policy, variant.name)
    oracle = orc.Oracle(variant, {"mode": "ray", "policy": policy, "variant": variant.name},
                        to_seqs=lambda ids: decode_ids(ids)[2], resend=True)
    root = os.path.join(tmp, "durable")
    t0 = time.monotonic()
    s = ShardedStore.create(variant.schema, 1, variant.capacity, wl.sampler(), seed=0, strategy=None,
                            chunk_rows=variant.chunk_rows, durable=root, durability=policy,
                            tasks=list(variant.tasks), checkpoint_every=0.5)
    try:
        for gen in range(kills + 1):
            oracle.where["gen"] = gen
            log = wl.MemoryLog(gen)
            shared = wl.Shared()
            handles: list[Any] = []
            handle = functools.partial(_own_handle, s, handles)
            threads = wl.client_threads(handle, log, variant, gen, shared, seed * 1000 + gen, lease_s=2.0)
            ck = threading.Thread(target=wl.guarded, daemon=True,
                                  args=(wl.checkpointer, log, handle(), log, shared, seed * 1000 + gen))
            ck.start()
            threads.append(ck)
            started = time.monotonic()
            last = gen == kills
            time.sleep(rng.uniform(1.0, 2.5))
            killed_pid = None
            if not last:
                if gen % 2 == 0:  # during an explicit checkpoint call
                    k0 = max([e["k"] for e in log.events if e["op"] == "ckpt"] or [0])
                    end = time.monotonic() + 10
                    while time.monotonic() < end and not any(e["op"] == "ckpt" and e["ph"] == "s" and e["k"] > k0
                                                             for e in log.events):
                        time.sleep(0.005)
                    time.sleep(rng.uniform(0.0, 0.03))
                info = _actor_info(ray, s.actors[0])
                killed_pid = info["pid"]
                ckpt_open = [e["k"] for e in log.events if e["op"] == "ckpt" and e["ph"] == "s"]
                oracle.kills.append(time.time())
                os.kill(killed_pid, signal.SIGKILL)
                result.kills += 1
                done = {e["k"] for e in log.events if e["op"] == "ckpt" and e["ph"] != "s"}
                if ckpt_open and ckpt_open[-1] not in done:
                    result.kills_during_checkpoint += 1
                time.sleep(0.5)
            shared.stop.set()
            for t in threads:
                t.join(180)
                assert not t.is_alive(), "a worker thread did not stop"
            for h in handles:
                h.close()
            result.timing["run"] += time.monotonic() - started
            if killed_pid is not None:
                _actor_info(ray, s.actors[0], other_than=killed_pid)
                s.report_down(0)
                assert s.wait_for_shards(timeout=180) == 1
            result.violations += oracle.ingest(log.events)
            if last:
                break
            t_check = time.monotonic()
            st = s.stats()["shards"][0]
            table = s.to_table()
            result.violations += oracle.check(orc.Restored(table, int(st["next_seq"])), partial=True)
            result.timing["check"] += time.monotonic() - t_check
    finally:
        s.shutdown()
    # the last incarnation closed cleanly: restore its directory (a copy) here and check everything
    copy = os.path.join(tmp, "check")
    shutil.copytree(os.path.join(root, "shard-0"), copy)
    try:
        store = ab.ExperienceStore.restore(copy)
        try:
            got = orc.snapshot(store, variant.tasks)
            got.checkpoint = _checkpoint_of(copy)
            result.violations += oracle.check(got)
        finally:
            store.close()
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    result.seconds = time.monotonic() - t0
    result.counts.update(oracle.counts)
    return record(result)


# ------------------------------------------------------------------------------------------------ power loss
def record_powerloss(res: dict[str, Any]) -> RunResult:
    """A `crash.powerloss` result as a `RunResult` (its violations' text kept, counted per kind)."""
    r = RunResult("powerloss", res["policy"], res["variant"] + ("" if res["ckpt"] else "/no-checkpoints"))
    r.counts.update(res["counts"])
    r.counts["images"] = res["images_checked"]
    r.counts["images_with_violations"] = res["images_with_violations"]
    r.counts["images_taken"] = res["images"]
    r.seconds = res["seconds"]
    r.violations = [orc.Violation(v["kind"], {}, detail=v["text"]) for v in res["violations"]]
    if res["model_errors"]:
        r.violations.append(orc.Violation("model incomplete", {}, detail="; ".join(res["model_errors"][:5])))
        r.counts["violation:model incomplete"] += 1
    return record(r)
