"""Tests for arrowbuf.samplers.sumtree: sums, minima and prefix-sum search checked against brute force."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrowbuf.samplers.sumtree as sumtree_module
from arrowbuf.samplers.sumtree import MinTree, SumTree

# Capacities around the powers of two, below and above the summary level (2048 nodes), so both the flat
# search and the binary descent below it run.
CAPACITIES = [1, 2, 3, 5, 7, 100, 1000, 2047, 2048, 2049, 5000, 70_001]

HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(params=[None, 0, 3], ids=["default-summary", "summary-root", "summary-8"])
def summary_depth(request, monkeypatch):
    """Run a test with the default summary level, with none (pure binary descent) and with a tiny one."""
    if request.param is not None:
        monkeypatch.setattr(sumtree_module, "_SUMMARY_DEPTH", request.param)
    return request.param


def last_writes(idx, vals):
    """The (index, value) pairs that survive a batch when the last write of each index wins."""
    rev_idx, rev_vals = idx[::-1], vals[::-1]
    _, first_in_reversed = np.unique(rev_idx, return_index=True)
    return rev_idx[first_in_reversed], rev_vals[first_in_reversed]


def apply_batches(capacity, batches):
    """Feed batches of (indices, values) to fresh trees and to plain arrays."""
    sums, mins = SumTree(capacity), MinTree(capacity)
    ref_sum, ref_min = np.zeros(capacity), np.full(capacity, np.inf)
    for idx, vals in batches:
        sums.update(idx, vals)
        mins.update(idx, vals)
        i, v = last_writes(idx, vals)
        ref_sum[i] = v
        ref_min[i] = v
    return sums, mins, ref_sum, ref_min


def random_batches(capacity, rng, n_batches=6, zero_fraction=0.3):
    batches = []
    for _ in range(n_batches):
        size = int(rng.integers(1, 2 * capacity + 2))
        idx = rng.integers(0, capacity, size)  # duplicates are likely
        vals = rng.random(size) * 10.0
        vals[rng.random(size) < zero_fraction] = 0.0
        batches.append((idx, vals))
    return batches


def check_search(sums, ref, targets):
    """find_prefixsum agrees with np.searchsorted over the cumulative sum, up to rounding at the boundaries."""
    got = sums.find_prefixsum(targets)
    assert got.dtype == np.int64 and got.shape == targets.shape
    assert np.all((got >= 0) & (got < sums.capacity))
    assert np.all(ref[got] > 0.0), "returned a zero-mass slot"
    cum = np.cumsum(ref)
    clamped = np.clip(targets, 0.0, sums.total() * (1 - 1e-12))
    want = np.minimum(np.searchsorted(cum, clamped, side="right"), len(ref) - 1)
    differ = got != want
    assert differ.mean() < 0.01
    if differ.any():
        # The tree adds in another order than np.cumsum: a disagreement is allowed only for a target within
        # rounding distance of the boundary between the two answers.
        lo = np.minimum(got, want)[differ]
        hi = np.maximum(got, want)[differ]
        t = clamped[differ]
        gap = np.minimum(np.abs(t - cum[lo]), np.abs(t - cum[hi - 1]))
        assert np.all(gap <= 1e-9 * max(cum[-1], 1.0)), (t, got[differ], want[differ])
        assert all(ref[a + 1 : b].sum() == 0.0 for a, b in zip(lo, hi))


# --- sums, gets and minima ---------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_totals_and_values_match_brute_force(capacity, summary_depth):
    rng = np.random.default_rng(capacity)
    sums, mins, ref_sum, ref_min = apply_batches(capacity, random_batches(capacity, rng))
    assert sums.total() == pytest.approx(ref_sum.sum(), rel=1e-12, abs=1e-12)
    np.testing.assert_array_equal(sums.get(np.arange(capacity)), ref_sum)
    np.testing.assert_array_equal(mins.get(np.arange(capacity)), ref_min)
    assert mins.min() == ref_min.min()


@given(
    capacity=st.integers(1, 3000),
    data=st.data(),
)
@HYPOTHESIS
def test_batched_updates_with_duplicates(capacity, data):
    n_batches = data.draw(st.integers(1, 5))
    batches = []
    for _ in range(n_batches):
        size = data.draw(st.integers(0, 40))
        idx = data.draw(st.lists(st.integers(0, capacity - 1), min_size=size, max_size=size))
        vals = data.draw(
            st.lists(
                st.one_of(st.just(0.0), st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False)),
                min_size=size,
                max_size=size,
            )
        )
        batches.append((np.array(idx, dtype=np.int64), np.array(vals, dtype=np.float64)))
    sums, mins, ref_sum, ref_min = apply_batches(capacity, batches)
    np.testing.assert_array_equal(sums.get(np.arange(capacity)), ref_sum)
    assert sums.total() == pytest.approx(ref_sum.sum(), rel=1e-12, abs=0.0)
    assert mins.min() == ref_min.min()


@pytest.mark.parametrize("batch", [3000, 40_000, 200_000])
def test_bulk_update_matches_small_batches(batch, summary_depth):
    """Large batches take another code path; node for node it must give the same tree as small ones."""
    capacity = 150_001
    rng = np.random.default_rng(batch)
    idx = rng.integers(0, capacity, batch)
    vals = rng.random(batch)
    for cls in (SumTree, MinTree):
        bulk, small = cls(capacity), cls(capacity)
        bulk.update(idx, vals)
        i, v = last_writes(idx, vals)
        for start in range(0, len(i), 1000):
            small.update(i[start : start + 1000], v[start : start + 1000])
        np.testing.assert_array_equal(bulk._tree, small._tree)
    assert bulk.min() == small.min()


def test_last_writes_helper():
    i, v = last_writes(np.array([3, 1, 3]), np.array([1.0, 2.0, 3.0]))
    assert dict(zip(i.tolist(), v.tolist())) == {1: 2.0, 3: 3.0}


def test_last_write_wins():
    sums, mins = SumTree(10), MinTree(10)
    idx = np.array([3, 7, 3, 3, 7, 1])
    vals = np.array([1.0, 2.0, 5.0, 4.0, 0.5, 9.0])
    sums.update(idx, vals)
    mins.update(idx, vals)
    assert sums.get(np.array([1, 3, 7])).tolist() == [9.0, 4.0, 0.5]
    assert sums.total() == 13.5
    assert mins.min() == 0.5


def test_negative_zero_is_a_zero_priority():
    sums = SumTree(4)
    sums.update(np.arange(4), np.array([-0.0, 1.0, -0.0, 2.0]))
    assert sums.total() == 3.0
    assert set(sums.sample(50, np.random.default_rng(1)).tolist()) <= {1, 3}


def test_scalar_value_and_any_index_dtype():
    sums = SumTree(6)
    sums.update(np.array([0, 2, 4], dtype=np.int32), 2.5)
    assert sums.total() == 7.5
    assert sums.get([[0, 1], [2, 4]]).tolist() == [[2.5, 0.0], [2.5, 2.5]]


def test_min_tree_starts_at_inf_and_tracks_clears():
    mins = MinTree(300)
    assert mins.min() == math.inf
    mins.update(np.arange(300), np.linspace(1.0, 3.0, 300))
    assert mins.min() == 1.0
    mins.update(np.array([0]), np.array([np.inf]))  # emptied slot
    assert mins.min() == pytest.approx(1.0 + 2.0 / 299)
    mins.clear()
    assert mins.min() == math.inf


@pytest.mark.parametrize("capacity", [1, 5, 2049, 70_001])
def test_min_tree_random(capacity, summary_depth):
    rng = np.random.default_rng(7)
    mins, ref = MinTree(capacity), np.full(capacity, np.inf)
    for _ in range(10):
        idx = rng.integers(0, capacity, 64)
        vals = rng.normal(size=64)
        vals[rng.random(64) < 0.2] = np.inf
        mins.update(idx, vals)
        i, v = last_writes(idx, vals)
        ref[i] = v
        assert mins.min() == ref.min()


# --- prefix-sum search -------------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_find_prefixsum_matches_searchsorted(capacity, summary_depth):
    rng = np.random.default_rng(capacity + 1)
    sums, _, ref, _ = apply_batches(capacity, random_batches(capacity, rng))
    if ref.sum() == 0:
        sums.update(np.array([capacity - 1]), np.array([1.0]))
        ref[-1] = 1.0
    targets = rng.random(5000) * ref.sum()
    check_search(sums, ref, targets)
    check_search(sums, ref, targets.reshape(50, 100))


@pytest.mark.parametrize("capacity", [7, 2049, 70_001])
def test_guarded_search_agrees(capacity, summary_depth):
    """The slow path used after rounding trouble gives the same answers as the fast path."""
    rng = np.random.default_rng(capacity + 2)
    sums, _, ref, _ = apply_batches(capacity, random_batches(capacity, rng))
    targets = np.minimum(rng.random(3000) * ref.sum(), sums.total() * (1 - 1e-12))
    fast = sums.find_prefixsum(targets)
    np.testing.assert_array_equal(sums._find_guarded(targets.copy()), fast)


def test_subnormal_total_uses_guarded_search(summary_depth):
    """With a subnormal total the clamp below total cannot move a target: the fallback must catch it."""
    capacity = 4099
    sums = SumTree(capacity)
    sums.update(np.array([5, 1800, 4000]), np.array([5e-324, 5e-324, 5e-324]))
    total = sums.total()
    assert total == 1.5e-323
    got = sums.find_prefixsum(np.array([0.0, 5e-324, 1e-323, total, 1.0, np.inf]))
    assert got.tolist() == [5, 1800, 4000, 4000, 4000, 4000]
    assert set(sums.sample(100, np.random.default_rng(0)).tolist()) <= {5, 1800, 4000}


def test_find_prefixsum_exact_boundaries():
    sums = SumTree(6)
    sums.update(np.arange(6), np.array([1.0, 0.0, 2.0, 0.0, 0.0, 3.0]))
    # slot i owns [cum[i-1], cum[i]): a boundary belongs to the next slot of positive mass
    got = sums.find_prefixsum(np.array([0.0, 0.5, 1.0, 2.999, 3.0, 5.999, 6.0, 100.0, -1.0]))
    assert got.tolist() == [0, 0, 2, 2, 5, 5, 5, 5, 0]


@given(
    capacity=st.integers(1, 5000),
    data=st.data(),
)
@HYPOTHESIS
def test_never_returns_zero_mass(capacity, data):
    """Sparse, wildly scaled priorities and adversarial targets never yield an empty or padding slot."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    ref = np.zeros(capacity)
    k = data.draw(st.integers(1, min(capacity, 20)))
    slots = rng.choice(capacity, k, replace=False)
    scales = data.draw(st.lists(st.sampled_from([5e-324, 1e-300, 1e-12, 1.0, 1e12, 1e200]), min_size=k, max_size=k))
    ref[slots] = rng.random(k) * np.array(scales) + np.array(scales)
    sums = SumTree(capacity)
    sums.update(np.arange(capacity), ref)
    total = sums.total()
    cum = np.cumsum(ref)
    targets = np.concatenate(
        [
            [0.0, -0.0, -1.0, total, np.nextafter(total, 0.0), total * (1 - 1e-16), 2 * total, np.inf],
            cum,
            np.nextafter(cum, 0.0),
            np.nextafter(cum, np.inf),
            rng.random(200) * total,
        ]
    )
    got = sums.find_prefixsum(targets)
    assert np.all((got >= 0) & (got < capacity))
    assert np.all(ref[got] > 0.0)
    for stratified in (True, False):
        drawn = sums.sample(300, rng, stratified=stratified)
        assert np.all(ref[drawn] > 0.0)


