"""Soak (issue 25, "Done when"): a durable store under `kill -9` of everything around it and of itself.

`test_durable_flight_soak`: a serving process (`ab.serve` on `ExperienceStore(..., durable=DIR)`), writer processes
over Flight, a reference stage that fills later fields (`update`) and priorities under leases, trainer processes that
consume under leases, and `kill -9` at random times of writers, consumers and the serving process. A killed server is
started again from the same directory (`ExperienceStore.restore(DIR)`) on the same port; the clients' own reconnect
plus the workers' retries on `Unavailable` carry them over, and a worker counts an operation as done only once its
call returned. `test_durable_ray_shards_soak`: the same on a `ShardedStore.create(..., durable=ROOT)` on the
session's Ray cluster, killing shard actors (SIGKILL of the actor's process, `ray.kill(no_restart=False)`) while
writer, updater and consumer threads (each with its own handle) work and, at random, die holding their leases.

Shared memory is left out: `durable=` refuses `tier="shm"` (writes of attached processes are not journaled).

Checked afterwards, from the workers' logs and the store's own journal (no checkpoint is taken after consumption
starts, so the journal holds every final consumption of the run):
- every row a writer had acknowledged is present with the values it wrote; every row present was sent by a writer;
- every row has the later fields and priority the reference stage wrote (it acks only after its update returned);
- the journal records each row consumed exactly once per task (no duplicate, none missing);
- an ack that returned OK is never followed by a delivery of that row to that task (a delivery whose call started
  after the ack returned); no row is acked OK twice per task;
- the rows a killed consumer held (and had not begun to ack) were delivered again to another consumer.
Redeliveries (rows delivered more than once per task: at-least-once before the ack) are counted and printed.

Bounded for CI (`ARROWBUF_SOAK_S`, default 6 s of kills per test; the kill loop goes on past that, up to 60 s more,
until it made the kills the assertions need); the long variant: `ARROWBUF_SOAK_S=600 pytest
tests/test_soak_durable.py -m slow -s` (docs/durability.md).
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import random
import signal
import sys
import threading
import time

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.persist import journal as jr

pytestmark = pytest.mark.slow

SOAK_S = float(os.environ.get("ARROWBUF_SOAK_S", "6"))
TASKS = ("ref", "train")
SCHEMA = {"name": "soak", "fields": {
    "prompt_id": {"dtype": "int64"},
    "response": {"dtype": "int32", "ragged": True},
    "reward": {"dtype": "float32", "later": True},
    "ref_logprobs": {"dtype": "float32", "ragged": True, "later": True},
}}
CAPACITY = 1 << 19


def response(p: int) -> np.ndarray:
    return np.arange(p % 7 + 1, dtype=np.int32)


def reward(p: int) -> float:
    return (p % 1000) * 0.5


def priority(p: int) -> float:
    return float(p % 997 + 1)


SERVER = r"""
import os, sys, time, arrowbuf as ab
from test_soak_durable import SCHEMA, CAPACITY
d, port = sys.argv[1], sys.argv[2]
if os.path.exists(os.path.join(d, "_durable.json")):
    store = ab.ExperienceStore.restore(d)
else:
    store = ab.ExperienceStore(SCHEMA, capacity=CAPACITY, durable=d, durability="group", tasks=["ref", "train"],
                               sampler=ab.samplers.PrioritizedSampler(alpha=1.0, eps=0.0))
for attempt in range(100):  # the port of the killed incarnation: free again at once (SO_REUSEADDR), or soon
    try:
        server = ab.serve(store, f"grpc://127.0.0.1:{port}")
        break
    except Exception as exc:
        print(f"bind {exc!r}", file=sys.stderr, flush=True)
        time.sleep(0.2)
