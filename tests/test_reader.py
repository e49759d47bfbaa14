"""Consistent snapshots (arrowbuf.engine.reader): to_table, sql and episodes while a writer thread or a writer process keeps
overwriting a small ring. Every row encodes its own seq (obs = [seq, seq, seq], reward = seq), so a row carrying
another row's data, or a torn row, shows."""

from __future__ import annotations

import os
import threading
import uuid

import numpy as np
import pyarrow as pa
import pytest
from conftest import SMALL, process_context

import arrowbuf as ab
from arrowbuf.tiers import shm

CTX = process_context()
JOIN_S = 60


def rows_from(seq0: int, n: int) -> dict[str, np.ndarray]:
    s = np.arange(seq0, seq0 + n)
    obs = np.repeat(s[:, None], 3, 1).astype(np.float32)
    end = (s % 10) == 9
    return {"obs": obs, "action": s.astype(np.int64), "reward": s.astype(np.float32), "terminated": end,
            "truncated": np.zeros(n, bool), "next_obs": obs + 1}


def check(table) -> None:
    seq = table.column("seq").to_numpy()
    obs = table.column("obs").combine_chunks().to_numpy_ndarray()
    assert (np.diff(seq) == 1).all(), "not one contiguous seq range"
    np.testing.assert_array_equal(table.column("action").to_numpy(), seq)
    np.testing.assert_array_equal(obs, np.repeat(seq[:, None], 3, 1).astype(np.float32))
    np.testing.assert_array_equal(table.column("reward").to_numpy(), seq.astype(np.float32))


def _write(store: ab.ExperienceStore, batches: int, stop: threading.Event | None = None) -> None:
    seq = len(store) and store.stats()["next_seq"]
    for _ in range(batches):
        if stop is not None and stop.is_set():
            return
        store.extend(rows_from(seq, 37))
        seq += 37


@pytest.mark.slow
def test_snapshots_are_consistent_while_a_writer_thread_runs():
    store = ab.ExperienceStore(SMALL, capacity=300, chunk_rows=16, seed=0)
    _write(store, 10)
    stop = threading.Event()
    th = threading.Thread(target=_write, args=(store, 10**6, stop), daemon=True)
    th.start()
    try:
        for _ in range(40):
            check(store.to_table())
            snap = store.snapshot(["obs", "action", "reward", "seq"])
            check(snap.table)
            assert snap.table.num_rows == snap.hi - snap.lo and snap.lo >= snap.live_lo
            t = store.sql("SELECT seq, action, reward, obs FROM experience ORDER BY seq")
            assert (t.column("action").to_numpy() == t.column("seq").to_numpy()).all()
            assert (t.column("reward").to_numpy() == t.column("seq").to_numpy()).all()
            ep = store.episodes()
            assert (ep.column("last_seq").to_numpy() - ep.column("first_seq").to_numpy() + 1
                    == ep.column("length").to_numpy()).all()
    finally:
        stop.set()
        th.join(JOIN_S)
    store.close()


def _process_writer(name: str, batches: int) -> None:
    store = ab.ExperienceStore.attach(name)
    _write(store, batches)
    store.close()


def test_snapshots_are_consistent_while_a_writer_process_runs():
    name = f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"
    p = None
    try:
        with ab.ExperienceStore(SMALL, 300, chunk_rows=16, tier="shm", name=name) as store:
            _write(store, 10)
            p = CTX.Process(target=_process_writer, args=(name, 3000), daemon=True)
            p.start()
            reads = 0
            while p.is_alive() or reads == 0:
                check(store.to_table())
                reads += 1
            p.join(JOIN_S)
            assert p.exitcode == 0
            check(store.to_table())
    finally:
        if p is not None and p.is_alive():
            p.kill()
            p.join(10)
        shm.remove(name)


# ---------------------------------------------------------------------- iter_table: a snapshot chunk by chunk
def check_batch(batch) -> np.ndarray:
    """One streamed batch: one contiguous seq range, every row as committed. Returns its seqs."""
    seq = batch.column("seq").to_numpy()
    assert (np.diff(seq) == 1).all(), "a batch is not one contiguous seq range"
    np.testing.assert_array_equal(batch.column("action").to_numpy(), seq)
    obs = batch.column("obs").to_numpy_ndarray()
    np.testing.assert_array_equal(obs, np.repeat(seq[:, None], 3, 1).astype(np.float32))
    np.testing.assert_array_equal(batch.column("reward").to_numpy(), seq.astype(np.float32))
    return seq


