"""Consistent snapshots (arrowbuf.reader): to_table, sql and episodes while a writer thread or a writer process keeps
overwriting a small ring. Every row encodes its own seq (obs = [seq, seq, seq], reward = seq), so a row carrying
another row's data, or a torn row, shows."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import uuid

import numpy as np

import arrowbuf as ab
from arrowbuf.tiers import shm
from conftest import SMALL

CTX = mp.get_context("spawn")
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
