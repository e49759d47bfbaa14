"""The write path (arrowbuf.engine.writer): atomic batches (threads, killed shared-memory writer processes), the rate limiter
waited for outside the write lock, end_episode() of an idle actor's open step, and loud final-observation drops.

Rows encode their batch: `action` is the batch number and `reward` the row's index inside it, so any table read
anywhere shows whether a batch is whole.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import uuid
import warnings

import numpy as np
import pytest
from conftest import SMALL, make_episodes, process_context

import arrowbuf as ab
from arrowbuf.tiers import shm

CTX = process_context()
JOIN_S = 60
BATCH = 100


def batch_rows(k: int, n: int = BATCH) -> dict[str, np.ndarray]:
    """Batch `k`: n rows, one episode per batch (it ends on the last row)."""
    end = np.zeros(n, bool)
    end[-1] = True
    obs = np.full((n, 3), k, np.float32)
    return {"obs": obs, "action": np.full(n, k, np.int64), "reward": np.arange(n, dtype=np.float32),
            "terminated": end, "truncated": np.zeros(n, bool), "next_obs": obs + 0.5}


def whole_batches(table) -> dict[int, int]:
    """batch number -> rows of it in `table`; asserts every row is its batch's own."""
    action = table.column("action").to_numpy()
    obs = table.column("obs").combine_chunks().to_numpy_ndarray()
    assert (obs == action[:, None]).all(), "a row carries another row's data"
    ks, counts = np.unique(action, return_counts=True)
    return dict(zip(ks.tolist(), counts.tolist()))


# ---------------------------------------------------------------------------------------------- threads
def test_a_batch_becomes_visible_at_once_never_a_prefix():
    """Readers look at the store in the middle of a batch (from inside the writer) and from another thread."""
    store = ab.ExperienceStore(SMALL, capacity=100 * BATCH, chunk_rows=16, seed=0)  # spare chunk: 16 rows
    seen: list[tuple[int, int]] = []
    write = store._cols.write

    def look_while_writing(*args, **kwargs):  # a reader's view while the batch is half written
        seen.append((len(store), store.to_table(["seq"]).num_rows))
        return write(*args, **kwargs)

    store._cols.write = look_while_writing
    ids = store.extend(batch_rows(0))
    store._cols.write = write
    assert seen and all(n == 0 for pair in seen for n in pair), f"rows of a batch visible before it returned: {seen}"
    np.testing.assert_array_equal(ids, np.arange(BATCH))

    bad: list[object] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            n = len(store)
            t = store.to_table(["obs", "action", "seq"])
            try:
                assert n % BATCH == 0, f"len {n} is not whole batches"
                assert all(c == BATCH for c in whole_batches(t).values())
            except AssertionError as e:
                bad.append(e)
                return

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    try:
        for k in range(1, 60):
            store.extend(batch_rows(k))
    finally:
        done.set()
        th.join(JOIN_S)
    assert not th.is_alive()
    assert not bad, bad[0]
    store.close()


def test_a_batch_longer_than_capacity_keeps_its_newest_rows_atomically():
    store = ab.ExperienceStore(SMALL, capacity=50, chunk_rows=8, seed=0)
    store.extend(batch_rows(0, 30))
    seen: list[int] = []
    write = store._cols.write
    store._cols.write = lambda *a, **k: (seen.append(len(store)), write(*a, **k))[1]
    ids = store.extend(batch_rows(1, 120))
    store._cols.write = write
    np.testing.assert_array_equal(ids, np.arange(30, 150))
    assert max(seen) <= 30  # the old rows may go early, the new rows never show before the commit
    t = store.to_table(["obs", "action", "reward", "seq"])
    np.testing.assert_array_equal(t.column("seq").to_numpy(), np.arange(100, 150))
    np.testing.assert_array_equal(t.column("reward").to_numpy(), np.arange(70, 120))
    assert whole_batches(t) == {1: 50}
    assert store.stats()["inserts"] == 150


class _BigAfterSample(ab.rate_limiters.RateLimiter):
    """Small inserts go in at once; inserts of more than 10 rows wait until a sample happened."""

    def can_sample(self, n, c):
        return True

    def can_insert(self, n, c):
        return n <= 10 or c.samples > 0


