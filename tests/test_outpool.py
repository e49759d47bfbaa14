"""The pool of gather outputs (arrowbuf.ring.outpool): a batch, or a view, tensor or Arrow array of it that a caller keeps is
never overwritten by later samples; dropped batches' arrays are reused; the pool stays within its bounds.

Every row encodes its own seq (obs = seq in every element, action = seq; next_obs = seq + 1), so a kept batch whose
memory was reused for a later batch shows as rows that no longer match their ids."""

from __future__ import annotations

import os
import threading
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.ring.outpool import MIN_BYTES, PER_SHAPE, OutputPool, take_into
from arrowbuf.tiers import shm

DIM = 128  # float32 obs of 512 bytes: a batch of 256 is 128 KiB per column, above the pool's minimum
SCHEMA = {
    "name": "pooled",
    "fields": {
        "obs": {"dtype": "float32", "shape": [DIM]},
        "action": {"dtype": "int64"},
        "reward": {"dtype": "float32"},
        "terminated": {"dtype": "bool"},
        "truncated": {"dtype": "bool"},
    },
    "derived": {"next_obs": {"next_of": "obs"}},
}
B = 256


def rows(seq0: int, n: int) -> dict[str, np.ndarray]:
    s = np.arange(seq0, seq0 + n)
    obs = np.repeat(s[:, None], DIM, 1).astype(np.float32)
    return {"obs": obs, "action": s.astype(np.int64), "reward": s.astype(np.float32),
            "terminated": (s % 10) == 9, "truncated": np.zeros(n, bool), "next_obs": obs + 1}


def make_store(sampler="uniform", capacity=4000) -> ab.ExperienceStore:
    store = ab.ExperienceStore(SCHEMA, capacity=capacity, sampler=sampler, seed=0)
    store.extend(rows(0, capacity))
    return store


def check_rows(ids: np.ndarray, obs: np.ndarray, next_obs: np.ndarray | None = None) -> None:
    expect = np.repeat(np.asarray(ids)[:, None], DIM, 1).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(obs), expect)
    if next_obs is not None:
        np.testing.assert_array_equal(np.asarray(next_obs), expect + 1)


def churn(store: ab.ExperienceStore, times: int = 30, **kw) -> None:
    """Sample and drop batches, so that every idle pooled array is reused."""
    for _ in range(times):
        b = store.sample(B, **kw)
        check_rows(b.indices, b["obs"], b["next_obs"])


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_a_kept_batch_is_never_overwritten(sampler):
    s = ab.samplers.Prioritized(alpha=0.6, beta=0.4) if sampler == "prioritized" else sampler
    store = make_store(s)
    try:
        kept = store.sample(B)
        ids, obs, nxt = kept.indices.copy(), kept["obs"].copy(), kept["next_obs"].copy()
        churn(store)
        check_rows(ids, kept["obs"], kept["next_obs"])
        np.testing.assert_array_equal(kept["obs"], obs)
        np.testing.assert_array_equal(kept["next_obs"], nxt)
        assert store.stats()["output_pool"]["hits"] > 0  # the churn did reuse arrays: the test exercised the pool
    finally:
        store.close()


def test_views_tensors_and_arrow_arrays_of_a_dropped_batch_are_never_overwritten():
    pytest.importorskip("torch")
    store = make_store()
    try:
        b = store.sample(B)
        ids = b.indices.copy()
        view = b["obs"][10:20, 3:]  # a numpy view
        column = b["next_obs"][:, 0]  # a strided view
        tensor = b.to_torch()["obs"]  # torch.from_numpy: shares the batch's memory
        record = b.data  # Arrow, zero-copy over the gathered arrays
        assert np.shares_memory(view, b["obs"]) and tensor.data_ptr() == b["obs"].ctypes.data
        del b  # only the views are left
        churn(store)
        check_rows(ids[10:20], np.pad(view, ((0, 0), (3, 0)), mode="edge"))
        np.testing.assert_array_equal(column, ids.astype(np.float32) + 1)
        check_rows(ids, tensor.numpy())
        arrow_obs = record.column("obs").to_numpy_ndarray()
        check_rows(record.column("action").to_numpy(), arrow_obs, record.column("next_obs").to_numpy_ndarray())
        np.testing.assert_array_equal(record.column("action").to_numpy(), ids)
    finally:
        store.close()