print(server.location, flush=True)
time.sleep(3600)
"""

# every worker: connect (retrying while the server is down), log what it did as JSON lines with time.time() stamps
PRELUDE = r"""
import json, os, random, sys, time, numpy as np
location, seed, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
os.dup2(os.open(out + ".err", os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)  # a full pipe would block the worker
LOG = open(out, "a", buffering=1)
import arrowbuf as ab
from test_soak_durable import response, reward, priority
rng = random.Random(seed)
def log(**kw):
    LOG.write(json.dumps(kw) + "\n")
def connect():
    while True:
        try:
            return ab.connect(location, reconnect_timeout=60, timeout=60)
        except (ab.Unavailable, OSError) as exc:
            log(err=type(exc).__name__, msg=str(exc)[:200])
            time.sleep(0.2)
remote = connect()
RETRY = (ab.Unavailable, ab.StoreClosed, ConnectionError)
"""

WRITER = PRELUDE + r"""
k = 0
while True:
    p = seed * 10**9 + np.arange(k, k + 16)
    k += 16
    log(sent=p.tolist())  # before the call: a row present must have been sent
    try:
        ids = remote.extend({"prompt_id": p, "response": [response(int(x)) for x in p]})
    except RETRY as exc:
        log(err=type(exc).__name__)  # not acknowledged: may or may not be there; the next batch has new keys
        continue
    log(written=ids.tolist(), prompts=p.tolist())  # acknowledged
    time.sleep(0.02)
"""

CONSUMER = PRELUDE + r"""
task, hang = sys.argv[4], len(sys.argv) > 5
while True:
    t0 = time.time()
    try:
        if task == "ref":
            b = remote.consume("ref", rng.randint(8, 48), lease=2.0, timeout=0.2)
        else:
            b = remote.consume("train", rng.randint(8, 64), require=["reward", "ref_logprobs"], lease=2.0,
                               timeout=0.2)
    except RETRY as exc:
        log(err=type(exc).__name__, msg=str(exc)[:200])
        time.sleep(0.05)
        continue
    if not len(b):
        continue
    log(got=b.indices.tolist(), t0=t0, t1=time.time())
    if hang:  # a consumer that stops responding while it holds a lease (until it is killed)
        time.sleep(3600)
    d = b.to_numpy()
    p = d["prompt_id"]
    if task == "ref":
        time.sleep(rng.random() * 0.1)  # computing: killed here, or not
        try:
            remote.update(b.indices, {"reward": np.array([reward(int(x)) for x in p], np.float32),
                                      "ref_logprobs": [np.full(len(r), -float(x % 1000), np.float32)
                                                       for r, x in zip(d["response"], p)]})
            remote.update_priorities(b.indices, np.array([priority(int(x)) for x in p]))
        except RETRY as exc:
            log(err=type(exc).__name__)
            continue  # not acked: the lease expires (or the restart forgets it) and the rows come again
    else:
        bad = [int(i) for i, x, r, resp, lp in zip(b.indices, p, d["reward"], d["response"], d["ref_logprobs"])
               if r != reward(int(x)) or list(resp) != list(response(int(x)))
               or list(lp) != [-float(x % 1000)] * len(resp)]
        if bad:
            log(bad=bad)
        time.sleep(rng.random() * 0.1)  # training: killed here, or not
    log(acking=b.indices.tolist())
    try:
        b.ack()
    except ab.LeaseError as exc:  # expired, or a lease of the server's previous incarnation: the rows come again
        log(ackfail=b.indices.tolist(), why=str(exc)[:60])
        continue
    except RETRY as exc:  # unknown whether it was acked: not counted as done
        log(ackunknown=b.indices.tolist(), err=type(exc).__name__)
        continue
    log(acked=b.indices.tolist(), t=time.time())
"""


class Logs:
    """The JSON lines of every worker process, by kind and process."""

    def __init__(self) -> None:
        self.by_proc: list[tuple[str, str, bool, list[dict]]] = []  # (kind, task, killed, lines)

    def add(self, kind: str, task: str, killed: bool, out: bytes) -> None:
        lines = []
        for line in out.decode(errors="replace").splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue  # a line cut by the kill
        self.by_proc.append((kind, task, killed, lines))

    def lines(self, kind: str | None = None, task: str | None = None):
        for k, t, _killed, lines in self.by_proc:
            if (kind is None or k == kind) and (task is None or t == task):
                yield from lines


def journal_consumed(root: str) -> dict[str, np.ndarray]:
    """Every final consumption the journal of `root` records, per task (seqs in record order)."""
    records, _torn, _next = jr.read_segments(root, 0)
    out: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    for r in records:
        if r.kind == "consumed":
            out[str(r.meta["task"])].append(np.frombuffer(r.payload, dtype="<i8").astype(np.int64))
    return {t: np.concatenate(v) if v else np.zeros(0, np.int64) for t, v in out.items()}


def check_consumer_logs(logs: Logs, task: str) -> dict[str, int]:
    """The per-task delivery checks of the module docstring, from the consumers' logs; returns counts."""
    acked_at: dict[int, float] = {}
    acked_ok: list[int] = []
    deliveries: list[tuple[int, float, int]] = []  # (row, call start, process)
    for proc, (kind, t, _killed, lines) in enumerate(logs.by_proc):
        if kind != "consumer" or t != task:
            continue
        for x in lines:
            if "got" in x:
                deliveries += [(i, x["t0"], proc) for i in x["got"]]
            elif "acked" in x:
                acked_ok += x["acked"]
                for i in x["acked"]:
                    acked_at[i] = min(acked_at.get(i, x["t"]), x["t"])
    assert len(acked_ok) == len(set(acked_ok)), f"task {task}: a row acked OK twice"
    after = [(i, t0) for i, t0, _ in deliveries if i in acked_at and t0 > acked_at[i]]
    assert not after, f"task {task}: delivered again after an ack returned OK: {after[:5]}"
    # the rows a killed consumer held, not yet being acked, went to another consumer later
    orphans = 0
    for proc, (kind, t, killed, lines) in enumerate(logs.by_proc):
        if kind != "consumer" or t != task or not killed:
            continue
        last = next((x for x in reversed(lines) if "got" in x or "acking" in x), None)
        if last is None or "got" not in last:
            continue
        for i in last["got"]:
            orphans += 1
            assert any(j == i and t0 >= last["t0"] and q != proc for j, t0, q in deliveries), \
                f"task {task}: row {i} of a killed consumer was never delivered again"
    per_row = collections.Counter(i for i, _, _ in deliveries)
    return {"deliveries": len(deliveries), "redelivered": sum(c - 1 for c in per_row.values()),
            "acked_ok": len(acked_ok), "orphans_redelivered": orphans}


def test_durable_flight_soak(procs, tmp_path, monkeypatch):
    rng = random.Random(0)
    root = str(tmp_path / "durable")
    tests = os.path.dirname(os.path.abspath(__file__))
    logs = Logs()
    seeds = iter(range(1, 10**6))
    running: dict[str, list] = {"writer": [], "ref": [], "train": []}
    kills = collections.Counter()
    crashed: list[str] = []

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))

    def spawn(code, *args):
        return procs([sys.executable, "-c", code, *map(str, args)])

    def start_server(port):
        p = spawn(SERVER, root, port)
        line = p.stdout.readline().decode().strip()
        assert line.startswith("grpc://"), (line, p.stderr.read().decode()[-2000:] if p.poll() is not None else "")
        return p, line

    server, loc = start_server(0)
    port = int(loc.rsplit(":", 1)[1])

    def start(kind, *extra):
        seed = next(seeds)
        out = str(tmp_path / f"{kind}-{seed}.log")
        p = spawn(WRITER, loc, seed, out) if kind == "writer" else spawn(CONSUMER, loc, seed, out, kind, *extra)
        running[kind].append((p, out))
        return p, out

    def reap(kind, p_out, killed=True):
        p, out = p_out
        if p.poll() is not None:  # it ended by itself: a worker's bug (or a library error it met)
            with open(out + ".err", errors="replace") as f:
                crashed.append(f.read()[-3000:])
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=30)
        if not os.path.exists(out):  # killed while its interpreter was still starting (a busy machine): no log
            return
        with open(out, "rb") as f:
            logs.add("writer" if kind == "writer" else "consumer", kind, killed, f.read())

    hung: list = []
    try:
        for kind in ("writer", "writer", "ref", "train", "train"):
            start(kind)
        for kind in TASKS:  # a consumer per task that stops while holding a lease; killed a third in
            p_out = start(kind, "hang")
            running[kind].remove(p_out)  # not among the random victims
            hung.append((kind, p_out))
        end = time.monotonic() + SOAK_S

        def short_of_kills() -> bool:  # the kills asserted below (a short SOAK_S goes on until they happened)
            return kills["server"] < 1 or sum(kills.values()) < 3

        while time.monotonic() < end or ((hung or short_of_kills()) and time.monotonic() < end + 60):
            for task, p_out in list(hung) if time.monotonic() > end - SOAK_S * 2 / 3 else []:
                with open(p_out[1]) as f:
                    if '"got"' not in f.read():
                        continue  # not holding a lease yet
                hung.remove((task, p_out))
                reap(task, p_out)
                kills[task] += 1
            time.sleep(rng.uniform(1.0, 3.0))
            kind = rng.choice(["writer", "ref", "train", "server", "server"])
            kills[kind] += 1
            if kind == "server":
                os.kill(server.pid, signal.SIGKILL)
                server.communicate(timeout=30)
                time.sleep(rng.uniform(0, 1.0))  # the clients find it gone, and retry
                server, again = start_server(port)
                assert again == loc
                continue
            victim = running[kind].pop(rng.randrange(len(running[kind])))
            reap(kind, victim)
            start(kind)
        for p in running["writer"]:  # the writers stop; the consumers drain what is left
            reap("writer", p)
        running["writer"] = []
        drained = True
        with ab.connect(loc, reconnect_timeout=60, timeout=60) as client:
            total = len(client)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                st = client.stats()
                if all(st["consumed"][t] == total for t in TASKS):
                    break
                time.sleep(0.5)
            else:
                drained = False
        for kind in ("ref", "train"):
            for p in running[kind]:
                reap(kind, p, killed=False)
            running[kind] = []
    finally:
        for ps in [*running.values(), [p_out for _, p_out in hung]]:
            for p, _ in ps:
                p.kill()
        server.kill()
        server.communicate(timeout=30)
    kills_total = sum(kills.values())

    # the last incarnation was killed too: restore it here and look
    consumed = journal_consumed(root)
    with ab.ExperienceStore.restore(root) as again:
        st = again.stats()
        table = again.to_table(["seq", "prompt_id", "response", "reward", "ref_logprobs"])
        seqs = table["seq"].to_numpy()
        assert seqs.max() < CAPACITY  # nothing evicted: a row's ring position is its seq
        pri = again.sampler.mass(seqs)  # alpha=1, eps=0: the priority itself
        left = {t: len(again.consume(t, CAPACITY).indices) for t in TASKS}
    rows = table.to_pydict()
    ids = np.asarray(rows["seq"], np.int64)
    sent = {p for x in logs.lines("writer") if "sent" in x for p in x["sent"]}
    written = {i: p for x in logs.lines("writer") if "written" in x for i, p in zip(x["written"], x["prompts"])}
    counts = {t: check_consumer_logs(logs, t) for t in TASKS}
    prompts = collections.Counter(rows["prompt_id"])
    print(f"\ndurable flight soak {SOAK_S:.0f}s: {len(ids)} rows ({len(written)} acknowledged to writers, "
          f"{sum(c > 1 for c in prompts.values())} sent twice by a client's retry), kills {dict(kills)}, "
          f"per task {counts}, journal replayed at the last restore {st['journal']['replayed']}, errors seen by "
          f"workers {collections.Counter((k, t, x['err']) for k, t, _, ls in logs.by_proc for x in ls if 'err' in x)}")

    msgs = collections.Counter(x.get("msg", "")[:120] for x in logs.lines() if "err" in x)
    print("worker errors, most common:", msgs.most_common(4))
    assert not crashed, crashed
    assert drained, f"the consumers did not drain the store: {st['consumed']}, in flight {st['in_flight']}"
    assert not [x for x in logs.lines() if "bad" in x]  # every row a trainer saw was complete and as written
    assert written and set(written) <= set(ids.tolist())  # every acknowledged row is there ...
    by_id = dict(zip(ids.tolist(), range(len(ids))))
    for i, p in written.items():
        assert rows["prompt_id"][by_id[i]] == p  # ... under the id it was acknowledged with
    for k, p in enumerate(rows["prompt_id"]):  # every row was sent, and is exactly as written and updated
        assert p in sent
        assert rows["response"][k] == response(p).tolist()
        assert rows["reward"][k] == reward(p) and rows["ref_logprobs"][k] == [-float(p % 1000)] * (p % 7 + 1)
    np.testing.assert_array_equal(pri, [priority(p) for p in rows["prompt_id"]])
    for t in TASKS:
        assert left[t] == 0 and st["in_flight"][t] == 0
        final = consumed.get(t, np.zeros(0, np.int64))
        assert len(final) == len(np.unique(final)), f"task {t}: a row consumed twice in the journal"
        np.testing.assert_array_equal(np.sort(final), np.sort(ids), err_msg=f"task {t}: each row exactly once")
        acked_ok = [i for x in logs.lines("consumer", t) if "acked" in x for i in x["acked"]]
        assert set(acked_ok) <= set(final.tolist())  # an ack that returned OK is durable
    assert kills["server"] >= 1 and kills_total >= 3
    for t in TASKS:  # the hung consumers' rows at least
        assert counts[t]["orphans_redelivered"] >= 1 and counts[t]["redelivered"] >= 1


