"""Leases (issue 25): consume(task, n, lease=s), ack/nack, expiry back into the task's queue in order; locally, over
Flight (consumer processes killed mid-batch) and on a ShardedStore. Real stores, servers, processes; no mocks."""

from __future__ import annotations

import contextlib
import json
import pickle
import random
import sys
import threading
import time

import numpy as np
import pytest
from conftest import LLM

import arrowbuf as ab

G = 4


def rows(n, start=0, pv=0):
    i = np.arange(start, start + n)
    return {"prompt_id": i // G, "response_tokens": [[int(k)] * (int(k) % 3 + 1) for k in i],
            "reward": i.astype(np.float32), "done": np.ones(n, bool), "policy_version": np.full(n, pv)}


def store(capacity=64, **kw):
    return ab.ExperienceStore(LLM, capacity=capacity, **kw)


# ---------------------------------------------------------------------------------------------------- local
def test_an_expired_lease_puts_its_rows_back_in_order_before_rows_not_yet_delivered():
    with store(tasks=["t"]) as s:
        s.extend(rows(10))
        a = s.consume("t", 3, lease=0.2)
        b = s.consume("t", 3, lease=60)
        assert a.indices.tolist() == [0, 1, 2] and b.indices.tolist() == [3, 4, 5] and a.lease != b.lease
        assert s.stats()["in_flight"] == {"t": 6}
        time.sleep(0.3)
        c = s.consume("t", 5)
        assert c.indices.tolist() == [0, 1, 2, 6, 7]  # the expired rows first, in their order, then new ones
        st = s.stats()
        assert st["in_flight"] == {"t": 3} and st["redelivered"] == {"t": 3} and st["leases_expired"] == {"t": 1}
        assert st["consumed"] == {"t": 5}  # b is still in flight: not counted until acked
        assert b.ack() == 3 and s.stats()["consumed"] == {"t": 8}


def test_nack_returns_the_rows_at_once_and_ack_is_final():
    with store(tasks=["t"]) as s:
        s.extend(rows(6))
        b = s.consume("t", 4, lease=60)
        assert len(s.consume("t", 10)) == 2  # rows in flight go to no other consumer
        assert s.nack(b.lease) == 4
        again = s.consume("t", 10, lease=0.1)
        assert again.indices.tolist() == [0, 1, 2, 3]
        assert again.ack() == 4
        time.sleep(0.2)  # past the lease: acked rows never come back
        assert len(s.consume("t", 10)) == 0
        st = s.stats()
        assert st["consumed"] == {"t": 6} and st["redelivered"] == {"t": 4} and st["in_flight"] == {"t": 0}


def test_double_ack_expired_and_unknown_leases_are_clear_errors():
    with store(tasks=["t"]) as s:
        s.extend(rows(6))
        b = s.consume("t", 2, lease=60)
        s.ack(b.lease)
        with pytest.raises(ab.LeaseError, match="already acked"):
            s.ack(b.lease)
        with pytest.raises(ab.LeaseError, match="already acked"):
            s.nack(b.lease)
        c = s.consume("t", 2, lease=60)
        c.nack()
        with pytest.raises(ab.LeaseError, match="already nacked"):
            c.ack()
        d = s.consume("t", 2, lease=0.05)
        time.sleep(0.1)
        with pytest.raises(ab.LeaseError, match="expired"):
            d.ack()
        with pytest.raises(ab.LeaseError, match="unknown lease"):
            s.ack("ffffffffffff.1")
        for bad in (None, 7, "", "x" * 200, "a b"):
            with pytest.raises(ab.LeaseError, match="not a lease id"):
                s.ack(bad)
        assert isinstance(ab.LeaseError("x"), ab.InvalidArgument)
        with store(tasks=["t"]) as other:  # another store's lease id is unknown there, never taken for its own
            other.extend(rows(2))
            with pytest.raises(ab.LeaseError, match="unknown lease"):
                other.ack(s.consume("t", 1, lease=60).lease)
        for bad in (0, -1, float("inf"), float("nan"), True, "5", 86401):
            with pytest.raises(ab.InvalidArgument, match="lease"):
                s.consume("t", 1, lease=bad)
        assert s.stats()["in_flight"] == {"t": 1}  # a refused request leased nothing


