"""Placement over real tiers (sparse host arenas, memory-mapped IPC files, torch tensors standing in for the GPU):
budgets hold, hot columns and chunks move up, alternating patterns do not thrash, residency never changes what a
seeded sampler returns, migrations racing samplers and writers never tear a row, and a store bigger than its host
budget works end to end.

Policies run with `interval=None` and tests call `step()` for determinism; concurrency tests use real threads and
events. Rows encode their seq: a = [seq] * 64, b = [-seq] * 64, reward = seq, so every row is checked on its own.
"""

from __future__ import annotations

import copy
import gc
import threading

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.tiers import GpuTier

SCHEMA = {
    "name": "placement",
    "fields": {
        "a": {"dtype": "float32", "shape": [64]},
        "b": {"dtype": "float32", "shape": [64]},
        "reward": {"dtype": "float32"},
        "terminated": {"dtype": "bool"},
        "truncated": {"dtype": "bool"},
    },
    "derived": {"next_a": {"next_of": "a"}},
}
CAP, CR = 2048, 32
EPISODE = 50
BW = {"gpu": 100e9, "host": 10e9, "disk": 1e9}  # given, so no test waits for a probe


def rows(k0: int, n: int) -> dict[str, np.ndarray]:
    k = np.arange(k0, k0 + n)
    col = np.repeat(k.astype(np.float32)[:, None], 64, 1)
    return {"a": col, "b": -col, "reward": k.astype(np.float32), "terminated": (k % EPISODE) == EPISODE - 1,
            "truncated": np.zeros(n, bool), "next_a": col + 1}


def check(batch: ab.SampleBatch) -> None:
    x = batch.to_numpy()
    seq = batch.indices.astype(np.float32)
    ref = x["reward"] if "reward" in x else seq
    if "reward" in x:
        np.testing.assert_array_equal(x["reward"], seq)
    if "a" in x:
        np.testing.assert_array_equal(x["a"], np.repeat(ref[:, None], 64, 1))
    if "b" in x:
        np.testing.assert_array_equal(x["b"], -np.repeat(ref[:, None], 64, 1))
    if "next_a" in x:
        np.testing.assert_array_equal(x["next_a"][:, 0], ref + 1)


def chunk_bytes(store: ab.ExperienceStore, *cols: str) -> int:
    return sum(store.schema.fields[c].row_bytes for c in cols) * store.chunk_rows


def meta_bytes(tmp_path, sampler="uniform", capacity=CAP, **kw) -> int:
    """Host bytes a tiered store takes besides column chunks (index, sampler, final observations)."""
    sampler = copy.deepcopy(sampler)  # a sampler instance binds to one store: the probe gets its own
    with ab.ExperienceStore(SCHEMA, capacity, sampler, chunk_rows=CR, tiers={"host": None, "disk": tmp_path / "m"},
                            placement="static", **kw) as probe:
        return probe._tier.nbytes() - sum(s.held_pages * 4096 for s in probe._tier._sparse.values())


def tiers_of(store: ab.ExperienceStore, column: str) -> np.ndarray:
    """Tier name of each sealed, live chunk of `column`, oldest first."""
    cols = store._cols
    ci = cols.ci[column]
    with store._lock:
        gens = store.index.seq[np.arange(cols.num_slots) * CR]
        live = np.flatnonzero((gens >= store.index.lo) & (gens + CR <= store.index.hi))
    live = live[np.argsort(gens[live])]
    return np.array([cols.tiers[c].name for c in cols.res[ci][live]])


def resident_bytes(ranges: list[tuple[int, int]]) -> int:
    """Resident bytes of the mappings (from /proc/self/smaps) that overlap the address `ranges`; adjacent anonymous
    mappings with the same flags are merged by the kernel, so each mapping is counted once."""
    total, vma = 0, None
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if parts and "-" in parts[0] and ":" not in parts[0]:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            vma = (lo, hi) if any(a < hi and lo < b for a, b in ranges) else None
        elif vma is not None and line.startswith("Rss:"):
            total += int(parts[1]) * 1024
    return total


