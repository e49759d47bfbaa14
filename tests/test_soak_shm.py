"""Soak (issue 25, "Done when", the shared-memory side): processes attached to one `tier="shm"` store, `kill -9`ed
at random times.

The test process creates (owns) a shared store with tasks "ref" and "train", a later field pair and priorities
(`PrioritizedSampler(alpha=1, eps=0)`: a row's sampling mass is its priority). Around it, each its own process with
no server between them (`ExperienceStore.attach`):
- writer processes `extend` batches of 16 rows (each logs a batch as sent before the call and as written, with the
  ids, once the call returned: acknowledged);
- an updater consumes "ref" under a lease, fills the later fields (`update`) and the priority (`update_priorities`),
  then acks (idempotent: the same values for the same row, so a redelivered row is filled again the same way);
- trainer processes consume "train" requiring the later fields, under leases, check every row they see and ack;
- a killer (the test) sends `kill -9` at random to writers, the updater and trainers and starts them again; besides,
  consumers made to freeze inside a consume, holding the store's state lock (`pick`: the robust mutex) or gathering
  their leased rows outside it (`gather`: a pin holds eviction), are killed there.

Checked afterwards, from the store (still in shared memory, never restored) and the workers' logs (a line is written
with one `write` to a file of its own, so a kill loses at most the line being written):
- every row a writer had acknowledged is present under its id with the values written, its later fields and its
  priority; every row present was sent by a writer, and a present row not acknowledged is in the last batch a killed
  writer had sent (it died after its rows were committed and before it logged them: allowed, docs/shared-memory.md);
- each row is consumed exactly once per task: the store's own count of final consumption equals the rows present,
  its per-row record (the consume marks in shared memory) marks every row consumed and held by no lease, nothing is
  in flight, and a consume of either task returns nothing; from the logs, no row is acked OK twice per
  task and no delivery of a row starts after an ack of it returned (deliveries before the ack, at least once, are
  counted);
- the rows a killed consumer held (its last delivery, not yet being acked) were delivered again to another process,
  and the store counts expired leases and redelivered rows.
A killed owner is not part of the soak: a shared store lives as long as its creator (docs/durability.md).

Bounded for CI (`ARROWBUF_SOAK_S`, default 8 s of kills, and on, up to 60 s more, until the kills asserted below
happened; start-up and drain add most of the rest: importing arrowbuf in eight worker processes); the long variant:
`ARROWBUF_SOAK_S=600 pytest tests/test_soak_shm.py -m slow -s` (docs/durability.md).
"""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest

import arrowbuf as ab

pytestmark = pytest.mark.slow

SOAK_S = float(os.environ.get("ARROWBUF_SOAK_S", "8"))
TASKS = ("ref", "train")
SCHEMA = {"name": "soak", "fields": {
    "prompt_id": {"dtype": "int64"},
    "response": {"dtype": "int32", "ragged": True},
    "reward": {"dtype": "float32", "later": True},
    "ref_logprobs": {"dtype": "float32", "ragged": True, "later": True},
}}
#: Rows the ring holds; writers pause before it is full, so nothing is evicted and every row can be checked at the end.
CAPACITY = 1 << 17
#: Where a consumer made to freeze stops until it is killed: inside a consume holding the store's state lock
#: (`pick`), inside a consume gathering its leased rows outside the lock (`gather`), or after a consume returned,
#: holding its lease (`hold`).
FREEZES = ("pick", "gather", "hold")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def response(p: int) -> np.ndarray:
    return np.arange(p % 7 + 1, dtype=np.int32)


def reward(p: int) -> float:
    return (p % 1000) * 0.5


def priority(p: int) -> float:
    return float(p % 997 + 1)


# every worker: attach, log JSON lines (one os.write each) with time.time() stamps
PRELUDE = r"""
import json, os, random, sys, time, numpy as np
name, seed, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
FD = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
def log(**kw):
    os.write(FD, (json.dumps(kw) + "\n").encode())
import arrowbuf as ab
from test_soak_shm import response, reward, priority, CAPACITY
rng = random.Random(seed)
store = ab.ExperienceStore.attach(name, timeout=30)
log(up=os.getpid())  # the killer picks only workers that are up
"""

