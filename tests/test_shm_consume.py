"""Consumption per task, groups and staleness over shared memory, with real processes (spawn) on one /dev/shm.

A rollout writer, a reward updater and three trainer consumers, each its own process, share one store with no
server: every row is consumed once per task, groups arrive whole, rows wait for the reward the updater writes, and
the writer waits for eviction until every task consumed its oldest rows. Also: staleness with the policy version set
by another process, a checkpoint with tasks restored into shared memory and consumed from where it left off by
another process, a process SIGKILLed while it holds the consume lock (or gathers its rows) blocks nobody, and a
tampered manifest entry is a `StoreCorrupt` naming the file.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
from conftest import process_context
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab

CTX = process_context()
JOIN_S = 90
G = 4  # rows per group
GRPO = {"name": "grpo", "fields": {
    "prompt_id": {"dtype": "int64"},
    "response_tokens": {"dtype": "int32", "ragged": True},
    "reward": {"dtype": "float32", "later": True},
    "done": {"dtype": "bool"},
    "policy_version": {"dtype": "int64"},
}}


def groups(first: int, count: int, pv: int = 0) -> dict:
    """`count` whole groups of G completions, prompts first..first+count-1; row tokens encode the prompt."""
    p = np.repeat(np.arange(first, first + count), G)
    return {"prompt_id": p, "response_tokens": [[int(x)] * (int(x) % 3 + 1) for x in p],
            "done": np.ones(len(p), bool), "policy_version": np.full(len(p), pv)}


def start(names, target, *args) -> mp.Process:
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    names.procs.append(p)  # the `names` fixture kills what is left and removes the segments, even on failure
    return p


def join_ok(p: mp.Process) -> None:
    p.join(JOIN_S)
    assert not p.is_alive(), "child process hung"
    assert p.exitcode == 0, f"child failed with exit code {p.exitcode}"


# ---------------------------------------------------------------------------------------------- child processes
def _writer(name: str, n_groups: int, per_batch: int) -> None:
    store = ab.ExperienceStore.attach(name, timeout=30)
    for g in range(0, n_groups, per_batch):
        store.extend(groups(g, min(per_batch, n_groups - g)), timeout=60)  # waits while the ring is held
    store.close()


def _updater(name: str, total: int) -> None:
    """Consumes task "ref" and writes each row's reward (its id, so that no group has zero variance)."""
    store = ab.ExperienceStore.attach(name, timeout=30)
    done = 0
    deadline = time.monotonic() + 150
    while done < total and time.monotonic() < deadline:
        b = store.consume("ref", 12, timeout=0.5)
        if len(b):
            store.update(b.indices, {"reward": b.indices.astype(np.float32)})
            done += len(b)
    store.close()


def _trainer(name: str, total: int, q) -> None:
    """Consumes task "train" (rows with their reward only) until every row of the run was consumed by someone."""
    store = ab.ExperienceStore.attach(name, timeout=30)
    q.put("ready")  # the parent starts the writer once every trainer waits for rows
    got = []
    deadline = time.monotonic() + 60
    while store.stats()["consumed"]["train"] < total and time.monotonic() < deadline:
        b = store.consume("train", 2 * G, require=["reward"], timeout=0.2)
        if len(b):
            d = b.to_numpy()
            got.append((b.indices, d["prompt_id"], d["reward"], [list(t) for t in d["response_tokens"]]))
            time.sleep(0.01)  # a trainer's step: the others get their turn
    q.put((os.getpid(), got))
    store.close()


def _stale_consumer(name: str, q) -> None:
    store = ab.ExperienceStore.attach(name, timeout=30)
    store.policy_version = 5  # seen by every process
    b = store.consume("t", 100, max_staleness=1)
    q.put((b.indices, store.stats()["stale_dropped"]))
    store.close()


