import threading

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from conftest import SCHEMAS, SMALL, chi_square_p, make_episodes, store_snapshot


def small_store(capacity=100, **kw):
    return ab.ExperienceStore(ab.load_schema(SMALL), capacity=capacity, seed=kw.pop("seed", 0), **kw)


def test_extend_then_sample_returns_exact_rows():
    batch, _ = make_episodes([5, 7, 3])
    store = small_store()
    ids = store.extend(batch)
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.ndim == 1
    np.testing.assert_array_equal(ids, np.arange(15))
    assert len(store) == 15
    b = store.sample(200)
    d = b.to_numpy()
    assert d["obs"].shape == (200, 3) and d["next_obs"].shape == (200, 3)
    np.testing.assert_array_equal(d["obs"], batch["obs"][b.indices])
    np.testing.assert_array_equal(d["next_obs"], batch["next_obs"][b.indices])
    np.testing.assert_array_equal(d["reward"], batch["reward"][b.indices])
    assert b.weights is None
    assert isinstance(b.data, pa.RecordBatch) and b.data.num_rows == 200


def test_rows_visible_when_extend_returns_and_unsealed():
    store = small_store(capacity=1000, chunk_rows=64)
    batch, _ = make_episodes([10])
    store.extend(batch)
    assert len(store) == 10 and store.to_table().num_rows == 10
    assert store.chunks().column("sealed").to_pylist() == [False]
    b = store.sample(50)
    assert set(b.indices) <= set(range(10))


def test_append_equals_extend():
    batch, _ = make_episodes([4, 6, 5], seed=3)
    a, b = small_store(), small_store()
    a.extend(batch)
    for i in range(len(batch["obs"])):
        step = {k: v[i] for k, v in batch.items()}
        step["reward"] = float(step["reward"])
        step["action"] = int(step["action"])
        step["terminated"] = bool(step["terminated"])
        step["truncated"] = bool(step["truncated"])
        b.append(step)
    ta, tb = a.to_table(), b.to_table()
    assert ta.equals(tb)
    sa, sb = a.sample(64), b.sample(64)
    np.testing.assert_array_equal(sa.indices, sb.indices)
    np.testing.assert_array_equal(sa["next_obs"], sb["next_obs"])


def test_append_slow_path_converts_lists():
    store = small_store()
    seq = store.append({"obs": [1, 2, 3], "action": 1, "reward": 0.5, "terminated": 1, "truncated": False,
                        "next_obs": [2, 3, 4]})
    assert seq == 0 and len(store) == 1
    np.testing.assert_array_equal(store.sample(1)["next_obs"][0], [2, 3, 4])


@pytest.mark.parametrize("chunk_rows", [4, 7, 16])
def test_ring_eviction_order_across_chunks(chunk_rows):
    store = small_store(capacity=20, chunk_rows=chunk_rows)
    seen = []
    for k in range(9):  # 9 batches of 7 rows: wraps the ring several times, batches straddle chunks
        batch, _ = make_episodes([7], seed=k, start=1000.0 * k)
        store.extend(batch)
        seen.append(batch["obs"][:, 0])
        t = store.to_table()
        expected = np.concatenate(seen)[-20:]
        got = np.asarray(t.column("obs").combine_chunks().to_numpy_ndarray())[:, 0]
        np.testing.assert_array_equal(got, expected)
        assert len(store) == min(20, 7 * (k + 1))
        seqs = t.column("seq").to_numpy()
        np.testing.assert_array_equal(seqs, np.arange(7 * (k + 1) - len(store), 7 * (k + 1)))
    # sampling never returns an evicted row
    b = store.sample(500)
    assert b.indices.min() >= 63 - 20
    np.testing.assert_array_equal(b["obs"][:, 0], np.concatenate(seen)[b.indices])