def test_dropped_batches_are_reused_and_the_pool_stays_bounded():
    store = make_store()
    try:
        churn(store, 10)
        st = store.stats()["output_pool"]
        assert st["hits"] >= 10  # two pooled columns (obs, next_obs) per sample after the first few
        assert st["bytes"] <= st["max_bytes"]
        kept = [store.sample(B) for _ in range(3 * PER_SHAPE)]  # a caller that keeps every batch
        st = store.stats()["output_pool"]
        assert st["arrays"] <= 2 * PER_SHAPE  # obs and next_obs, PER_SHAPE each; the rest were fresh
        assert st["fresh"] > 0
        assert st["bytes"] == st["arrays"] * B * DIM * 4
        for i, a in enumerate(kept):  # no two kept batches share memory, and each still holds its own rows
            check_rows(a.indices, a["obs"], a["next_obs"])
            for b in kept[i + 1:]:
                assert not np.shares_memory(a["obs"], b["obs"])
                assert not np.shares_memory(a["next_obs"], b["next_obs"])
    finally:
        store.close()


def test_a_shared_memory_store_and_an_attached_handle_never_overwrite_kept_batches():
    name = f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"
    store = other = None
    try:
        store = ab.ExperienceStore(SCHEMA, capacity=4000, tier="shm", name=name, seed=0)
        store.extend(rows(0, 4000))
        other = ab.ExperienceStore.attach(name)
        kept = [store.sample(B), other.sample(B)]
        want = [k["obs"].copy() for k in kept]
        for _ in range(10):
            churn(store, 2)
            churn(other, 2)
        for k, w in zip(kept, want):
            np.testing.assert_array_equal(k["obs"], w)
            check_rows(k.indices, k["obs"], k["next_obs"])
        assert store.stats()["output_pool"]["hits"] > 0 and other.stats()["output_pool"]["hits"] > 0
    finally:
        for s in (other, store):
            if s is not None:
                s.close()
        shm.remove(name)
    assert not [n for n in os.listdir(shm.shm_root()) if name in n]


def test_close_releases_the_pool_and_kept_batches_stay_valid():
    store = make_store()
    kept = store.sample(B)
    churn(store, 5)
    assert store.stats()["output_pool"]["bytes"] > 0
    want = kept["obs"].copy()
    store.close()
    assert store.stats()["output_pool"]["bytes"] == 0
    np.testing.assert_array_equal(kept["obs"], want)


def test_sequences_and_n_step_outputs_are_pooled_safely():
    store = ab.ExperienceStore(SCHEMA, capacity=4000, sampler=ab.samplers.Sequence(length=4), seed=0)
    try:
        store.extend(rows(0, 4000))
        kept = store.sample(64)  # [64, 4, DIM]: 128 KiB, pooled
        assert kept["obs"].shape == (64, 4, DIM)
        want = kept["obs"].copy()
        for _ in range(20):
            b = store.sample(64)
            np.testing.assert_array_equal(b["obs"][:, :, 0], b["action"].astype(np.float32))
        np.testing.assert_array_equal(kept["obs"], want)
        np.testing.assert_array_equal(kept["obs"][:, :, 0], kept["action"].astype(np.float32))
    finally:
        store.close()
    store = make_store()
    try:
        kept = store.sample(B, n_step=3, gamma=0.9)
        want = kept["n_step_next_obs"].copy()
        for _ in range(20):
            store.sample(B, n_step=3, gamma=0.9)
        np.testing.assert_array_equal(kept["n_step_next_obs"], want)
    finally:
        store.close()