WRITER = PRELUDE + r"""
k = 0
while True:
    if len(store) > CAPACITY - 2048:  # nothing is evicted: every row is checked at the end
        time.sleep(0.1)
        continue
    p = seed * 10**9 + np.arange(k, k + 16)
    k += 16
    log(sent=p.tolist())  # before the call: a row present must have been sent
    ids = store.extend({"prompt_id": p, "response": [response(int(x)) for x in p]}, timeout=30)
    log(written=ids.tolist(), prompts=p.tolist())  # acknowledged
    time.sleep(0.04)
"""

CONSUMER = PRELUDE + r"""
task, freeze = sys.argv[4], sys.argv[5]
batches, after = 0, rng.randint(1, 4)
if freeze in ("pick", "gather"):  # freeze inside the consume call after a few calls; the killer kills us there
    from arrowbuf.engine.consume import ConsumeTracker
    from arrowbuf.engine.reader import StoreReader
    cls, attr = (ConsumeTracker, "_pick") if freeze == "pick" else (StoreReader, "gather")
    original, calls = getattr(cls, attr), [0]
    def frozen(*args, **kwargs):
        if freeze == "gather" and not len(args[1]):
            return original(*args, **kwargs)  # an empty batch (a consume that timed out) holds no lease
        calls[0] += 1
        if calls[0] > after:
            if freeze == "gather":  # the rows it took under its lease: to be delivered again to another process
                log(got=[int(x) for x in args[1]], t0=time.time())
            log(frozen=freeze)  # holding the state lock (pick), or the leased rows pinned (gather)
            time.sleep(3600)
        return original(*args, **kwargs)
    setattr(cls, attr, frozen)
while True:
    t0 = time.time()
    if task == "ref":
        b = store.consume("ref", rng.randint(8, 48), lease=1.5, timeout=0.2)
    else:
        b = store.consume("train", rng.randint(8, 64), require=["reward", "ref_logprobs"], lease=1.5, timeout=0.2)
    if not len(b):
        continue
    log(got=b.indices.tolist(), t0=t0)
    batches += 1
    if freeze == "hold" and batches > after:  # stops responding while it holds a lease (until it is killed)
        log(frozen=freeze)
        time.sleep(3600)
    d = b.to_numpy()
    p = d["prompt_id"]
    if task == "ref":
        time.sleep(rng.random() * 0.05)  # computing: killed here, or not
        store.update(b.indices, {"reward": np.array([reward(int(x)) for x in p], np.float32),
                                 "ref_logprobs": [np.full(len(r), -float(x % 1000), np.float32)
                                                  for r, x in zip(d["response"], p)]})
        store.update_priorities(b.indices, np.array([priority(int(x)) for x in p]))
    else:
        bad = [int(i) for i, x, r, resp, lp in zip(b.indices, p, d["reward"], d["response"], d["ref_logprobs"])
               if r != reward(int(x)) or list(resp) != list(response(int(x)))
               or list(lp) != [-float(x % 1000)] * len(resp)]
        if bad:
            log(bad=bad)
        time.sleep(rng.random() * 0.05)  # training: killed here, or not
    log(acking=b.indices.tolist())
    try:
        b.ack()
    except ab.LeaseError as exc:  # too slow: expired, the rows come again
        log(ackfail=b.indices.tolist(), why=str(exc)[:60])
        continue
    log(acked=b.indices.tolist(), t=time.time())
"""