def _consume_rest(name: str, q) -> None:
    store = ab.ExperienceStore.attach(name, timeout=30)
    train = store.consume("train", 1000)
    ref = store.consume("ref", 1000)
    q.put((train.indices, ref.indices, store.policy_version, store.stats()["consumed"]))
    store.close()


def _frozen_consumer(name: str, where: str, ready) -> None:
    """Consume, and freeze inside it (the parent SIGKILLs us): holding the state lock (`pick`), or gathering the
    rows outside it with the rows pinned (`gather`)."""
    from arrowbuf.engine.consume import ConsumeTracker
    from arrowbuf.engine.reader import StoreReader

    def freeze(*args, **kwargs):
        ready.set()
        time.sleep(3600)

    if where == "pick":
        ConsumeTracker._pick = freeze  # type: ignore[method-assign]
    else:
        StoreReader.gather = freeze  # type: ignore[method-assign]
    store = ab.ExperienceStore.attach(name, timeout=30)
    store.consume("t", 4)


def _lease(name: str, seconds: float, q) -> None:
    """Consume 4 rows under a lease, report them and the lease id, and wait (the parent acks, or SIGKILLs us)."""
    store = ab.ExperienceStore.attach(name, timeout=30)
    b = store.consume("t", 4, lease=seconds)
    q.put((b.indices, b.lease))
    time.sleep(3600)


def _rewrite_reward(name: str, value: float) -> None:
    store = ab.ExperienceStore.attach(name, timeout=30)
    ids = store.to_table(["seq"]).column("seq").to_numpy()
    store.update(ids, {"reward": np.full(len(ids), value, np.float32)})
    store.close()


