"""Page preparation ahead of the write head (issue 18, first fill): arrowbuf/tiers/prefault.py.

Real stores over a real `HostTier`; residency is what the kernel says (`mincore`), not a counter of ours. No
timing asserts: the tests wait for the preparer on its condition variable (`wait_idle`).
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import multiprocessing as mp
import threading

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.tiers import prefault
from arrowbuf.tiers.host import HostTier
from arrowbuf.tiers.prefault import PagePreparer, fits_in_ram

PAGE = mmap.PAGESIZE
HUGE = 2 << 20  # a transparent huge page: populating one row may make its whole 2 MiB resident
ROW = 64 * 1024  # bytes of one obs row
WAIT = 120.0  # seconds; a bound on a hung thread, not a timing expectation

pytestmark = pytest.mark.skipif(prefault.kernel_method() is None,
                                reason="this kernel offers neither MADV_POPULATE_WRITE nor mlock")


def _schema(stored_next: bool = False) -> ab.ExperienceSchema:
    fields = {"obs": {"dtype": "uint8", "shape": [64, 1024]}, "action": {"dtype": "int64"},
              "reward": {"dtype": "float32"}, "terminated": {"dtype": "bool"}, "truncated": {"dtype": "bool"}}
    if stored_next:
        fields["next_obs"] = {"dtype": "uint8", "shape": [64, 1024]}
        return ab.load_schema({"name": "big_stored", "fields": fields})
    return ab.load_schema({"name": "big", "fields": fields, "derived": {"next_obs": {"next_of": "obs"}}})


def _batch(n: int, start: int, stored_next: bool = False) -> dict:
    rng = np.random.default_rng(start)
    obs = rng.integers(0, 255, size=(n + 1, 64, 1024), dtype=np.uint8)
    term = np.zeros(n, dtype=bool)
    term[n // 2] = True
    out = {"obs": obs[:n], "action": np.arange(start, start + n, dtype=np.int64),
           "reward": rng.standard_normal(n).astype(np.float32), "terminated": term,
           "truncated": np.zeros(n, dtype=bool), "next_obs": obs[1:]}
    return out


def _resident(address: int, nbytes: int) -> np.ndarray:
    """Per page of [address, address + nbytes) (widened to pages): resident now, from mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = address - address % PAGE
    pages = -(-(address + nbytes - start) // PAGE)
    vec = np.zeros(pages, dtype=np.uint8)
    assert libc.mincore(start, pages * PAGE, vec.ctypes.data) == 0, ctypes.get_errno()
    return (vec & 1).astype(bool)


def _rows_resident(tier: HostTier, key: str, r0: int, r1: int, row: int = ROW) -> np.ndarray:
    addr, _ = tier.address_range(key)
    return _resident(addr + r0 * row, (r1 - r0) * row)


def test_pages_ahead_of_the_head_become_resident() -> None:
    tier = HostTier(prefault_window="16MiB")
    store = ab.ExperienceStore(_schema(), capacity=2000, tier=tier, chunk_rows=100)
    try:
        prep = store._cols.pages
        assert isinstance(prep, PagePreparer) and tier.preparers == [prep]
        ring = store.arena_rows
        assert prep.wait_idle(WAIT)
        # before any write: the first window is prepared, and nothing far beyond it
        first = prep.prepared
        assert first == prep.target == min(ring, prep.lead_rows) and 0 < prep.lead_rows <= prep.window_rows < ring
        assert _rows_resident(tier, "obs", 0, first).all()
        beyond = (first * ROW + 2 * HUGE) // ROW + 1
        assert not _rows_resident(tier, "obs", beyond, ring).any()
        # the writer moves the head: the window follows it
        store.extend(_batch(300, 0))
        assert prep.wait_idle(WAIT)
        assert prep.prepared >= prep.target == min(ring, 300 + prep.lead_rows)
        assert _rows_resident(tier, "obs", 0, prep.prepared).all()
        beyond = (prep.prepared * ROW + 2 * HUGE) // ROW + 1
        # (the batch ended an episode: its final observation went to row `ring`, whose huge page may reach back)
        assert not _rows_resident(tier, "obs", beyond, ring - 2 * HUGE // ROW).any()
        stats = store.stats()["prefault"]
        assert stats["state"] == "running" and stats["prepared_rows"] == prep.prepared
        assert stats["populated_bytes"] > 0 and stats["error"] is None
        # per-step appends move it too
        for i in range(5):
            store.append({"obs": np.full((64, 1024), i, np.uint8), "action": i, "reward": 0.0,
                          "terminated": False, "truncated": False})
        assert prep.head == 305
    finally:
        store.close()


def test_it_finishes_after_one_lap_and_stops_on_close() -> None:
    tier = HostTier(prefault_window="8MiB")
    store = ab.ExperienceStore(_schema(), capacity=1000, tier=tier, chunk_rows=100)
    prep = store._cols.pages
    assert prep is not None
    for s in range(0, 1200, 300):  # past the end of the ring: every page has been written once
        store.extend(_batch(300, s))
    assert prep.wait_idle(WAIT)
    assert not prep.running and store.stats()["prefault"]["state"] == "done"
    store.close()

    tier = HostTier(prefault_window="8MiB")
    store = ab.ExperienceStore(_schema(), capacity=1000, tier=tier, chunk_rows=100)
    prep = store._cols.pages
    assert prep is not None and prep.running
    store.close()
    assert not prep.running  # close joined the thread
    assert tier.preparers == []
    assert prep._thread not in threading.enumerate()


def test_a_store_dropped_without_close_frees_its_ring_and_the_thread_ends() -> None:
    tier = HostTier(prefault_window="8MiB")
    store = ab.ExperienceStore(_schema(), capacity=1000, tier=tier, chunk_rows=100)
    prep = store._cols.pages
    assert prep is not None
    assert prep.wait_idle(WAIT)  # waiting for the writer, holding no arena
    addr, nbytes = tier.address_range("obs")
    del store, tier
    gc.collect()
    # the arenas were freed (the thread held no reference), which stopped the thread
    assert prep.wait_idle(WAIT)
    prep._thread.join(WAIT)  # type: ignore[union-attr]
    assert not prep.running
    with open("/proc/self/maps") as f:
        spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f]
    assert not any(a <= addr and addr + nbytes <= b for a, b in spans)


def test_off_when_disabled_small_or_sparse() -> None:
    tier = HostTier(prefault=False)
    with ab.ExperienceStore(_schema(), capacity=1000, tier=tier) as store:
        assert store._cols.pages is None and store.stats()["prefault"] is None
        assert tier.prefault_off is not None and "prefault=False" in tier.prefault_off
    tier = HostTier()
    with ab.ExperienceStore(_schema(), capacity=100, tier=tier) as store:  # 6.4 MiB: not worth a thread
        assert store._cols.pages is None and "bytes <" in str(tier.prefault_off)


def test_off_for_rings_bigger_than_ram(tmp_path) -> None:
    avail = prefault.mem_available()
    assert avail is not None
    assert fits_in_ram(1 << 20) and not fits_in_ram(avail + (1 << 30))
    # a tiered store's host arenas are sparse (rings bigger than RAM spill): never prepared
    with ab.ExperienceStore(_schema(), capacity=1000, tiers={"host": "160MiB", "disk": str(tmp_path)}) as store:
        assert store._cols.pages is None and store.stats()["prefault"] is None
        store.extend(_batch(300, 0))


@pytest.mark.parametrize("stored_next", [False, True])
def test_stored_bytes_are_the_same_with_it_on_and_off(stored_next: bool) -> None:
    tables = []
    for on in (True, False):
        tier = HostTier(prefault=on, prefault_window="8MiB")
        with ab.ExperienceStore(_schema(stored_next), capacity=700, tier=tier, chunk_rows=100) as store:
            assert (store._cols.pages is not None) == on
            for s in range(0, 1000, 250):  # wraps the ring
                store.extend(_batch(250, s, stored_next))
            store.append({"obs": np.full((64, 1024), 7, np.uint8), "action": 9, "reward": 1.0,
                          "terminated": True, "truncated": False, "next_obs": np.full((64, 1024), 8, np.uint8)})
            tables.append(store.to_table())
    assert tables[0].num_rows == 700
    assert tables[0].equals(tables[1])


def test_the_lead_follows_the_cost_of_a_page() -> None:
    arena = np.empty((2000, ROW), dtype=np.uint8)
    prep = PagePreparer([arena], ring_rows=2000, window=64 << 20, name="test")
    try:
        assert prep.wait_idle(WAIT)
        step = 16 << 20
        prep._adapt(step, step / 1e8)  # 100 MB/s: slow pages, lead by the whole window
        assert prep.lead_rows == prep.window_rows == (64 << 20) // ROW
        prep._adapt(step, step / 1e10)  # 10 GB/s: cheap pages, two steps ahead
        assert prep.lead_rows == 2 * prep.step_rows < prep.window_rows
        prep._adapt(PAGE, 1.0)  # too small a step to judge: unchanged
        assert prep.lead_rows == 2 * prep.step_rows
    finally:
        prep.close()


def test_mlock_method_prepares_pages_too() -> None:
    if prefault.populate(np.zeros(PAGE, np.uint8).ctypes.data, PAGE, "mlock") != 0:
        pytest.skip("mlock is not allowed here (RLIMIT_MEMLOCK)")
    arena = np.empty((400, ROW), dtype=np.uint8)  # 25.6 MB, untouched
    prep = PagePreparer([arena], ring_rows=400, window=8 << 20, method="mlock", name="test")
    try:
        assert prep.wait_idle(WAIT) and prep.error is None
        assert prep.prepared >= 8 * (1 << 20) // ROW
        assert _resident(arena.ctypes.data, prep.prepared * ROW).all()
        prep.advance(400)  # the writer went past the end: nothing left to prepare
        assert prep.wait_idle(WAIT)
    finally:
        prep.close()
    assert not prep.running


def _child_extend(name: str, q: "mp.Queue") -> None:
    store = _HELD[name]
    store.extend(_batch(300, 0))  # advance() past the window: must not wait on the parent's thread
    q.put(len(store))


_HELD: dict = {}


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="needs fork")
def test_a_forked_child_writes_without_the_thread() -> None:
    tier = HostTier(prefault_window="8MiB")
    store = ab.ExperienceStore(_schema(), capacity=2000, tier=tier, chunk_rows=100)
    _HELD["s"] = store
    try:
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_child_extend, args=("s", q))
        p.start()
        try:
            assert q.get(timeout=WAIT) == 300
        finally:
            p.join(WAIT)
            if p.is_alive():
                p.kill()
                p.join()
        assert p.exitcode == 0
        assert len(store) == 0  # the child's rows are its own copy
    finally:
        _HELD.clear()
        store.close()
