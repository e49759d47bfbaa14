"""The shared-memory tier with real processes (spawn): attach, concurrent writers, SIGKILL mid-extend, the janitor,
the /dev/shm size check, zero-copy and read-only views.

Every row a writer makes encodes who wrote it: obs = [writer, k, k + 1, 7], reward = writer * 1e6 + k, and the
episode's next observation is the successor's obs, so any row read anywhere can be checked on its own.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import threading
from typing import Any

import numpy as np
import pytest
from conftest import EPISODE, ROWS_SCHEMA, process_context, rows

import arrowbuf as ab
from arrowbuf.tiers import shm

SCHEMA = {**ROWS_SCHEMA, "name": "shmtest"}
CTX = process_context()
#: for the tests that set variables their children read (a forkserver child sees the server's environment)
SPAWN = mp.get_context("spawn")
JOIN_S = 60


def check_rows(obs: np.ndarray, next_obs: np.ndarray | None = None, reward: np.ndarray | None = None) -> None:
    """Every row is whole: its columns agree with each other (no torn or partial row)."""
    assert (obs[:, 3] == 7).all() and (obs[:, 2] == obs[:, 1] + 1).all()
    if reward is not None:
        np.testing.assert_array_equal(reward, (obs[:, 0] * 1e6 + obs[:, 1]).astype(np.float32))
    if next_obs is not None:
        np.testing.assert_array_equal(next_obs[:, :2], np.stack([obs[:, 0], obs[:, 1] + 1], 1))


def start(names, target, *args, ctx: Any = CTX) -> mp.Process:
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    names.procs.append(p)
    return p


def join_ok(p: mp.Process) -> None:
    p.join(JOIN_S)
    assert not p.is_alive(), "child process hung"
    assert p.exitcode == 0, f"child failed with exit code {p.exitcode}"


# ---------------------------------------------------------------------------------------------- child processes
def _attach_and_sample(name: str, fifo_name: str, pri_name: str, q) -> None:
    store = ab.ExperienceStore.attach(name, seed=1)
    b = store.sample(64)
    q.put((b.indices, b["obs"], b["next_obs"], store.to_table(["seq"]).column("seq").to_numpy(), len(store)))
    store.extend(rows(9, 0, 10))
    fifo = ab.ExperienceStore.attach(fifo_name)
    q.put(fifo.sample(30).indices)
    fifo.close()
    pri = ab.ExperienceStore.attach(pri_name)  # rows and priorities set here steer the creator's samples
    pri.extend(rows(9, 0, 100))
    first = pri.sample(10).indices
    assert pri.update_priorities(np.arange(10), np.full(10, 1e6)) == 10
    q.put(first)
    pri.close()
    store.close()


def _writer(name: str, writer: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    store = ab.ExperienceStore.attach(name)
    k = 0
    while k < n:
        if rng.random() < 0.2:  # per-step appends between extends
            store.append({key: col[0] for key, col in rows(writer, k, 1).items()})
            k += 1
        else:
            m = min(n - k, int(rng.integers(1, 300)))
            store.extend(rows(writer, k, m))
            k += m
    store.close()


#: Where a killed writer stops in the reservation protocol (arrowbuf/tiers/reservations.py): "reserve": rows reserved,
#: nothing copied; "copy": a second column being copied; "commit": rows copied, waiting to commit; "in-commit": inside
#: the commit, holding the state lock; "committed": committed, before extend returns.
POINTS = ("reserve", "copy", "commit", "in-commit", "committed")


def _stuck_writer(name: str, where: str, ready) -> None:
    """Extend a batch and freeze at `where` (one of POINTS; the parent then SIGKILLs us)."""
    store = ab.ExperienceStore.attach(name)
    calls = []
    owner, attr = {"reserve": (store._writer, "_copy_rows"), "copy": (store._cols, "write"),
                   "commit": (store._writer, "commit_reserved"), "in-commit": (store._core, "notify"),
                   "committed": (store._writer, "commit_reserved")}[where]
    original = getattr(owner, attr)

    def freeze(*args, **kwargs):
        calls.append(1)
        if where == "committed":
            original(*args, **kwargs)
        if where != "copy" or len(calls) == 2:  # a second column being copied
            ready.set()
            threading.Event().wait()
        return original(*args, **kwargs)

    setattr(owner, attr, freeze)
    store.extend(rows(5, 0, 4 * store.directory.spare_rows))


def _paused_writer(name: str, ready, go) -> None:
    """Reserve and copy a batch, then wait for `go` before committing it."""
    store = ab.ExperienceStore.attach(name)
    original = store._writer.commit_reserved

    def pause(r):
        ready.set()
        go.wait(JOIN_S)
        original(r)

    store._writer.commit_reserved = pause
    store.extend(rows(5, 0, 300))
    store.close()


def _tight_writer(name: str, ready, stop, q) -> None:
    """Extend in a tight loop (taking and releasing the locks back to back) until `stop`."""
    store = ab.ExperienceStore.attach(name)
    k = 0
    while not stop.is_set():
        store.extend(rows(6, k, 50))
        k += 50
        ready.set()
    q.put(k)
    store.close()


def _report_ids(q) -> None:
    q.put((threading.get_native_id(), os.getpid()))


RAGGED = {"name": "tok", "fields": {"tokens": {"dtype": "int32", "ragged": True, "mean_length": 512},
                                    "logprobs": {"dtype": "float32", "ragged": True, "mean_length": 512},
                                    "reward": {"dtype": "float32"}, "done": {"dtype": "bool"}}}


def _tokens(writer: int, k: int) -> int:
    return (writer * 7 + k) % 300 + 1


def ragged_rows(writer: int, k0: int, n: int) -> dict:
    """Rows k0..k0+n-1 of `writer`: row k has `_tokens(writer, k)` tokens [k, k + 1, ...] and matching logprobs, so
    each row can be checked on its own."""
    import pyarrow as pa

    lens = [_tokens(writer, k) for k in range(k0, k0 + n)]
    toks = [np.arange(k, k + m, dtype=np.int32) for k, m in zip(range(k0, k0 + n), lens)]
    return {"tokens": pa.array(toks, type=pa.list_(pa.int32())),
            "logprobs": pa.array([-t.astype(np.float32) / 1000 for t in toks], type=pa.list_(pa.float32())),
            "reward": np.array([writer * 1e6 + k for k in range(k0, k0 + n)], np.float32), "done": np.ones(n, bool)}


def check_ragged(tokens: list, logprobs: list, reward: np.ndarray) -> None:
    """Every row is whole: its token count and values follow from its reward (writer, k)."""
    for t, lp, r in zip(tokens, logprobs, reward):
        writer, k = divmod(int(r), 1_000_000)
        m = _tokens(writer, k)
        np.testing.assert_array_equal(np.asarray(t), np.arange(k, k + m))
        np.testing.assert_allclose(np.asarray(lp), -np.arange(k, k + m, dtype=np.float32) / 1000)


def _ragged_writer(name: str, writer: int, q) -> None:
    store = ab.ExperienceStore.attach(name)
    ids = np.concatenate([store.extend(ragged_rows(writer, k, 10)) for k in range(0, 60, 10)])
    b = store.sample(100)
    q.put((ids, b.indices, b["tokens"].to_pylist(), b["logprobs"].to_pylist(), b["reward"]))
    store.close()


def _write_then_sample(name: str, writer: int, q) -> None:
    store = ab.ExperienceStore.attach(name)
    store.extend(rows(writer, 0, 100))
    b = store.sample(200)
    q.put((b["obs"], b["next_obs"], b["reward"]))
    store.close()


def _create_and_wait(names_: list[str], ready) -> None:
    stores = [ab.ExperienceStore(SCHEMA, 100, tier="shm", name=n) for n in names_]
    stores[0].extend(rows(0, 0, 10))
    ready.set()
    threading.Event().wait()


# ---------------------------------------------------------------------------------------------- tests
def test_attach_keeps_the_schema_field_order(names):
    """An attached store has the creator's schema, field order included (the manifest was written with sorted
    keys, so an attached store listed 'action' before 'obs' and its tables had another column order)."""
    name = names()
    with ab.ExperienceStore(SCHEMA, 100, tier="shm", name=name) as store:
        store.extend(rows(0, 0, 10))
        with ab.ExperienceStore.attach(name) as other:
            assert list(other.schema.fields) == list(store.schema.fields) == list(SCHEMA["fields"])
            assert other.schema.to_arrow().names == store.schema.to_arrow().names
            assert other.to_table().column_names == store.to_table().column_names


def test_attach_from_another_process_samples_the_same_rows(names):
    name, fifo_name, pri_name = names(), names(), names()
    with ab.ExperienceStore(SCHEMA, 1000, tier="shm", name=name) as store, \
            ab.ExperienceStore(SCHEMA, 1000, sampler="fifo", tier="shm", name=fifo_name) as fifo, \
            ab.ExperienceStore(SCHEMA, 1000, sampler=ab.samplers.Prioritized(alpha=1.0), tier="shm",
                               name=pri_name) as pri:
        store.extend(rows(0, 0, 300))
        fifo.extend(rows(0, 0, 100))
        q = CTX.Queue()
        p = start(names, _attach_and_sample, name, fifo_name, pri_name, q)
        idx, obs, next_obs, seqs, size = q.get(timeout=JOIN_S)
        child_fifo = q.get(timeout=JOIN_S)
        child_pri = q.get(timeout=JOIN_S)
        join_ok(p)
        assert size == 300
        np.testing.assert_array_equal(seqs, np.arange(300))
        table = store.to_table(["obs", "seq"])
        mine = table.column("obs").combine_chunks().to_numpy_ndarray()
        np.testing.assert_array_equal(obs, mine[idx])   # the child read exactly the rows this process holds
        check_rows(obs, next_obs)
        # the child's append is visible here, with its own episode ids
        assert len(store) == 310
        t = store.to_table(["obs", "episode_id"])
        new = t.slice(300)
        assert (new.column("obs").combine_chunks().to_numpy_ndarray()[:, 0] == 9).all()
        assert set(new.column("episode_id").to_numpy()).isdisjoint(t.slice(0, 300).column("episode_id").to_numpy())
        # one queue: the child took the first 30 items of the fifo, this process gets the next ones
        np.testing.assert_array_equal(child_fifo, np.arange(30))
        np.testing.assert_array_equal(fifo.sample(30).indices, np.arange(30, 60))
        assert store.stats()["inserts"] == 310
        # prioritized: one sum tree in shared memory, fed by the child's commits and priority updates
        assert len(child_pri) == 10 and len(pri) == 100
        b = pri.sample(1000)
        assert (b.indices < 10).mean() > 0.95 and b.weights is not None
        check_rows(b["obs"], b["next_obs"])


@pytest.mark.slow  # about 3.5 s on 2 cores (four writer processes): CI runs it
def test_four_writer_processes_lose_and_duplicate_nothing(names):
    name = names()
    n = 2000
    with ab.ExperienceStore(SCHEMA, 4 * n, tier="shm", name=name) as store:
        procs = [start(names, _writer, name, w, n, w) for w in range(4)]
        first = store.sample(8, timeout=JOIN_S)  # waits for another process's commit (polls: no notify across)
        check_rows(first["obs"], first["next_obs"])
        while any(p.is_alive() for p in procs):  # sample while they write: no torn row ever
            b = store.sample(256)
            check_rows(b["obs"], b["next_obs"], b["reward"])
        for p in procs:
            join_ok(p)
        assert len(store) == 4 * n and store.stats()["inserts"] == 4 * n
        t = store.to_table(["obs", "reward", "seq", "episode_id", "step"])
        np.testing.assert_array_equal(t.column("seq").to_numpy(), np.arange(4 * n))
        obs = t.column("obs").combine_chunks().to_numpy_ndarray()
        check_rows(obs, reward=t.column("reward").to_numpy())
        for w in range(4):
            mine = obs[obs[:, 0] == w, 1]
            np.testing.assert_array_equal(mine, np.arange(n))  # each writer's rows, once each, in its order
        ep = t.column("episode_id").to_numpy()
        writer_of = {}
        for e, w, k, s in zip(ep, obs[:, 0], obs[:, 1], t.column("step").to_numpy()):
            assert writer_of.setdefault(e, w) == w, "an episode id was handed to two writers"
            assert s == k % EPISODE
        assert len(writer_of) == 4 * (n // EPISODE)
        b = store.sample(1024)
        check_rows(b["obs"], b["next_obs"], b["reward"])


@pytest.mark.parametrize("where,locks", [(p, "pthread") for p in POINTS] + [("copy", "flock"), ("in-commit", "flock")])
def test_writer_killed_anywhere_in_the_protocol_blocks_nobody(names, where, locks, monkeypatch):
    """A writer process SIGKILLed at any point between reserve and the end of its commit: a writer that reserved
    after it commits once it is gone, its rows are all there or none (never a torn one), and the ring moves on."""
    if locks == "flock":  # the fallback where libc has no robust mutexes
        monkeypatch.setenv("ARROWBUF_SHM_LOCKS", "flock")
    name = names()
    with ab.ExperienceStore(SCHEMA, 2000, tier="shm", name=name) as store:
        store.extend(rows(0, 0, 500))
        assert store._tier.manifest["locks"]["kind"] == locks
        batch = 4 * store.directory.spare_rows
        ctx = SPAWN if locks == "flock" else CTX
        ready = ctx.Event()
        p = start(names, _stuck_writer, name, where, ready, ctx=ctx)
        assert ready.wait(JOIN_S), f"the writer never reached {where!r}"
        done = threading.Event()
        ids: list[np.ndarray] = []

        def after() -> None:  # reserves after the stuck writer: commits only once that one committed or is gone
            ids.append(store.extend(rows(1, 0, 100)))
            done.set()

        th = threading.Thread(target=after, daemon=True)
        th.start()
        os.kill(p.pid, signal.SIGKILL)
        p.join(JOIN_S)
        th.join(JOIN_S)
        assert done.is_set(), "a writer stayed blocked after the writer before it died"
        kept = where in ("in-commit", "committed")  # it died after its commit point: its rows stay
        committed = 500 + (batch if kept else 0)
        assert len(store) == committed + 100
        np.testing.assert_array_equal(ids[0], np.arange(500 + batch, 600 + batch))  # after the victim's seqs
        t = store.to_table(["obs", "reward", "seq"])
        seq = t.column("seq").to_numpy()
        want = np.concatenate([np.arange(500), np.arange(500, 500 + batch) if kept else [], ids[0]])
        np.testing.assert_array_equal(seq, want)  # 0 acknowledged rows lost, the victim's all or none
        obs = t.column("obs").combine_chunks().to_numpy_ndarray()
        check_rows(obs, reward=t.column("reward").to_numpy())
        assert (obs[:, 0] == 5).sum() == (batch if kept else 0)
        b = store.sample(500)
        check_rows(b["obs"], b["next_obs"], b["reward"])
        assert kept or not (b["obs"][:, 0] == 5).any()
        if where == "copy" and locks == "pthread":  # another process writes and samples
            q = CTX.Queue()
            other = start(names, _write_then_sample, name, 3, q)
            obs3, next_obs, reward = q.get(timeout=JOIN_S)
            join_ok(other)
            check_rows(obs3, next_obs, reward)
        # the ring keeps moving: wrap it twice; the skipped seqs leave with the rows around them
        store.extend(rows(2, 0, 4000))
        assert len(store) == 2000
        seq = store.to_table(["seq"]).column("seq").to_numpy()
        np.testing.assert_array_equal(seq, np.arange(seq[-1] - 1999, seq[-1] + 1))
        b = store.sample(500)
        check_rows(b["obs"], b["next_obs"], b["reward"])


def test_rows_commit_in_seq_order_across_processes(names):
    """A writer that reserved later copies meanwhile, but its rows become visible only after the earlier batch
    committed: the commit watermark."""
    name = names()
    with ab.ExperienceStore(SCHEMA, 2000, tier="shm", name=name) as store:
        store.extend(rows(0, 0, 500))
        ready, go = CTX.Event(), CTX.Event()
        p = start(names, _paused_writer, name, ready, go)
        assert ready.wait(JOIN_S)
        waiting = threading.Event()
        original = store._writer._wait_hi

        def wait_hi(target: int) -> None:
            waiting.set()
            original(target)

        store._writer._wait_hi = wait_hi
        ids: list[np.ndarray] = []
        th = threading.Thread(target=lambda: ids.append(store.extend(rows(1, 0, 100))), daemon=True)
        th.start()
        assert waiting.wait(JOIN_S)  # reserved after the paused writer, copied, waiting for its turn
        assert len(store) == 500
        b = store.sample(2000)
        assert (b["obs"][:, 0] == 0).all()  # neither batch is visible yet
        assert store.to_table(["seq"]).num_rows == 500
        go.set()
        th.join(JOIN_S)
        join_ok(p)
        assert len(store) == 900
        np.testing.assert_array_equal(ids[0], np.arange(800, 900))
        t = store.to_table(["obs", "seq"])
        np.testing.assert_array_equal(t.column("seq").to_numpy(), np.arange(900))
        np.testing.assert_array_equal(t.column("obs").combine_chunks().to_numpy_ndarray()[:, 0],
                                      np.repeat([0, 5, 1], [500, 300, 100]))


def test_a_tight_writer_process_does_not_starve_another_writer(names):
    """A writer process re-taking the store's locks back to back; a writer here still gets its turns (the locks hand
    off to a waiter that waited, `RobustMutex`), and every row of both is whole."""
    name = names()
    with ab.ExperienceStore(SCHEMA, 5000, tier="shm", name=name) as store:
        ready, stop, q = CTX.Event(), CTX.Event(), CTX.Queue()
        p = start(names, _tight_writer, name, ready, stop, q)
        assert ready.wait(JOIN_S)
        done = threading.Event()

        def mine() -> None:
            for k in range(0, 2000, 20):
                store.extend(rows(1, k, 20))
            done.set()

        th = threading.Thread(target=mine, daemon=True)
        th.start()
        th.join(JOIN_S)
        stop.set()
        assert done.is_set(), "the writer here starved beside the tight writer"
        assert q.get(timeout=JOIN_S) > 0
        join_ok(p)
        for lk in (store._core.write_lock, store._core.lock):
            assert not lk._hand.any()  # no hand-off request left behind
        t = store.to_table(["obs", "reward"])
        obs = t.column("obs").combine_chunks().to_numpy_ndarray()
        check_rows(obs, reward=t.column("reward").to_numpy())
        mine_k = obs[obs[:, 0] == 1, 1]
        np.testing.assert_array_equal(mine_k, np.arange(2000)[2000 - len(mine_k):])  # the newest of them (maybe none)


def test_lock_hand_off_word_holds_others_back_until_its_thread_is_gone(names):
    """While a waiter's hand-off request stands, other lockers wait even on a free mutex; a request left by a thread
    or process that no longer exists is cleared by the next locker."""
    name = names()
    with ab.ExperienceStore(SCHEMA, 100, tier="shm", name=name) as store:
        lk = store._core.write_lock
        started, leave = threading.Event(), threading.Event()
        tid: list[int] = []

        def waiter() -> None:  # stands for a starved waiter of another process
            tid.append(threading.get_native_id())
            started.set()
            leave.wait(JOIN_S)

        th = threading.Thread(target=waiter, daemon=True)
        th.start()
        assert started.wait(JOIN_S)
        lk._hand[:] = [tid[0], os.getpid()]
        assert not lk.acquire(blocking=False)
        assert not lk.acquire(timeout=0.2)  # the mutex is free, but the hand-off request stands
        leave.set()
        th.join(JOIN_S)
        assert lk.acquire(timeout=JOIN_S)  # its thread is gone: cleared
        lk.release()
        assert not lk._hand.any()
        q = CTX.Queue()
        p = start(names, _report_ids, q)
        ids = q.get(timeout=JOIN_S)
        join_ok(p)
        lk._hand[:] = ids  # a request of a process that exited
        store.extend(rows(0, 0, 10))
        assert len(store) == 10 and not lk._hand.any()


def test_ragged_fields_in_shared_memory_round_trip_across_processes(names):
    """Ragged fields live in the store's shared memory: what one process extends, another samples and reads back
    equal, in parallel-writer stores too (ragged batches are written under the write lock), while the ring turns."""
    name = names()
    with ab.ExperienceStore(RAGGED, 200, tier="shm", name=name) as store:
        ids = store.extend(ragged_rows(0, 0, 50))
        q = CTX.Queue()
        p = start(names, _ragged_writer, name, 1, q)
        child_ids, idx, toks, lps, rew = q.get(timeout=JOIN_S)
        join_ok(p)
        check_ragged(toks, lps, rew)
        assert len(store) == 110
        t = store.to_table(["tokens", "logprobs", "reward", "seq"])
        np.testing.assert_array_equal(t.column("seq").to_numpy(), np.concatenate([ids, child_ids]))
        check_ragged(t.column("tokens").to_pylist(), t.column("logprobs").to_pylist(), t.column("reward").to_numpy())
        assert set(t.column("reward").to_numpy() // 1e6) == {0, 1}
        b = store.sample(64)
        key = next(k for k in store._tier.manifest["arenas"] if k.endswith("tokens.values"))
        start_, size = store._tier.address_range(key)
        addr = b["tokens"].values.buffers()[1].address
        assert not start_ <= addr < start_ + size  # a copy, never a view of the shared values
        check_ragged(b["tokens"].to_pylist(), b["logprobs"].to_pylist(), b["reward"])
        for k in range(0, 1000, 50):  # the ring turns five times; every row read back is whole
            store.extend(ragged_rows(1, 1000 + k, 50))
            t = store.to_table(["tokens", "logprobs", "reward"])
            check_ragged(t.column("tokens").to_pylist(), t.column("logprobs").to_pylist(),
                         t.column("reward").to_numpy())
        assert len(store) == 200
        np.testing.assert_array_equal(t.column("reward").to_numpy(), 1e6 + np.arange(1800, 2000))
        b = store.sample(256)
        check_ragged(b["tokens"].to_pylist(), b["logprobs"].to_pylist(), b["reward"])


def test_checkpoint_keeps_holes_out_and_restores_with_no_open_reservation(names, tmp_path):
    """A checkpoint of a store with a dead writer's hole and another writer's open reservation restores the committed
    rows only, and the restored store takes writes at once (no reservation left to wait for)."""
    name = names()
    with ab.ExperienceStore(SCHEMA, 4000, tier="shm", name=name) as store:
        store.extend(rows(0, 0, 500))
        batch = 4 * store.directory.spare_rows
        ready = CTX.Event()
        p = start(names, _stuck_writer, name, "copy", ready)
        assert ready.wait(JOIN_S)
        th = threading.Thread(target=lambda: store.extend(rows(1, 0, 100)), daemon=True)
        th.start()
        os.kill(p.pid, signal.SIGKILL)
        p.join(JOIN_S)
        th.join(JOIN_S)
        assert not th.is_alive() and len(store) == 600  # a hole of `batch` seqs, then writer 1's rows
        ready2, go = CTX.Event(), CTX.Event()
        paused = start(names, _paused_writer, name, ready2, go)
        assert ready2.wait(JOIN_S)  # its reservation is open while the checkpoint is taken
        store.checkpoint(str(tmp_path / "ck"))
        go.set()
        join_ok(paused)
        restored = ab.ExperienceStore.restore(str(tmp_path / "ck"))
        try:
            assert len(restored) == 600
            t = restored.to_table(["obs", "reward", "seq"])
            np.testing.assert_array_equal(t.column("seq").to_numpy(),
                                          np.concatenate([np.arange(500), np.arange(500 + batch, 600 + batch)]))
            check_rows(t.column("obs").combine_chunks().to_numpy_ndarray(), reward=t.column("reward").to_numpy())
            ids: list[np.ndarray] = []
            w = threading.Thread(target=lambda: ids.append(restored.extend(rows(2, 0, 100))), daemon=True)
            w.start()
            w.join(JOIN_S)
            assert ids, "a write into the restored store waited for a reservation that is not there"
            np.testing.assert_array_equal(ids[0], np.arange(600 + batch, 700 + batch))
            b = restored.sample(300)
            check_rows(b["obs"], b["next_obs"], b["reward"])
            assert not (b["obs"][:, 0] == 5).any()
        finally:
            restored.close()


def test_threads_reserve_copy_and_commit_in_order_and_a_failed_copy_is_skipped():
    """The same protocol between threads of one host store: a later batch waits for the earlier one's commit, and a
    batch whose copy raised gives its seqs up (a hole), so the writers after it go on."""
    with ab.ExperienceStore(SCHEMA, 1000) as store:
        store.extend(rows(0, 0, 100))
        go, waiting, held = threading.Event(), threading.Event(), threading.Event()
        commit, wait_hi = store._writer.commit_reserved, store._writer._wait_hi

        def paused(r):
            if threading.current_thread().name == "first":
                held.set()
                go.wait(JOIN_S)
            commit(r)

        def noted(target: int) -> None:
            waiting.set()
            wait_hi(target)

        store._writer.commit_reserved, store._writer._wait_hi = paused, noted
        first = threading.Thread(target=lambda: store.extend(rows(1, 0, 50)), name="first", daemon=True)
        first.start()
        assert held.wait(JOIN_S)  # the first reserved and copied its rows and holds its commit (before the second
        # starts: a second thread scheduled first would reserve the earlier seqs and never wait)
        ids: list[np.ndarray] = []
        second = threading.Thread(target=lambda: ids.append(store.extend(rows(2, 0, 50))), daemon=True)
        second.start()
        assert waiting.wait(JOIN_S) and len(store) == 100  # the second copied its rows, and waits for the first
        go.set()
        first.join(JOIN_S)
        second.join(JOIN_S)
        np.testing.assert_array_equal(ids[0], np.arange(150, 200))
        write = store._cols.write

        def broken(*args, **kwargs):
            raise MemoryError("copy failed")

        store._cols.write = broken
        with pytest.raises(MemoryError):
            store.extend(rows(3, 0, 50))
        store._cols.write = write
        np.testing.assert_array_equal(store.extend(rows(4, 0, 50)), np.arange(250, 300))  # after the hole
        assert len(store) == 250
        t = store.to_table(["obs", "seq"])
        np.testing.assert_array_equal(t.column("seq").to_numpy(), np.concatenate([np.arange(200), np.arange(250, 300)]))
        assert not (t.column("obs").combine_chunks().to_numpy_ndarray()[:, 0] == 3).any()


def test_janitor_reclaims_stores_of_dead_owners(names, capsys, tmp_path, monkeypatch):
    # a shared-memory root of its own: any other process's janitor (another pytest-xdist worker's store opening)
    # reclaims dead owners' stores in the default root before this test can list them
    root = tmp_path / "shm"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("ARROWBUF_SHM_DIR", str(root))
    a, b, c = names(), names(), names()
    ready = SPAWN.Event()
    p = start(names, _create_and_wait, [a, b, c], ready, ctx=SPAWN)
    assert ready.wait(JOIN_S)
    with pytest.raises(ab.StoreExists, match="attach"):
        ab.ExperienceStore(SCHEMA, 100, tier="shm", name=a)
    live = {s["name"]: s for s in shm.list_stores()}
    assert live[a]["alive"] and live[a]["owner_pid"] == p.pid and p.pid in live[a]["attached_pids"]
    os.kill(p.pid, signal.SIGKILL)
    p.join(JOIN_S)
    for n in (a, b, c):
        assert os.path.isdir(shm.store_path(n))
    with pytest.raises(ab.StoreNotFound):  # attach runs the janitor: every dead store goes
        ab.ExperienceStore.attach(a)
    for n in (a, b, c):
        assert not os.path.exists(shm.store_path(n))
    # and from the command line, for a store of a dead owner made again
    ready2 = SPAWN.Event()
    p2 = start(names, _create_and_wait, [b], ready2, ctx=SPAWN)
    assert ready2.wait(JOIN_S)
    os.kill(p2.pid, signal.SIGKILL)
    p2.join(JOIN_S)
    from arrowbuf.cli import main

    assert main(["shm", "ls"]) == 0
    assert b in capsys.readouterr().out
    assert main(["shm", "gc"]) == 0
    assert b in capsys.readouterr().out
    assert not os.path.exists(shm.store_path(b))
    # a name freed by the janitor can be created again
    ab.ExperienceStore(SCHEMA, 100, tier="shm", name=a).close()


def test_store_larger_than_dev_shm_fails_at_creation(names):
    name = names()
    vfs = os.statvfs(shm.shm_root())
    free = vfs.f_bavail * vfs.f_frsize
    row = 1 << 20
    schema = {"name": "big", "fields": {"obs": {"dtype": "uint8", "shape": [row]}, "terminated": {"dtype": "bool"}}}
    with pytest.raises(ab.OutOfSpace) as err:
        ab.ExperienceStore(schema, free // row + 64, tier="shm", name=name)
    msg = str(err.value)
    assert "free" in msg and "needs" in msg and "GiB" in msg and "--shm-size" in msg
    assert not os.path.exists(shm.store_path(name))
    assert isinstance(err.value, MemoryError)


def test_views_are_zero_copy_and_read_only(names):
    name = names()
    with ab.ExperienceStore(SCHEMA, 1000, tier="shm", name=name) as store:
        store.extend(rows(0, 0, 200))
        start_, size = store._tier.address_range("obs")
        arena = store._arenas["obs"]
        assert start_ <= arena.ctypes.data < start_ + size  # what a sample gathers from is the mapping itself
        t = store.to_table(["obs", "reward"])
        for chunk in t.column("obs").chunks:  # to_table is a snapshot: a copy, never a view of the segment
            addr = chunk.storage.values.buffers()[1].address
            assert not start_ <= addr < start_ + size
        view = t.column("obs").chunk(0).to_numpy_ndarray()
        assert not view.flags.writeable
        with pytest.raises(ValueError):
            view[0, 0] = 1.0
        assert not t.column("reward").chunk(0).to_numpy().flags.writeable


def test_torch_tensors_never_alias_shared_memory(names):
    pytest.importorskip("torch")
    name = names()
    with ab.ExperienceStore(SCHEMA, 1000, tier="shm", name=name) as store:
        store.extend(rows(0, 0, 200))
        start_, size = store._tier.address_range("obs")
        before = store.to_table(["obs"]).column("obs").combine_chunks().to_numpy_ndarray().copy()
        tensors = store.sample(64).to_torch()
        tensors["obs"].add_(1.0)  # a private copy: no segfault, the store is unchanged
        # a batch built over zero-copy (read-only) views: to_torch copies instead of aliasing the mapping
        view = store.to_table(["obs"]).column("obs").chunk(0).to_numpy_ndarray()
        t = ab.SampleBatch({"obs": view}, np.arange(len(view))).to_torch()["obs"]
        assert not (start_ <= t.data_ptr() < start_ + size)
        t.add_(1.0)
        after = store.to_table(["obs"]).column("obs").combine_chunks().to_numpy_ndarray()
        np.testing.assert_array_equal(before, after)


def test_lifetime_pickling_and_errors(names):
    name = names()
    store = ab.ExperienceStore(SCHEMA, 100, tier="shm", name=name)
    store.extend(rows(0, 0, 20))
    other = pickle.loads(pickle.dumps(store))  # a shared store pickles by name
    assert len(other) == 20 and other._tier.info()["attached_pids"] == [os.getpid(), os.getpid()]
    with pytest.raises(TypeError, match="tier='shm'"):
        pickle.dumps(ab.ExperienceStore(SCHEMA, 100))
    with pytest.raises(ab.StoreNotFound, match="timeout"):
        ab.ExperienceStore.attach(names())
    with ab.ExperienceStore({"name": "r", "fields": {"tok": {"dtype": "int32", "ragged": True}}}, 10, tier="shm",
                            name=names()) as ragged:  # ragged fields live in shared memory too (issue 16)
        ragged.extend({"tok": [[1, 2], [3]]})
        assert ragged.to_table(["tok"]).column(0).to_pylist() == [[1, 2], [3]]
    store.close()  # the owner's close removes the name; the attached handle keeps working on its mapping
    assert not os.path.exists(shm.store_path(name))
    other.extend(rows(1, 0, 5))
    assert len(other) == 25
    other.close()
    other.close()
    with pytest.raises(ab.StoreClosed):
        other.sample(1)
