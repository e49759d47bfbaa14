"""Loader: prefetching delivery over a real store and real threads (synchronisation by events, queues, timeouts)."""

import gc
import queue
import threading

import numpy as np
import pyarrow as pa
import pytest
from conftest import SCHEMAS

import arrowbuf as ab
from arrowbuf.delivery.loader import POLICY_VERSION, LoaderMetrics, TorchBatch

CARTPOLE = SCHEMAS / "cartpole.yaml"
WAIT = 10.0  # generous upper bound for anything that should happen "soon"; never a sleep


def cartpole_steps(n, version=0, start=0, episode_len=10):
    """n CartPole steps; obs[:, 0] encodes the global step number, so contents can be checked per id."""
    g = start + np.arange(n, dtype=np.float32)
    obs = np.stack([g, g * 2, g * 3, -g], axis=1)
    term = ((np.arange(n) + start) % episode_len) == episode_len - 1
    return {
        "obs": obs, "next_obs": obs + 0.5, "action": (np.arange(n) + start) % 2,
        "reward": np.ones(n, np.float32), "terminated": term, "truncated": np.zeros(n, bool),
        POLICY_VERSION: np.broadcast_to(np.asarray(version, np.int64), (n,)).copy(),
    }


def cartpole_store(n=200, capacity=1000, seed=0, **kw):
    store = ab.ExperienceStore(CARTPOLE, capacity=capacity, seed=seed, **kw)
    if n:
        store.extend(cartpole_steps(n))
    return store


def loader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("arrowbuf-loader")]


@pytest.fixture(autouse=True)
def _no_loader_threads_left():
    yield
    gc.collect()
    assert not [t for t in loader_threads() if t.is_alive()], "a Loader thread outlived its test"


def assert_batches_equal(a: ab.SampleBatch, b: ab.SampleBatch):
    np.testing.assert_array_equal(a.indices, b.indices)
    assert a.columns == b.columns
    for k, va in a.to_numpy().items():
        np.testing.assert_array_equal(va, b.to_numpy()[k])


class RecordingSource:
    """A real store that logs the order of sample starts and priority updates."""

    def __init__(self, store):
        self.store, self.log, self.started, self.kwargs = store, [], 0, []
        self.lock = threading.Lock()

    def sample(self, n, **kw):
        with self.lock:
            self.started += 1
            self.log.append(("sample", self.started))
            self.kwargs.append(kw)
        return self.store.sample(n, **kw)

    def update_priorities(self, ids, p):
        with self.lock:
            self.log.append(("update", len(ids)))


# ------------------------------------------------------------------------------------------------ delivery
def test_same_batches_as_synchronous_sampling_with_the_same_seed():
    loaded, direct = cartpole_store(seed=7), cartpole_store(seed=7)
    with ab.Loader(loaded, batch_size=32, prefetch=3) as loader:
        got = [next(loader) for _ in range(10)]
    want = [direct.sample(32) for _ in range(10)]
    for g, w in zip(got, want):
        assert isinstance(g, ab.SampleBatch) and len(g) == 32
        assert_batches_equal(g, w)
        np.testing.assert_array_equal(g["obs"][:, 0], g.indices.astype(np.float32))  # contents belong to the ids
    # as a multiset of (id, contents) too
    def key(bs):
        return sorted((int(i), tuple(o)) for b in bs for i, o in zip(b.indices, b["obs"]))
    assert key(got) == key(want)


def test_columns_and_sample_options_pass_through():
    store = cartpole_store()
    with ab.Loader(store, 16, columns=["obs", "reward"]) as loader:
        b = next(loader)
    assert b.columns == ["obs", "reward"]
    src = RecordingSource(store)
    with ab.Loader(src, 16, n_step=3, gamma=0.9) as loader:
        try:
            next(loader)  # a store with n-step support serves it; one without raises TypeError, here
        except TypeError as e:
            assert "n_step" in str(e)
    assert src.kwargs[0] == {"columns": None, "timeout": pytest.approx(0.05), "n_step": 3, "gamma": 0.9}


def test_torch_format_yields_dicts_of_tensors():
    torch = pytest.importorskip("torch")
    loaded, direct = cartpole_store(seed=3), cartpole_store(seed=3)
    with ab.Loader(loaded, 24, prefetch=2, format="torch", device="cpu") as loader:
        got = [next(loader) for _ in range(3)]
    for g in got:
        want = direct.sample(24)
        assert isinstance(g, TorchBatch) and isinstance(g, dict)
        np.testing.assert_array_equal(g.indices, want.indices)
        assert g.weights is None
        for k, v in want.to_torch().items():
            assert isinstance(g[k], torch.Tensor) and torch.equal(g[k], v)