def test_a_rate_limited_writer_waits_outside_the_write_lock():
    store = ab.ExperienceStore(SMALL, capacity=1000, rate_limiter=_BigAfterSample(), seed=0)
    store.extend(make_episodes([5])[0])
    big_done, small_done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def big() -> None:  # held back by the limiter, with a long timeout
        try:
            store.extend(make_episodes([50], start=100.0)[0], timeout=JOIN_S)
            big_done.set()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def small() -> None:
        try:
            store.extend(make_episodes([5], start=500.0)[0], timeout=0.5)
            small_done.set()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    tb = threading.Thread(target=big, daemon=True)
    tb.start()
    ts = threading.Thread(target=small, daemon=True)
    ts.start()
    ts.join(JOIN_S)  # a guard against a hang, not a timing assert: on failure it waits for `big` to give up
    assert small_done.is_set(), f"the small insert waited for the rate-limited one: {errors}"
    assert not big_done.is_set() and len(store) == 10
    store.sample(1)  # lets the big insert in (and notifies it)
    tb.join(JOIN_S)
    assert big_done.is_set() and len(store) == 60 and not errors
    store.close()


# ---------------------------------------------------------------------------------------------- end_episode, final obs
def test_flush_is_a_deprecated_alias_of_end_episode():
    store = ab.ExperienceStore(SMALL, capacity=100, sampler="fifo", seed=0)
    step = {"obs": np.zeros(3, np.float32), "action": 1, "reward": 1.0, "terminated": False, "truncated": False}
    store.append({**step, "actor": "idle"})
    with pytest.warns(DeprecationWarning, match="end_episode"):
        assert store.flush("idle", next_obs=np.full(3, -1, np.float32))
    assert store.sample(1).indices[0] == 0  # the step became sampleable, as end_episode makes it