# ---------------------------------------------------------------------------------------------- Ray shard actors
def row_key(ids) -> np.ndarray:
    """A row's name across shard incarnations: (shard, seq) (a global id also carries the incarnation's
    generation, so the same row has another global id after its shard restarted)."""
    from arrowbuf.ray.ids import SEQ_BITS, decode_ids

    shard, _gen, seq = decode_ids(ids)
    return (shard << SEQ_BITS) | seq


class ThreadLog:
    """Lines of one worker thread (as the processes' JSON lines), and the flag that kills it."""

    def __init__(self, kind: str, task: str) -> None:
        self.kind, self.task, self.lines, self.die = kind, task, [], threading.Event()
        self.killed = False

    def log(self, **kw) -> None:
        self.lines.append(kw)


def _ray_writer(handle, me: ThreadLog, wid: int) -> None:
    k = 0
    while not me.die.is_set():
        p = wid * 10**9 + np.arange(k, k + 16)
        k += 16
        me.log(sent=p.tolist())
        try:
            ids = handle.extend({"prompt_id": p, "response": [response(int(x)) for x in p]})
        except Exception as exc:  # noqa: BLE001 - not acknowledged; logged and counted
            me.log(err=type(exc).__name__, msg=str(exc)[:200])
            time.sleep(0.1)
            continue
        me.log(written=row_key(ids).tolist(), prompts=p.tolist())
        time.sleep(0.03)