def test_extend_longer_than_capacity_keeps_newest():
    store = small_store(capacity=10, chunk_rows=4)
    store.extend(make_episodes([3])[0])
    batch, _ = make_episodes([25], seed=1, start=500.0)
    ids = store.extend(batch)
    np.testing.assert_array_equal(ids, np.arange(3, 28))
    assert len(store) == 10
    t = store.to_table()
    np.testing.assert_array_equal(t.column("seq").to_numpy(), np.arange(18, 28))
    np.testing.assert_array_equal(np.asarray(t.column("obs").combine_chunks().to_numpy_ndarray()),
                                  batch["obs"][-10:])
    b = store.sample(100)
    np.testing.assert_array_equal(b["next_obs"], batch["next_obs"][b.indices - 3])


def test_interleaved_actors_exact_next_obs():
    """Three actors interleave step by step and in chunks; next_obs is exact, also across chunk boundaries."""
    rng = np.random.default_rng(7)
    store = small_store(capacity=10_000, chunk_rows=8)
    per_actor = {a: make_episodes(list(rng.integers(1, 12, size=6)), seed=a, start=10_000.0 * a)[0]
                 for a in range(3)}
    cursor = {a: 0 for a in range(3)}
    rows = []  # (actor, index) in insert order
    while any(cursor[a] < len(per_actor[a]["obs"]) for a in range(3)):
        a = int(rng.integers(0, 3))
        n0 = cursor[a]
        if n0 >= len(per_actor[a]["obs"]):
            continue
        k = int(rng.integers(1, 5))
        part = {key: v[n0:n0 + k] for key, v in per_actor[a].items()}
        m = len(part["obs"])
        part["actor"] = np.full(m, a)
        store.extend(part)
        rows.extend((a, n0 + j) for j in range(m))
        cursor[a] += m
    assert len(store) == len(rows)
    b = store.sample(2000)
    for seq, nobs, obs in zip(b.indices, b["next_obs"], b["obs"]):
        a, i = rows[seq]
        np.testing.assert_array_equal(obs, per_actor[a]["obs"][i])
        np.testing.assert_array_equal(nobs, per_actor[a]["next_obs"][i])
    # every row is sampleable: all episodes of all actors ended
    assert set(b.indices) == set(range(len(rows)))
    eps = store.episodes()
    assert eps.num_rows == sum(18 for _ in range(1))  # 3 actors x 6 episodes
    assert all(eps.column("complete").to_pylist())


def test_pending_step_is_not_sampled():
    store = small_store()
    batch, _ = make_episodes([5])
    batch["terminated"][:] = False
    batch["truncated"][:] = False
    store.extend(batch)  # episode still running: the last step has no next_obs yet
    assert len(store) == 5
    b = store.sample(500)
    assert 4 not in b.indices and set(b.indices) == {0, 1, 2, 3}
    more, _ = make_episodes([1], start=4.0 + 1)
    store.extend({k: v for k, v in more.items()})
    b = store.sample(500)
    assert 4 in b.indices


def test_only_pending_rows_times_out():
    store = small_store()
    store.append({"obs": np.zeros(3, np.float32), "action": 0, "reward": 0.0, "terminated": False,
                  "truncated": False})
    with pytest.raises(ab.SampleTimeout):
        store.sample(4)


def test_final_observation_needed_on_episode_end():
    store = small_store()
    batch, _ = make_episodes([3])
    del batch["next_obs"]
    with pytest.raises(ab.SchemaError, match="next_obs"):
        store.extend(batch)
    assert len(store) == 0


def test_explicit_episode_ids():
    store = small_store()
    batch, _ = make_episodes([3])
    batch["episode_id"] = np.full(3, 42)
    store.extend(batch)
    t = store.to_table()
    assert t.column("episode_id").to_pylist() == [42, 42, 42]
    assert t.column("step").to_pylist() == [0, 1, 2]
    with pytest.raises(ab.SchemaError, match="already ended"):
        store.extend(batch)
    assert len(store) == 3