def test_a_batch_without_rows_or_lease_has_nothing_to_ack_and_a_copy_acks_through_the_store():
    with store(tasks=["t"]) as s:
        empty = s.consume("t", 4, lease=60)
        assert len(empty) == 0 and empty.lease is None and empty.ack() == 0
        s.extend(rows(4))
        plain = s.consume("t", 2)
        assert plain.lease is None and plain.ack() == 0 and plain.nack() == 0
        b = s.consume("t", 2, lease=60)
        copy = pickle.loads(pickle.dumps(b))  # e.g. sent to another process: it keeps the id, not the store
        assert copy.lease == b.lease and copy.indices.tolist() == [2, 3]
        with pytest.raises(ab.LeaseError, match="store.ack"):
            copy.ack()
        assert s.ack(copy.lease) == 2


def test_a_consumer_waiting_for_rows_gets_an_expired_leases_rows_when_it_expires():
    """Nothing notifies at an expiry: the waiting consumer's wait is cut at the lease's deadline."""
    with store(tasks=["t"]) as s:
        s.extend(rows(3))
        s.consume("t", 3, lease=0.3)
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("b", s.consume("t", 3, timeout=30)))
        start = time.monotonic()
        t.start()
        t.join(60)
        assert got["b"].indices.tolist() == [0, 1, 2]
        assert time.monotonic() - start < 29  # woken by the expiry, not by its own deadline


def test_leased_rows_hold_eviction_until_acked_and_a_held_writer_goes_on_after_the_ack():
    with store(capacity=4, tasks=["t"]) as s:
        s.extend(rows(4))
        b = s.consume("t", 4, lease=60)
        with pytest.raises(ab.InsertTimeout):
            s.extend(rows(2, 4), timeout=0.05)  # the leased rows may come back: they are not evicted
        done = {}
        w = threading.Thread(target=lambda: done.setdefault("ids", s.extend(rows(2, 4), timeout=30)))
        w.start()
        time.sleep(0.1)
        b.ack()
        w.join(60)
        assert done["ids"].tolist() == [4, 5]


def test_a_writer_held_by_a_lease_is_released_when_the_rows_are_consumed_after_expiry():
    with store(capacity=4, tasks=["t"]) as s:
        s.extend(rows(4))
        s.consume("t", 4, lease=0.2)  # the consumer dies
        done = {}
        w = threading.Thread(target=lambda: done.setdefault("ids", s.extend(rows(2, 4), timeout=30)))
        w.start()
        again = s.consume("t", 4, timeout=10)  # after the expiry, another consumer takes them
        assert again.indices.tolist() == [0, 1, 2, 3]
        w.join(60)
        assert done["ids"].tolist() == [4, 5]


def test_a_writer_never_evicts_the_rows_of_a_lease_that_expires_as_it_checks():
    """The writer's eviction check read the rows' consumed marks, then expired the leases past their deadline (their
    rows went back, unconsumed), then left out only the rows of leases still open: the rows of a lease that expired
    right then counted as consumed and were evicted unconsumed (the crash harness's "evicted before every task
    consumed it"; a lease abandoned by a consumer that died)."""
    with store(capacity=4, tasks=["t"]) as s:
        s.extend(rows(4))
        assert s.consume("t", 4, lease=0.05).indices.tolist() == [0, 1, 2, 3]  # the consumer dies
        time.sleep(0.2)  # past its deadline; nothing has expired it yet
        # the writer's last check, under its write lock (`StoreWriter.hold.ready`), is the one that expires it: a
        # writer whose earlier check (`hold.wait`) ran just before the deadline goes straight to it
        cols, n = s.schema.validate_batch(rows(2, 4))
        assert not s._consume.ready(cols, n), "the rows of the lease that just expired would be evicted"
        with pytest.raises(ab.InsertTimeout):
            s.extend(rows(2, 4), timeout=0.05)  # rows 0 and 1 are back, unconsumed: they stay
        assert s.consume("t", 4, timeout=0).indices.tolist() == [0, 1, 2, 3]