def test_threads_sampling_at_once_never_share_an_output():
    store = make_store(ab.samplers.Prioritized(alpha=0.6, beta=0.4))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            mine = []
            for i in range(60):
                b = store.sample(B)
                check_rows(b.indices, b["obs"], b["next_obs"])
                store.update_priorities(b.indices, np.random.default_rng(i).random(B))
                if i % 10 == 0:
                    mine.append((b, b["obs"].copy()))
            for b, want in mine:  # kept while the other thread went on sampling
                np.testing.assert_array_equal(b["obs"], want)
                check_rows(b.indices, b["obs"], b["next_obs"])
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
    finally:
        store.close()


# ---------------------------------------------------------------- OutputPool itself

def test_pool_never_hands_out_an_array_that_is_still_referenced():
    pool = OutputPool(max_bytes=1 << 30)
    a = pool.empty((100, 1000), np.float32)
    b = pool.empty((100, 1000), np.float32)
    assert not np.shares_memory(a, b)
    view = a[5]
    del a
    c = pool.empty((100, 1000), np.float32)  # a is held through its view; b by the name b
    assert not np.shares_memory(c, view) and not np.shares_memory(c, b)
    del view
    d = pool.empty((100, 1000), np.float32)  # a's array is idle now: reused
    assert pool.stats()["hits"] == 1 and pool.stats()["arrays"] == 3
    assert not np.shares_memory(d, b) and not np.shares_memory(d, c)


def test_pool_bounds_bytes_and_arrays_per_shape():
    row = MIN_BYTES  # one "row" of the pool minimum: every array below is pooled by size
    pool = OutputPool(max_bytes=10 * row, per_shape=2)
    held = [pool.empty((3, row), np.uint8) for _ in range(4)]  # 2 tracked, then 2 fresh (per_shape)
    st = pool.stats()
    assert st["arrays"] == 2 and st["bytes"] == 6 * row and st["fresh"] == 2
    held += [pool.empty((4, row), np.uint8) for _ in range(2)]  # 6 + 4 = 10 fits, then the bound: fresh
    st = pool.stats()
    assert st["arrays"] == 3 and st["bytes"] == 10 * row and st["fresh"] == 3
    del held[:2]  # the two tracked (3, row) arrays are idle now
    x = pool.empty((4, row), np.uint8)  # room is made by dropping idle arrays of the other shape
    st = pool.stats()
    assert st["bytes"] <= 10 * row and st["arrays"] == 2 and st["bytes"] == 8 * row
    assert all(not np.shares_memory(x, h) for h in held)
    assert pool.empty((1, row // 2), np.uint8).size == row // 2  # under min_bytes: fresh, untracked
    assert pool.empty((11, row), np.uint8).nbytes == 11 * row  # over max_bytes: fresh, untracked
    assert pool.stats()["bytes"] <= 10 * row
    off = OutputPool(max_bytes=0)
    off.empty((4, row), np.uint8)
    assert off.stats()["arrays"] == 0


def test_take_into_matches_np_take_and_refuses_out_of_range_positions():
    arena = np.arange(50 * 6, dtype=np.int32).reshape(50, 2, 3)
    pos = np.array([7, 0, 49, 7, 3])
    out = np.empty((5, 2, 3), np.int32)
    assert take_into(arena, pos, out) is out
    np.testing.assert_array_equal(out, np.take(arena, pos, axis=0))
    take_into(arena, pos.astype(np.int32), out)  # any integer dtype
    np.testing.assert_array_equal(out, arena[pos])
    with pytest.raises(IndexError):  # never clipped onto a wrong row
        take_into(arena, np.array([1, 50]), np.empty((2, 2, 3), np.int32))
    take_into(arena, np.array([-1, 2]), out[:2])  # negatives keep np.take's meaning
    np.testing.assert_array_equal(out[:2], arena[[-1, 2]])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 49), st.integers(1, 12)), min_size=1, max_size=20))
def test_take_into_runs_of_consecutive_rows_match_np_take(runs: list[tuple[int, int]]) -> None:
    # FIFO and consume gathers are a run or two (the ring wraps): copied run by run; many runs go through take
    arena = np.arange(50 * 6, dtype=np.int32).reshape(50, 2, 3)
    pos = np.concatenate([np.arange(a, min(a + n, 50)) for a, n in runs])
    out = np.full((pos.size, 2, 3), -1, np.int32)
    assert take_into(arena, pos, out) is out
    np.testing.assert_array_equal(out, np.take(arena, pos, axis=0))


