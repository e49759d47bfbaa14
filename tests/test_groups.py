"""Groups (arrowbuf/groups.py): whole groups only, never split; DAPO zero-variance filter; staleness per group."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.samplers.group import assign_groups, complete_groups

from conftest import LLM

G = 4


def group_rows(prompts, pv=0, rewards=None, members=None):
    """G completions of each prompt in `prompts` (or only `members` of each); reward = a distinct value per row."""
    members = list(range(G)) if members is None else list(members)
    pid = np.repeat(np.asarray(prompts, np.int64), len(members))
    idx = np.tile(np.asarray(members), len(prompts))
    reward = (pid * 10 + idx).astype(np.float32) if rewards is None else np.asarray(rewards, np.float32)
    return {"prompt_id": pid, "response_tokens": [[1] * (int(i) + 1) for i in idx], "reward": reward,
            "done": np.ones(len(pid), bool), "policy_version": np.full(len(pid), pv)}


def store(capacity=256, drop=None, **kw):
    return ab.ExperienceStore(LLM, capacity=capacity, sampler=ab.samplers.Group(key="prompt_id", size=G,
                                                                                drop_zero_variance=drop), **kw)


def assert_whole_groups(batch):
    pid = batch.to_numpy()["prompt_id"]
    assert len(pid) % G == 0
    for g in pid.reshape(-1, G):
        assert (g == g[0]).all(), pid


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=40), st.integers(1, 4))
def test_assign_groups_cuts_each_key_in_order(keys, size):
    keys = np.asarray(keys, np.int64)
    gid, counts = assign_groups(keys, size)
    for g in range(len(counts)):
        mine = np.flatnonzero(gid == g)
        assert len(mine) == counts[g] <= size and len(set(keys[mine])) == 1
    members = complete_groups(np.arange(len(keys)), keys, size)
    for key in set(keys.tolist()):
        assert sum((keys[m[0]] == key) for m in members) == (keys == key).sum() // size


def test_group_is_reexported_from_samplers():
    assert ab.samplers.Group is ab.samplers.GroupSampler


def test_only_complete_groups_are_delivered_never_split():
    s = store(tasks=["t"])
    s.extend(group_rows([0, 1], members=[0, 1]))  # two halves
    s.extend(group_rows([2]))                      # one whole group
    b = s.consume("t", 16)
    assert_whole_groups(b)
    assert set(b.to_numpy()["prompt_id"]) == {2}
    s.extend(group_rows([1, 0], members=[2, 3]))  # the halves complete
    b = s.consume("t", 16)
    assert_whole_groups(b)
    assert sorted(set(b.to_numpy()["prompt_id"])) == [0, 1]


def test_n_counts_rows_and_whole_groups_fit_in_it():
    s = store(tasks=["t"])
    s.extend(group_rows(range(5)))
    b = s.consume("t", 10)  # two groups fit in 10 rows
    assert len(b) == 8
    assert_whole_groups(b)
    with pytest.raises(ab.InvalidArgument, match="group"):
        s.consume("t", G - 1)


def test_concurrent_writers_and_consumers_never_split_a_group():
    s = store(capacity=4096, tasks=["train"])
    prompts, got, errors = 60, [], []

    def writer(first):  # interleaves halves of its groups with the other writer's
        for p in range(first, prompts, 2):
            s.extend(group_rows([p], members=[0, 1]))
            s.extend(group_rows([p], members=[2, 3]))

    def consumer():
        try:
            while sum(map(len, got)) < prompts * G:
                b = s.consume("train", 3 * G, timeout=0.2)
                assert_whole_groups(b)
                got.append(b.indices)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in (0, 1)] + [threading.Thread(target=consumer)
                                                                              for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    ids = np.concatenate(got)
    assert len(ids) == prompts * G == len(np.unique(ids))


def test_zero_variance_groups_are_dropped_for_every_task_and_counted():
    s = store(drop="reward", tasks=["ref", "train"])
    flat = np.ones(G, np.float32)
    s.extend(group_rows([0, 1, 2], rewards=np.concatenate([np.arange(G), flat, np.arange(G)])))
    b = s.consume("train", 64)
    assert sorted(set(b.to_numpy()["prompt_id"])) == [0, 2]
    assert s.stats()["groups_dropped_zero_variance"] == 1
    assert sorted(set(s.consume("ref", 64).to_numpy()["prompt_id"])) == [0, 2]
    assert s.stats()["groups_dropped_zero_variance"] == 1  # counted once
    s.extend(group_rows([3], rewards=flat))
    assert 3 not in set(s.sample(64).to_numpy()["prompt_id"])  # sample skips it too
    assert s.stats()["groups_dropped_zero_variance"] == 2


def test_sample_draws_whole_groups():
    s = store()
    s.extend(group_rows(range(6)))
    s.extend(group_rows([9], members=[0, 1]))  # incomplete: never sampled
    b = s.sample(5 * G)
    assert_whole_groups(b)
    assert 9 not in set(b.to_numpy()["prompt_id"])


def test_staleness_drops_whole_groups():
    s = store(tasks=["t"])
    s.extend(group_rows([0], pv=1))
    s.extend(group_rows([1], pv=3))
    s.policy_version = 3
    b = s.consume("t", 64, max_staleness=1)
    assert set(b.to_numpy()["prompt_id"]) == {1}
    assert s.stats()["stale_dropped"] == G


def test_where_judges_whole_groups():
    s = store(tasks=["t"])
    s.extend(group_rows([0, 1]))  # rewards 0..3 and 10..13
    b = s.consume("t", 64, where="reward >= 2")
    assert set(b.to_numpy()["prompt_id"]) == {1}  # group 0 has rows below 2: not delivered, not split
    assert set(s.consume("t", 64).to_numpy()["prompt_id"]) == {0}


def test_group_on_a_non_scalar_key_is_a_schema_error():
    with pytest.raises(ab.SchemaError, match="scalar"):
        ab.ExperienceStore(LLM, capacity=8, sampler=ab.samplers.Group(key="response_tokens", size=2))
    with pytest.raises(ab.InvalidArgument):
        ab.samplers.Group(size=0)


def test_a_group_waits_until_every_row_has_its_required_fields_and_then_its_variance_is_judged():
    schema = {**LLM, "fields": {**LLM["fields"], "reward": {"dtype": "float32", "later": True}}}
    s = ab.ExperienceStore(schema, capacity=64, tasks=["ref", "train"],
                           sampler=ab.samplers.Group(key="prompt_id", size=G, drop_zero_variance="reward"))
    r = group_rows([0, 1])
    del r["reward"]
    ids = s.extend(r)
    assert len(s.consume("ref", 64)) == 2 * G  # a task not requiring the reward takes complete groups at once
    s.update(ids[:G - 1], {"reward": np.arange(G - 1, dtype=np.float32)})
    s.update(ids[G:], {"reward": np.zeros(G, np.float32)})  # group 1: zero variance
    assert len(s.consume("train", 64, require=["reward"])) == 0  # group 0 lacks one reward
    assert s.stats()["groups_dropped_zero_variance"] == 1
    s.update(ids[G - 1:G], {"reward": np.array([7.0], np.float32)})
    b = s.consume("train", 64, require=["reward"])
    np.testing.assert_array_equal(b.indices, ids[:G])


# ---------------------------------------------------------------------------------------------------- ShardedStore
@pytest.mark.slow
def test_sharded_store_keeps_groups_on_one_shard_and_consumes_each_row_once_per_task(ray_cluster):
    pytest.importorskip("ray")
    from arrowbuf.ray import ShardedStore
    from arrowbuf.ray.consume import group_shards

    sharded = ShardedStore.create(LLM, 2, 512, sampler=ab.samplers.Group(key="prompt_id", size=G),
                                  tasks=["ref", "train"], strategy=None, failure_timeout=30.0)
    try:
        prompts = 24
        for first in range(0, prompts, 6):  # halves of groups in separate batches: the hash keeps them together
            sharded.extend(group_rows(range(first, first + 6), members=[0, 1]))
            sharded.extend(group_rows(range(first, first + 6), members=[2, 3]))
        table = sharded.to_table(["prompt_id"])
        shard_of = {}
        for shard, pid in zip(table.column("shard").to_pylist(), table.column("prompt_id").to_pylist()):
            assert shard_of.setdefault(pid, shard) == shard  # a group's rows on one shard
        assert len(set(shard_of.values())) == 2  # both shards used
        np.testing.assert_array_equal(group_shards(np.arange(prompts), 2),
                                      [shard_of[p] for p in range(prompts)])
        sharded.policy_version = 2
        assert sharded.policy_version == 2 and sharded.tasks == ["ref", "train"]
        got = {"ref": [], "train": []}
        for task in got:
            while True:
                b = sharded.consume(task, 5 * G, timeout=0)
                if not len(b):
                    break
                assert_whole_groups(b)
                got[task].append(b.indices)
        for task, parts in got.items():
            ids = np.concatenate(parts)
            assert len(ids) == prompts * G == len(np.unique(ids)), task
        with pytest.raises(ab.InvalidArgument):
            sharded.consume("nope", G)
        sharded.extend(group_rows([100], pv=2))
        b = sharded.consume("train", 2 * G, timeout=5.0)  # one whole group is ready: it comes at the deadline
        assert set(b.to_numpy()["prompt_id"]) == {100}
    finally:
        sharded.shutdown()


def test_groups_staleness_and_admission_over_flight():
    s = store(drop="reward", tasks=["train"], max_staleness=1)
    server = ab.serve(s)
    remote = ab.connect(server.location)
    try:
        remote.policy_version = 1
        remote.extend(group_rows([0], members=[0, 1], pv=1))
        remote.extend(group_rows([1], rewards=np.ones(G), pv=1))  # zero variance
        assert len(remote.consume("train", 4 * G)) == 0  # group 0 incomplete, group 1 dropped
        remote.extend(group_rows([0], members=[2, 3], pv=1))
        b = remote.consume("train", 4 * G)
        assert_whole_groups(b) and set(b.to_numpy()["prompt_id"]) == {0}
        assert remote.stats()["groups_dropped_zero_variance"] == 1
        with pytest.raises(ab.InsertTimeout):  # ahead of the window: held, then timed out
            remote.extend(group_rows([2], pv=3), timeout=0.05)
        with pytest.raises(ab.InvalidArgument):  # behind it: refused
            remote.policy_version = 3
            remote.extend(group_rows([2], pv=1))
        assert len(s) == 2 * G
    finally:
        remote.close()
        server.close()
        s.close()


def test_shared_memory_tasks_are_fixed_at_creation():
    """Tasks and groups work on shared memory (tests/test_shm_consume.py across processes); what does not: a task
    declared after creation (its arenas are made before the store is sealed)."""
    schema = {"name": "flat", "fields": {"prompt_id": {"dtype": "int64"}, "reward": {"dtype": "float32"},
                                         "done": {"dtype": "bool"}}}
    name = f"consume-test-{os.getpid()}"
    s = ab.ExperienceStore(schema, capacity=8, tier="shm", name=name, sampler=ab.samplers.Group(size=2),
                           tasks=["t"])
    try:
        s.extend({"prompt_id": np.array([0, 0, 1]), "reward": np.array([1, 2, 3], np.float32),
                  "done": np.ones(3, bool)})
        assert s.consume("t", 4).indices.tolist() == [0, 1]  # one whole group; the second is not complete
        with pytest.raises(ab.InvalidArgument, match="declared when it is created"):
            s.add_task("later")
    finally:
        s.close()
    from arrowbuf.tiers.shm import shm_root

    assert not [n for n in os.listdir(shm_root()) if name in n]  # the creator's close removed it


def test_a_group_store_checkpoints_and_restores(tmp_path):
    s = store(drop="reward")
    s.extend(group_rows(range(3)))
    s.extend(group_rows([7], rewards=np.ones(G)))
    s.sample(G)  # judges (and drops) the zero-variance group
    s.checkpoint(tmp_path / "ckpt")
    again = ab.ExperienceStore.restore(tmp_path / "ckpt")
    assert isinstance(again.sampler, ab.samplers.Group) and again.sampler.size == G
    assert again.stats()["groups_dropped_zero_variance"] == 1
    b = again.sample(4 * G)
    assert_whole_groups(b)
    assert 7 not in set(b.to_numpy()["prompt_id"])
    assert again.stats()["groups_dropped_zero_variance"] == 1  # remembered per row: not dropped (counted) again
    again.close()