def test_in_flight_counts_are_per_task():
    with store(tasks=["ref", "train"]) as s:
        s.extend(rows(8))
        s.consume("ref", 3, lease=60)
        t = s.consume("train", 5, lease=60)
        s.consume("train", 2)
        st = s.stats()
        assert st["in_flight"] == {"ref": 3, "train": 5} and st["leases"] == 2
        assert st["consumed"] == {"ref": 0, "train": 2}
        t.ack()
        assert s.stats()["in_flight"] == {"ref": 3, "train": 0}


def test_a_group_leased_together_comes_back_together():
    with ab.ExperienceStore(LLM, capacity=64, tasks=["t"],
                            sampler=ab.samplers.Group(key="prompt_id", size=G)) as s:
        s.extend(rows(4 * G))
        a = s.consume("t", 2 * G, lease=0.2)
        b = s.consume("t", G, lease=60)
        assert a.indices.tolist() == list(range(2 * G)) and b.indices.tolist() == list(range(2 * G, 3 * G))
        time.sleep(0.3)
        c = s.consume("t", 4 * G)
        assert c.indices.tolist() == list(range(2 * G)) + list(range(3 * G, 4 * G))  # whole groups, in order
        b.nack()
        d = s.consume("t", 4 * G)
        assert d.indices.tolist() == list(range(2 * G, 3 * G))
        pid = d.to_numpy()["prompt_id"]
        assert (pid == pid[0]).all()


def test_final_hooks_see_each_final_consumption_once_never_a_lease_in_flight():
    with store(tasks=["t"]) as s:
        seen: list[tuple[str, list[int], str]] = []
        s._consume.final_hooks.append(lambda task, seqs, how: seen.append((task, seqs.tolist(), how)))
        s.extend(rows(8))
        s.consume("t", 2)
        b = s.consume("t", 2, lease=60)
        c = s.consume("t", 2, lease=60)
        assert seen == [("t", [0, 1], "consumed")]
        c.nack()
        b.ack()
        s.policy_version = 5
        s.consume("t", 10, max_staleness=0)  # every row left is stale: dropped
        assert seen == [("t", [0, 1], "consumed"), ("t", [2, 3], "acked"), ("t", [4, 5, 6, 7], "dropped")]


def test_exactly_once_per_task_with_acks_under_concurrent_consumer_threads():
    """Consumers that ack, nack or 'die' (drop a batch without acking) at random: every row is acked exactly once
    per task, and the dropped batches' rows were delivered again."""
    total = 1500
    with store(capacity=4096, tasks=["ref", "train"]) as s:
        acked: dict[str, list[int]] = {"ref": [], "train": []}
        dropped = {"ref": 0, "train": 0}
        lock = threading.Lock()
        written = threading.Event()
        errors: list[BaseException] = []

        def consumer(task: str, seed: int) -> None:
            rng = random.Random(seed)
            try:
                while True:
                    done = written.is_set()
                    b = s.consume(task, rng.randint(1, 40), lease=0.5, timeout=0.05)
                    if not len(b):
                        st = s.stats()
                        if done and st["consumed"][task] == total:
                            return
                        continue
                    r = rng.random()
                    if r < 0.1:
                        with lock:
                            dropped[task] += len(b)  # the consumer "died": the lease expires
                    elif r < 0.2:
                        with contextlib.suppress(ab.LeaseError):  # expired meanwhile (a loaded machine): back anyway
                            b.nack()
                    else:
                        ids = b.indices.tolist()
                        try:
                            b.ack()
                        except ab.LeaseError:  # too slow: the rows went back and are delivered again
                            continue
                        with lock:
                            acked[task] += ids
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=consumer, args=(t, k)) for k, t in enumerate(["ref", "train"] * 3)]
        for t in threads:
            t.start()
        for k in range(0, total, 50):
            s.extend(rows(50, k))
        written.set()
        for t in threads:
            t.join(120)
        assert not errors and not any(t.is_alive() for t in threads)
        st = s.stats()
        for task in ("ref", "train"):
            assert sorted(acked[task]) == list(range(total)), task  # each row acked once
            assert st["redelivered"][task] >= dropped[task] > 0
            assert st["in_flight"][task] == 0


