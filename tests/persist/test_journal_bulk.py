"""Bulk replay (issue 25, recovery speed): consecutive batch records applied as one extend give exactly the store
that applying them one by one gives: rows, seqs, episodes, later fields, consumption, priorities; a torn tail is
still dropped. Real files."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.persist import journal as jr
from arrowbuf.persist import replay as rp

BULK = rp.BULK_ROWS
GRPO = {"name": "g", "fields": {
    "prompt_id": {"dtype": "int64"},
    "response": {"dtype": "int32", "ragged": True},
    "reward": {"dtype": "float32", "later": True, "allow_nan": False},
    "obs": {"dtype": "float32", "shape": [3]},
    "done": {"dtype": "bool"},
}}


def rows(n, start, done_every=3, reward=False):
    rng = np.random.default_rng(start)
    out = {"prompt_id": np.arange(start, start + n), "done": (np.arange(start, start + n) % done_every) == 0,
           "obs": rng.random((n, 3), dtype=np.float32),
           "response": [rng.integers(0, 100, rng.integers(1, 6)).astype(np.int32) for _ in range(n)]}
    if reward:
        out["reward"] = rng.random(n, dtype=np.float32)
    return out


def write(root, capacity=64):
    """Runs of batches (with done flags across their edges), broken by updates, a task, consumption and a batch
    that gives a later field (another payload schema); the ring wraps."""
    s = ab.ExperienceStore(GRPO, capacity=capacity, durable=root, durability="os",
                           sampler=ab.samplers.Prioritized(alpha=0.6, beta=0.4), seed=3)
    start = 0
    for _ in range(6):
        s.extend(rows(5, start, done_every=4))
        start += 5
    ids = s.extend(rows(4, start))
    start += 4
    s.update(ids[:2], {"reward": np.array([1.0, 2.0], np.float32)})
    s.add_task("train")
    got = s.consume("train", 3)
    assert len(got.indices) == 3
    s.consume("train", 100)  # the rest so far: the ring may evict them (a task holds rows it has not consumed)
    for k in range(5):
        s.extend(rows(7, start, reward=k == 2))
        start += 7
    s.update_priorities(ids, np.arange(1, len(ids) + 1, dtype=np.float64))
    for _ in range(4):
        s.extend(rows(3, start))
        start += 3
    s.close()


def state(s):
    return {"table": s.to_table(), "len": len(s), "consumed": s.stats()["consumed"], "tasks": s.tasks,
            "episodes": s.episodes(), "sample": s.sample(16).indices.tolist()}


def restore(root, bulk, monkeypatch):
    monkeypatch.setattr(rp, "BULK_ROWS", bulk)
    with ab.ExperienceStore.restore(root) as s:
        return state(s), s.stats()["journal"]["replayed"]


@pytest.mark.parametrize("capacity", [64, 1000])
def test_bulk_replay_gives_the_same_store_as_per_record_replay(tmp_path, monkeypatch, capacity):
    root = str(tmp_path / "run")
    write(root, capacity)
    shutil.copytree(root, str(tmp_path / "copy"))
    one, counts_one = restore(str(tmp_path / "copy"), 0, monkeypatch)
    bulk, counts_bulk = restore(root, BULK, monkeypatch)
    assert counts_bulk.get("bulk_runs", 0) >= 3, counts_bulk  # the runs were applied in bulk ...
    assert "bulk_runs" not in counts_one
    assert counts_bulk["batch"] == counts_one["batch"] == 16
    assert one["table"].equals(bulk["table"])  # ... and the store is the same
    for k in ("len", "consumed", "tasks", "sample"):
        assert one[k] == bulk[k], k
    assert one["episodes"].to_pandas().equals(bulk["episodes"].to_pandas())  # (NaN returns: no reward yet)


def test_a_run_never_holds_more_than_half_the_capacity(tmp_path, monkeypatch):
    recs = [jr.Record(i, "batch", {"first": 10 * i, "n": 10}, b"x" * 100) for i in range(10)]
    runs = rp._bulk_runs(recs, set(), capacity=40)
    assert runs and all(sum(int(r.meta["n"]) for r in recs[a:b]) <= 20 for a, b in runs.items())
    assert rp._bulk_runs(recs, set(), capacity=10) == {}  # 5 rows a run: no two records fit
    gap = [*recs[:3], jr.Record(3, "batch", {"first": 31, "n": 10}, b"x")]  # not consecutive seqs
    assert rp._bulk_runs(gap, set(), capacity=None) == {0: 3}
    assert rp._bulk_runs(recs[:4], {10}, capacity=None) == {2: 4}  # an aborted batch goes alone


def test_a_torn_tail_after_a_run_is_still_dropped(tmp_path, monkeypatch):
    root = str(tmp_path / "run")
    s = ab.ExperienceStore(GRPO, capacity=1000, durable=root, durability="os")
    for k in range(8):
        s.extend(rows(4, 4 * k))
    s.close()
    (_, path), = jr.segments(root)[-1:]
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 37)  # the last record half-written (a closed store's journal ends in it)
    bulk, counts = restore(root, BULK, monkeypatch)
    assert counts["torn_bytes"] > 0 and counts.get("bulk_runs", 0) >= 1
    assert bulk["len"] == 28  # the eighth batch is dropped, never applied
    assert bulk["table"].column("prompt_id").to_pylist() == list(range(28))
