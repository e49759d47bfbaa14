import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from conftest import SMALL, chi_square_p, make_episodes


def store_with(sampler, capacity=1000, **kw):
    return ab.ExperienceStore(ab.load_schema(SMALL), capacity=capacity, sampler=sampler, seed=kw.pop("seed", 0),
                              **kw)


# ---------------------------------------------------------------- prioritized
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("stratified", [False, True])
def test_prioritized_frequencies_match_p_alpha(alpha, stratified):
    store = store_with(ab.samplers.Prioritized(alpha=alpha, beta=0.4, eps=0.0, stratified=stratified), seed=11)
    store.extend(make_episodes([40])[0])
    pri = np.arange(1, 41, dtype=np.float64)
    assert store.update_priorities(np.arange(40), pri) == 40
    draws = 200_000
    counts = np.zeros(40)
    for _ in range(draws // 1000):
        counts += np.bincount(store.sample(1000).indices, minlength=40)
    expected = pri ** alpha / (pri ** alpha).sum() * draws
    assert chi_square_p(counts, expected) > 1e-3
    if alpha == 0.0:  # alpha = 0 is uniform
        assert chi_square_p(counts, np.full(40, draws / 40)) > 1e-3


def test_importance_weights_hand_computed():
    store = store_with(ab.samplers.Prioritized(alpha=1.0, beta=0.5, eps=0.0))
    store.extend(make_episodes([4])[0])
    store.update_priorities([0, 1, 2, 3], [1.0, 2.0, 3.0, 4.0])
    b = store.sample(64)
    # P(i) = p_i / 10; w_i = (N P(i))^-beta / max_j (N P(j))^-beta = (p_i / p_min)^-0.5
    expected = {0: 1.0, 1: 2 ** -0.5, 2: 3 ** -0.5, 3: 4 ** -0.5}
    for i, w in zip(b.indices, b.weights):
        assert w == pytest.approx(expected[int(i)], rel=1e-6)
    assert b.weights.max() <= 1.0


def test_new_items_get_max_priority():
    sampler = ab.samplers.Prioritized(alpha=1.0, beta=1.0, eps=0.0)
    store = store_with(sampler)
    store.extend(make_episodes([4])[0])
    store.update_priorities([0, 1, 2, 3], [1.0, 1.0, 1.0, 5.0])
    store.extend(make_episodes([2], start=100.0)[0])  # rows 4, 5 come in at priority 5
    np.testing.assert_allclose(sampler.probabilities(np.array([4, 5])), [5 / 18, 5 / 18])


def test_updates_to_evicted_or_recycled_ids_are_ignored():
    store = store_with(ab.samplers.Prioritized(), capacity=10, chunk_rows=4)
    store.extend(make_episodes([10])[0])
    old = store.sample(8).indices
    store.extend(make_episodes([25], start=50.0)[0])  # every old row evicted and its slot recycled
    assert store.update_priorities(old, np.full(len(old), 100.0)) == 0
    assert store.stats()["priority_updates_ignored"] == len(old)
    fresh = store.sample(5).indices
    assert store.update_priorities(fresh, np.ones(5)) == 5
    with pytest.raises(ValueError):
        store.update_priorities(fresh, np.ones(4))
    with pytest.raises(ValueError):
        store.update_priorities(fresh, np.full(5, np.nan))


def test_priorities_need_a_prioritized_sampler():
    store = store_with("uniform")
    store.extend(make_episodes([3])[0])
    with pytest.raises(ab.ArrowbufError, match="Prioritized"):
        store.update_priorities([0], [1.0])


# ---------------------------------------------------------------- fifo, lifo, removal
def test_fifo_each_item_once_in_order_producer_consumer():
    store = store_with("fifo", capacity=100_000)
    total = 3000
    got = []

    def producer():
        for k in range(total // 30):
            store.extend(make_episodes([30], seed=k, start=k * 100.0)[0])

    t = threading.Thread(target=producer)
    t.start()
    try:
        while len(got) < total:
            got.extend(store.sample(50, timeout=10).indices.tolist())
    finally:
        t.join()
    assert got == list(range(total))


def test_lifo_returns_newest():
    store = store_with("lifo")
    store.extend(make_episodes([10])[0])
    assert store.sample(3).indices.tolist() == [7, 8, 9]


def test_max_times_sampled_removes_items():
    store = store_with("fifo", max_times_sampled=1)
    store.extend(make_episodes([6])[0])
    assert store.sample(6).indices.tolist() == list(range(6))
    store2 = store_with("uniform", max_times_sampled=2, seed=3)
    store2.extend(make_episodes([5])[0])
    counts = np.zeros(5, int)
    for _ in range(5):
        counts += np.bincount(store2.sample(2).indices, minlength=5)
    assert counts.max() <= 2 + 1  # a batch may take the same row twice in its last allowed draw
    assert store2.stats()["removed"] >= 3
    with pytest.raises(ab.SampleTimeout):
        for _ in range(20):
            store2.sample(1)


# ---------------------------------------------------------------- sequences
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 15), min_size=2, max_size=12), actors=st.integers(1, 3),
       T=st.integers(1, 6), stride=st.integers(1, 3), capacity=st.integers(20, 200), seed=st.integers(0, 99))