def test_chi_square_uniform():
    store = small_store(capacity=50, seed=123)
    batch, _ = make_episodes([20, 30, 10])  # 60 rows into a 50-row ring
    store.extend(batch)
    counts = np.bincount(store.sample(100_000).indices - 10, minlength=50)
    assert counts.sum() == 100_000 and len(counts) == 50
    assert chi_square_p(counts, np.full(50, 100_000 / 50)) > 1e-3


def test_seed_makes_sampling_reproducible():
    batch, _ = make_episodes([30, 30])
    a, b = small_store(seed=5), small_store(seed=5)
    a.extend(batch)
    b.extend(batch)
    for _ in range(3):
        np.testing.assert_array_equal(a.sample(32).indices, b.sample(32).indices)


def test_columns_selection_and_system_columns():
    store = small_store()
    store.extend(make_episodes([10])[0])
    b = store.sample(8, columns=["reward", "episode_id", "step", "seq"])
    assert b.columns == ["reward", "episode_id", "step", "seq"]
    np.testing.assert_array_equal(b["seq"], b.indices)
    np.testing.assert_array_equal(b["step"], b.indices)
    with pytest.raises(ab.SchemaError, match="unknown column"):
        store.sample(8, columns=["nope"])


def test_fifo_delivers_in_order_once():
    store = small_store(sampler="fifo")
    store.extend(make_episodes([10])[0])
    got = np.concatenate([store.sample(3).indices for _ in range(3)])
    np.testing.assert_array_equal(got, np.arange(9))
    with pytest.raises(ab.SampleTimeout):
        store.sample(3)
    assert store.sample(1).indices.tolist() == [9]


def test_sample_timeout_on_empty_store_and_waits():
    store = small_store()
    with pytest.raises(ab.SampleTimeout) as err:
        store.sample(4)
    assert isinstance(err.value, TimeoutError) and "empty" in str(err.value)
    with pytest.raises(ab.SampleTimeout):
        store.sample(4, timeout=0.05)
    batch, _ = make_episodes([5])
    writer = threading.Timer(0.05, store.extend, args=(batch,))
    writer.start()
    b = store.sample(4, timeout=10)
    writer.join()
    assert len(b) == 4


def test_min_size_rate_limiter():
    store = small_store(rate_limiter=ab.rate_limiters.MinSize(8))
    store.extend(make_episodes([5])[0])
    with pytest.raises(ab.SampleTimeout, match="MinSize"):
        store.sample(2)
    store.extend(make_episodes([5], start=100.0)[0])
    assert len(store.sample(2)) == 2


def test_to_table_is_a_snapshot_not_a_view():
    """to_table copies the rows it reads: writers overwriting the ring later leave the table as it was."""
    store = ab.ExperienceStore(ab.load_schema(SCHEMAS / "mujoco.yaml"), capacity=1000, chunk_rows=128)
    n = 300
    o = np.random.rand(n + 1, 376).astype(np.float32)
    t = np.zeros(n, bool)
    t[-1] = True
    batch = {"obs": o[:-1], "action": np.zeros((n, 17), np.float32), "reward": np.ones(n, np.float32),
             "terminated": t, "truncated": np.zeros(n, bool), "next_obs": o[1:]}
    store.extend(batch)
    table = store.to_table()
    arena = store._arenas["obs"]
    lo, hi = arena.ctypes.data, arena.ctypes.data + arena.nbytes
    for chunk in table.column("obs").chunks:
        assert not lo <= chunk.storage.values.buffers()[1].address < hi
    assert table.column("obs").num_chunks == 3  # 128 + 128 + 44 rows
    for _ in range(5):  # the whole ring replaced
        store.extend({k: np.zeros_like(v) for k, v in batch.items()})
    np.testing.assert_array_equal(np.asarray(table.column("obs").combine_chunks().to_numpy_ndarray()), o[:-1])
    np.testing.assert_array_equal(table.column("seq").to_numpy(), np.arange(n))


def test_close_is_idempotent_and_refuses_calls():
    store = small_store()
    store.extend(make_episodes([3])[0])
    store.close()
    store.close()
    with pytest.raises(ab.StoreClosed):
        store.sample(1)
    with pytest.raises(ab.StoreClosed):
        store.extend(make_episodes([3])[0])
    with small_store() as s2:
        s2.extend(make_episodes([2])[0])
    assert s2.closed