def _ray_consumer(handle, me: ThreadLog, seed: int) -> None:
    rng = random.Random(seed)
    task = me.task
    while not me.die.is_set():
        t0 = time.time()
        try:
            b = handle.consume(task, rng.randint(8, 48), lease=3.0, timeout=0.2,
                               require=None if task == "ref" else ["reward", "ref_logprobs"])
        except Exception as exc:  # noqa: BLE001
            me.log(err=type(exc).__name__, msg=str(exc)[:200])
            time.sleep(0.1)
            continue
        if not len(b):
            continue
        keys = row_key(b.indices).tolist()
        me.log(got=keys, t0=t0, t1=time.time())
        d = b.to_numpy()
        p = d["prompt_id"]
        time.sleep(rng.random() * 0.1)
        if me.die.is_set():
            return  # died holding the lease
        if task == "ref":
            try:
                n = handle.update(b.indices, {"reward": np.array([reward(int(x)) for x in p], np.float32),
                                              "ref_logprobs": [np.full(len(r), -float(x % 1000), np.float32)
                                                               for r, x in zip(d["response"], p)]})
                m = handle.update_priorities(b.indices, np.array([priority(int(x)) for x in p]))
            except Exception as exc:  # noqa: BLE001
                me.log(err=type(exc).__name__, msg=str(exc)[:200])
                continue
            if n != len(b) or m != len(b):  # a part went to a dead shard (or its earlier incarnation): not done
                me.log(err="short update", msg=f"{n}/{m} of {len(b)}")
                continue
        else:
            bad = [k for k, x, r, resp, lp in zip(keys, p, d["reward"], d["response"], d["ref_logprobs"])
                   if r != reward(int(x)) or list(resp) != list(response(int(x)))
                   or list(lp) != [-float(x % 1000)] * len(resp)]
            if bad:
                me.log(bad=bad)
        me.log(acking=keys)
        try:
            handle.ack(b.lease)
        except ab.LeaseError as exc:
            me.log(ackfail=keys, why=str(exc)[:80])
            continue
        except Exception as exc:  # noqa: BLE001 - unknown whether acked: not counted as done
            me.log(ackunknown=keys, err=type(exc).__name__, msg=str(exc)[:200])
            continue
        me.log(acked=keys, t=time.time())