# Regression (from the Hypothesis database): one complete window among 12 rows; rejection draws ran out and the
# second sample raised SampleTimeout although the window exists.
@example(lengths=[3, 4, 5], actors=1, T=5, stride=1, capacity=20, seed=1)
def test_sequences_never_cross_episodes(lengths, actors, T, stride, capacity, seed):
    store = store_with(ab.samplers.Sequence(length=T, stride=stride), capacity=capacity, chunk_rows=8, seed=seed)
    for i, n in enumerate(lengths):
        batch, _ = make_episodes([n], seed=i, start=i * 1000.0)
        batch["actor"] = np.full(n, i % actors)
        store.extend(batch)
    try:
        b = store.sample(32)
    except ab.SampleTimeout:
        assert all(n < T for n in lengths) or stride > 1 or capacity < T
        return
    d = b.to_numpy()
    ep = d.get("episode_id")
    s = store.sample(32, columns=["episode_id", "step", "obs", "next_obs"])
    assert s["episode_id"].shape == (32, T) and s["obs"].shape == (32, T, 3)
    assert (s["episode_id"] == s["episode_id"][:, :1]).all()
    assert (np.diff(s["step"], axis=1) == 1).all()
    assert (s["step"][:, 0] % stride == 0).all()
    # inside a window, obs[t+1] == next_obs[t]
    np.testing.assert_array_equal(s["obs"][:, 1:], s["next_obs"][:, :-1])
    assert ep is None


@pytest.mark.parametrize("priority", [False, True])
@pytest.mark.parametrize("distinct", [False, True])
def test_sequence_rare_complete_window_is_always_served(priority, distinct):
    """One complete window among ~200 rows: sample must serve it every time (rejection draws alone run out)."""
    pri = ab.samplers.Prioritized(alpha=1.0, beta=1.0) if priority else None
    store = store_with(ab.samplers.Sequence(length=5, priority=pri), max_times_sampled=1000 if distinct else None)
    batch, _ = make_episodes([4] * 50 + [5])
    store.extend(batch)
    n = 1 if distinct else 32
    for _ in range(20):
        s = store.sample(n, columns=["obs", "step"])
        assert s["obs"].shape == (n, 5, 3)
        assert (s["step"] == np.arange(5)).all()
        np.testing.assert_array_equal(s["obs"][:, :, 0], np.tile(s["obs"][:1, :1, 0] + np.arange(5), (n, 1)))
    if distinct:
        with pytest.raises(ab.SampleTimeout):
            store.sample(2)  # only one distinct complete window exists


def test_sequence_torch_shape_and_burn_in():
    torch = pytest.importorskip("torch")
    store = store_with(ab.samplers.Sequence(length=4, burn_in=2))
    store.extend(make_episodes([20, 20])[0])
    t = store.sample(8).to_torch()
    assert tuple(t["obs"].shape) == (8, 6, 3) and t["reward"].dtype == torch.float32


def test_prioritized_sequences():
    store = store_with(ab.samplers.Sequence(length=3, priority=ab.samplers.Prioritized(alpha=1.0, beta=1.0)))
    store.extend(make_episodes([10, 10])[0])
    b = store.sample(16)
    assert b.weights is not None and b.weights.shape == (16,)
    store.update_priorities(b.indices, np.ones(16))


# ---------------------------------------------------------------- n-step
def reference_n_step(batch, t, k, gamma):
    """Plain Python loop: returns, discount, bootstrap obs for row t of a single-actor batch."""
    ret, disc, j = 0.0, 1.0, t
    for i in range(k):
        ret += disc * float(batch["reward"][j])
        disc *= gamma
        if batch["terminated"][j]:
            return ret, 0.0, batch["next_obs"][j]
        if batch["truncated"][j] or i == k - 1:
            return ret, disc, batch["next_obs"][j]
        j += 1
    raise AssertionError


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=8), k=st.integers(1, 6),
       gamma=st.floats(0.5, 1.0), seed=st.integers(0, 999))