def _leasing_trainer(name: str, report_dir: str) -> None:
    """Consume under short leases, record each batch as processed (a line in its own file: a write the kernel has
    once it returns, unlike a multiprocessing queue's, whose lock a SIGKILL can leave held), then ack it."""
    store = ab.ExperienceStore.attach(name, timeout=30)
    fd = os.open(os.path.join(report_dir, f"{os.getpid()}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    while True:
        b = store.consume("train", 8, require=["reward"], lease=0.5, timeout=0.2)
        if len(b):
            os.write(fd, (" ".join(map(str, b.indices.tolist())) + "\n").encode())
            time.sleep(0.2)  # processing: the run lasts long enough for the parent's kills (a fast run had one)
            b.ack()


def _ahead_writer(name: str, q) -> None:
    """Write rows of policy_version 3 (ahead of the store's window): held until another process advances it."""
    store = ab.ExperienceStore.attach(name, timeout=30)
    q.put("writing")
    t0 = time.monotonic()
    ids = store.extend(groups(0, 1, pv=3), timeout=30)
    q.put((ids.tolist(), time.monotonic() - t0))
    store.close()


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.slow
def test_writer_updater_and_three_trainer_processes_share_one_store(names):
    """Exactly once per task under three concurrent consumer processes, groups whole, `require=` waiting for the
    reward another process writes, and a ring smaller than the run (the writer waits for every task)."""
    name = names()
    n_groups = 48
    total = n_groups * G
    store = ab.ExperienceStore(GRPO, capacity=64, tier="shm", name=name, tasks=["ref", "train"],
                               sampler=ab.samplers.Group(key="prompt_id", size=G))
    try:
        q = CTX.Queue()
        trainers = [start(names, _trainer, name, total, q) for _ in range(3)]
        assert [q.get(timeout=JOIN_S) for _ in trainers] == ["ready"] * 3  # all three consume before any row exists
        updater = start(names, _updater, name, total)
        writer = start(names, _writer, name, n_groups, 2)
        results = [q.get(timeout=JOIN_S) for _ in trainers]
        for p in [writer, updater, *trainers]:
            join_ok(p)
        ids = np.concatenate([i for _, got in results for i, *_ in got])
        assert len(ids) == total and len(np.unique(ids)) == total  # every row once, to one consumer
        np.testing.assert_array_equal(np.sort(ids), np.arange(total))
        assert sum(1 for _, got in results if got) >= 2, "one consumer took everything: not concurrent"
        for _, got in results:
            for idx, prompt, reward, tokens in got:
                np.testing.assert_array_equal(reward, idx.astype(np.float32))  # the reward was there (require=)
                per = prompt.reshape(-1, G)
                assert (per == per[:, :1]).all()  # whole groups, each in insert order
                np.testing.assert_array_equal(prompt, idx // G)
                assert all(t == [p] * (p % 3 + 1) for t, p in zip(tokens, prompt.tolist()))
        st = store.stats()
        assert st["consumed"] == {"ref": total, "train": total}
        assert st["insert_waits"] > 0  # the writer was held back by unconsumed rows (capacity 64 < 192)
        assert len(store.consume("train", 8)) == 0 and len(store.consume("ref", 8)) == 0
    finally:
        store.close()


def test_staleness_with_the_policy_version_set_by_another_process(names):
    name = names()
    store = ab.ExperienceStore(GRPO, capacity=64, tier="shm", name=name, tasks=["t", "u"])
    try:
        old = store.extend(groups(0, 2, pv=0))
        new = store.extend(groups(2, 1, pv=4))
        q = CTX.Queue()
        p = start(names, _stale_consumer, name, q)
        got, dropped = q.get(timeout=JOIN_S)
        join_ok(p)
        np.testing.assert_array_equal(got, new)
        assert dropped == len(old)
        assert store.policy_version == 5  # set there, seen here
        st = store.stats()
        assert st["stale_dropped"] == len(old) and st["stale_dropped_by_task"] == {"t": len(old), "u": 0}
        assert len(store.consume("t", 100)) == 0  # dropped rows are consumed for "t"
        assert len(store.consume("u", 100)) == len(old) + len(new)  # and not for "u"
    finally:
        store.close()


def test_zero_variance_groups_dropped_in_one_process_are_dropped_for_all(names):
    name = names()
    store = ab.ExperienceStore(GRPO, capacity=64, tier="shm", name=name, tasks=["t"],
                               sampler=ab.samplers.Group(key="prompt_id", size=G, drop_zero_variance="reward"))
    other = ab.ExperienceStore.attach(name)
    try:
        ids = store.extend(groups(0, 2))
        store.update(ids, {"reward": np.array([1, 1, 1, 1, 0, 1, 0, 1], np.float32)})
        assert other.consume("t", 8).indices.tolist() == ids[G:].tolist()  # group 0 has zero variance
        assert store.stats()["groups_dropped_zero_variance"] == 1  # counted once, seen by the creator
        assert other.stats()["groups_dropped_zero_variance"] == 1
    finally:
        other.close()
        store.close()


@pytest.mark.parametrize("sampler", ["uniform", "group"])
def test_a_checkpoint_with_tasks_restores_into_shared_memory_and_goes_on_in_another_process(names, tmp_path,
                                                                                            sampler):
    s = ab.ExperienceStore(GRPO, capacity=64, tasks=["ref", "train"],
                           sampler=ab.samplers.Group(key="prompt_id", size=G) if sampler == "group" else "uniform")
    ids = s.extend(groups(0, 5))
    s.update(ids, {"reward": ids.astype(np.float32)})
    first = s.consume("train", 2 * G)
    s.policy_version = 3
    s.checkpoint(tmp_path / "ckpt")
    s.close()
    name = names()
    r = ab.ExperienceStore.restore(tmp_path / "ckpt", tier="shm", name=name)
    try:
        assert r.tasks == ["ref", "train"] and r.policy_version == 3
        q = CTX.Queue()
        p = start(names, _consume_rest, name, q)
        train, ref, pv, consumed = q.get(timeout=JOIN_S)
        join_ok(p)
        np.testing.assert_array_equal(train, ids[len(first):])  # where it left off
        np.testing.assert_array_equal(ref, ids)
        assert pv == 3 and consumed == {"ref": len(ids), "train": len(ids)}
    finally:
        r.close()


@pytest.mark.parametrize("where", ["pick", "gather"])
def test_a_consumer_killed_holding_the_lock_or_its_rows_blocks_nobody(names, where):
    """SIGKILL while holding the consume (state) lock: the robust mutex passes to the next locker. SIGKILL while
    gathering: its pin (which holds eviction) is cleared once its process is seen gone, so a writer of a full ring
    goes on; the rows it had taken are lost for its task (consumed at most once, see docs/shared-memory.md)."""
    name = names()
    store = ab.ExperienceStore(GRPO, capacity=16, tier="shm", name=name, tasks=["t"])
    try:
        store.extend(groups(0, 4))  # full
        ready = CTX.Event()
        p = start(names, _frozen_consumer, name, where, ready)
        assert ready.wait(JOIN_S)
        os.kill(p.pid, signal.SIGKILL)
        p.join(JOIN_S)
        t0 = time.monotonic()
        taken = 0 if where == "pick" else 4
        rest = store.consume("t", 16 - taken, timeout=10)  # returns as soon as it has them
        assert len(rest) == 16 - taken and time.monotonic() - t0 < 5
        store.extend(groups(4, 4), timeout=10)  # evicts every old row: none is pinned by the dead process
        assert len(store.consume("t", 100)) == 16
    finally:
        store.close()


def test_a_tampered_consume_entry_is_store_corrupt_naming_the_manifest(names):
    name = names()
    store = ab.ExperienceStore(GRPO, capacity=16, tier="shm", name=name, tasks=["t"])
    file = os.path.join(store._tier.path, "manifest.json")
    with open(file, "rb") as f:
        original = f.read()
    try:
        for bad in ({"tasks": "t"}, {"tasks": ["t", "t"], "max_staleness": None, "token_field": None},
                    {"tasks": ["t"], "max_staleness": -1, "token_field": None},
                    {"tasks": ["t", "u"], "max_staleness": None, "token_field": None},  # no arena for task 2
                    {"tasks": ["t"], "max_staleness": None, "token_field": "done"}):  # not a ragged field
            m = json.loads(original)
            m.update(bad)  # the store's options, flat in the manifest (StoreOptions.to_dict)
            with open(file, "w") as f:
                json.dump(m, f)
            with pytest.raises(ab.StoreCorrupt) as err:
                ab.ExperienceStore.attach(name)
            assert file in str(err.value), (bad, str(err.value))
    finally:
        with open(file, "wb") as f:
            f.write(original)
        store.close()


def _die(*args, **kwargs) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _die_after_a_lease_slot_is_freed() -> None:
    """From now on this process SIGKILLs itself right after the shared lease table frees a slot (holding the state
    lock)."""
    from arrowbuf.engine.shared_leases import SharedLeaseTable

    freed = SharedLeaseTable.free

    def free_then_die(self, s):
        freed(self, s)
        _die()

    SharedLeaseTable.free = free_then_die  # type: ignore[method-assign]


def _die_in_lease_bookkeeping(name: str, where: str, lease: str | None) -> None:
    """SIGKILL ourselves inside the shared lease table, holding the state lock: as a consume records its lease
    (`open`), or right after a lease's slot is freed, as an expired lease ends (`expire`: the next consume ends it)
    or a nack ends it (`nack`)."""
    from arrowbuf.engine.shared_leases import SharedLeaseTable

    if where == "open":
        SharedLeaseTable.open = _die  # type: ignore[method-assign]
    else:
        _die_after_a_lease_slot_is_freed()
    store = ab.ExperienceStore.attach(name, timeout=30)
    if where == "nack":
        store.nack(lease)
    else:
        store.consume("t", 8, lease=30.0)


@pytest.mark.parametrize("where", ["open", "expire", "nack"])
def test_a_consumer_killed_inside_the_lease_bookkeeping_loses_no_row(names, where):
    """A process SIGKILLed between marking rows consumed for a task and recording their lease (or between ending a
    lease and putting its rows back) held rows that no lease would ever return: the task never got them again (the
    shared-memory soak saw 62 rows of one consume never delivered, with no lease open). The lease is recorded before
    the rows are marked, and rows go back before their lease ends: whatever prefix of those steps ran, every row
    comes back to the task."""
    name = names()
    store = ab.ExperienceStore(GRPO, capacity=16, tier="shm", name=name, tasks=["t"])
    try:
        ids = store.extend(groups(0, 2))
        lease = None
        if where in ("expire", "nack"):
            held = store.consume("t", 8, lease=0.3 if where == "expire" else 60.0)
            np.testing.assert_array_equal(held.indices, ids)
            lease = held.lease
            if where == "expire":
                time.sleep(0.5)
        p = start(names, _die_in_lease_bookkeeping, name, where, lease)
        p.join(JOIN_S)
        assert p.exitcode == -signal.SIGKILL
        back = store.consume("t", 8, lease=60.0, timeout=5)
        np.testing.assert_array_equal(np.sort(back.indices), ids)  # every row comes back to the task
        assert store.ack(back.lease) == 8
        st = store.stats()
        assert st["consumed"] == {"t": 8} and st["leases"] == 0 and st["in_flight"] == {"t": 0}
    finally:
        store.close()


@pytest.mark.slow
def test_leases_across_processes_ack_elsewhere_and_expire_after_their_consumer_died(names):
    """A lease taken in one process is acked in another; the rows of a consumer SIGKILLed under its lease hold
    eviction until the lease expires, then come back to the task before newer rows (whoever consumes next)."""
    name = names()
    store = ab.ExperienceStore(GRPO, capacity=16, tier="shm", name=name, tasks=["t"])
    try:
        ids = store.extend(groups(0, 4))  # full
        q = CTX.Queue()
        acked = start(names, _lease, name, 60.0, q)
        first, lease = q.get(timeout=JOIN_S)
        dies = start(names, _lease, name, 3.0, q)  # the checks below take well under its 3 s
        second, doomed = q.get(timeout=JOIN_S)
        np.testing.assert_array_equal(np.concatenate([first, second]), ids[:8])
        assert store.stats()["in_flight"] == {"t": 8} and store.stats()["leases"] == 2
        with pytest.raises(ab.InsertTimeout):  # leased rows are never evicted
            store.extend(groups(4, 1), timeout=0.2)
        assert store.ack(lease) == 4  # taken in another process, acked here
        with pytest.raises(ab.LeaseError, match="already acked"):
            store.ack(lease)
        acked.kill()
        os.kill(dies.pid, signal.SIGKILL)  # dies holding its lease
        dies.join(JOIN_S)
        back = store.consume("t", 12, timeout=10)  # waits for the expiry, then the returned rows come first
        np.testing.assert_array_equal(back.indices, np.concatenate([second, ids[8:]]))
        st = store.stats()
        assert st["redelivered"] == {"t": 4} and st["leases_expired"] == {"t": 1} and st["leases"] == 0
        assert st["consumed"] == {"t": 16}
        with pytest.raises(ab.LeaseError, match="expired"):
            store.ack(doomed)
        store.extend(groups(4, 1), timeout=5)  # everything consumed: the writer goes on
    finally:
        store.close()


def test_where_judges_a_row_again_after_another_process_rewrote_its_field(names):
    """`where=` results are cached per row; a field rewritten by `update` in another process voids them (that
    process's update hook cannot reach this one's cache)."""
    name = names()
    store = ab.ExperienceStore(GRPO, capacity=16, tier="shm", name=name, tasks=["t"])
    try:
        ids = store.extend(groups(0, 1))
        store.update(ids, {"reward": np.zeros(len(ids), np.float32)})
        assert len(store.consume("t", 4, where="reward > 0.5")) == 0  # judged: fails, cached
        p = start(names, _rewrite_reward, name, 1.0)
        join_ok(p)
        np.testing.assert_array_equal(store.consume("t", 4, where="reward > 0.5").indices, ids)
    finally:
        store.close()


def test_a_full_lease_table_refuses_a_lease_and_loses_no_row(names, monkeypatch):
    from arrowbuf.engine import consume_state, shared_leases

    monkeypatch.setattr(consume_state, "LEASE_SLOTS", 2)
    monkeypatch.setattr(shared_leases, "LEASE_SLOTS", 2)
    name = names()
    store = ab.ExperienceStore(GRPO, capacity=16, tier="shm", name=name, tasks=["t"])
    try:
        ids = store.extend(groups(0, 2))
        a = store.consume("t", 2, lease=30)
        store.consume("t", 2, lease=30)
        with pytest.raises(ab.InvalidArgument, match="open leases"):
            store.consume("t", 2, lease=30)
        assert store.stats()["in_flight"] == {"t": 4}
        a.nack()
        np.testing.assert_array_equal(store.consume("t", 6).indices, [*ids[:2], *ids[4:]])  # none lost
    finally:
        store.close()


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                 max_size=4),
                    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(entry=JSON | st.fixed_dictionaries(
    {"capacity": st.integers(-2, 1 << 46) | JSON, "tasks": JSON, "max_staleness": JSON, "token_field": JSON},
    optional={"chunk_rows": JSON, "final_obs_capacity": JSON, "max_times_sampled": JSON, "name": JSON,
              "sampler": JSON, "rate_limiter": JSON, "observe": JSON}))
def test_any_options_a_manifest_records_are_read_or_store_corrupt(entry):
    """A manifest's options are another process's output (or a file anyone may have changed): anything is either
    options or StoreCorrupt naming the manifest, never another error."""
    try:
        opts = ab.StoreOptions.from_dict(entry, "manifest.json")
    except ab.StoreCorrupt as exc:
        assert "manifest.json" in str(exc)
        return
    assert 1 <= opts.capacity <= 1 << 45
    assert opts.tasks is None or all(isinstance(t, str) and t for t in opts.tasks)


def test_an_overwritten_lease_slot_is_store_corrupt_once_not_a_crash_or_a_hang(names):
    name = names()
    store = ab.ExperienceStore(GRPO, capacity=16, tier="shm", name=name, tasks=["t"])
    try:
        store.extend(groups(0, 2))
        b = store.consume("t", 4, lease=0.05)
        path = os.path.join(store._tier.path, "arena.consume.leases")
        from arrowbuf.engine.shared_leases import SLOT_INTS

        table = np.memmap(path, dtype=np.int64, mode="r+", shape=(4096, SLOT_INTS))
        table[0, 4:6] = (0, 1 << 60)  # a range no ring has
        table.flush()
        del table
        time.sleep(0.1)  # expired: the next look at consumption ends it
        with pytest.raises(ab.StoreCorrupt, match="arena.consume.leases"):
            store.consume("t", 4)
        assert store.consume("t", 8).indices.tolist() == list(range(4, 8))  # the slot is gone; the rest goes on
        with pytest.raises(ab.LeaseError):
            store.ack(b.lease)
    finally:
        store.close()


@pytest.mark.slow
def test_consumers_killed_at_random_under_leases_lose_no_row_and_ack_each_once(names, tmp_path):
    """Three leasing trainer processes, a writer and a reward updater; a trainer that has processed a batch is
    SIGKILLed (often between processing and its ack) and replaced, again and again: every row is processed (reported)
    at least once, and acked exactly once (the store counts each final consumption once: `consumed` equals the rows
    written)."""
    name = names()
    n_groups = 24
    total = n_groups * G
    store = ab.ExperienceStore(GRPO, capacity=64, tier="shm", name=name, tasks=["ref", "train"],
                               sampler=ab.samplers.Group(key="prompt_id", size=G))
    try:
        trainers = [start(names, _leasing_trainer, name, str(tmp_path)) for _ in range(3)]
        start(names, _updater, name, total)
        start(names, _writer, name, n_groups, 2)
        kills = 0
        deadline = time.monotonic() + 150
        while store.stats()["consumed"]["train"] < total and time.monotonic() < deadline:
            time.sleep(0.2)
            busy = [p for p in trainers if (tmp_path / f"{p.pid}.txt").exists()
                    and (tmp_path / f"{p.pid}.txt").stat().st_size]
            if kills < 6 and busy:  # it has processed a batch: it may be about to ack one, or just did
                victim = busy[0]
                os.kill(victim.pid, signal.SIGKILL)
                victim.join(JOIN_S)
                trainers.remove(victim)
                kills += 1
                trainers.append(start(names, _leasing_trainer, name, str(tmp_path)))
        st = store.stats()
        seen = [int(x) for f in tmp_path.glob("*.txt") for x in f.read_text().split()]
        assert st["consumed"]["train"] == total, st  # each row's ack counted once: none twice, none lost
        assert sorted(set(seen)) == list(range(total))  # every row processed at least once
        assert kills >= 3
        assert len(store.consume("train", 8)) == 0 and st["leases"] == 0
    finally:
        store.close()


def test_a_writer_ahead_of_the_window_waits_for_the_version_another_process_sets(names):
    name = names()
    store = ab.ExperienceStore(GRPO, capacity=16, tier="shm", name=name, tasks=["t"], max_staleness=1)
    try:
        q = CTX.Queue()
        p = start(names, _ahead_writer, name, q)
        assert q.get(timeout=JOIN_S) == "writing"
        time.sleep(0.5)
        assert len(store) == 0  # held: version 3 > 0 + 1
        store.policy_version = 2  # here; the writer is in another process
        ids, waited = q.get(timeout=JOIN_S)
        join_ok(p)
        assert ids == [0, 1, 2, 3] and waited >= 0.4
        assert store.stats()["insert_waits"] == 1
        with pytest.raises(ab.InvalidArgument, match="older than the store's staleness window"):
            store.extend(groups(1, 1, pv=0))  # 0 < 2 - 1: refused
    finally:
        store.close()


def _oldest_consumer(name: str, q) -> None:
    """Consumes task "t" oldest-first under the window [version - 2, version], one group a call, until none is left;
    reports each call's (oldest policy_version, ids)."""
    store = ab.ExperienceStore.attach(name, timeout=30)
    got = []
    while len(b := store.consume("t", G, max_staleness=2, admission="oldest")):
        got.append((int(b.to_numpy()["policy_version"].min()), b.indices.tolist()))
    store.close()
    q.put(got)


@pytest.mark.slow  # two spawned processes
def test_oldest_first_admission_across_processes_once_each_in_order_and_counted(names):
    name = names()
    store = ab.ExperienceStore(GRPO, capacity=256, tier="shm", name=name, tasks=["t"],
                               sampler=ab.samplers.Group(key="prompt_id", size=G))
    try:
        versions = np.random.default_rng(3).integers(0, 5, 24)  # 24 groups of versions 0..4, in no order
        ids = np.concatenate([store.extend(groups(g, 1, pv=int(v))) for g, v in enumerate(versions)])
        store.policy_version = 3  # window [1, 3]: version 0 is behind, version 4 ahead
        q = CTX.Queue()
        procs = [start(names, _oldest_consumer, name, q) for _ in range(2)]
        results = [q.get(timeout=JOIN_S) for _ in procs]
        for p in procs:
            join_ok(p)
        delivered = [i for res in results for _, batch in res for i in batch]
        eligible = ids.reshape(-1, G)[(versions >= 1) & (versions <= 3)].reshape(-1)
        assert sorted(delivered) == sorted(eligible.tolist())  # each eligible row once, across both processes
        for res in results:  # each process's calls come oldest first: no row is written meanwhile
            keys = [(v, batch[0]) for v, batch in res]
            assert keys == sorted(keys)
        waiting = {"waiting_ahead": int((versions > 3).sum()) * G, "waiting_stale": int((versions < 1).sum()) * G}
        assert store.stats()["admission"]["t"] == {"admitted": len(eligible), "waiting": sum(waiting.values()),
                                                   **waiting, "dropped": 0}  # counted there, seen here
        store.policy_version = 4  # the rows ahead come in; the ones behind still wait, never dropped
        ahead = ids.reshape(-1, G)[versions == 4].reshape(-1)
        np.testing.assert_array_equal(np.sort(store.consume("t", 1000, max_staleness=2, admission="oldest").indices),
                                      np.sort(ahead))
        assert store.stats()["stale_dropped"] == 0
    finally:
        store.close()


def _die_in_ack(name: str, where: str, lease: str) -> None:
    """SIGKILL ourselves inside an ack, holding the state lock: before its rows are counted as consumed (`count`),
    or right after its lease's slot is freed (`free`)."""
    from arrowbuf.engine.consume import ConsumeTracker

    if where == "count":
        ConsumeTracker._final = _die  # type: ignore[method-assign]
    else:
        _die_after_a_lease_slot_is_freed()
    ab.ExperienceStore.attach(name, timeout=30).ack(lease)


@pytest.mark.parametrize("where", ["count", "free"])
def test_a_consumer_killed_inside_its_ack_leaves_the_rows_consumed_and_counted(names, where):
    """An ack ends the lease and counts its rows as the task's consumption; a process SIGKILLed between the two left
    the rows consumed (never delivered again) but not counted: the shared-memory soak's drain waited out its 180 s
    with 44 rows short ('ref' 10100 of 10144 consumed, no lease open, nothing in flight). An ack that began counts
    whole: the next process to take the state lock finishes it (its lease ended, its rows counted once)."""
    name = names()
    store = ab.ExperienceStore(GRPO, capacity=16, tier="shm", name=name, tasks=["t"])
    try:
        ids = store.extend(groups(0, 2))
        held = store.consume("t", 8, lease=60.0)
        np.testing.assert_array_equal(held.indices, ids)
        p = start(names, _die_in_ack, name, where, held.lease)
        p.join(JOIN_S)
        assert p.exitcode == -signal.SIGKILL
        assert len(store.consume("t", 8, timeout=0.3)) == 0  # consumed: not delivered again
        st = store.stats()
        assert st["consumed"] == {"t": 8} and st["leases"] == 0 and st["in_flight"] == {"t": 0}
        with pytest.raises(ab.LeaseError):
            store.ack(held.lease)
        assert store.stats()["consumed"] == {"t": 8}  # counted once
    finally:
        store.close()


def _die_counting_a_consume(name: str) -> None:
    """SIGKILL ourselves inside a consume without a lease, holding the state lock: its rows marked, not yet counted."""
    from arrowbuf.engine.consume import ConsumeTracker

    ConsumeTracker._final = _die  # type: ignore[method-assign]
    ab.ExperienceStore.attach(name, timeout=30).consume("t", 8)


def test_a_consumer_killed_between_marking_and_counting_a_consume_leaves_the_count_right(names):
    """A consume without a lease is final at once: its rows are marked, then counted. A process killed in between
    left them consumed but uncounted for good (as an ack did); the next holder of the state lock counts them."""
    name = names()
    store = ab.ExperienceStore(GRPO, capacity=16, tier="shm", name=name, tasks=["t"])
    try:
        store.extend(groups(0, 2))
        p = start(names, _die_counting_a_consume, name)
        p.join(JOIN_S)
        assert p.exitcode == -signal.SIGKILL
        assert len(store.consume("t", 8, timeout=0.3)) == 0  # consumed (without a lease: at most once)
        assert store.stats()["consumed"] == {"t": 8}
    finally:
        store.close()