def policy(**kw) -> ab.placement.BandwidthAware:
    return ab.placement.BandwidthAware(interval=None, bandwidth=BW, **kw)


def two_column_store(tmp_path, columns_in_host: float, sampler="uniform", **kw) -> ab.ExperienceStore:
    """A store whose host budget fits the index and `columns_in_host` times the a column (the rest spills)."""
    probe = ab.ExperienceStore(SCHEMA, CAP, chunk_rows=CR, tiers={"host": None, "disk": tmp_path / "p"},
                               placement="static")
    ring = probe.arena_rows * SCHEMA_ROW
    probe.close()
    budget = meta_bytes(tmp_path, sampler) + int(columns_in_host * ring) + 8 * 4096
    return ab.ExperienceStore(SCHEMA, CAP, sampler, seed=0, chunk_rows=CR,
                              tiers={"host": budget, "disk": tmp_path / "spill"}, placement=policy(**kw))


SCHEMA_ROW = 64 * 4


# ---------------------------------------------------------------------- budgets
def test_budgets_are_never_exceeded(tmp_path):
    """Every byte counted: tier.nbytes() <= budget after every operation, and the kernel agrees (the host arenas'
    resident pages, from /proc/self/smaps, never exceed what the host tier accounts)."""
    rng = np.random.default_rng(0)
    budget_host = meta_bytes(tmp_path, ab.samplers.Prioritized()) + 20 * chunk_bytes_of("a", "b")
    gpu = GpuTier(budget=6 * CR * 256 + 7, device="cpu")
    store = ab.ExperienceStore(SCHEMA, CAP, ab.samplers.Prioritized(alpha=1.0), seed=0, chunk_rows=CR,
                               tiers={"gpu": gpu, "host": budget_host, "disk": tmp_path}, placement=policy())
    host = store._tier
    ranges = [(start, start + size) for start, size in (host.address_range(n) for n in host._sparse)]

    def check_budgets(kernel: bool = False):
        assert gpu.nbytes() <= gpu.budget and host.nbytes() <= budget_host
        if kernel:  # parsing smaps takes a while: every few steps
            held = sum(s.held_pages for s in host._sparse.values()) * 4096
            assert resident_bytes(ranges) <= held

    with store:
        seq = 0
        for step in range(25):
            n = int(rng.integers(1, 300))
            store.extend(rows(seq, n))
            seq += n
            check_budgets(kernel=step % 5 == 0)
            cols = [["a"], ["b"], ["a", "b"], ["reward"]][step % 4 if step < 12 else 0]
            for _ in range(3):
                batch = store.sample(64, columns=cols + ["reward"])
                check(batch)
                store.update_priorities(batch.indices, rng.pareto(1.0, size=64))
            store.placement_policy.step()
            check_budgets(kernel=step % 5 == 4)
        assert store.stats()["placement"]["migrations"] > 0
        assert (store.placement().to_pandas().query("tier == 'gpu'")["chunks"] > 0).any()


def chunk_bytes_of(*cols: str) -> int:
    return CR * sum(64 * 4 if c in ("a", "b") else 4 for c in cols)


# ---------------------------------------------------------------------- moving up and down
def sample_steps(store: ab.ExperienceStore, columns: list[str], steps: int, per_step: int = 5) -> int:
    moved = 0
    for _ in range(steps):
        for _ in range(per_step):
            check(store.sample(128, columns=columns))
        moved += store.placement_policy.step()
    return moved