def test_n_step_matches_reference(lengths, k, gamma, seed):
    batch, _ = make_episodes(lengths, seed=seed)
    store = store_with("uniform", capacity=500, chunk_rows=8, seed=seed)
    store.extend(batch)
    b = store.sample(64, n_step=k, gamma=gamma)
    for row, i in enumerate(b.indices):
        ret, disc, boot = reference_n_step(batch, int(i), k, gamma)
        assert b["n_step_return"][row] == pytest.approx(ret, rel=1e-4, abs=1e-4)
        assert b["n_step_discount"][row] == pytest.approx(disc, rel=1e-5, abs=1e-6)
        np.testing.assert_array_equal(b["n_step_next_obs"][row], boot)


def test_n_step_stops_at_pending_successor():
    batch, _ = make_episodes([6])
    batch["terminated"][:] = batch["truncated"][:] = False
    store = store_with("uniform")
    store.extend(batch)  # rows 0..5, row 5 pending (not sampleable); row 4's window can't pass row 5
    b = store.sample(200, n_step=3, gamma=1.0)
    for row, i in enumerate(b.indices):
        m = min(3, 5 - int(i))
        assert b["n_step_return"][row] == pytest.approx(batch["reward"][i:i + m].sum(), rel=1e-5)
        np.testing.assert_array_equal(b["n_step_next_obs"][row], batch["obs"][i + m])


# ---------------------------------------------------------------- rate limiting
def test_sample_to_insert_ratio_two_threads():
    spi, buf, min_size = 2.0, 64.0, 32
    limiter = ab.rate_limiters.SampleToInsertRatio(samples_per_insert=spi, min_size=min_size, error_buffer=buf)
    store = store_with("uniform", capacity=100_000, rate_limiter=limiter)
    violations = []
    stop = threading.Event()

    def check():
        s = store.stats()
        if s["size"] >= min_size:
            diff = s["inserts"] * spi - s["samples"]
            if not (limiter.min_diff - 1e-9 <= diff <= limiter.max_diff + 1e-9):
                violations.append(diff)

    def writer():
        for k in range(200):
            if stop.is_set():
                return
            store.extend(make_episodes([4], seed=k, start=k * 10.0)[0], timeout=10)
            check()

    t = threading.Thread(target=writer)
    t.start()
    try:
        samples = 0
        while samples < 200 * 4 * spi - buf:
            samples += len(store.sample(8, timeout=10))
            check()
    finally:
        stop.set()
        t.join()
    assert not violations
    s = store.stats()
    assert abs(s["inserts"] * spi - s["samples"] - spi * min_size) <= buf


def test_timeouts_raise_the_right_errors():
    limiter = ab.rate_limiters.SampleToInsertRatio(samples_per_insert=1.0, min_size=2, error_buffer=4.0)
    store = store_with("uniform", rate_limiter=limiter)
    with pytest.raises(ab.SampleTimeout):
        store.sample(1, timeout=0.05)
    store.extend(make_episodes([2])[0], timeout=0.05)
    # inserts ahead of samples beyond the buffer: the next insert waits, then times out
    with pytest.raises(ab.InsertTimeout) as err:
        for k in range(10):
            store.extend(make_episodes([2], start=10.0 * (k + 1))[0], timeout=0.05)
    assert isinstance(err.value, TimeoutError)
    size = len(store)
    store.sample(4)  # sampling makes room again
    store.extend(make_episodes([1], start=999.0)[0], timeout=1)
    assert len(store) == size + 1


def test_rate_limiter_arguments():
    with pytest.raises(ValueError):
        ab.rate_limiters.SampleToInsertRatio(samples_per_insert=0)
    with pytest.raises(ValueError):
        ab.rate_limiters.SampleToInsertRatio(samples_per_insert=4.0, min_size=1, error_buffer=1.0)
    with pytest.raises(ValueError):
        ab.rate_limiters.MinSize(0)


