"""Oldest-first admission under a version window (arrowbuf/store/admission.py): order, holding back, counts.

The tests that take no fixture run again over a shared-memory store in tests/test_shm_consume_parity.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import LLM

import arrowbuf as ab
from arrowbuf.samplers.admission import admit, waiting


def rows(n, start=0, pv=0, group=4):
    """`n` completions: row i has prompt i // group, i % 5 + 1 tokens, reward i, policy version `pv` (or one each)."""
    i = np.arange(start, start + n)
    return {"prompt_id": i // group, "response_tokens": [[int(k)] * (int(k) % 5 + 1) for k in i],
            "reward": i.astype(np.float32), "done": np.ones(n, bool),
            "policy_version": np.broadcast_to(np.asarray(pv, dtype=np.int64), (n,)).copy()}


def store(capacity=64, **kw):
    return ab.ExperienceStore(LLM, capacity=capacity, **kw)


def counts(s, task="t"):
    return s.stats()["admission"][task]


def test_oldest_first_delivers_by_policy_version_then_id():
    s = store(tasks=["t"])
    s.extend(rows(6, pv=[2, 2, 0, 0, 1, 1]))  # slow rollouts of older policies arrive after fast new ones
    s.policy_version = 2
    first = s.consume("t", 3, admission="oldest")
    np.testing.assert_array_equal(first.indices, [2, 3, 4])
    np.testing.assert_array_equal(first.to_numpy()["policy_version"], [0, 0, 1])
    np.testing.assert_array_equal(s.consume("t", 10, admission="oldest").indices, [5, 0, 1])
    assert counts(s) == {"admitted": 6, "waiting": 0, "waiting_ahead": 0, "waiting_stale": 0, "dropped": 0}
    assert s.stats()["consumed"] == {"t": 6}


def test_arrival_order_is_unchanged_without_admission():
    s = store(tasks=["t"])
    s.extend(rows(4, pv=[1, 0, 1, 0]))
    s.policy_version = 1
    np.testing.assert_array_equal(s.consume("t", 10).indices, [0, 1, 2, 3])
    assert counts(s) == {"admitted": 0, "waiting": 0, "waiting_ahead": 0, "waiting_stale": 0, "dropped": 0}


def test_rows_outside_the_window_wait_instead_of_being_dropped_and_are_counted():
    s = store(tasks=["t", "other"])
    s.extend(rows(6, pv=[0, 0, 2, 2, 4, 4]))
    s.policy_version = 3
    b = s.consume("t", 100, max_staleness=1, admission="oldest")  # window [2, 3]: 0 too old, 4 ahead
    np.testing.assert_array_equal(b.indices, [2, 3])
    assert counts(s) == {"admitted": 2, "waiting": 4, "waiting_ahead": 2, "waiting_stale": 2, "dropped": 0}
    assert counts(s, "other")["waiting"] == 0  # a task that never consumed oldest-first waits on no window
    assert s.stats()["stale_dropped"] == 0
    s.policy_version = 4  # the rows ahead are in the window now
    np.testing.assert_array_equal(s.consume("t", 100, max_staleness=1, admission="oldest").indices, [4, 5])
    assert counts(s) == {"admitted": 4, "waiting": 2, "waiting_ahead": 0, "waiting_stale": 2, "dropped": 0}
    # the stale rows were kept: a wider window takes them, oldest first
    np.testing.assert_array_equal(s.consume("t", 100, max_staleness=10, admission="oldest").indices, [0, 1])
    assert counts(s) == {"admitted": 6, "waiting": 0, "waiting_ahead": 0, "waiting_stale": 0, "dropped": 0}
    assert s.stats()["consumed"]["t"] == 6


def test_the_store_window_applies_and_eviction_is_the_only_drop():
    s = store(capacity=4, tasks=["t"], max_staleness=1)
    s.extend(rows(4, pv=0))
    s.policy_version = 2  # window [1, 2]: every row is stale
    assert len(s.consume("t", 100, admission="oldest")) == 0  # held back, not dropped
    assert counts(s) == {"admitted": 0, "waiting": 4, "waiting_ahead": 0, "waiting_stale": 4, "dropped": 0}
    s.extend(rows(2, start=4, pv=2), timeout=0)  # the ring needs room: stale rows may go, counted as dropped
    assert counts(s) == {"admitted": 0, "waiting": 2, "waiting_ahead": 0, "waiting_stale": 2, "dropped": 2}
    np.testing.assert_array_equal(s.consume("t", 100, admission="oldest").indices, [4, 5])
    st = s.stats()
    assert st["stale_dropped_by_task"] == {"t": 2} and st["consumed"] == {"t": 2}
    # every row written is accounted for: delivered + dropped + still in the ring unconsumed (waiting)
    assert st["consumed"]["t"] + st["stale_dropped_by_task"]["t"] + counts(s)["waiting"] == 6