def test_hot_columns_move_up_after_the_access_pattern_changes(tmp_path):
    with two_column_store(tmp_path, 1.1) as store:  # the host fits one of a, b
        store.extend(rows(0, 3000))
        sample_steps(store, ["a"], 3)
        assert (tiers_of(store, "a") == "host").all() and (tiers_of(store, "b") == "disk").mean() > 0.8
        sample_steps(store, ["b"], 8)  # the pattern changes: b goes up, a comes down
        assert (tiers_of(store, "b") == "host").all() and (tiers_of(store, "a") == "disk").mean() > 0.8
        p = store.placement(explain=True).to_pandas().set_index(["column", "tier"])
        assert p.loc[("b", "host"), "access_share"] > 0.8 and "fits the budget" in p.loc[("b", "host"), "why"]
        assert p.loc[("terminated", "disk"), "why"].endswith("never sampled: lowest value")


def test_an_alternating_pattern_does_not_thrash(tmp_path):
    """Sampling a, then b, then a, ... : both columns are equally hot over time. Placement may settle (a chunk or two
    changes hands while the access counts converge) but never moves a chunk back and forth, and then stops."""
    with two_column_store(tmp_path, 1.1) as store:
        store.extend(rows(0, 3000))
        sample_steps(store, ["a"], 3)
        cols = store._cols
        moves: list[tuple[str, int]] = []
        migrate = cols.migrate

        def logged(name, s, *args):
            ok = migrate(name, s, *args)
            if ok:
                moves.append((name, s))
            return ok

        cols.migrate = logged  # type: ignore[method-assign]
        per_step = [sample_steps(store, ["a"] if i % 2 else ["b"], 1) for i in range(40)]
        assert len(moves) == len(set(moves)) <= 8, moves  # no (column, chunk) moved twice
        assert sum(per_step[-20:]) == 0, per_step
        assert (tiers_of(store, "a") == "host").mean() > 0.8  # a, hot first, keeps the host