# ---------------------------------------------------------------- semantics fixed in issue 14 / 17
@pytest.mark.parametrize("sampler", ["uniform", "prioritized", "lifo"])
def test_max_times_sampled_holds_within_a_batch(sampler):
    store = store_with(sampler, max_times_sampled=1)
    store.extend(make_episodes([4])[0])
    with pytest.raises(ab.SampleTimeout, match="distinct"):  # 10 distinct items do not exist: no short batch
        store.sample(10)
    assert store.stats()["removed"] == 0  # a refused sample uses nothing up
    b = store.sample(4)
    assert sorted(b.indices.tolist()) == [0, 1, 2, 3]
    with pytest.raises(ab.SampleTimeout):
        store.sample(1, timeout=0.01)


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_max_times_sampled_two_never_exceeded(sampler):
    store = store_with(sampler, max_times_sampled=2, seed=3)
    store.extend(make_episodes([5])[0])
    counts = np.zeros(5, int)
    for _ in range(5):
        idx = store.sample(2).indices
        assert len(set(idx.tolist())) == 2
        counts += np.bincount(idx, minlength=5)
    assert (counts == 2).all()
    with pytest.raises(ab.SampleTimeout):
        store.sample(1)


def test_n_step_horizon_does_not_shrink_at_used_up_rows():
    batch, _ = make_episodes([10])
    batch["reward"][:] = 1.0
    store = store_with("lifo", max_times_sampled=1)
    store.extend(batch)
    assert store.sample(5).indices.tolist() == [5, 6, 7, 8, 9]  # rows 5..9 are used up, but still stored
    b = store.sample(1, n_step=3, gamma=0.5)
    assert b.indices.tolist() == [4]
    assert b["n_step_return"][0] == pytest.approx(1.75)
    assert b["n_step_discount"][0] == pytest.approx(0.125)
    np.testing.assert_array_equal(b["n_step_next_obs"][0], batch["obs"][7])


def test_sequence_max_times_sampled_counts_windows():
    store = store_with(ab.samplers.Sequence(length=4), max_times_sampled=1, seed=5)
    store.extend(make_episodes([20])[0])
    starts = [int(store.sample(1).indices[0]) for _ in range(17)]  # a 20-step episode has 17 windows of 4
    assert sorted(starts) == list(range(17))
    with pytest.raises(ab.SampleTimeout):
        store.sample(1)
    again = store_with(ab.samplers.Sequence(length=4), max_times_sampled=1, seed=6)
    again.extend(make_episodes([20])[0])
    b = again.sample(17, columns=["step", "obs"])  # one batch: 17 different windows
    assert sorted(b.indices.tolist()) == list(range(17))
    assert (b["step"][:, 0] == b.indices).all() and (np.diff(b["step"], axis=1) == 1).all()


def test_zero_priority_has_probability_zero_and_keeps_weights():
    sampler = ab.samplers.Prioritized(alpha=1.0, beta=1.0, eps=0.0)
    store = store_with(sampler)
    store.extend(make_episodes([4])[0])
    store.update_priorities([0, 1, 2, 3], [0.0, 1.0, 2.0, 4.0])
    b = store.sample(2000)
    assert 0 not in set(b.indices.tolist())
    expected = {1: 1.0, 2: 0.5, 3: 0.25}  # (P(i) / P_min)^-1 with P_min the smallest positive probability
    for i, w in zip(b.indices, b.weights):
        assert w == pytest.approx(expected[int(i)])
    np.testing.assert_array_equal(sampler.mass(np.arange(4)), [0.0, 1.0, 2.0, 4.0])
    assert sampler.min_mass() == 1.0 and sampler.total_mass() == 7.0
    store.update_priorities([1, 2, 3], [0.0, 0.0, 0.0])  # nothing left with positive priority: nothing to serve
    with pytest.raises(ab.SampleTimeout):
        store.sample(1)


@pytest.mark.parametrize("bad", [1e308, np.inf, np.nan, -1.0])
def test_bad_priority_is_refused_and_changes_nothing(bad):
    sampler = ab.samplers.Prioritized(alpha=1.0, beta=1.0, eps=0.0)
    store = store_with(sampler)
    store.extend(make_episodes([4])[0])
    store.update_priorities([0, 1, 2, 3], [1.0, 2.0, 3.0, 4.0])
    before = (sampler.mass(np.arange(4)).tolist(), sampler.max_priority, store.stats()["priority_updates_ignored"])
    with pytest.raises(ab.InvalidArgument, match="priorit"):
        store.update_priorities([0, 1], [5.0, bad])
    assert (sampler.mass(np.arange(4)).tolist(), sampler.max_priority,
            store.stats()["priority_updates_ignored"]) == before
    b = store.sample(64)
    assert np.isfinite(b.weights).all() and b.weights.max() <= 1.0 and len(set(b.indices.tolist())) > 1