def test_fifo_delivers_each_item_once_with_a_concurrent_writer():
    store = ab.ExperienceStore(CARTPOLE, capacity=10_000, sampler="fifo", seed=0)
    total, chunk = 2000, 50
    writer_done = threading.Event()

    def write():
        for start in range(0, total, chunk):
            store.extend(cartpole_steps(chunk, start=start))
        writer_done.set()

    w = threading.Thread(target=write)
    with ab.Loader(store, batch_size=40, prefetch=4, timeout=WAIT) as loader:
        w.start()
        ids = np.concatenate([next(loader).indices for _ in range(total // 40)])
        w.join()
        assert writer_done.is_set()
        loader.timeout = 0.2  # everything was delivered: the next batch cannot come
        with pytest.raises(ab.SampleTimeout):
            next(loader)
    np.testing.assert_array_equal(ids, np.arange(total))  # each once, in insert order


def test_rate_limiter_sees_at_most_prefetch_batches_ahead():
    store = cartpole_store(n=500)
    with ab.Loader(store, batch_size=10, prefetch=3) as loader:
        assert loader.fill(WAIT)
        assert store.stats()["samples"] == 3 * 10  # drawn ahead: exactly the window, not more
        next(loader)
        assert loader.fill(WAIT)
        assert store.stats()["samples"] == (1 + 3) * 10


def test_rate_limited_store_serves_through_the_loader():
    limiter = ab.rate_limiters.SampleToInsertRatio(samples_per_insert=1.0, min_size=10, error_buffer=50.0)
    store = ab.ExperienceStore(CARTPOLE, capacity=10_000, rate_limiter=limiter, seed=0)
    with ab.Loader(store, batch_size=10, prefetch=2, timeout=WAIT) as loader:
        store.extend(cartpole_steps(40))  # the loader's thread was blocked on the limiter; inserts release it
        batches = [next(loader) for _ in range(3)]
    assert all(len(b) == 10 for b in batches)


# ------------------------------------------------------------------------------------------------ errors, shutdown
class FailingSource:
    """A real store whose k-th sample raises."""

    def __init__(self, store, fail_at):
        self.store, self.fail_at, self.calls = store, fail_at, 0

    def sample(self, n, **kw):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("disk on fire")
        return self.store.sample(n, **kw)

    def update_priorities(self, ids, p):
        return self.store.update_priorities(ids, p)


def test_background_error_raises_in_the_learners_thread():
    with ab.Loader(FailingSource(cartpole_store(), fail_at=3), 8, prefetch=4) as loader:
        assert len(next(loader)) == 8 and len(next(loader)) == 8  # batches drawn before the failure come first
        with pytest.raises(RuntimeError, match="disk on fire") as info:
            next(loader)
        assert any("background thread" in n for n in getattr(info.value, "__notes__", []))
        with pytest.raises(RuntimeError):  # the loader stays failed
            next(loader)


def test_store_errors_keep_their_type():
    store = ab.ExperienceStore(CARTPOLE, capacity=100, seed=0)
    with ab.Loader(store, 8, unknown_option=1) as loader:
        store.extend(cartpole_steps(20))
        with pytest.raises(TypeError):
            next(loader)


def test_close_with_batches_in_flight_is_prompt_and_leaks_no_thread():
    store = cartpole_store(n=500)
    loader = ab.Loader(store, batch_size=16, prefetch=4)
    assert loader.fill(WAIT) and loader.prefetched == 4
    thread = loader._thread
    assert thread in threading.enumerate()
    loader.close()  # joins the thread: it ends (behaviour, not wall time)
    assert not thread.is_alive() and thread not in threading.enumerate()
    loader.close()  # idempotent
    with pytest.raises(StopIteration):
        next(loader)
    assert list(loader) == []


def test_close_while_the_thread_waits_for_data_and_the_learner_waits_for_a_batch():
    store = ab.ExperienceStore(CARTPOLE, capacity=100, sampler="fifo", seed=0)  # empty: nothing can be served
    loader = ab.Loader(store, batch_size=16, prefetch=2)
    out: queue.Queue = queue.Queue()
    waiting = threading.Event()

    def learner():
        waiting.set()
        try:
            out.put(next(loader))
        except BaseException as e:  # noqa: BLE001
            out.put(e)

    t = threading.Thread(target=learner)
    t.start()
    assert waiting.wait(WAIT)
    loader.close()
    assert isinstance(out.get(timeout=WAIT), StopIteration)  # the waiting learner is released
    t.join(WAIT)
    assert not t.is_alive() and not loader_threads()


def test_a_forgotten_loader_stops_its_thread():
    loader = ab.Loader(cartpole_store(), 8, prefetch=2)
    assert loader.fill(WAIT)
    thread = loader._thread
    del loader
    gc.collect()
    thread.join(WAIT)
    assert not thread.is_alive()


def test_next_times_out_with_sample_timeout():
    store = ab.ExperienceStore(CARTPOLE, capacity=100, seed=0)
    with ab.Loader(store, 4, timeout=0.1) as loader, pytest.raises(ab.SampleTimeout, match="timeout"):
        next(loader)


def test_bad_arguments():
    store = cartpole_store(n=0)
    with pytest.raises(ValueError):
        ab.Loader(store, 0)
    with pytest.raises(ValueError):
        ab.Loader(store, 8, prefetch=0)
    with pytest.raises(ValueError):
        ab.Loader(store, 8, format="arrow")
    with pytest.raises(ValueError, match="format='torch'"):
        ab.Loader(store, 8, device="cuda")
    with pytest.raises(ValueError, match="policy_version"):
        ab.Loader(store, 8, max_staleness=1)
    atari = ab.ExperienceStore(SCHEMAS / "atari.yaml", capacity=100)
    with pytest.raises(ab.SchemaError, match="policy_version"):
        ab.Loader(atari, 8, min_policy_version=1)
    assert not loader_threads()


# ------------------------------------------------------------------------------------------------ priorities
def test_priority_updates_are_applied_before_the_next_sample():
    src = RecordingSource(cartpole_store())
    prefetch = 3
    with ab.Loader(src, 8, prefetch=prefetch) as loader:
        first = next(loader)
        loader.update_priorities(first, np.ones(8))
        with src.lock:
            started_before_return = src.started
        batches = [next(loader) for _ in range(prefetch + 2)]
    log = src.log
    at = log.index(("update", 8))
    later = [num for kind, num in log[at:] if kind == "sample"]
    # every sample that started after update_priorities returned started after the update was applied
    assert all(num > started_before_return for num in later) or not later
    assert ("sample", started_before_return + 1) in log[at:]
    # the bound: of the batches taken after the update, at most `prefetch` were drawn before it
    drawn_before = sum(1 for kind, num in log[:at] if kind == "sample") - 1  # minus `first`
    assert drawn_before <= prefetch and len(batches) == prefetch + 2


def test_update_priorities_checks_input_in_the_learners_thread_and_surfaces_source_errors():
    store = cartpole_store()  # uniform: no priorities
    with ab.Loader(store, 8, prefetch=2) as loader:
        b = next(loader)
        with pytest.raises(ValueError, match="priorities"):
            loader.update_priorities(b, np.ones(7))
        with pytest.raises(ValueError):
            loader.update_priorities(b, np.full(8, np.nan))
        loader.update_priorities(b, np.ones(8))  # the uniform sampler has no priorities: the source says so
        with pytest.raises(ab.ArrowbufError, match="no priorities"):
            while True:
                next(loader)


def test_pending_priority_updates_are_applied_by_close():
    src = RecordingSource(cartpole_store())
    loader = ab.Loader(src, 8, prefetch=1)
    b = next(loader)
    loader.update_priorities(b, np.ones(8))
    loader.close()  # applied by the background thread or, if still pending, by close(): never lost
    assert src.log.count(("update", 8)) == 1
    with pytest.raises(ab.StoreClosed):  # after close an update is refused, not dropped silently
        loader.update_priorities(b, np.ones(8))


# ------------------------------------------------------------------------------------------------ staleness
def test_max_staleness_never_delivers_older_rows():
    store = ab.ExperienceStore(CARTPOLE, capacity=10_000, seed=0)
    for v in range(10):
        store.extend(cartpole_steps(100, version=v, start=100 * v))
    with ab.Loader(store, 64, prefetch=3, max_staleness=2, policy_version=9, timeout=WAIT,
                   columns=["obs"]) as loader:
        for _ in range(5):
            b = next(loader)
            assert len(b) == 64 and b.columns == ["obs"]  # policy_version read for the filter, not delivered
            assert (b["obs"][:, 0] >= 700).all()  # rows of versions 7..9 are the steps 700..999
        assert loader.fill(WAIT)  # prefetched batches of versions 7..9 wait in the window
        loader.set_policy_version(12)  # now only versions >= 10 may be delivered: there are none yet
        store.extend(cartpole_steps(100, version=10, start=1000))
        for _ in range(3):
            b = next(loader)
            assert (b["obs"][:, 0] >= 1000).all()
    assert loader.metrics.stale_batches_skipped == 3
    assert loader.metrics.stale_rows_dropped > 0
    assert "stale rows dropped" in loader.metrics.summary()


def test_min_policy_version_with_a_fifo_queue_consumes_stale_rows():
    store = ab.ExperienceStore(CARTPOLE, capacity=10_000, sampler="fifo", seed=0)
    store.extend(cartpole_steps(30, version=1))
    store.extend(cartpole_steps(50, version=2, start=30))
    with ab.Loader(store, 25, prefetch=2, min_policy_version=2, timeout=WAIT) as loader:
        ids = np.concatenate([next(loader).indices for _ in range(2)])
    np.testing.assert_array_equal(ids, np.arange(30, 80))


# ------------------------------------------------------------------------------------------------ metrics
def test_metrics_add_up():
    store = cartpole_store(n=500)
    with ab.Loader(store, 32, prefetch=2) as loader:
        for i in range(20):
            next(loader)
            if i == 10:
                loader.extend(cartpole_steps(10, start=500))
        assert loader.fill(WAIT)
        next(loader)  # prepared long before it was asked for: nothing of its path is exposed
    m = loader.metrics
    t = m.to_arrow()
    assert isinstance(t, pa.Table) and t.num_rows == 21 == m.iterations
    d = t.to_pydict()
    for i in range(21):
        assert 0 <= d["exposed_path_s"][i] <= d["path_s"][i] + 1e-12
        assert d["exposed_path_s"][i] <= d["wait_s"][i] + 1e-12
        assert 0.0 <= d["hidden_fraction"][i] <= 1.0
        assert d["exposed_s"][i] == pytest.approx(d["wait_s"][i] + d["insert_s"][i])
        assert d["path_s"][i] == pytest.approx(d["sample_s"][i] + d["collate_s"][i] + d["copy_s"][i])
        assert d["rows"][i] == 32
    assert d["exposed_path_s"][-1] == 0.0 and d["hidden_fraction"][-1] == 1.0
    assert d["insert_s"][11] > 0 and sum(x > 0 for x in d["insert_s"]) == 1
    assert m.totals["path_s"] == pytest.approx(sum(d["path_s"]))
    assert m.totals["exposed_s"] == pytest.approx(sum(d["exposed_s"]))
    assert 0.0 <= m.hidden_fraction <= 1.0
    assert m.summary().startswith("Loader: 21 iterations")
    assert LoaderMetrics().summary() == "Loader: no iterations yet"
    assert LoaderMetrics().to_arrow().num_rows == 0


# ------------------------------------------------------------------------------------------------ real samplers, remote
def test_prioritized_updates_through_the_loader_steer_the_next_samples():
    store = ab.ExperienceStore(CARTPOLE, capacity=1000, sampler=ab.samplers.Prioritized(alpha=1.0, beta=1.0, eps=0.0),
                               seed=0)
    store.extend(cartpole_steps(200))
    prefetch = 3
    with ab.Loader(store, 16, prefetch=prefetch) as loader:
        assert loader.fill(WAIT)
        ids = np.arange(200)
        loader.update_priorities(ids, np.where(ids == 42, 1.0, 1e-12))  # others: drawn with odds ~2e-10
        after = [next(loader) for _ in range(prefetch + 4)]
    assert all((b.indices == 42).all() for b in after[prefetch:])  # drawn after the update: only 42
    assert after[-1].weights is not None


def test_update_priorities_takes_ids_given_as_a_tensor():
    # a tensor has a method `indices` (sparse tensors): the ids are the tensor itself, not that method
    torch = pytest.importorskip("torch")
    store = ab.ExperienceStore(CARTPOLE, capacity=1000, sampler=ab.samplers.Prioritized(alpha=1.0, beta=1.0, eps=0.0),
                               seed=0)
    store.extend(cartpole_steps(200))
    prefetch = 2
    with ab.Loader(store, 16, prefetch=prefetch) as loader:
        assert loader.fill(WAIT)
        ids = torch.arange(200)
        loader.update_priorities(ids, torch.where(ids == 7, 1.0, 1e-12).double())
        after = [next(loader) for _ in range(prefetch + 3)]
    assert all((b.indices == 7).all() for b in after[prefetch:])


def test_loader_over_flight_matches_local_sampling():
    pytest.importorskip("pyarrow.flight")
    served, local = cartpole_store(seed=11), cartpole_store(seed=11)
    with ab.serve(served, "grpc://127.0.0.1:0") as server, ab.connect(server.location) as remote, \
            ab.Loader(remote, 32, prefetch=2, timeout=WAIT) as loader:
        got = [next(loader) for _ in range(4)]
    for g in got:
        assert_batches_equal(g, local.sample(32))


def test_a_remote_loader_waits_in_one_session_and_close_cancels_it():
    """Over Flight the Loader holds one DoExchange session (the server waits for data: no DoGet polling); data that
    arrives is delivered; close() releases a learner waiting on an empty store."""
    pytest.importorskip("pyarrow.flight")
    served = ab.ExperienceStore(CARTPOLE, capacity=1000, sampler="fifo", seed=0)  # empty
    with ab.serve(served, "grpc://127.0.0.1:0") as server, ab.connect(server.location) as remote:
        loader = ab.Loader(remote, 8, prefetch=2)
        out: queue.Queue = queue.Queue()
        waiting = threading.Event()

        def learner():
            waiting.set()
            try:
                while True:
                    out.put(next(loader))
            except BaseException as e:  # noqa: BLE001
                out.put(e)

        t = threading.Thread(target=learner)
        t.start()
        assert waiting.wait(WAIT)
        remote.extend(cartpole_steps(20))  # whole episodes into a fifo store: each row once, in order
        first, second = out.get(timeout=WAIT), out.get(timeout=WAIT)
        np.testing.assert_array_equal(np.concatenate([first.indices, second.indices]), np.arange(16))
        assert remote.stats()["server"]["sessions"] == 1
        loader.close()  # the learner waits on an empty store again: close releases it
        assert isinstance(out.get(timeout=WAIT), StopIteration)
        t.join(WAIT)
        assert not t.is_alive() and not loader_threads()


def test_priority_updates_through_a_remote_loader_steer_the_next_samples():
    pytest.importorskip("pyarrow.flight")
    store = ab.ExperienceStore(CARTPOLE, capacity=1000, sampler=ab.samplers.Prioritized(alpha=1.0, beta=1.0, eps=0.0),
                               seed=0)
    store.extend(cartpole_steps(200))
    prefetch = 2
    with ab.serve(store, "grpc://127.0.0.1:0") as server, ab.connect(server.location) as remote, \
            ab.Loader(remote, 16, prefetch=prefetch, timeout=WAIT) as loader:
        assert loader.fill(WAIT)
        ids = np.arange(200)
        loader.update_priorities(ids, np.where(ids == 42, 1.0, 1e-12))
        window = 2 * prefetch + 3  # drawn before the update: the Loader's, the server's, requests in flight
        after = [next(loader) for _ in range(window + 4)]
    assert all((b.indices == 42).all() for b in after[window:])
    assert after[-1].weights is not None


# ------------------------------------------------------------------------------------------------ learner sessions
class _LocalSession:
    """A learner session over a local store: batches of a fixed size, as `RemoteStore.session` serves them."""

    def __init__(self, store, n, columns, **kw):
        self.store, self.n, self.columns, self.kw, self.drawn, self.closed = store, n, columns, kw, 0, False

    def __next__(self):
        self.drawn += 1
        return self.store.sample(self.n, self.columns)

    def update_priorities(self, ids, priorities):
        self.store.update_priorities(ids, priorities)

    def cancel(self):
        pass

    def close(self):
        self.closed = True


class _SessionSource(RecordingSource):
    """A source that has a `session` method; whether the Loader uses it depends on the declared capability."""

    learner_sessions = False

    def __init__(self, store):
        super().__init__(store)
        self.sessions = []

    def session(self, n, columns=None, **kw):
        s = _LocalSession(self.store, n, columns, **kw)
        self.sessions.append(s)
        return s


class _DeclaredSessionSource(_SessionSource):
    learner_sessions = True


def test_a_source_that_declares_learner_sessions_is_served_through_one_session():
    """The Loader picks a learner session by the class's `learner_sessions` capability, not by its type."""
    source = _DeclaredSessionSource(cartpole_store())
    with ab.Loader(source, batch_size=8, prefetch=2) as loader:
        batches = [next(loader) for _ in range(3)]
    assert all(len(b) == 8 for b in batches)
    assert len(source.sessions) == 1 and source.sessions[0].drawn >= 3 and source.sessions[0].closed
    assert source.started == 0  # no polling sample() beside the session


def test_a_session_method_without_the_capability_is_not_used():
    source = _SessionSource(cartpole_store())
    with ab.Loader(source, batch_size=8, prefetch=2) as loader:
        assert len(next(loader)) == 8
    assert source.sessions == [] and source.started >= 1