class Worker:
    """One worker process: its kind ("writer", "ref", "train"), freeze mode, log file and whether it was killed."""

    def __init__(self, kind: str, freeze: str, out: str, proc: subprocess.Popen) -> None:
        self.kind, self.freeze, self.out, self.proc = kind, freeze, out, proc
        self.killed = False
        self.lines: list[dict] = []

    def text(self) -> str:
        try:
            with open(self.out, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def reap(self, killed: bool = True) -> str | None:
        """SIGKILL it, wait, read its log; the tail of its stderr when it had ended by itself (a worker's bug)."""
        crashed = None
        if self.proc.poll() is not None:
            with open(self.out + ".err", errors="replace") as f:
                crashed = f"{self.kind} {self.freeze}: {f.read()[-3000:]}"
        self.proc.kill()
        self.proc.wait(30)
        self.killed = killed
        for line in self.text().splitlines():
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                continue  # a line cut by the kill
        return crashed


def check_consumer_logs(workers: list[Worker], task: str) -> dict[str, int]:
    """The per-task delivery checks of the module docstring, from the consumers' logs; returns counts."""
    acked_at: dict[int, float] = {}
    acked_ok: list[int] = []
    deliveries: list[tuple[int, float, int]] = []  # (row, call start, worker)
    mine = [(k, w) for k, w in enumerate(workers) if w.kind == task]
    for k, w in mine:
        for x in w.lines:
            if "got" in x:
                deliveries += [(i, x["t0"], k) for i in x["got"]]
            elif "acked" in x:
                acked_ok += x["acked"]
                for i in x["acked"]:
                    acked_at[i] = min(acked_at.get(i, x["t"]), x["t"])
    assert len(acked_ok) == len(set(acked_ok)), f"task {task}: a row acked OK twice"
    after = [(i, t0) for i, t0, _ in deliveries if i in acked_at and t0 > acked_at[i]]
    assert not after, f"task {task}: delivered again after an ack returned OK: {after[:5]}"
    orphans = 0  # the rows a killed consumer held, not yet being acked, went to another consumer later
    for k, w in mine:
        if not w.killed:
            continue
        last = next((x for x in reversed(w.lines) if "got" in x or "acking" in x), None)
        if last is None or "got" not in last:
            continue
        for i in last["got"]:
            orphans += 1
            assert any(j == i and t0 >= last["t0"] and q != k for j, t0, q in deliveries), \
                f"task {task}: row {i} of a killed consumer was never delivered again"
    per_row = collections.Counter(i for i, _, _ in deliveries)
    return {"deliveries": len(deliveries), "redelivered": sum(c - 1 for c in per_row.values()),
            "acked_ok": len(acked_ok), "orphans_redelivered": orphans}


def consume_marks(store: ab.ExperienceStore) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The store's own per-row consumption record, per task, read from its shared memory (the layout of
    docs/shared-memory.md): per ring position, the seq the task consumed there (-1: none) and the lease holding it
    (0: none)."""
    path = store._tier.path  # the store's directory in /dev/shm (a test may look at the documented layout)
    out = {}
    for i, t in enumerate(store.tasks):
        seqs = np.fromfile(os.path.join(path, f"arena.consume.task.{i}"), dtype=np.int64)
        leases = np.fromfile(os.path.join(path, f"arena.consume.task.{i}.lease"), dtype=np.int64)
        out[t] = (seqs, leases)
    return out


def test_shm_soak_with_random_kills(names, tmp_path):
    rng = random.Random(0)
    name = names()  # the fixture removes the segment even on failure, after the finally below killed every worker
    seeds = iter(range(1, 10**6))
    workers: list[Worker] = []
    running: dict[str, list[Worker]] = {"writer": [], "ref": [], "train": []}
    frozen: list[Worker] = []
    kills: collections.Counter[str] = collections.Counter()
    crashed: list[str] = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), ROOT,
                                                       os.environ.get("PYTHONPATH", "")]))

    def start(kind: str, freeze: str = "none") -> Worker:
        seed = next(seeds)
        out = str(tmp_path / f"{kind}-{seed}.log")
        args = [sys.executable, "-c", WRITER if kind == "writer" else CONSUMER, name, str(seed), out]
        with open(out + ".err", "wb") as err:  # a file, not a pipe: a full pipe would block the worker
            proc = subprocess.Popen(args + ([] if kind == "writer" else [kind, freeze]), cwd=ROOT, env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        w = Worker(kind, freeze, out, proc)
        workers.append(w)
        (running[kind] if freeze == "none" else frozen).append(w)
        return w

    def reap(w: Worker, killed: bool = True) -> None:
        why = w.reap(killed)
        if why is not None:
            crashed.append(why)

    t_start = time.monotonic()
    store = ab.ExperienceStore(SCHEMA, capacity=CAPACITY, tier="shm", name=name, tasks=list(TASKS),
                               sampler=ab.samplers.PrioritizedSampler(alpha=1.0, eps=0.0))
    try:
        for kind in ("writer", "writer", "ref", "train", "train"):
            start(kind)
        for k, mode in enumerate(FREEZES):  # one of each at any time, for "ref" and "train" by turns
            start(TASKS[k % 2], mode)
        up = time.monotonic() + 120
        while not all('"up"' in w.text() for w in workers) and time.monotonic() < up:
            time.sleep(0.1)  # importing arrowbuf takes seconds on a loaded machine
        t_up = time.monotonic()
        end = t_up + SOAK_S
        next_kill = time.monotonic() + rng.uniform(0.5, 2.0)

        def short_of_kills() -> bool:  # the kills asserted below (a short SOAK_S goes on until they happened)
            return kills["ref"] + kills["train"] < 2 or any(
                sum(n for k, n in kills.items() if k.endswith(f"frozen in {mode}")) < 1 for mode in FREEZES)

        # past SOAK_S only while short of those, up to 60 s more
        while time.monotonic() < end or (short_of_kills() and time.monotonic() < end + 60):
            time.sleep(0.05)
            for w in list(frozen):  # frozen inside a consume: kill it there
                if '"frozen"' in w.text():
                    time.sleep(rng.uniform(0, 0.2))
                    frozen.remove(w)
                    reap(w)
                    kills[f"{w.kind} frozen in {w.freeze}"] += 1
                    start(TASKS[1 - TASKS.index(w.kind)], w.freeze)  # the other task's turn
            if time.monotonic() >= next_kill:
                next_kill = time.monotonic() + rng.uniform(0.5, 2.0)
                ready = [w for ws in running.values() for w in ws if '"up"' in w.text()]  # not still starting
                if not ready:
                    continue
                victim = rng.choice(ready)
                running[victim.kind].remove(victim)
                reap(victim)
                kills[victim.kind] += 1
                start(victim.kind)
        for w in frozen:  # not frozen yet: stopped, not counted as a kill
            reap(w)
        for w in running["writer"]:  # the writers stop; the consumers drain what is left
            reap(w)
            kills["writer"] += 1
        frozen.clear()
        running["writer"] = []
        t_drain = time.monotonic()
        total = len(store)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            st = store.stats()
            if all(st["consumed"][t] == total for t in TASKS) and st["leases"] == 0:
                break
            time.sleep(0.5)
        t_done = time.monotonic()
        # what the consumers of the drain were doing (exit code or None, the end of their logs): for a failed drain
        drainers = [(w.kind, w.proc.poll(), w.text()[-400:]) for kind in TASKS for w in running[kind]]
        for kind in TASKS:
            for w in running[kind]:
                reap(w, killed=False)
            running[kind] = []
        st = store.stats()
        table = store.to_table(["seq", "prompt_id", "response", "reward", "ref_logprobs"])
        seqs = table["seq"].to_numpy()
        pri = store.sampler.mass(seqs)  # alpha=1, eps=0: the priority itself
        marks = consume_marks(store)
        left = {t: len(store.consume(t, CAPACITY).indices) for t in TASKS}
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
            w.proc.wait(30)
        store.close()

    rows = table.to_pydict()
    ids = np.asarray(rows["seq"], np.int64)
    writers = [w for w in workers if w.kind == "writer"]
    sent = {p for w in writers for x in w.lines if "sent" in x for p in x["sent"]}
    written = {i: p for w in writers for x in w.lines if "written" in x for i, p in zip(x["written"], x["prompts"])}
    last_sent = set()  # the batch each writer had sent when it was killed, if it did not log it written
    for w in writers:
        tail = next((x for x in reversed(w.lines) if "sent" in x or "written" in x), None)
        if tail is not None and "sent" in tail:
            last_sent |= set(tail["sent"])
    counts = {t: check_consumer_logs(workers, t) for t in TASKS}
    unacked = [p for i, p in zip(ids.tolist(), rows["prompt_id"]) if i not in written]
    print(f"\nshm soak {SOAK_S:.0f}s: {len(ids)} rows ({len(written)} acknowledged to writers, {len(unacked)} present "
          f"unacknowledged), kills {dict(kills)}, per task {counts}, store: redelivered {st['redelivered']}, "
          f"leases expired {st['leases_expired']}, ids of writers killed mid-extend (holes) "
          f"{st['next_seq'] - st['first_seq'] - len(ids)}; seconds: start-up {t_up - t_start:.0f}, "
          f"kills {t_drain - t_up:.0f}, drain {t_done - t_drain:.0f}")

    assert not crashed, crashed
    if not (all(st["consumed"][t] == len(ids) for t in TASKS) and st["leases"] == 0):
        stuck = {t: [(int(i), int(marks[t][0][i % len(marks[t][0])]), int(marks[t][1][i % len(marks[t][1])]))
                     for i in ids if marks[t][0][i % len(marks[t][0])] != i][:10] for t in TASKS}
        raise AssertionError(
            f"the consumers did not drain the store: {st['consumed']} of {len(ids)}, in flight {st['in_flight']}, "
            f"leases {st['leases']}; a consume after the drain got {left}; rows not marked consumed (id, mark, "
            f"lease): {stuck}; the drain's consumers (kind, exit code, log tail): {drainers}")
    assert not [x for w in workers for x in w.lines if "bad" in x]  # every row a trainer saw was as written
    assert written and set(written) <= set(ids.tolist())  # every acknowledged row is there ...
    assert ids.max() < CAPACITY  # (nothing evicted)
    by_id = dict(zip(ids.tolist(), range(len(ids))))
    for i, p in written.items():
        assert rows["prompt_id"][by_id[i]] == p  # ... under the id it was acknowledged with
    for k, p in enumerate(rows["prompt_id"]):  # every row was sent, and is exactly as written and updated
        assert p in sent
        assert rows["response"][k] == response(p).tolist()
        assert rows["reward"][k] == reward(p) and rows["ref_logprobs"][k] == [-float(p % 1000)] * (p % 7 + 1)
    assert set(unacked) <= last_sent  # a row nobody acknowledged: committed just before its writer was killed
    np.testing.assert_array_equal(pri, [priority(p) for p in rows["prompt_id"]])
    for t in TASKS:  # each row consumed exactly once per task, as the store counts it and marks it, none in flight
        assert left[t] == 0 and st["in_flight"][t] == 0 and st["consumed"][t] == len(ids)
        seqs_at, lease_at = marks[t]
        np.testing.assert_array_equal(seqs_at[ids % len(seqs_at)], ids, err_msg=f"task {t}: a row not consumed")
        assert not lease_at[ids % len(lease_at)].any(), f"task {t}: a row still held by a lease"
    assert sum(kills.values()) >= 3 and kills["writer"] + kills["ref"] + kills["train"] >= 3
    for mode in FREEZES:  # killed inside a consume: each way, for either task
        assert sum(n for k, n in kills.items() if k.endswith(f"frozen in {mode}")) >= 1, kills
    assert sum(c["orphans_redelivered"] for c in counts.values()) >= 1
    for t in TASKS:  # a consumer killed holding a lease (frozen mid-gather or holding its batch) never acks it
        held = sum(kills[f"{t} frozen in {mode}"] for mode in ("gather", "hold"))
        assert st["leases_expired"][t] >= held, (t, st["leases_expired"], kills)
        assert st["redelivered"][t] >= held and (st["redelivered"][t] >= counts[t]["orphans_redelivered"])