def test_priority_whose_power_would_overflow_is_refused_and_trees_recover():
    sampler = ab.samplers.Prioritized(alpha=3.0, beta=1.0, eps=0.0)
    store = store_with(sampler, capacity=16, chunk_rows=4)
    store.extend(make_episodes([8])[0])
    with pytest.raises(ab.InvalidArgument, match="overflow"):
        store.update_priorities([0], [1e90])  # 1e270 as a leaf: refused
    store.update_priorities(np.arange(8), np.full(8, 1e80))  # 1e240 per leaf: allowed, sums stay finite
    assert np.isfinite(sampler.total_mass())
    store.extend(make_episodes([30], start=500.0)[0])  # the whole ring replaced
    b = store.sample(64)
    assert np.isfinite(b.weights).all() and (b.weights > 0).all() and len(set(b.indices.tolist())) > 4


def test_validate_priorities_is_the_one_check():
    ids, pri = ab.samplers.validate_priorities([[1, 2]], [0.5, 2])
    assert ids.dtype == np.int64 and pri.dtype == np.float64 and ids.tolist() == [1, 2]
    for bad in ([1.0], [np.nan, 1.0], [1.0, -0.5], [1.0, 2 * ab.samplers.MAX_PRIORITY]):
        with pytest.raises(ab.InvalidArgument):
            ab.samplers.validate_priorities([1, 2], bad)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_n_step_columns_follow_the_reward_dtype(dtype):
    schema = {**SMALL, "fields": {**SMALL["fields"], "reward": {"dtype": dtype}}}
    store = ab.ExperienceStore(schema, capacity=100, seed=0)
    batch = make_episodes([10])[0]
    batch["reward"] = (batch["reward"].astype(np.float64) + 1e-9).astype(dtype)
    store.extend(batch)
    b = store.sample(8, n_step=3, gamma=1.0)
    assert b["n_step_return"].dtype == np.dtype(dtype) and b["n_step_discount"].dtype == np.dtype(dtype)


def test_a_sampler_binds_to_one_store():
    pri = ab.samplers.Prioritized()
    first = store_with(pri)
    with pytest.raises(ab.InvalidArgument, match="one store"):
        store_with(pri)
    with pytest.raises(ab.InvalidArgument, match="one store"):
        store_with(ab.samplers.Sequence(length=2, priority=pri))
    first.extend(make_episodes([5])[0])
    assert len(first.sample(4)) == 4  # the first store is untouched


def test_shm_attach_rebuilds_its_own_sampler():
    import os
    import uuid

    name = f"tsampler{os.getpid()}-{uuid.uuid4().hex[:8]}"
    pri = ab.samplers.Prioritized(alpha=1.0)
    with ab.ExperienceStore(ab.load_schema(SMALL), 100, sampler=pri, tier="shm", name=name) as owner:
        owner.extend(make_episodes([6])[0])
        with ab.ExperienceStore.attach(name) as other:
            assert other.sampler is not pri
            other.update_priorities([0], [8.0])  # one distribution in shared memory
            assert pri.mass(np.array([0]))[0] == pytest.approx(8.0 + pri.eps)
            assert len(other.sample(4)) == 4 and len(owner.sample(4)) == 4


@pytest.mark.parametrize("spec", ["uniform", "fifo", "lifo", "prioritized", "sequence"])
def test_every_sampler_states_its_mass(spec):
    sampler = ab.samplers.Sequence(length=2) if spec == "sequence" else ab.samplers.make_sampler(spec)
    store = store_with(sampler, capacity=40, chunk_rows=8)
    batch, _ = make_episodes([6])
    batch["terminated"][:] = batch["truncated"][:] = False
    store.extend(batch)  # rows 0..4 sampleable, row 5 waits for its successor
    mass = sampler.mass(np.arange(store.arena_rows))
    assert mass.dtype == np.float64 and mass.shape == (store.arena_rows,)
    np.testing.assert_array_equal(mass[:6], [1, 1, 1, 1, 1, 0])
    assert (mass[6:] == 0).all()
    assert sampler.total_mass() == 5.0 and sampler.min_mass() == 1.0
    if spec == "fifo":
        store.sample(2)
        np.testing.assert_array_equal(sampler.mass(np.arange(6)), [0, 0, 1, 1, 1, 0])
        assert sampler.total_mass() == 3.0
    if spec == "prioritized":
        store.update_priorities([1], [3.0 - sampler.eps])
        assert sampler.mass(np.array([1]))[0] == pytest.approx(3.0 ** sampler.alpha)