def test_many_columns_of_one_shape_each_reuse_their_array() -> None:
    # nine [B, 8192] float32 fields (TransferQueue's perftest rows): every column's output is reused once dropped,
    # not only `PER_SHAPE` of them among the nine
    fields = {f"field_{i}": {"dtype": "float32", "shape": [1024]} for i in range(9)}
    store = ab.ExperienceStore(ab.load_schema({"name": "nine", "fields": fields}), capacity=64, tasks=["train"])
    try:
        rows = {k: np.full((32, 1024), i, np.float32) for i, k in enumerate(fields)}
        store.extend(rows)
        first = store.consume("train", 32)
        where = {k: first[k].ctypes.data for k in fields}
        del first
        store.extend(rows)
        again = store.consume("train", 32)
        assert {k: again[k].ctypes.data for k in fields} == where
        assert all((again[k] == i).all() for i, k in enumerate(fields))
        assert store.stats()["output_pool"]["fresh"] == 0
    finally:
        store.close()


# ---------------------------------------------------------------------------------------------------- ragged outputs
def test_at_least_hands_out_a_view_of_a_size_class_and_reuses_it_once_dropped() -> None:
    pool = OutputPool(max_bytes=64 << 20, min_bytes=1 << 10, per_shape=2)
    a = pool.at_least(100_000, np.float32, tag="t")
    assert a.shape == (100_000,) and a.base is not None and len(a.base) <= 100_000 * 9 // 8
    base = a.base.ctypes.data
    kept = pool.at_least(90_000, np.float32, tag="t")  # `a` is held: another array
    assert kept.base.ctypes.data != base
    del a
    b = pool.at_least(95_000, np.float32, tag="t")  # a smaller request fits the idle array
    assert b.base.ctypes.data == base and pool.hits == 1
    other = pool.at_least(95_000, np.float32, tag="u")  # another tag: its own array
    assert other.base.ctypes.data not in (base, kept.base.ctypes.data)
    assert pool.at_least(10, np.float32).base is None  # under min_bytes: fresh, untracked
    assert pool.nbytes <= 64 << 20


RAGGED = {"name": "rg", "fields": {"k": {"dtype": "int64"}, "tok": {"dtype": "int32", "ragged": True},
                                   "done": {"dtype": "bool"}}}


def test_large_ragged_gathers_reuse_pooled_values_and_never_overwrite_a_kept_batch() -> None:
    """A uniform gather of ragged rows puts its values in the reader's pool (warm pages across gathers and pauses):
    dropped batches' arrays are reused, kept ones (or tensors of them) are never written."""
    torch = pytest.importorskip("torch")
    n = 64
    s = ab.ExperienceStore(RAGGED, capacity=n, sampler="uniform", seed=0)
    try:
        s.extend({"k": np.arange(n), "tok": [np.full(2000 + k, k, np.int32) for k in range(n)],
                  "done": np.ones(n, bool)})
        before = s.stats()["output_pool"]["hits"]
        for _ in range(4):  # dropped at once: reused
            b = s.sample(32)
            assert all(t == [k] * (2000 + k) for k, t in zip(b.data.column("k").to_pylist(),
                                                               b.data.column("tok").to_pylist()))
            del b
        assert s.stats()["output_pool"]["hits"] >= before + 2
        kept = [s.sample(32) for _ in range(3)]
        packed = kept[0].to_torch(pack=True)["tok"]  # the batch's own values, writable without a copy
        want = [b.data.column("tok").to_pylist() for b in kept]
        for _ in range(6):
            s.sample(32)
        assert [b.data.column("tok").to_pylist() for b in kept] == want
        packed.fill_(-1)  # writing into a delivered tensor reaches neither the store nor another batch
        assert [b.data.column("tok").to_pylist() for b in kept[1:]] == want[1:]
        d = s.to_table()
        assert all(t == [k] * (2000 + k) for k, t in zip(d.column("k").to_pylist(), d.column("tok").to_pylist()))
        del torch
    finally:
        s.close()