def test_a_checkpoint_records_leased_rows_as_not_consumed(tmp_path):
    with store(tasks=["t"]) as s:
        s.extend(rows(6))
        s.consume("t", 2, lease=60).ack()
        s.consume("t", 2, lease=60)  # in flight at the checkpoint: delivered again after a restore
        s.checkpoint(tmp_path / "c")
    with ab.ExperienceStore.restore(tmp_path / "c") as r:
        assert r.consume("t", 10).indices.tolist() == [2, 3, 4, 5]
        assert r.stats()["consumed"]["t"] == 6


# ---------------------------------------------------------------------------------------------------- over Flight
@pytest.fixture
def served():
    s = store(capacity=4096, tasks=["ref", "train"])
    server = ab.serve(s)
    try:
        yield s, server.location
    finally:
        server.close()
        s.close()


def test_leases_over_flight_and_a_lease_outlives_its_clients_connection(served):
    s, location = served
    s.extend(rows(8))
    with ab.connect(location) as remote:
        b = remote.consume("train", 3, lease=60)
        assert b.indices.tolist() == [0, 1, 2] and b.lease is not None
        assert remote.stats()["in_flight"]["train"] == 3
        c = remote.consume("train", 2, lease=60)
        assert c.nack() == 2
        with pytest.raises(ab.LeaseError, match="already nacked"):
            remote.ack(c.lease)
        with pytest.raises(ab.LeaseError, match="unknown lease"):
            remote.ack("nope.1")
        with pytest.raises(ab.LeaseError, match="not a lease id"):
            remote.ack("a b")
        with pytest.raises(ab.InvalidArgument, match="lease"):
            remote.consume("train", 1, lease=-1)
        lease = b.lease
    # the client is gone; the lease lives on the server: another client may ack it, no one else gets the rows
    with ab.connect(location) as other:
        assert other.consume("train", 10).indices.tolist() == [3, 4, 5, 6, 7]
        assert other.ack(lease) == 3
    assert s.stats()["consumed"]["train"] == 8 and s.stats()["in_flight"]["train"] == 0


HOLDER = r"""
import json, sys, time
import arrowbuf as ab
with ab.connect(sys.argv[1]) as remote:
    b = remote.consume("train", int(sys.argv[2]), lease=float(sys.argv[3]), timeout=10)
    print(json.dumps(b.indices.tolist()), flush=True)
    time.sleep(60)  # "processing": killed here, never acks
"""


def test_a_consumer_process_killed_mid_batch_has_its_rows_redelivered_after_expiry(served, procs):
    s, location = served
    s.extend(rows(10))
    child = procs([sys.executable, "-c", HOLDER, location, "6", "2.0"])
    taken = json.loads(child.stdout.readline())
    assert taken == [0, 1, 2, 3, 4, 5]
    child.kill()
    child.wait(10)
    with ab.connect(location) as remote:
        first = remote.consume("train", 10, lease=30)
        assert first.indices.tolist() == [6, 7, 8, 9]  # the dead consumer's rows are in flight still
        first.ack()
        again = remote.consume("train", 6, lease=30, timeout=20)  # they come back at the expiry
        assert again.indices.tolist() == taken
        again.ack()
    st = s.stats()
    assert st["consumed"]["train"] == 10 and st["redelivered"]["train"] == 6 and st["leases_expired"]["train"] == 1


WORKER = r"""
import json, random, sys
import arrowbuf as ab
location, task, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(seed)
acked = []
with ab.connect(location) as remote:
    while True:
        done = remote.policy_version == 1
        b = remote.consume(task, rng.randint(1, 30), lease=1.0, timeout=0.1)
        if len(b):
            try:
                if rng.random() < 0.15:
                    b.nack()
                else:
                    b.ack()
                    acked += b.indices.tolist()
                    print(json.dumps(b.indices.tolist()), flush=True)
            except ab.LeaseError:  # too slow (a loaded machine): the rows went back, someone takes them again
                pass
        elif done and remote.stats()["consumed"][task] == int(sys.argv[4]):
            break
"""