def _time_limit_schema(**extra):
    return {"name": "tl", "fields": {"obs": {"dtype": "float32", "shape": [3]}, "reward": {"dtype": "float32"},
                                     "terminated": {"dtype": "bool"}, "time_limit": {"dtype": "bool"}},
            "derived": {"next_obs": {"next_of": "obs"}}, "episode_end": ["terminated", "time_limit"], **extra}


def test_an_end_field_that_reads_as_a_time_limit_must_be_declared():
    with pytest.raises(ab.SchemaError, match="truncation"):
        ab.load_schema(_time_limit_schema())
    with pytest.raises(ab.SchemaError, match="truncation"):
        ab.load_schema({**_time_limit_schema(), "fields": {**_time_limit_schema()["fields"],
                                                           "timeout": {"dtype": "bool"}},
                        "episode_end": ["terminated", "timeout"]})
    with pytest.raises(ab.SchemaError, match="not an episode_end"):
        ab.load_schema(_time_limit_schema(truncation=["obs"]))
    with pytest.warns(UserWarning, match="finished"):
        ab.load_schema({"name": "w", "fields": {"finished": {"dtype": "bool"}}, "episode_end": ["finished"]})
    assert ab.load_schema(SMALL).truncation == ("truncated",)


def test_the_declared_truncation_field_bootstraps():
    schema = ab.load_schema(_time_limit_schema(truncation=["time_limit"]))
    assert schema.truncation == ("time_limit",)
    assert ab.load_schema(schema.to_arrow()).truncation == ("time_limit",)  # survives Arrow metadata and dicts
    assert ab.load_schema(schema.to_dict()).truncation == ("time_limit",)
    store = ab.ExperienceStore(schema, capacity=100, sampler="lifo", seed=0)
    obs = np.arange(9, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    store.extend({"obs": obs[:3], "reward": np.ones(3, np.float32), "terminated": np.zeros(3, bool),
                  "time_limit": np.array([False, False, True]), "next_obs": obs[1:4]})
    b = store.sample(3, n_step=5, gamma=0.5)  # rows 0..2; the time limit at row 2 cuts, but bootstraps
    assert b.indices.tolist() == [0, 1, 2]
    np.testing.assert_allclose(b["n_step_return"], [1.75, 1.5, 1.0])
    np.testing.assert_allclose(b["n_step_discount"], [0.125, 0.25, 0.5])
    terminating = ab.ExperienceStore(ab.load_schema(_time_limit_schema(truncation=[])), capacity=100,
                                     sampler="lifo", seed=0)
    terminating.extend({"obs": obs[:3], "reward": np.ones(3, np.float32), "terminated": np.zeros(3, bool),
                        "time_limit": np.array([False, False, True]), "next_obs": obs[1:4]})
    np.testing.assert_allclose(terminating.sample(3, n_step=5, gamma=0.5)["n_step_discount"], [0, 0, 0])


def test_prioritized_sequence_windows_are_distinct_and_weighted():
    seq = ab.samplers.Sequence(length=3, priority=ab.samplers.Prioritized(alpha=1.0, beta=1.0, eps=0.0))
    store = store_with(seq, max_times_sampled=1, seed=2)
    store.extend(make_episodes([12])[0])  # 10 windows
    store.update_priorities(np.arange(12), np.arange(1, 13, dtype=np.float64))
    np.testing.assert_array_equal(seq.mass(np.arange(3)), [1.0, 2.0, 3.0])  # the start distribution's mass
    b = store.sample(6, columns=["step"])
    assert len(set(b.indices.tolist())) == 6 and (b["step"][:, 0] == b.indices).all()
    assert b.weights is not None and np.isfinite(b.weights).all() and b.weights.max() <= 1.0
    rest = store.sample(4, columns=["step"]).indices.tolist()
    assert sorted(b.indices.tolist() + rest) == list(range(10))
    with pytest.raises(ab.SampleTimeout):
        store.sample(1)


def test_max_times_sampled_holds_across_concurrent_samplers():
    store = store_with("uniform", capacity=1000, max_times_sampled=1, seed=4)
    store.extend(make_episodes([300])[0])
    got: list[list[int]] = [[], []]

    def drain(out):
        while True:
            try:
                out.extend(store.sample(7).indices.tolist())
            except ab.SampleTimeout:
                return

    threads = [threading.Thread(target=drain, args=(g,)) for g in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    delivered = got[0] + got[1]
    assert len(delivered) == len(set(delivered)) and len(delivered) > 280


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6), actors=st.integers(1, 3),
       kind=st.sampled_from(["uniform", "prioritized", "lifo", "sequence"]), k=st.integers(1, 3),
       sizes=st.lists(st.integers(1, 9), min_size=1, max_size=8), seed=st.integers(0, 99))