def test_ragged_tokens_schema():
    store = ab.ExperienceStore(ab.load_schema(SCHEMAS / "tokens.yaml"), capacity=8, seed=0)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(12):
        p = rng.integers(0, 100, rng.integers(1, 6)).astype(np.int32)
        r = rng.integers(0, 100, rng.integers(0, 9)).astype(np.int32)
        lp = rng.normal(size=len(r)).astype(np.float32)
        rows.append((p, r, lp))
        store.append({"prompt_tokens": p, "response_tokens": r, "logprobs": lp, "reward": float(i),
                      "done": True, "policy_version": i})
    assert len(store) == 8
    b = store.sample(50)
    d = b.to_numpy()
    for k, seq in enumerate(b.indices):
        p, r, lp = rows[seq]
        np.testing.assert_array_equal(d["prompt_tokens"][k], p)
        np.testing.assert_array_equal(d["response_tokens"][k], r)
        np.testing.assert_allclose(d["logprobs"][k], lp)
    t = store.to_table()
    assert t.column("reward").to_pylist() == [float(i) for i in range(4, 12)]
    with pytest.raises(ab.SchemaError, match="1-D"):
        store.append({"prompt_tokens": [[1, 2]], "response_tokens": [1], "logprobs": [0.1], "reward": 0.0,
                      "done": True, "policy_version": 0})


# ---------------------------------------------------------------- bad input leaves the store unchanged
def _good_batch(n, seed=0):
    batch, _ = make_episodes([n], seed=seed, start=77.0)
    return batch


BAD_KINDS = ["wrong_dtype", "wrong_shape", "missing", "unknown", "ragged_where_fixed", "nan", "length_mismatch",
             "float_to_int", "int_overflow", "not_a_batch"]


def _corrupt(batch, kind, data):
    b = dict(batch)
    n = len(b["obs"])
    if kind == "wrong_dtype":
        b["terminated"] = np.full(n, 0.5)
    elif kind == "wrong_shape":
        b["obs"] = np.zeros((n, data.draw(st.sampled_from([2, 4, 9]))), np.float32)
    elif kind == "missing":
        del b[data.draw(st.sampled_from(["obs", "action", "reward", "terminated", "truncated"]))]
    elif kind == "unknown":
        b[data.draw(st.sampled_from(["colour", "next_reward", "obs2"]))] = np.zeros(n)
    elif kind == "ragged_where_fixed":
        b["obs"] = [np.zeros(3, np.float32)] * (n - 1) + [np.zeros(2, np.float32)]
    elif kind == "nan":
        b["reward"] = b["reward"].copy()
        b["reward"][data.draw(st.integers(0, n - 1))] = np.nan
    elif kind == "length_mismatch":
        b["action"] = b["action"][:-1]
    elif kind == "float_to_int":
        b["action"] = b["action"] + 0.5
    elif kind == "int_overflow":
        b["action"] = np.full(n, 2**40, dtype=np.uint64) * 2**23
    elif kind == "not_a_batch":
        b = [1, 2, 3]
    return b