def test_chunks_with_the_sampling_mass_move_up(tmp_path):
    """Prioritized replay with 10% of the chunks holding 90% of the mass: those chunks go to the host."""
    with two_column_store(tmp_path, 0.6, ab.samplers.Prioritized(alpha=1.0)) as store:
        store.extend(rows(0, CAP))
        hot_chunks = np.arange(3, CAP // CR, 10)
        seqs = np.arange(CAP)
        hot = np.isin(seqs // CR, hot_chunks)
        pri = np.where(hot, 9.0 * (~hot).sum() / hot.sum(), 1.0)  # 90% of the mass
        store.update_priorities(seqs, pri)
        sample_steps(store, ["a", "b"], 4)
        cols = store._cols
        for c in ("a", "b"):
            res = cols.res[cols.ci[c]][hot_chunks]
            assert (res == 0).all(), f"hot chunks of {c} not all in the host tier: {res}"
        # the samples are as the sampler drew them: mostly hot rows
        b = store.sample(1000)
        assert np.isin(b.indices // CR, hot_chunks).mean() > 0.8


def test_new_chunks_are_written_where_placement_wants_them(tmp_path):
    """A writer starting a new chunk puts it in the tier new chunks go to (no copy), room permitting."""
    with two_column_store(tmp_path, 0.6, ab.samplers.Prioritized(alpha=1.0)) as store:
        store.extend(rows(0, CAP))
        store.update_priorities(np.arange(CAP), np.linspace(0.01, 1, CAP))  # older rows colder
        store.update_priorities(np.arange(CAP - 64, CAP), np.full(64, 1e3))  # new rows get this max priority
        sample_steps(store, ["a"], 3)
        cols = store._cols
        assert cols.write_tier[cols.ci["a"]] == 0
        assert tiers_of(store, "a")[0] == "disk"  # the oldest chunk, next to be recycled, is cold
        landed = []
        copies = cols.counters["migrated_bytes"]
        for k in range(5):  # a learner loop: insert a chunk, sample, place
            store.extend(rows(CAP + k * CR, CR))
            landed.append(str(tiers_of(store, "a")[-1]))
            assert store._tier.nbytes() <= store._tier.budget
            sample_steps(store, ["a"], 1)
        # new chunks go straight to the host: the writer moves the slot it reuses there (no copy), or placement
        # already moved that empty slot up (no copy either: nothing in it is live)
        assert landed == ["host"] * 5, landed
        assert cols.counters["write_moves"] > 0
        assert cols.counters["migrated_bytes"] - copies <= 5 * 2 * chunk_bytes(store, "a", "b")


def test_loader_accesses_steer_placement_and_device_columns_reach_torch(tmp_path):
    """A Loader's samples count as accesses (b goes up); columns the torch-backed tier gathered come out as tensors."""
    pytest.importorskip("torch")
    with two_column_store(tmp_path, 1.1) as store:
        store.extend(rows(0, 3000))
        sample_steps(store, ["a"], 3)
        with ab.Loader(store, batch_size=64, prefetch=2, columns=["b", "reward"], format="torch") as loader:
            for _ in range(3):
                for _ in range(5):
                    tb = next(loader)
                    np.testing.assert_array_equal(tb["b"][:, 0].numpy(), -tb["reward"].numpy())
                store.placement_policy.step()
        cols = store._cols
        assert cols.access[cols.ci["b"]] >= 15 * 64 and store.placement_policy.explain()["share"]["b"] > 0.25
    gpu = GpuTier(budget=None, device="cpu")
    with ab.ExperienceStore(SCHEMA, CAP, seed=0, chunk_rows=CR, tiers={"gpu": gpu, "host": None},
                            placement=policy()) as store:
        store.extend(rows(0, CAP))
        sample_steps(store, ["a", "reward"], 2)
        assert (store.placement().to_pandas().query("column == 'a' and tier == 'gpu'")["chunks"] > 0).all()
        with ab.Loader(store, batch_size=64, prefetch=2, columns=["a", "reward"], format="torch") as loader:
            tb = next(loader)
            np.testing.assert_array_equal(tb["a"][:, 0].numpy(), tb["reward"].numpy())


# ---------------------------------------------------------------------- the same rows whatever the residency
def scramble(store: ab.ExperienceStore, rng: np.random.Generator, moves: int = 300) -> int:
    """Move random chunks of random columns to random tiers (as a policy would, through the same path)."""
    cols = store._cols
    done = 0
    for _ in range(moves):
        name = cols.names[int(rng.integers(len(cols.names)))]
        s = int(rng.integers(cols.num_slots))
        target = int(rng.integers(len(cols.tiers)))
        gen = int(store.index.seq[s * CR])
        done += cols.migrate(name, s, target, gen, store.index, store._lock)
    return done


@pytest.mark.parametrize("sampler", ["uniform", "prioritized", "sequence", "fifo"])
def test_the_same_seeded_sampler_returns_the_same_rows_whatever_the_residency(sampler, tmp_path):
    def make_sampler():
        return {"uniform": "uniform", "prioritized": ab.samplers.Prioritized(alpha=0.7),
                "sequence": ab.samplers.Sequence(length=5), "fifo": "fifo"}[sampler]

    ref = ab.ExperienceStore(SCHEMA, CAP, make_sampler(), seed=7, chunk_rows=CR)
    tiered = ab.ExperienceStore(SCHEMA, CAP, make_sampler(), seed=7, chunk_rows=CR,
                                tiers={"gpu": GpuTier(None, device="cpu"), "host": "4MiB", "disk": tmp_path},
                                placement="static")
    rng = np.random.default_rng(1)
    with ref, tiered:
        for s in (ref, tiered):
            s.extend(rows(0, 2500))
        for name in tiered._cols.names:  # device slots for every column (a policy sizes them from the budget)
            assert tiered._cols.ensure_arena(0, name, 8)
        assert scramble(tiered, rng) > 50
        assert len(set(tiered.placement().to_pandas().query("chunks > 0")["tier"])) == 3
        for i in range(6):
            kw = {"n_step": 3, "gamma": 0.9} if sampler in ("uniform", "prioritized") and i % 2 else {}
            a, b = ref.sample(40, **kw), tiered.sample(40, **kw)
            np.testing.assert_array_equal(a.indices, b.indices)
            xa, xb = a.to_numpy(), b.to_numpy()
            assert list(xa) == list(xb)
            for k in xa:
                np.testing.assert_array_equal(xa[k], xb[k], err_msg=k)
            if a.weights is not None:
                np.testing.assert_array_equal(a.weights, b.weights)
            if sampler == "prioritized":
                p = rng.random(40)
                ref.update_priorities(a.indices, p)
                tiered.update_priorities(b.indices, p)
            scramble(tiered, rng, 50)
        assert ref.to_table().equals(tiered.to_table())


# ---------------------------------------------------------------------- concurrency
def test_migrations_concurrent_with_sampling_and_writing_never_tear_a_row(tmp_path):
    """A mover thread shuffles chunks between the three tiers (device slots are freed and reused) and a writer keeps
    the ring turning, while the sampler checks every row it gets."""
    store = ab.ExperienceStore(SCHEMA, CAP, seed=0, chunk_rows=CR,
                               tiers={"gpu": GpuTier(budget=8 * CR * 600, device="cpu"), "host": "4MiB",
                                      "disk": tmp_path}, placement="static")
    store.extend(rows(0, CAP))
    stop = threading.Event()
    errors: list[BaseException] = []
    gpu = 0
    for name in ("a", "b", "reward"):
        store._cols.ensure_arena(gpu, name, 6)

    def mover():
        rng = np.random.default_rng(2)
        try:
            while not stop.is_set():
                scramble(store, rng, 20)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def writer():
        seq = CAP
        try:
            while not stop.is_set():
                store.extend(rows(seq, 100))
                seq += 100
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=mover), threading.Thread(target=writer)]
    for t in threads:
        t.start()
    try:
        for i in range(150):
            check(store.sample(64, columns=["a", "b", "reward", "next_a"] if i % 3 else None))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    c = store.stats()["placement"]
    assert c["migrations"] > 50 and c["write_moves"] > 0
    store.close()


def test_the_background_policy_moves_chunks_and_stops_on_close(tmp_path):
    policy = ab.placement.BandwidthAware(interval=0.01, bandwidth=BW)
    done = threading.Event()
    store = ab.ExperienceStore(SCHEMA, CAP, seed=0, chunk_rows=CR, tiers={"host": meta_bytes(tmp_path) + (
        2 * CAP + 64 * CR) * SCHEMA_ROW // 2, "disk": tmp_path / "s"}, placement=policy)
    assert policy.running
    store.extend(rows(0, CAP))
    original = policy.step

    def step():  # the thread's own steps signal when one moved something
        moved = original()
        if moved:
            done.set()
        return moved

    policy.step = step  # type: ignore[method-assign]
    while not done.is_set():
        check(store.sample(128, columns=["b"]))
    store.close()
    assert not policy.running and policy._thread is None
    assert store.stats is not None


def test_a_forgotten_store_lets_its_policy_thread_end(tmp_path):
    store = ab.ExperienceStore(SCHEMA, 256, chunk_rows=CR, tiers={"host": "4MiB", "disk": tmp_path},
                               placement=ab.placement.BandwidthAware(interval=0.01, bandwidth=BW))
    thread = store.placement_policy._thread
    assert thread.is_alive()
    del store
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()


# ---------------------------------------------------------------------- bigger than the host
def test_a_store_larger_than_its_host_budget_works_end_to_end(tmp_path):
    capacity = 8192
    data_bytes = capacity * (2 * SCHEMA_ROW + 6)
    meta = meta_bytes(tmp_path, ab.samplers.Prioritized(), capacity, final_obs_capacity=512)
    budget = meta + data_bytes // 4
    store = ab.ExperienceStore(SCHEMA, capacity, ab.samplers.Prioritized(), seed=0, chunk_rows=CR,
                               final_obs_capacity=512, tiers={"host": budget, "disk": tmp_path / "spill"},
                               placement=policy())
    assert meta + data_bytes > 2.5 * budget
    with store:
        seq = 0
        for _ in range(5):  # wraps the ring twice
            store.extend(rows(seq, 4000))
            seq += 4000
            for _ in range(4):
                b = store.sample(256)
                check(b)
                store.update_priorities(b.indices, np.abs(np.sin(b.indices)) + 0.1)
            store.placement_policy.step()
            assert store._tier.nbytes() <= budget
        assert len(store) == capacity
        t = store.to_table(["a", "reward", "seq"])
        np.testing.assert_array_equal(t["seq"].to_numpy(), np.arange(seq - capacity, seq))
        np.testing.assert_array_equal(t["reward"].to_numpy(), np.arange(seq - capacity, seq, dtype=np.float32))
        np.testing.assert_array_equal(t["a"].combine_chunks().to_numpy_ndarray()[:, 5],
                                      np.arange(seq - capacity, seq, dtype=np.float32))
        ep = store.episodes()
        assert ep["length"].to_numpy().sum() == capacity
        p = store.placement()
        host = p.to_pandas().groupby("tier")["bytes"].sum()
        assert host["disk"] > 2 * host["host"]
        b = store.sample(2000, n_step=3, gamma=0.5)
        check(b)
        assert store.stats()["bytes"]["host"] <= budget


# ---------------------------------------------------------------------- the narrow target
class _Recorder(ab.placement.Placement):
    """A policy that sees its store only through the `PlacementTarget` it is bound to."""

    interval = None

    def bind(self, target: ab.placement.PlacementTarget) -> None:
        super().bind(target)
        self.target = target

    def step(self) -> int:
        return int(self.target.migrate("a", 0, self.target.bottom, int(self.target.snapshot()["gens"][0])))


def test_a_policy_sees_its_store_only_through_a_placement_target(tmp_path):
    recorder = _Recorder()
    with ab.ExperienceStore(SCHEMA, CAP, ab.samplers.Prioritized(alpha=1.0), seed=0, chunk_rows=CR,
                            tiers={"host": None, "disk": tmp_path}, placement=recorder) as store:
        target = recorder.target
        assert isinstance(target, ab.placement.PlacementTarget)
        assert not any(v is store for v in vars(target).values())  # parts of the store, never the store
        store.extend(rows(0, CAP))
        pri = np.repeat(np.arange(1, CAP // CR + 1, dtype=np.float64), CR)  # chunk k: priority k + 1 per row
        store.update_priorities(np.arange(CAP), pri)
        mass = target.chunk_mass()  # the ring's slots, then the spare one (empty: no mass)
        n = CAP // CR
        np.testing.assert_allclose(mass[:n - 1], CR * np.arange(1, n), rtol=1e-5)
        assert mass[n - 1] == pytest.approx((CR - 1) * n, rel=1e-5)  # the newest row waits for its successor
        assert (mass[n:] == 0).all()
        snap = target.snapshot()
        assert (snap["lo"], snap["hi"]) == (store.stats()["first_seq"], store.stats()["next_seq"])
        assert target.columns == ["a", "b", "reward", "terminated", "truncated"]
        assert target.residency().shape == (5, target.num_slots) and (target.residency()[:, 0] == 0).all()
        before = store.sample(64, ["a", "reward"])
        assert recorder.step() == 1  # chunk 0 of column a goes to the disk
        res = target.residency()
        assert res[0, 0] == target.bottom and (res[1:, 0] == 0).all()
        p = store.placement().to_pylist()
        assert {"column": "a", "tier": "disk", "chunks": 1, "bytes": CR * 64 * 4} in p
        check(before)
        check(store.sample(256, ["a", "reward", "next_a"]))
        with pytest.raises(ab.InvalidArgument):  # a policy serves one store
            recorder.bind(target)
    assert target.closed  # the store closed it with the policy