def _closing(work, handle, *args) -> None:
    try:
        work(handle, *args)
    finally:
        handle.close()


def _info(ray, actor) -> dict:
    """The info of the actor's current incarnation, waiting while it restarts (bounded: 50 tries)."""
    for _ in range(50):
        try:
            return ray.get(actor.get_info.remote(), timeout=120)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            time.sleep(0.5)
    raise AssertionError("a shard actor did not come back")


def test_durable_ray_shards_soak(ray_cluster, tmp_path):
    ray = pytest.importorskip("ray")
    from arrowbuf.persist import manifest as mf
    from arrowbuf.ray import ShardedStore

    rng = random.Random(1)
    root = tmp_path / "durable"
    num_shards = 2
    s = ShardedStore.create(SCHEMA, num_shards, CAPACITY // 4, seed=0, strategy=None, durable=str(root),
                            durability="group", tasks=list(TASKS),
                            sampler=ab.samplers.PrioritizedSampler(alpha=1.0, eps=0.0))
    workers: list[tuple[ThreadLog, threading.Thread]] = []
    kills: collections.Counter = collections.Counter()
    ids_seen = iter(range(1, 10**6))

    def start(kind: str, task: str = "") -> None:
        me = ThreadLog("writer" if kind == "writer" else "consumer", task)
        handle = pickle.loads(pickle.dumps(s))  # its own handle (connections), as another process would have
        args = (handle, me, next(ids_seen))
        th = threading.Thread(target=_closing, args=(_ray_writer if kind == "writer" else _ray_consumer, *args),
                              daemon=True)
        th.start()
        workers.append((me, th))

    def stop(me: ThreadLog, th: threading.Thread) -> None:
        me.die.set()
        th.join(120)
        assert not th.is_alive()

    try:
        for _ in range(2):
            start("writer")
        time.sleep(2)
        s.checkpoint()  # a restart is this checkpoint + the journal after it (which holds every consumption)
        for task in ("ref", "train", "train"):
            start("consumer", task)
        end = time.monotonic() + SOAK_S
        # past SOAK_S only while no shard was killed yet (asserted below), up to 60 s more
        while time.monotonic() < end or (kills["shard-sigkill"] + kills["shard-ray.kill"] < 1
                                         and time.monotonic() < end + 60):
            time.sleep(rng.uniform(1.5, 4.0))
            what = rng.choice(["shard-sigkill", "shard-ray.kill", "writer", "consumer", "consumer"])
            kills[what] += 1
            if what.startswith("shard"):
                k = rng.randrange(num_shards)
                if what == "shard-sigkill":
                    os.kill(_info(ray, s.actors[k])["pid"], signal.SIGKILL)
                else:
                    ray.kill(s.actors[k], no_restart=False)
                continue
            alive = [(me, th) for me, th in workers if not me.die.is_set() and me.kind == what]
            me, th = alive[rng.randrange(len(alive))]
            me.killed = True
            stop(me, th)
            start(what, me.task)
        for me, th in workers:
            if me.kind == "writer":
                stop(me, th)
        assert s.wait_for_shards(timeout=180) == num_shards
        drained = False
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not drained:
            st = s.stats()
            drained = st["up"] == num_shards and all(st["consumed"][t] == st["size"] for t in TASKS)
            time.sleep(0.5)
        for me, th in workers:
            stop(me, th)
        s.wait_for_shards(timeout=180)
        infos = [_info(ray, a) for a in s.actors]
    finally:
        for me, _th in workers:
            me.die.set()
        s.shutdown()
    assert drained, f"the consumers did not drain the shards: {st.get('consumed')} of {st.get('size')}"

    # the shards are gone: restore each directory here and look (as a restarted shard would)
    rows: dict[str, list] = collections.defaultdict(list)
    pri, left = [], {}
    consumed: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    from arrowbuf.ray.ids import SEQ_BITS
    for k in range(num_shards):
        d = str(root / f"shard-{k}")
        records, _torn, _next = jr.read_segments(d, int(mf.read_manifest(d)["journal"]["from_lsn"]))
        for r in records:
            if r.kind == "consumed":
                consumed[str(r.meta["task"])].append((k << SEQ_BITS) | np.frombuffer(r.payload, "<i8"))
        with ab.ExperienceStore.restore(d) as again:
            t = again.to_table(["seq", "prompt_id", "response", "reward", "ref_logprobs"]).to_pydict()
            for name, v in t.items():
                rows[name] += v
            rows["key"] += [(k << SEQ_BITS) | i for i in t["seq"]]
            pri.append(again.sampler.mass(np.asarray(t["seq"], np.int64)))
            for task in TASKS:
                left[task] = left.get(task, 0) + len(again.consume(task, CAPACITY).indices)
    logs = Logs()
    logs.by_proc = [(me.kind, me.task, me.killed, me.lines) for me, _ in workers]
    keys = np.asarray(rows["key"], np.int64)
    sent = {p for x in logs.lines("writer") if "sent" in x for p in x["sent"]}
    written = {i: p for x in logs.lines("writer") if "written" in x for i, p in zip(x["written"], x["prompts"])}
    counts = {t: check_consumer_logs(logs, t) for t in TASKS}
    errors = collections.Counter((me.kind, x["err"]) for me, _ in workers for x in me.lines if "err" in x)
    prompts = collections.Counter(rows["prompt_id"])
    print(f"\ndurable ray soak {SOAK_S:.0f}s: {len(keys)} rows ({len(written)} acknowledged to writers, "
          f"{sum(c > 1 for c in prompts.values())} stored twice: a batch re-sent after its shard died), kills "
          f"{dict(kills)}, incarnations {[i['generation'] for i in infos]}, per task {counts}, errors {errors}")
    assert not [x for x in logs.lines() if "bad" in x]
    assert written and set(written) <= set(keys.tolist())
    by_key = dict(zip(keys.tolist(), range(len(keys))))
    for i, p in written.items():
        assert rows["prompt_id"][by_key[i]] == p
    for j, p in enumerate(rows["prompt_id"]):
        assert p in sent and rows["response"][j] == response(p).tolist()
        assert rows["reward"][j] == reward(p) and rows["ref_logprobs"][j] == [-float(p % 1000)] * (p % 7 + 1)
    np.testing.assert_array_equal(np.concatenate(pri), [priority(p) for p in rows["prompt_id"]])
    for task in TASKS:
        final = np.concatenate(consumed[task])
        assert len(final) == len(np.unique(final)), f"task {task}: a row consumed twice in a shard's journal"
        np.testing.assert_array_equal(np.sort(final), np.sort(keys), err_msg=f"task {task}: each row once")
        assert left[task] == 0
        acked_ok = [i for x in logs.lines("consumer", task) if "acked" in x for i in x["acked"]]
        assert set(acked_ok) <= set(final.tolist())
    assert kills["shard-sigkill"] + kills["shard-ray.kill"] >= 1
    assert min(i["generation"] for i in infos) >= 0