def test_iter_table_streams_the_same_rows_as_to_table():
    with ab.ExperienceStore(SMALL, capacity=300, chunk_rows=16, seed=0) as store:
        _write(store, 12)  # wrapped: 444 rows into 300
        batches = list(store.iter_table())
        assert all(b.num_rows <= 16 for b in batches)
        whole = store.to_table()
        assert pa.Table.from_batches(batches).equals(whole)
        small = list(store.iter_table(["seq", "action"], max_rows=5))
        assert all(b.num_rows <= 5 for b in small) and small[0].schema.names == ["seq", "action"]
        assert pa.Table.from_batches(small).equals(whole.select(["seq", "action"]))
        with pytest.raises(ab.SchemaError):
            store.iter_table(["nope"])  # raised at the call, before any row is read
        with pytest.raises(ab.InvalidArgument):
            store.iter_table(max_rows=0)


def test_iter_table_stops_at_the_snapshot_point_and_skips_rows_evicted_before_it_reached_them():
    with ab.ExperienceStore(SMALL, capacity=300, chunk_rows=16, seed=0) as store:
        _write(store, 10)  # seqs 0..369, live 70..369
        it = store.iter_table()
        first = check_batch(next(it))
        assert first[0] == 70
        store.extend(rows_from(370, 150))  # evicts 70..219 (some of them not read yet); newer than the snapshot
        rest = [check_batch(b) for b in it]
        seqs = np.concatenate([first, *rest])
        assert (np.diff(seqs) > 0).all()
        assert seqs[-1] == 369  # nothing newer than the snapshot point
        assert rest[0][0] == 220  # the stream went on at the oldest live row, every row intact


def test_iter_table_batches_are_consistent_while_a_writer_thread_runs():
    store = ab.ExperienceStore(SMALL, capacity=300, chunk_rows=16, seed=0)
    _write(store, 10)
    stop = threading.Event()
    th = threading.Thread(target=_write, args=(store, 10**6, stop), daemon=True)
    th.start()
    try:
        streams = 0
        while streams < 40:
            it = store.iter_table(max_rows=7)
            after = store.stats()["next_seq"]
            last = -1
            for batch in it:
                assert batch.num_rows <= 7
                seq = check_batch(batch)
                assert seq[0] > last
                last = int(seq[-1])
            assert last < after  # nothing newer than the snapshot point (its tail may have been evicted unread)
            streams += 1
    finally:
        stop.set()
        th.join(JOIN_S)
        store.close()


# ---------------------------------------------------------------------- sql/episodes copy only what they read
class RecordingStore(ab.ExperienceStore):
    """A real store that notes which columns each snapshot copies."""

    def to_table(self, columns=None):
        self.asked = list(columns) if columns is not None else None
        return super().to_table(columns)


QUERIES = {
    "SELECT episode_id, sum(reward) AS r FROM experience GROUP BY 1 ORDER BY 1": ["reward", "episode_id", "seq"],
    "SELECT count(*) AS n FROM experience": ["seq"],
    "SELECT max(step) AS m FROM experience WHERE terminated": ["terminated", "step", "seq"],
    "SELECT e.action, \"Reward\" * 2 AS x FROM experience AS e WHERE seq > 40 ORDER BY seq -- obs": [
        "action", "reward", "seq"],
    "SELECT * FROM experience ORDER BY seq": None,
    "SELECT obs FROM experience ORDER BY seq": ["obs", "seq"],
    "SELECT e FROM experience e ORDER BY e.seq": None,                    # the row as a struct
    "SELECT experience FROM experience ORDER BY seq": None,
    "SELECT a FROM experience AS t(a, b) ORDER BY a": None,               # renamed by position
    "SELECT COLUMNS('re.*') FROM experience ORDER BY 1": None,
    "SELECT max(s) AS m FROM (FROM experience) AS q(s)": None,
    "SELECT x.reward FROM experience x JOIN experience y ON x.seq = y.seq + 1 ORDER BY 1": ["reward", "seq"],
}


@pytest.mark.parametrize("query", list(QUERIES))
def test_sql_copies_only_the_columns_its_query_names_and_returns_the_same(query):
    pytest.importorskip("duckdb")
    from arrowbuf.query import sql
    from arrowbuf.query.frames import _plain

    with RecordingStore(SMALL, capacity=120, chunk_rows=16, seed=0) as store:
        _write(store, 5)  # wrapped: 185 rows into 120
        got = store.sql(query)
        assert store.asked == QUERIES[query]
        want = sql.run(_plain(ab.ExperienceStore.to_table(store)), query)  # over every column, as before
        assert got.equals(want)


def test_episodes_copies_only_the_stream_keys_end_fields_and_reward():
    with RecordingStore(SMALL, capacity=120, chunk_rows=16, seed=0) as store:
        _write(store, 5)
        ep = store.episodes()
        assert sorted(store.asked) == sorted(["episode_id", "step", "seq", "terminated", "truncated", "reward"])
        assert "obs" not in store.asked and ep.num_rows > 0