def test_oldest_first_groups_are_whole_and_ordered_by_their_oldest_row():
    s = store(tasks=["t"], sampler=ab.samplers.Group(key="prompt_id", size=4))
    s.extend(rows(12, pv=np.repeat([1, 0, 1], 4)))  # prompts 0, 1, 2: prompt 1 is of the oldest policy
    s.extend(rows(2, start=12, pv=0))  # an incomplete group waits whatever its age
    s.policy_version = 1
    b = s.consume("t", 4, admission="oldest")
    np.testing.assert_array_equal(b.indices, [4, 5, 6, 7])
    b = s.consume("t", 100, admission="oldest")
    np.testing.assert_array_equal(b.indices, [0, 1, 2, 3, 8, 9, 10, 11])
    assert counts(s)["admitted"] == 12


def test_a_group_with_a_row_outside_the_window_waits_whole():
    s = store(tasks=["t"], sampler=ab.samplers.Group(key="prompt_id", size=2))
    s.extend(rows(6, pv=[0, 2, 2, 2, 3, 3], group=2))
    s.policy_version = 2
    b = s.consume("t", 100, max_staleness=1, admission="oldest")  # window [1, 2]
    np.testing.assert_array_equal(b.indices, [2, 3])  # prompt 0 has a stale row, prompt 2 is ahead
    assert counts(s) == {"admitted": 2, "waiting": 3, "waiting_ahead": 2, "waiting_stale": 1, "dropped": 0}


def test_oldest_first_with_where_budget_require_and_leases():
    s = store(tasks=["t"])
    s.extend(rows(8, pv=[3, 3, 2, 2, 1, 1, 0, 0]))
    s.policy_version = 3
    b = s.consume("t", 100, where="reward >= 2", max_tokens=8, admission="oldest", lease=30.0)
    np.testing.assert_array_equal(b.indices, [6, 7])  # v0 first; tokens 2 + 3, then row 4 (5 tokens) is over 8
    s.nack(b.lease)
    b = s.consume("t", 3, where="reward >= 2", admission="oldest", lease=30.0)
    np.testing.assert_array_equal(b.indices, [6, 7, 4])  # back in the queue, still oldest first
    b.ack()
    np.testing.assert_array_equal(s.consume("t", 100, require=["reward"], where="reward >= 2",
                                             admission="oldest").indices, [5, 2, 3])
    assert counts(s)["admitted"] == 8  # deliveries: the nacked two count twice
    np.testing.assert_array_equal(s.consume("t", 100).indices, [0, 1])  # the filter left them for another call


def test_a_bad_admission_is_a_clear_error_that_consumes_nothing():
    s = store(tasks=["t"])
    s.extend(rows(2))
    for bad in ("newest", "", 1, True):
        with pytest.raises(ab.InvalidArgument, match="admission"):
            s.consume("t", 2, admission=bad)
    assert s.stats()["consumed"] == {"t": 0} and counts(s)["admitted"] == 0


