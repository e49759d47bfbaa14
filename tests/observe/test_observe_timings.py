"""Latency histograms of store operations (`arrowbuf.observe.timings`): every call counted once, in the right
bucket, through folds, failures and concurrent callers."""

from __future__ import annotations

import threading

import pytest

from arrowbuf.observe.timings import BOUNDS, Timings, timed


class Probe:
    def __init__(self, timings: Timings | None) -> None:
        self.timings = timings

    @timed("op")
    def call(self, x: int, *, fail: bool = False) -> int:
        if fail:
            raise KeyError(x)
        return x + 1


def test_every_call_is_counted_once_through_folds_and_failures():
    t = Timings()
    p = Probe(t)
    n = 3 * Timings.FOLD + 5  # several folds and a remainder
    assert sum(p.call(i) for i in range(n)) == n * (n + 1) // 2
    for i in range(3):
        with pytest.raises(KeyError):
            p.call(i, fail=True)
    snap = t.snapshot()["op"]
    assert snap["count"] == n + 3 == sum(snap["buckets"])
    assert snap["outcomes"] == {"KeyError": 3}
    assert 0 < snap["sum"] < 60
    assert len(snap["buckets"]) == len(BOUNDS) + 1


def test_recorded_latencies_land_in_their_buckets():
    t = Timings()
    for s in (5e-6, 7e-5, 0.003, 0.003, 42.0):
        t.record("x", s)
    b = t.snapshot()["x"]["buckets"]
    assert b[BOUNDS.index(0.00001)] == 1 and b[BOUNDS.index(0.0001)] == 1 and b[BOUNDS.index(0.005)] == 2
    assert b[-1] == 1  # +Inf


def test_concurrent_callers_lose_no_count():
    t = Timings()
    p = Probe(t)
    per = Timings.FOLD + 100

    def run() -> None:
        for i in range(per):
            p.call(i)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for th in threads:
        th.start()
    snaps = [t.snapshot() for _ in range(20)]  # snapshots while they run fold concurrently
    for th in threads:
        th.join()
    assert t.snapshot()["op"]["count"] == 4 * per
    assert all(s.get("op", {"count": 0})["count"] <= 4 * per for s in snaps)


def test_no_timings_records_nothing():
    p = Probe(None)
    assert p.call(1) == 2