NAN_SCHEMA = {**SMALL, "fields": {**SMALL["fields"], "reward": {"dtype": "float32", "allow_nan": False}}}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), kind=st.sampled_from(BAD_KINDS), n=st.integers(2, 12), prefill=st.integers(0, 40))
def test_bad_input_raises_and_changes_nothing(data, kind, n, prefill):
    store = ab.ExperienceStore(ab.load_schema(NAN_SCHEMA), capacity=30, seed=0, chunk_rows=8)
    if prefill:
        good = _good_batch(prefill, seed=1)
        good["terminated"][:] = False
        good["truncated"][:] = False  # leave an episode open: its state must survive the bad batch too
        store.extend(good)
    before = store_snapshot(store)
    bad = _corrupt(_good_batch(n), kind, data)
    with pytest.raises(ab.SchemaError) as err:
        store.extend(bad)
    assert isinstance(err.value, ValueError)
    if kind in ("wrong_dtype", "wrong_shape", "nan", "float_to_int", "int_overflow", "ragged_where_fixed"):
        field = {"wrong_dtype": "terminated", "wrong_shape": "obs", "nan": "reward", "float_to_int": "action",
                 "int_overflow": "action", "ragged_where_fixed": "obs"}[kind]
        assert repr(field) in str(err.value)
    assert store_snapshot(store) == before
    if kind != "not_a_batch" and isinstance(bad, dict) and n > 1:
        step = {k: v[0] for k, v in bad.items() if hasattr(v, "__len__") and len(v)}
        try:
            store.append(step)
        except ab.SchemaError:
            assert store_snapshot(store) == before


def test_pyarrow_inputs():
    store = small_store()
    batch, _ = make_episodes([6])
    arrays = {k: (pa.FixedShapeTensorArray.from_numpy_ndarray(v) if v.ndim > 1 else pa.array(v))
              for k, v in batch.items()}
    rb = pa.RecordBatch.from_pydict(arrays)
    store.extend(rb)
    store.extend(pa.Table.from_batches([rb]))
    assert len(store) == 12
    t = store.to_table()
    np.testing.assert_array_equal(np.asarray(t.column("obs").combine_chunks().to_numpy_ndarray())[:6],
                                  batch["obs"])
    bad = pa.RecordBatch.from_pydict({**arrays, "action": pa.array(batch["action"].astype(np.float64) + 0.1)})
    with pytest.raises(ab.SchemaError, match="action"):
        store.extend(bad)
    assert len(store) == 12


def test_concurrent_extend_and_sample_never_tears():
    """Rows encode their seq in every column; a torn row would mix two seqs."""
    schema = ab.load_schema({"name": "t", "fields": {"a": {"dtype": "int64", "shape": [64]},
                                                     "b": {"dtype": "int64"}, "done": {"dtype": "bool"}}})
    store = ab.ExperienceStore(schema, capacity=256, chunk_rows=16, seed=0)
    stop = threading.Event()
    errors = []

    def writer():
        seq = 0
        try:
            while not stop.is_set() and seq < 200_000:
                n = 37
                vals = np.arange(seq, seq + n, dtype=np.int64)
                store.extend({"a": np.repeat(vals[:, None], 64, axis=1), "b": vals, "done": np.ones(n, bool)})
                seq += n
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=writer)]
    for t in threads:
        t.start()
    try:
        for _ in range(400):
            b = store.sample(128, columns=["a", "b", "seq"], timeout=10)
            assert (b["a"] == b["b"][:, None]).all()
            np.testing.assert_array_equal(b["b"], b.indices)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors


def test_take_reads_rows_by_id_in_the_given_order():
    store = ab.ExperienceStore(SMALL, capacity=8)
    eps = {"obs": np.arange(36, dtype=np.float32).reshape(12, 3), "action": np.arange(12),
           "reward": np.arange(12, dtype=np.float32), "terminated": np.arange(12) % 5 == 4,
           "truncated": np.zeros(12, bool), "next_obs": np.zeros((12, 3), np.float32)}
    ids = store.extend(eps)
    batch = store.take(ids[[11, 4, 7, 4]], columns=["obs", "action"])
    got = batch.to_numpy()
    assert got["action"].tolist() == [11, 4, 7, 4] and np.array_equal(got["obs"], eps["obs"][[11, 4, 7, 4]])
    assert batch.indices.tolist() == ids[[11, 4, 7, 4]].tolist() and batch.weights is None
    assert store.stats()["samples"] == 0
    with pytest.raises(ab.InvalidArgument, match="no stored row"):
        store.take(ids[[0, 5]])  # 0..3 were evicted by the ring of 8
    with pytest.raises(ab.InvalidArgument, match="no stored row"):
        store.take([999])
    store.close()