def test_admit_and_waiting_against_a_brute_force_order():
    rng = np.random.default_rng(7)
    for _ in range(50):
        n, size = int(rng.integers(0, 12)), int(rng.integers(1, 4))
        units = np.arange(n * size, dtype=np.int64).reshape(n, size)
        versions = rng.integers(0, 6, units.shape)
        pv, k = int(rng.integers(0, 6)), (None if rng.random() < 0.3 else int(rng.integers(0, 4)))
        got = admit(units, versions, pv, k)
        lo = -1 if k is None else pv - k
        expect = sorted((int(v.min()), int(u[0])) for u, v in zip(units, versions)
                        if v.max() <= pv and v.min() >= lo)
        assert [(int(versions[u[0] // size].min()), int(u[0])) for u in got] == expect
        flat = versions.reshape(-1)
        w = waiting(flat, pv, 1 if k is None else k + 2)
        assert w["waiting_ahead"] == int((flat > pv).sum())
        assert w["waiting_stale"] == (0 if k is None else int((flat < pv - k).sum()))


@pytest.fixture
def served():
    s = store(tasks=["t"])
    server = ab.serve(s)
    remote = ab.connect(server.location)
    try:
        yield s, remote
    finally:
        remote.close()
        server.close()
        s.close()


def test_oldest_first_over_flight(served):
    s, remote = served
    remote.extend(rows(6, pv=[2, 2, 0, 0, 4, 1]))
    remote.policy_version = 2
    b = remote.consume("t", 100, max_staleness=1, admission="oldest", timeout=0.2)
    np.testing.assert_array_equal(b.indices, [5, 0, 1])  # v1, then v2; v0 too old and v4 ahead wait
    assert remote.stats()["admission"]["t"] == {"admitted": 3, "waiting": 3, "waiting_ahead": 1,
                                                "waiting_stale": 2, "dropped": 0}
    with pytest.raises(ab.InvalidArgument, match="admission"):
        remote.consume("t", 1, admission="newest")
    assert s.stats()["consumed"] == {"t": 3}


def test_a_hostile_admission_on_the_wire_is_refused_before_the_store(served):
    from arrowbuf.flight import protocol as P

    s, _ = served
    for bad in ("newest", 7, ["oldest"], "x" * 10_000):
        raw = json.dumps({"v": P.LLM_VERSION, "kind": "consume", "task": "t", "n": 1, "admission": bad}).encode()
        with pytest.raises(ab.SchemaError, match="admission"):
            P.decode_ticket(raw)
    req = P.decode_ticket(json.dumps({"v": P.LLM_VERSION, "kind": "consume", "task": "t", "n": 1,
                                      "admission": "oldest"}).encode())
    assert req.admission == "oldest"


@pytest.mark.slow
def test_oldest_first_on_a_sharded_store_per_shard_with_summed_counts(ray_cluster):
    from arrowbuf.ray import ShardedStore
    from arrowbuf.ray.ids import shard_of

    sharded = ShardedStore.create(LLM, 2, 256, sampler=ab.samplers.Group(key="prompt_id", size=4), tasks=["t"],
                                  strategy=None, failure_timeout=30.0)
    try:
        versions = np.array([3, 0, 2, 1, 4, 2, 1, 3, 0, 2, 3, 1])  # one group of 4 per prompt
        for p, v in enumerate(versions):
            sharded.extend(rows(4, start=4 * p, pv=int(v)))
        sharded.policy_version = 3
        got = []
        while len(b := sharded.consume("t", 8, max_staleness=2, admission="oldest")):
            got.append(b)
        pids = np.concatenate([b.to_numpy()["prompt_id"] for b in got])
        eligible = np.flatnonzero((versions >= 1) & (versions <= 3))
        np.testing.assert_array_equal(np.sort(np.unique(pids)), eligible)  # each eligible group, whole, once
        assert len(pids) == 4 * len(eligible)
        ids = np.concatenate([b.indices for b in got])
        v = np.concatenate([b.to_numpy()["policy_version"] for b in got])
        for k in (0, 1):  # each shard delivers its rows oldest first (the order is per shard, not across shards)
            mine = shard_of(ids) == k
            assert mine.any() and (np.diff(v[mine]) >= 0).all(), v[mine]
        assert sharded.stats()["admission"]["t"] == {"admitted": 4 * len(eligible),
                                                     "waiting": 4 * int(((versions < 1) | (versions > 3)).sum()),
                                                     "waiting_ahead": 4 * int((versions > 3).sum()),
                                                     "waiting_stale": 4 * int((versions < 1).sum()), "dropped": 0}
    finally:
        sharded.shutdown()


def test_the_counts_and_the_window_survive_a_checkpoint(tmp_path):
    s = store(tasks=["t"])
    s.extend(rows(6, pv=[0, 0, 2, 2, 4, 4]))
    s.policy_version = 3
    assert len(s.consume("t", 100, max_staleness=1, admission="oldest")) == 2
    s.checkpoint(str(tmp_path / "ckpt"))
    s.close()
    again = ab.ExperienceStore.restore(str(tmp_path / "ckpt"))
    try:
        assert again.stats()["admission"]["t"] == {"admitted": 2, "waiting": 4, "waiting_ahead": 2,
                                                   "waiting_stale": 2, "dropped": 0}
        again.policy_version = 4
        np.testing.assert_array_equal(again.consume("t", 100, max_staleness=1, admission="oldest").indices, [4, 5])
    finally:
        again.close()