def test_max_times_sampled_property(lengths, actors, kind, k, sizes, seed):
    """Any batches, then single draws until none is left: no item twice in a batch, and in the end every item that
    was ever eligible delivered exactly k times (pending rows and incomplete windows never)."""
    sampler = ab.samplers.Sequence(length=2) if kind == "sequence" else kind
    store = store_with(sampler, capacity=200, max_times_sampled=k, seed=seed)
    for i, n in enumerate(lengths):
        batch, _ = make_episodes([n], seed=i, start=i * 1000.0)
        if i % 2:  # some episodes stay open: their last row waits for a successor
            batch["terminated"][:] = batch["truncated"][:] = False
        batch["actor"] = np.full(n, i % actors)
        store.extend(batch)
    counts: dict[int, int] = {}

    def take(n):
        idx = store.sample(n).indices.tolist()
        assert len(set(idx)) == len(idx)
        for i in idx:
            counts[i] = counts.get(i, 0) + 1

    for n in sizes:
        try:
            take(n)
        except ab.SampleTimeout:
            pass
    while True:
        try:
            take(1)
        except ab.SampleTimeout:
            break
    assert set(counts.values()) <= {k}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6), k=st.integers(1, 5),
       gamma=st.floats(0.5, 1.0), kind=st.sampled_from(["uniform", "lifo", "prioritized"]), seed=st.integers(0, 99))
def test_n_step_with_used_up_rows_matches_reference(lengths, k, gamma, kind, seed):
    """Rows that max_times_sampled removed do not shorten later rows' n-step windows."""
    batch, _ = make_episodes(lengths, seed=seed)
    store = store_with(kind, capacity=500, chunk_rows=8, seed=seed, max_times_sampled=1)
    store.extend(batch)
    while True:
        try:
            b = store.sample(3, n_step=k, gamma=gamma)
        except ab.SampleTimeout:
            break
        for row, i in enumerate(b.indices):
            ret, disc, boot = reference_n_step(batch, int(i), k, gamma)
            assert b["n_step_return"][row] == pytest.approx(ret, rel=1e-4, abs=1e-4)
            assert b["n_step_discount"][row] == pytest.approx(disc, rel=1e-5, abs=1e-6)
            np.testing.assert_array_equal(b["n_step_next_obs"][row], boot)


@pytest.mark.parametrize("spec", ["fifo", "prioritized", "sequence"])
def test_sampler_state_survives_checkpoint_and_restore(tmp_path, spec):
    def make():
        if spec == "sequence":
            return ab.samplers.Sequence(length=2, priority=ab.samplers.Prioritized(alpha=1.0, beta=1.0, eps=0.0))
        return ab.samplers.Prioritized(alpha=1.0, beta=1.0, eps=0.0) if spec == "prioritized" else "fifo"

    store = store_with(make(), capacity=64, chunk_rows=8)
    store.extend(make_episodes([6])[0])
    if spec == "fifo":
        store.sample(2)
    else:
        store.update_priorities([0, 1, 2, 3], [0.0, 1.0, 2.0, 4.0])
    before = store.sampler.state(np.arange(6))
    store.checkpoint(tmp_path / "ckpt")
    again = ab.ExperienceStore.restore(tmp_path / "ckpt")
    meta, arrays = again.sampler.state(np.arange(6))
    assert meta == before[0] and arrays.keys() == before[1].keys()
    for k in arrays:
        np.testing.assert_array_equal(arrays[k], before[1][k])
    if spec != "fifo":
        assert again.sampler.min_mass() == 1.0  # a zero priority does not become P_min after a restore
        assert np.isfinite(again.sample(8).weights).all()


