"""Per-task progress with thousands of leases open (issue 42): the counts are exact, and a scrape does no work per
open lease (before, `observe/progress.py` ran `np.isin` over every live row once per open lease, under the store's
lock: 2,000 one-row leases on 250k rows stalled a concurrent `extend` for 1.8 s).

No timing here: the work is counted (calls of `np.isin`, which a per-lease pass makes once per lease)."""

from __future__ import annotations

import numpy as np
import pytest

import arrowbuf as ab

SCHEMA = {"name": "prog", "fields": {"x": {"dtype": "int64"}, "reward": {"dtype": "float32", "later": True},
                                     "done": {"dtype": "bool"}}}
LEASES = 2000


@pytest.fixture(params=["host", "shm"])
def leased(request, names):
    kw = {"tier": "shm", "name": names()} if request.param == "shm" else {}
    store = ab.ExperienceStore(SCHEMA, capacity=8192, tasks=["a", "b"], **kw)
    ids = store.extend({"x": np.arange(5000), "done": np.ones(5000, bool)})
    store.update(ids[:3000], {"reward": np.ones(3000, np.float32)})
    held = [store.consume("a", 1, lease=600) for _ in range(LEASES)]  # rows 0..1999 in flight for task a
    store.consume("a", 500)  # rows 2000..2499 consumed for good
    store.consume("b", 10, lease=600)
    yield store, held
    store.close()


def test_progress_is_exact_with_thousands_of_leases_open(leased):
    store, _ = leased
    p = store.observability()["progress"]
    assert p["live"] == 5000 and p["produced"] == 3000
    a, b = p["tasks"]["a"], p["tasks"]["b"]
    assert a["in_flight"] == LEASES and a["consumed"] == 500
    assert a["ready"] == 500 and a["waiting"] == 2000  # 2500..2999 have their reward; 3000..4999 wait for it
    assert b["in_flight"] == 10 and b["consumed"] == 0 and b["ready"] == 2990 and b["waiting"] == 2000


def test_a_scrape_does_no_work_per_open_lease(leased, monkeypatch):
    store, held = leased
    calls = []
    real = np.isin

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "isin", counting)
    store.observability()
    store.stats()
    assert len(calls) <= 2, f"{len(calls)} passes over the rows for {LEASES} leases"
    for b in held[:10]:
        b.ack()
    assert store.observability()["progress"]["tasks"]["a"]["in_flight"] == LEASES - 10


@pytest.mark.parametrize("tier", ["host", "shm"])
def test_progress_is_exact_on_a_ring_that_wrapped(tier, names):
    from arrowbuf.observe.progress import ring_segments

    assert ring_segments(5, 5, 8) == [] and ring_segments(3, 7, 8) == [(3, 7)]
    assert ring_segments(6, 11, 8) == [(6, 8), (0, 3)]
    kw = {"tier": "shm", "name": names()} if tier == "shm" else {}
    store = ab.ExperienceStore({"name": "wrap", "fields": {"x": {"dtype": "int64"}, "done": {"dtype": "bool"}}},
                               capacity=64, tasks=["a"], **kw)
    try:
        store.extend({"x": np.arange(50), "done": np.ones(50, bool)})
        store.consume("a", 50)
        store.extend({"x": np.arange(40), "done": np.ones(40, bool)})  # 90 rows written: the oldest 26 evicted
        store.consume("a", 5, lease=60)
        p = store.observability()["progress"]
        assert p["live"] == 64 and p["produced"] == 64
        assert p["tasks"]["a"] == {"ready": 35, "waiting": 0, "consumed": 24, "in_flight": 5, "delivered": 50}
    finally:
        store.close()