def test_descent_leaves_no_zero_mass_after_churn(summary_depth):
    """Many updates that zero most slots, then search right at every cumulative boundary."""
    rng = np.random.default_rng(3)
    capacity = 4099
    sums, ref = SumTree(capacity), np.zeros(capacity)
    for _ in range(30):
        idx = rng.integers(0, capacity, 500)
        vals = rng.random(500) * (rng.random(500) < 0.05) * 10.0 ** rng.integers(-8, 8, 500)
        sums.update(idx, vals)
        for i, v in zip(idx.tolist(), vals.tolist()):  # plain sequential writes as the reference here
            ref[i] = v
    cum = np.cumsum(ref)
    targets = np.concatenate([cum, np.nextafter(cum, 0.0), np.nextafter(cum, np.inf)])
    assert np.all(ref[sums.find_prefixsum(targets)] > 0.0)


# --- sampling ----------------------------------------------------------------------------------------------


def chi2_sf(x: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (scipy if present, else Wilson-Hilferty)."""
    try:
        from scipy.stats import chi2
    except ImportError:
        z = ((x / dof) ** (1.0 / 3.0) - (1.0 - 2.0 / (9.0 * dof))) / math.sqrt(2.0 / (9.0 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2.0))
    return float(chi2.sf(x, dof))


def test_chi2_sf_approximation():
    # reference values of the chi-square upper tail
    assert chi2_sf(30.144, 19) == pytest.approx(0.05, abs=0.003)
    assert chi2_sf(63.691, 40) == pytest.approx(0.01, abs=0.001)
    assert chi2_sf(40.0, 40) == pytest.approx(0.4707, abs=0.005)


@pytest.mark.parametrize("capacity", [50, 3001])
@pytest.mark.parametrize("stratified", [False, True])
def test_sampling_frequencies_match_priorities(capacity, stratified, summary_depth):
    rng = np.random.default_rng(12345)
    prio = rng.random(capacity) ** 2
    prio[rng.random(capacity) < 0.2] = 0.0
    sums = SumTree(capacity)
    sums.update(np.arange(capacity), prio)
    n_draws = 400 * capacity if capacity < 1000 else 200_000
    draws = np.concatenate([sums.sample(1000, rng, stratified=stratified) for _ in range(n_draws // 1000)])
    counts = np.bincount(draws, minlength=capacity)
    assert counts[prio == 0].sum() == 0
    expected = prio / prio.sum() * len(draws)
    keep = expected > 0
    if capacity > 1000:  # pool the tail so every bin expects at least 5
        order = np.argsort(expected)
        bins = np.array_split(order[expected[order] > 0], 200)
        obs = np.array([counts[b].sum() for b in bins])
        exp = np.array([expected[b].sum() for b in bins])
    else:
        obs, exp = counts[keep], expected[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    p = chi2_sf(stat, len(obs) - 1)
    assert p > 1e-3, (stat, len(obs), p)
    if stratified:
        # one draw per segment: much tighter than iid, the statistic sits far below its dof
        assert stat < len(obs)


def test_stratified_sample_one_per_segment():
    sums = SumTree(4)
    sums.update(np.arange(4), np.array([1.0, 1.0, 1.0, 1.0]))
    rng = np.random.default_rng(0)
    for _ in range(20):
        assert sorted(sums.sample(4, rng).tolist()) == [0, 1, 2, 3]
    assert sums.sample(0, rng).shape == (0,)


def test_sample_is_deterministic_with_seed():
    sums = SumTree(1000)
    sums.update(np.arange(1000), np.arange(1000, dtype=np.float64))
    a = sums.sample(64, np.random.default_rng(5), stratified=False)
    b = sums.sample(64, np.random.default_rng(5), stratified=False)
    np.testing.assert_array_equal(a, b)
    assert sums.sample(8).shape == (8,)  # default generator


# --- errors and misc ---------------------------------------------------------------------------------------


def test_errors():
    sums, mins = SumTree(5), MinTree(5)
    with pytest.raises(ValueError):
        SumTree(0)
    with pytest.raises(IndexError):
        sums.update(np.array([5]), np.array([1.0]))
    with pytest.raises(IndexError):
        sums.update(np.array([-1]), np.array([1.0]))
    with pytest.raises(IndexError):
        sums.get(np.array([0, -1]))
    with pytest.raises(IndexError):
        mins.get(np.array([5]))
    with pytest.raises(ValueError):
        sums.update(np.array([0, 1]), np.array([1.0]))
    with pytest.raises(TypeError):
        sums.update(np.array([1.5]), np.array([1.0]))
    with pytest.raises(TypeError):
        sums.get(np.array([True, False]))
    for bad in (-1.0, np.nan, np.inf):
        with pytest.raises(ValueError):
            sums.update(np.array([0]), np.array([bad]))
    with pytest.raises(ValueError):
        mins.update(np.array([0]), np.array([np.nan]))
    with pytest.raises(ValueError):
        sums.sample(4, np.random.default_rng(0))  # empty tree
    with pytest.raises(ValueError):
        sums.find_prefixsum(np.array([0.0]))
    sums.update(np.array([2]), np.array([1.0]))
    with pytest.raises(ValueError):
        sums.find_prefixsum(np.array([np.nan]))
    with pytest.raises(ValueError):
        sums.sample(-1)
    # a rejected batch leaves the tree as it was
    assert sums.total() == 1.0 and mins.min() == math.inf
    sums.update(np.array([], dtype=np.int64), np.array([]))
    sums.update([], [])
    assert sums.total() == 1.0
    assert sums.get([]).shape == (0,)


def test_len_repr_clear():
    sums = SumTree(12)
    assert len(sums) == sums.capacity == 12
    assert repr(sums) == "SumTree(capacity=12)"
    sums.update(np.arange(12), 1.0)
    sums.clear()
    assert sums.total() == 0.0


def test_docstring_examples():
    result = doctest.testmod(sumtree_module, extraglobs={"np": np})
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize("capacity", [1, 5, 2049, 70_001])
def test_single_slot_updates_match_batched(capacity, summary_depth):
    """The scalar path for one slot (a store's append) leaves the same tree, bit for bit, as one batch."""
    rng = np.random.default_rng(capacity)
    idx = rng.integers(0, capacity, 300)
    vals = rng.random(300) * 10.0
    vals[::7] = 0.0
    vals[::11] = -0.0
    one_s, one_m = SumTree(capacity), MinTree(capacity)
    for i, v in zip(idx, vals):
        one_s.update(np.array([i]), v if i % 2 else np.array([v]))
        one_m.update(np.array([i], dtype=np.uint32), np.array([v]))
    batch_s, batch_m, ref_s, ref_m = apply_batches(capacity, [(idx, vals)])
    np.testing.assert_array_equal(one_s._tree, batch_s._tree)
    np.testing.assert_array_equal(one_m._tree, batch_m._tree)
    assert one_s.total() == batch_s.total() and one_m.min() == batch_m.min()
    for bad in (-1.0, np.nan, np.inf):
        with pytest.raises(ValueError):
            one_s.update(np.array([0]), bad)
    with pytest.raises(ValueError):
        one_m.update(np.array([0]), np.nan)
    with pytest.raises(IndexError):
        one_s.update(np.array([capacity]), 1.0)
    with pytest.raises(IndexError):
        one_s.update(np.array([-1]), 1.0)
    with pytest.raises(TypeError):
        one_s.update(np.array([True]), 1.0)
    np.testing.assert_array_equal(one_s._tree, batch_s._tree)  # refused updates changed nothing