@pytest.mark.slow
def test_exactly_once_per_task_with_acks_across_flight_client_processes(served, procs):
    """Consumer processes ack or nack at random, two of them are killed mid-run: every row is acked exactly once per
    task, and the rows the killed ones held were delivered again."""
    s, location = served
    total = 600
    workers = {(task, k): procs([sys.executable, "-c", WORKER, location, task, str(k), str(total)])
               for task in ("ref", "train") for k in range(2)}
    with ab.connect(location) as writer:
        for k in range(0, total, 30):
            writer.extend(rows(30, k))
            if k == 300:
                for key in (("ref", 0), ("train", 1)):  # killed whenever they are: maybe holding a lease
                    workers[key].kill()
        writer.policy_version = 1
    acked = {"ref": [], "train": []}
    for (task, k), p in workers.items():
        out, err = p.communicate(timeout=180)
        if (task, k) not in (("ref", 0), ("train", 1)):
            assert p.returncode == 0, err.decode()[-2000:]
        for line in out.decode().splitlines():
            acked[task] += json.loads(line)
    for task in ("ref", "train"):
        assert sorted(acked[task]) == list(range(total)), task
        assert s.stats()["consumed"][task] == total and s.stats()["in_flight"][task] == 0


# ---------------------------------------------------------------------------------------------------- Ray
@pytest.mark.slow
def test_leases_on_a_sharded_store_name_their_shard(ray_cluster):
    from arrowbuf.ray import ShardedStore

    sharded = ShardedStore.create(LLM, 2, 512, sampler=ab.samplers.Group(key="prompt_id", size=G), tasks=["t"],
                                  strategy=None, failure_timeout=30.0)
    try:
        sharded.extend(rows(16 * G))
        b = sharded.consume("t", 16 * G, lease=60)
        assert len(b) == 16 * G and b.lease is not None
        parts = b.lease.split("+")
        assert sorted(int(p.split("/")[0]) for p in parts) == [0, 1]  # both shards' parts, each named
        assert len(sharded.consume("t", 16 * G)) == 0  # in flight on their shards
        assert sharded.stats()["in_flight"] == {"t": 16 * G}
        assert sharded.nack(b.lease) == 16 * G
        c = sharded.consume("t", 16 * G, lease=60)
        assert sorted(c.indices.tolist()) == sorted(b.indices.tolist())
        assert c.ack() == 16 * G
        st = sharded.stats()
        assert st["consumed"] == {"t": 16 * G} and st["redelivered"] == {"t": 16 * G} and st["in_flight"] == {"t": 0}
        with pytest.raises(ab.LeaseError, match="already acked"):
            sharded.ack(c.lease)
        with pytest.raises(ab.LeaseError, match="shard"):
            sharded.ack("7/abc.1")
        d = sharded.consume("t", G, lease=0.5)
        assert len(d) == 0  # everything was acked
    finally:
        sharded.close()


def test_a_final_hook_may_ask_consume_and_ack_to_wait_outside_the_lock():
    """What the journal needs: an ack that returns only once its record is durable, without holding the lock."""
    with store(tasks=["t"]) as s:
        waited: list[tuple[str, bool]] = []

        def hook(task, seqs, how):
            def until_durable():  # runs after the lock is released: another thread can read the store meanwhile
                other: list[int] = []
                t = threading.Thread(target=lambda: other.append(s.stats()["leases"]))
                t.start()
                t.join(10)
                waited.append((how, bool(other)))
            return until_durable

        s._consume.final_hooks.append(hook)
        s.extend(rows(4))
        s.consume("t", 2)
        b = s.consume("t", 2, lease=60)
        assert waited == [("consumed", True)]  # not for a lease in flight
        b.ack()
        assert waited == [("consumed", True), ("acked", True)]


def test_stale_rows_in_flight_are_held_like_any_leased_row():
    with store(capacity=4, tasks=["t"], max_staleness=0) as s:
        s.extend(rows(4))
        b = s.consume("t", 2, lease=60)  # rows 0, 1 in flight
        s.policy_version = 1
        with pytest.raises(ab.InsertTimeout):  # rows 0, 1 are stale but in flight: their lease decides
            s.extend(rows(2, 4, pv=1), timeout=0.05)
        b.ack()
        s.extend(rows(2, 4, pv=1), timeout=0)
        assert s.stats()["stale_dropped_by_task"] == {"t": 0}  # acked, not dropped
        s.extend(rows(2, 6, pv=1), timeout=0)  # rows 2, 3: stale, never consumed: dropped for "t"
        assert s.stats()["stale_dropped_by_task"] == {"t": 2}
