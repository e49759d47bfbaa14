"""Lineage of batches kept as run records (one record per batch of `MIN_RUN` rows or more, `arrowbuf.observe.lineage`):
every live row still answers who wrote it and when, exactly as per-row records did, through ring wraps, appends
between batches, checkpoints and restores, and a replay's restamp."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.observe.identity import acting_as
from arrowbuf.observe.lineage import MIN_RUN

SCHEMA = {"name": "runs", "fields": {"x": {"dtype": "int64"}, "done": {"dtype": "bool"}}}
SCHEMA_V = {"name": "runs_v", "fields": {"x": {"dtype": "int64"}, "done": {"dtype": "bool"},
                                         "policy_version": {"dtype": "int64"}}}


def batch(first: int, n: int) -> dict:
    return {"x": np.arange(first, first + n, dtype=np.int64), "done": np.ones(n, bool)}


def write(store: ab.ExperienceStore, ops: list[tuple[str, int]]) -> dict[int, tuple[str, float, float]]:
    """Run `ops` ((writer, rows): rows == 0 is one `append`), returning per seq (writer, time before, time after)."""
    expect: dict[int, tuple[str, float, float]] = {}
    x = 0
    for who, n in ops:
        with acting_as(who):
            t0 = time.time()
            if n == 0:
                ids = [store.append({"x": x, "done": True})]
                x += 1
            else:
                ids = store.extend(batch(x, n)).tolist()
                x += n
            t1 = time.time()
        for s in ids:
            expect[int(s)] = (who, t0, t1)
    return expect


def check(store: ab.ExperienceStore, expect: dict[int, tuple[str, float, float]]) -> None:
    got = store.lineage_table().to_pylist()
    live = store.to_table().column("seq").to_pylist()
    assert sorted(r["seq"] for r in got) == sorted(live)
    for r in got:
        who, t0, t1 = expect[r["seq"]]
        assert r["writer"] == who, r
        at = r["written_at"].timestamp()
        assert t0 - 1e-5 <= at <= t1 + 1e-5, (r, t0, t1)


ops_strategy = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]),
                                  st.one_of(st.just(0), st.integers(1, MIN_RUN - 1), st.integers(MIN_RUN, 90))),
                        min_size=1, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_strategy)
def test_every_live_row_knows_its_writer_and_time_through_wraps(ops):
    store = ab.ExperienceStore(SCHEMA, capacity=48, chunk_rows=16, seed=0)
    try:
        check(store, write(store, ops))
    finally:
        store.close()


def test_a_batch_is_one_run_record_and_the_ring_of_runs_keeps_every_live_row():
    store = ab.ExperienceStore(SCHEMA, capacity=64, chunk_rows=16, seed=0)
    lineage = store._core.lineage  # the records themselves (the store's internals, as persist reads them)
    try:
        expect = write(store, [("w0", MIN_RUN)])
        assert lineage.runs == 1  # one record, not MIN_RUN rows' worth of stamps
        ops = [(f"w{i % 5}", MIN_RUN + (i % 3)) for i in range(3 * lineage.run_cap)]  # the ring of runs wraps
        expect.update(write(store, ops))
        assert lineage.runs == 1 + len(ops)
        check(store, expect)
    finally:
        store.close()


def test_runs_go_through_a_checkpoint_and_restore(tmp_path):
    store = ab.ExperienceStore(SCHEMA, capacity=100, chunk_rows=16, seed=0)
    expect = write(store, [("early", 40), ("mid", 0), ("late", 30), ("mid", 3), ("last", 50)])
    store.checkpoint(tmp_path / "ck")
    before = store.lineage_table()
    store.close()
    again = ab.ExperienceStore.restore(tmp_path / "ck")
    try:
        after = again.lineage_table()
        assert after.select(["seq", "writer", "written_at"]).equals(before.select(["seq", "writer", "written_at"]))
        check(again, expect)
        more = write(again, [("after", 40), ("after2", 0)])  # new runs beside the restored per-row records
        expect.update(more)
        check(again, expect)
    finally:
        again.close()


def test_a_replay_restamps_rows_of_a_run_and_leaves_the_others():
    store = ab.ExperienceStore(SCHEMA, capacity=200, chunk_rows=16, seed=0)
    lineage = store._core.lineage
    try:
        expect = write(store, [("first", 40), ("second", 40), ("third", 0)])
        ids = np.arange(40, 80, dtype=np.int64)  # the second batch, replayed: its recorded writer and time go back
        with store._core.lock:
            lineage.restamp_written(ids % lineage.arena_rows, "actor-7", 1_700_000_000.0)
        for s in ids.tolist():
            expect[s] = ("actor-7", 1_700_000_000.0, 1_700_000_000.0)
        check(store, expect)
        expect.update(write(store, [("fourth", 60)]))
        check(store, expect)
    finally:
        store.close()


@pytest.mark.parametrize("schema", [SCHEMA, SCHEMA_V])
def test_the_version_of_a_run_row_is_the_version_at_its_commit(schema):
    store = ab.ExperienceStore(schema, capacity=100, chunk_rows=16, tasks=["t"], seed=0)
    try:
        for v in range(3):
            store.policy_version = v
            b = batch(v * 20, 20)
            if "policy_version" in schema["fields"]:
                b["policy_version"] = np.full(20, v, np.int64)
            store.extend(b)
        store.policy_version = 5
        store.consume("t", 60)
        got = store.sql("SELECT seq, policy_version, staleness FROM lineage ORDER BY seq").to_pylist()
        assert [r["policy_version"] for r in got] == [0] * 20 + [1] * 20 + [2] * 20
        assert [r["staleness"] for r in got] == [5] * 20 + [4] * 20 + [3] * 20
    finally:
        store.close()


def test_an_appended_row_without_its_own_version_gets_the_version_at_its_commit():
    """A schema without a `policy_version` field: each appended row records the store's version when it committed
    (the one-row hook reads it through a live view of the version)."""
    store = ab.ExperienceStore(SCHEMA, capacity=100, chunk_rows=16, seed=0)  # no tasks: append's fast path
    try:
        for v in range(4):
            store.policy_version = v
            for i in range(3):
                store.append({"x": v * 3 + i, "done": True})
        assert store.stats()["append_slow_path"] == 0
        store.extend(batch(100, 2))  # a short batch: per-row versions too
        store.policy_version = 9
        got = store.sql("SELECT policy_version FROM lineage ORDER BY seq").to_pylist()
        assert [r["policy_version"] for r in got] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3 + [3] * 2
    finally:
        store.close()