def test_a_custom_sampler_without_state_cannot_be_checkpointed(tmp_path):
    class Newest(ab.samplers.Sampler):
        def select(self, n, *, distinct=False):
            hi = self.index.hi
            return (np.arange(hi - n, hi), None) if hi >= n else None

    store = store_with(Newest())
    store.extend(make_episodes([4])[0])
    assert store.sample(2).indices.tolist() == [2, 3]
    with pytest.raises(ab.InvalidArgument, match="state"):
        store.checkpoint(tmp_path / "ckpt")


def _two_actors(store, b_steps):
    """Actor 0 writes one step and goes idle (its row waits for a successor); actor 1 writes `b_steps`."""
    a, _ = make_episodes([5], seed=1)
    a = {k: v[:1] for k, v in a.items()}
    a["terminated"][:] = a["truncated"][:] = False
    a["actor"] = np.zeros(1, int)
    store.extend(a)
    b, _ = make_episodes([b_steps], seed=2, start=100.0)
    b["actor"] = np.ones(b_steps, int)
    store.extend(b)
    return a


def test_fifo_strict_order_waits_for_an_idle_actor():
    store = store_with("fifo")
    _two_actors(store, 10)
    with pytest.raises(ab.SampleTimeout):  # row 0 waits for its next observation: the strict queue waits too
        store.sample(1)
    assert store.stats()["blocked_at"] == 0


def test_fifo_skip_pending_serves_around_an_idle_actor():
    store = store_with(ab.samplers.Fifo(skip_pending=True))
    a = _two_actors(store, 10)
    assert store.sampler.available() == 10
    assert store.sample(4).indices.tolist() == [1, 2, 3, 4]
    assert store.sample(6).indices.tolist() == [5, 6, 7, 8, 9, 10]
    with pytest.raises(ab.SampleTimeout):
        store.sample(1)
    nxt = {k: v.copy() for k, v in a.items()}
    nxt["obs"] = nxt["obs"] + 1
    nxt["terminated"][:] = True  # actor 0 comes back: row 0 is sampleable now, row 11 too (its episode ended)
    store.extend(nxt)
    assert store.sample(2).indices.tolist() == [0, 11]
    with pytest.raises(ab.SampleTimeout):
        store.sample(1)
    assert store.stats()["skipped_evicted"] == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6), st.booleans()), min_size=1, max_size=15),
       sizes=st.lists(st.integers(1, 5), min_size=1, max_size=20))
def test_fifo_skip_pending_delivers_each_row_once(steps, sizes):
    store = store_with(ab.samplers.Fifo(skip_pending=True), capacity=1000)
    seen: list[int] = []
    sizes = iter(sizes * 10)
    for i, (actor, n, end) in enumerate(steps):
        batch, _ = make_episodes([n], seed=i, start=i * 100.0)
        batch["terminated"][:] = False
        batch["truncated"][:] = False
        batch["terminated"][-1] = end
        batch["actor"] = np.full(n, actor)
        store.extend(batch)
        try:
            seen += store.sample(next(sizes, 1)).indices.tolist()
        except ab.SampleTimeout:
            pass
    while True:
        try:
            seen += store.sample(1).indices.tolist()
        except ab.SampleTimeout:
            break
    valid = store.index.valid[np.arange(len(store))]
    assert len(seen) == len(set(seen)) and sorted(seen) == np.flatnonzero(valid).tolist()


def test_fifo_skip_pending_state_survives_checkpoint(tmp_path):
    store = store_with(ab.samplers.Fifo(skip_pending=True), capacity=64, chunk_rows=8)
    a = _two_actors(store, 5)
    assert store.sample(3).indices.tolist() == [1, 2, 3]
    store.checkpoint(tmp_path / "ckpt")
    again = ab.ExperienceStore.restore(tmp_path / "ckpt")
    assert again.sample(2).indices.tolist() == [4, 5]
    nxt = {k: v.copy() for k, v in a.items()}
    nxt["terminated"][:] = True
    again.extend(nxt)
    assert again.sample(2).indices.tolist() == [0, 6]


def test_fifo_skip_pending_is_one_queue_across_attached_handles():
    import os
    import uuid

    name = f"tsampler{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with ab.ExperienceStore(ab.load_schema(SMALL), 100, sampler=ab.samplers.Fifo(skip_pending=True), tier="shm",
                            name=name) as owner:
        _two_actors(owner, 8)
        with ab.ExperienceStore.attach(name) as other:
            assert other.sampler.skip_pending
            got = owner.sample(3).indices.tolist() + other.sample(3).indices.tolist() + owner.sample(2).indices.tolist()
            assert got == [1, 2, 3, 4, 5, 6, 7, 8]