def test_end_episode_ends_an_idle_actors_open_step_so_a_fifo_goes_on():
    store = ab.ExperienceStore(SMALL, capacity=100, sampler="fifo", seed=0)
    step = {"obs": np.zeros(3, np.float32), "action": 1, "reward": 1.0, "terminated": False, "truncated": False}
    assert store.append({**step, "actor": "idle"}) == 0  # its next step never comes
    for k in range(10):
        store.append({**step, "obs": np.full(3, k + 1, np.float32), "actor": "busy"})
    with pytest.raises(ab.SampleTimeout):  # the queue stops at the idle actor's open step
        store.sample(1)
    with pytest.raises(ab.SchemaError, match="next_obs"):
        store.end_episode("idle")
    assert store.end_episode("idle", next_obs=np.full(3, -1, np.float32))
    b = store.sample(5)
    np.testing.assert_array_equal(b.indices, [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(b["next_obs"][0], [-1, -1, -1])
    np.testing.assert_array_equal(b["next_obs"][1], [2, 2, 2])
    assert b["terminated"][0] == 0  # a truncation: n-step returns bootstrap from the given observation
    ret = store.sample(1, n_step=3, gamma=0.5)
    assert ret.indices[0] == 5
    assert store.append({**step, "actor": "idle"}) == 11
    t = store.to_table(["episode_id", "step"])
    assert t.column("step").to_pylist()[-1] == 0  # the idle actor's next step starts a new episode
    assert t.column("episode_id").to_pylist()[-1] != t.column("episode_id").to_pylist()[0]
    store.close()


def test_final_observation_drops_are_loud_and_the_hint_fixes_them():
    """Large observations and short episodes: the default final_obs_capacity (capacity // 16) is too small."""
    schema = {**SMALL, "fields": {**SMALL["fields"], "obs": {"dtype": "float32", "shape": [8192]}}}
    capacity, length = 2100, 4  # 2100 rows of 32 KiB: over the 64 MiB the default keeps a slot per row for

    def episodes(k0: int, count: int) -> dict[str, np.ndarray]:
        n = count * length
        end = (np.arange(n) % length) == length - 1
        obs = np.zeros((n, 8192), np.float32)
        obs[:, 0] = k0 + np.arange(n)
        return {"obs": obs, "action": np.zeros(n, np.int64), "reward": np.zeros(n, np.float32),
                "terminated": end, "truncated": np.zeros(n, bool), "next_obs": obs + 1}

    store = ab.ExperienceStore(schema, capacity=capacity, seed=0)
    with pytest.warns(ab.FinalObsWarning, match=r"final_obs_capacity=\d+") as rec:
        for k in range(4):
            store.extend(episodes(k * 1000, capacity // length // 4))
    assert len(rec) == 1  # once per store
    assert store.stats()["final_obs_dropped"] > 0
    want = int(str(rec[0].message).split("final_obs_capacity=")[2].split(" ")[0])
    store.close()
    fixed = ab.ExperienceStore(schema, capacity=capacity, seed=0, final_obs_capacity=want)
    fixed.extend(episodes(0, capacity // length))
    assert fixed.stats()["final_obs_dropped"] == 0
    b = fixed.sample(4000)
    assert 0.2 < b["terminated"].mean() < 0.3  # a quarter of the transitions end an episode
    fixed.close()


# ---------------------------------------------------------------------------------------------- killed processes
def _killed_writer(name: str, seed: int) -> None:
    """Extend batches; SIGKILL ourselves at a random column write (phase 1 of some batch)."""
    store = ab.ExperienceStore.attach(name)
    rng = np.random.default_rng(seed)
    die_at = int(rng.integers(1, 60))
    calls = [0]
    write = store._cols.write

    def write_then_maybe_die(*args, **kwargs):
        calls[0] += 1
        if calls[0] == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return write(*args, **kwargs)

    store._cols.write = write_then_maybe_die
    for k in range(1000):
        store.extend(batch_rows(seed * 1000 + k))


@pytest.mark.slow
def test_killed_writer_processes_leave_whole_batches_or_nothing():
    name = f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"
    procs: list[mp.Process] = []
    try:
        with ab.ExperienceStore(SMALL, 20 * BATCH, chunk_rows=16, tier="shm", name=name) as store:
            for seed in range(1, 5):
                p = CTX.Process(target=_killed_writer, args=(name, seed), daemon=True)
                procs.append(p)
                p.start()
                p.join(JOIN_S)
                assert p.exitcode == -signal.SIGKILL
            store.extend(batch_rows(99))  # the store goes on: no lock stays held
            t = store.to_table(["obs", "action", "reward", "seq"])
            counts = whole_batches(t)
            oldest = int(t.column("action")[0].as_py())  # the ring may have evicted the start of the oldest batch
            assert all(c == BATCH for k, c in counts.items() if k != oldest), counts
            head = t.column("reward").to_numpy()[:counts[oldest]]
            np.testing.assert_array_equal(head, np.arange(BATCH - counts[oldest], BATCH))
            assert len(store) == sum(counts.values()) and 99 in counts
            b = store.sample(500)
            assert (b["obs"][:, 0] == b["action"]).all()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        shm.remove(name)


# ---------------------------------------------------------------------- the append fast path (issue 18)
WIDE = {
    "name": "wide",
    "fields": {
        "obs": {"dtype": "float32", "shape": [3]},
        "action": {"dtype": "int64"},
        "small": {"dtype": "int32"},
        "reward": {"dtype": "float32", "allow_nan": False},
        "vec": {"dtype": "int64", "shape": [2]},
        "terminated": {"dtype": "bool"},
        "truncated": {"dtype": "bool"},
    },
    "derived": {"next_obs": {"next_of": "obs"}},
}


def plain_step(i: int) -> dict:
    """Step i with the schema's own dtypes (Python scalars for scalar fields)."""
    return {"obs": np.full(3, i, np.float32), "action": i, "small": -i, "reward": i / 2, "vec": np.array([i, -i]),
            "terminated": i % 5 == 4, "truncated": False, "next_obs": np.full(3, i + 1, np.float32)}


def converted_steps(i: int) -> list[dict]:
    """Step i with values the fast path converts: numpy scalars, 0-d arrays, int32 into int64, float64 into
    float32, 0/1 ints into bool; each stores what `plain_step(i)` stores."""
    p = plain_step(i)
    return [
        {**p, "action": np.int64(i), "small": np.int32(-i), "reward": np.float32(i / 2),
         "terminated": np.bool_(p["terminated"]), "truncated": np.False_},
        {**p, "action": np.array(i), "small": np.array(-i, np.int16), "reward": np.array(i / 2),
         "terminated": np.array(p["terminated"])},
        {**p, "obs": p["obs"].astype(np.float64), "vec": p["vec"].astype(np.int32), "action": np.int32(i),
         "reward": np.float64(i / 2), "terminated": int(p["terminated"]), "next_obs": p["next_obs"].astype(np.float64)},
    ]


@pytest.mark.parametrize("limiter", [None, ab.rate_limiters.MinSize(1000),
                                     ab.rate_limiters.SampleToInsertRatio(4.0, min_size=10**6)])
@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_append_stores_numpy_scalars_and_safe_casts_on_the_fast_path(limiter, sampler):
    """Every configuration and value kind of issue 18 stores exactly what `extend` stores, without the slow path."""
    kinds = [lambda i: plain_step(i)] + [lambda i, k=k: converted_steps(i)[k] for k in range(3)]
    for make in kinds:
        smp = ab.samplers.Prioritized(alpha=0.6, beta=0.4) if sampler == "prioritized" else sampler
        with ab.ExperienceStore(WIDE, capacity=16, chunk_rows=4, sampler=smp, rate_limiter=limiter) as store, \
                ab.ExperienceStore(WIDE, capacity=16, chunk_rows=4) as ref:
            with warnings.catch_warnings():
                warnings.simplefilter("error", ab.AppendSlowPathWarning)
                ids = [store.append(make(i)) for i in range(40)]  # wraps the ring
            assert ids == list(range(40))
            for i in range(40):
                ref.extend({k: np.asarray(v)[None] for k, v in plain_step(i).items()})
            assert store.stats()["append_slow_path"] == 0
            assert store.to_table().equals(ref.to_table())
            b = (store if limiter is None else ref).sample(8)
            np.testing.assert_array_equal(b.to_numpy()["next_obs"][:, 0], b.to_numpy()["obs"][:, 0] + 1)


@pytest.mark.parametrize("bad", [
    {"reward": np.float64(1e39)},          # beyond float32: extend refuses it (no silent infinity)
    {"reward": float("inf")},              # allow_nan: false
    {"reward": np.nan},
    {"small": 2 ** 40},                    # beyond int32
    {"action": 1.5},                       # no silent float -> int rounding
    {"terminated": 2},                     # bool from 0/1 only
    {"obs": np.array([1.0, np.inf, 0.0]) * 1e300},   # float64 -> float32 overflow
    {"vec": np.array([1, 2], np.uint64)},  # not a safe cast into int64
])
def test_append_refuses_what_extend_refuses_and_stores_nothing(bad):
    with ab.ExperienceStore(WIDE, capacity=16, chunk_rows=4) as store:
        store.append(plain_step(0))
        step = {**plain_step(1), **bad}
        if "vec" in bad:  # uint64 values that fit: the general path converts them (slow, counted)
            with pytest.warns(ab.AppendSlowPathWarning, match="'vec'"):
                store.append(step)
            assert store.stats()["append_slow_path"] == 1
            return
        with pytest.raises(ab.SchemaError):
            store.append(step)
        with pytest.raises(ab.SchemaError):
            store.extend({k: np.asarray(v)[None] for k, v in step.items()})
        assert len(store) == 1 and store.stats()["append_slow_path"] == 0


def test_append_slow_path_is_counted_and_warned_once():
    with ab.ExperienceStore(WIDE, capacity=16, chunk_rows=4) as store:
        with pytest.warns(ab.AppendSlowPathWarning, match="field 'obs': list") as rec:
            for i in range(3):
                store.append({**plain_step(i), "obs": [float(i)] * 3})
        assert len([w for w in rec if issubclass(w.category, ab.AppendSlowPathWarning)]) == 1
        s = store.stats()
        assert s["append_slow_path"] == 3 and len(store) == 3
        assert list(s["append_slow_reasons"].values()) == [3]
        store.append(plain_step(3))  # the fast path again
        assert store.stats()["append_slow_path"] == 3


def test_a_ratio_limited_append_waits_for_the_limiter_outside_the_fast_path():
    limiter = ab.rate_limiters.SampleToInsertRatio(1.0, min_size=4, error_buffer=4.0)
    with ab.ExperienceStore(WIDE, capacity=64, chunk_rows=4, rate_limiter=limiter) as store:
        i = 0
        with pytest.raises(ab.InsertTimeout):
            while i < 100:
                store.append(plain_step(i), timeout=0)
                i += 1
        assert len(store) == i and 4 <= i < 100  # held back: nothing stored by the refused call
        store.sample(4)
        store.append(plain_step(i), timeout=0)  # room again
        assert len(store) == i + 1
        assert store.stats()["append_slow_path"] == 0  # waiting is no slow path
