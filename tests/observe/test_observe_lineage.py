"""Lineage recorded by the store (issue 26): who wrote row X, under which version, who consumed it for task T,
when, at which staleness; across a checkpoint and restore in the middle of a pipeline with two tasks and a staleness
bound. Real stores, real files, a real Flight server."""

from __future__ import annotations

import time

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.observe.identity import acting_as

pytest.importorskip("duckdb")

SCHEMA = {"name": "lin", "fields": {
    "prompt_id": {"dtype": "int64"},
    "reward": {"dtype": "float32", "later": True},
    "done": {"dtype": "bool"},
    "policy_version": {"dtype": "int64"},
}}


def rows(first: int, n: int, version: int) -> dict:
    return {"prompt_id": np.arange(first, first + n, dtype=np.int64), "done": np.ones(n, bool),
            "policy_version": np.full(n, version, np.int64)}


def one(store, query: str) -> dict:
    out = store.sql(query).to_pylist()
    assert len(out) == 1, out
    return out[0]


def test_who_wrote_row_x_under_which_version_who_consumed_it_when_at_which_staleness(tmp_path):
    store = ab.ExperienceStore(SCHEMA, capacity=1000, tasks=["ref", "train"], seed=0)
    t0 = time.time()
    with acting_as("actor-A"):
        a = store.extend(rows(0, 10, version=0))
    store.policy_version = 1
    with acting_as("actor-B"):
        b = store.extend(rows(10, 10, version=1))
    t1 = time.time()
    with acting_as("ref-worker"):
        ref = store.consume("ref", 20)
    t2 = time.time()
    assert ref.indices.tolist() == [*a.tolist(), *b.tolist()]
    store.update(ref.indices, {"reward": np.ones(20, np.float32)})

    store.checkpoint(tmp_path / "ck")  # a restore in the middle of the pipeline
    store.close()
    again = ab.ExperienceStore.restore(tmp_path / "ck")
    again.policy_version = 2
    with acting_as("actor-C"):
        again.extend(rows(20, 5, version=2))
    t3 = time.time()
    with acting_as("trainer"):
        train = again.consume("train", 100, require=["reward"], max_staleness=1)
    t4 = time.time()
    # rows of version 0 are beyond the bound (2 - 0 > 1): dropped as stale; version 1 rows are delivered; the new
    # version 2 rows have no reward yet (require=["reward"]): not taken
    assert train.indices.tolist() == b.tolist()
    delivered = set(train.indices.tolist())

    x = int(b[3])  # row X: written by actor-B under version 1, taken by ref at version 1, by train at version 2
    w = one(again, f"SELECT writer, policy_version, written_at FROM lineage WHERE seq = {x} AND task = 'ref'")
    assert w["writer"] == "actor-B" and w["policy_version"] == 1
    assert t0 <= w["written_at"].timestamp() <= t1
    r = one(again, f"SELECT consumer, consumed_at, staleness, outcome FROM lineage WHERE seq = {x} AND task = 'ref'")
    assert r["consumer"] == "ref-worker" and r["staleness"] == 0 and r["outcome"] == "delivered"
    assert t1 <= r["consumed_at"].timestamp() <= t2  # recorded before the checkpoint, kept by the restore
    t = one(again, f"SELECT consumer, consumed_at, staleness, outcome FROM lineage WHERE seq = {x} "
                   "AND task = 'train'")
    assert t["consumer"] == "trainer" and t["staleness"] == 1 and t["outcome"] == "delivered"
    assert t3 <= t["consumed_at"].timestamp() <= t4

    y = int(a[0])  # written under version 0: ref took it at staleness 1, train dropped it as stale (staleness 2)
    r = one(again, f"SELECT writer, policy_version, consumer, staleness, outcome FROM lineage WHERE seq = {y} "
                   "AND task = 'ref'")
    assert r == {"writer": "actor-A", "policy_version": 0, "consumer": "ref-worker", "staleness": 1,
                 "outcome": "delivered"}
    t = one(again, f"SELECT consumer, staleness, outcome FROM lineage WHERE seq = {y} AND task = 'train'")
    assert t == {"consumer": "trainer", "staleness": 2, "outcome": "stale"}

    # every row, every task, exactly: what the table says about all of them
    table = again.sql("SELECT seq, task, writer, policy_version, consumer, staleness, outcome FROM lineage "
                      "ORDER BY task, seq").to_pylist()
    assert len(table) == 2 * 25
    for row in table:
        seq = row["seq"]
        writer, version = ("actor-A", 0) if seq < 10 else ("actor-B", 1) if seq < 20 else ("actor-C", 2)
        assert (row["writer"], row["policy_version"]) == (writer, version), row
        if row["task"] == "ref":
            expect = ("ref-worker", 1 - version, "delivered") if seq < 20 else (None, None, None)
        elif seq < 10:
            expect = ("trainer", 2, "stale")
        elif seq in delivered:
            expect = ("trainer", 2 - version, "delivered")
        else:
            expect = (None, None, None)
        assert (row["consumer"], row["staleness"], row["outcome"]) == expect, row
    # a join with the rows themselves, and the per-task summary the design names
    summary = again.sql("SELECT task, count(consumed_at) AS n, avg(staleness) AS s FROM lineage "
                        "WHERE outcome = 'delivered' GROUP BY 1 ORDER BY 1").to_pylist()
    assert summary[0]["task"] == "ref" and summary[0]["n"] == 20 and summary[0]["s"] == pytest.approx(0.5)
    joined = one(again, f"SELECT e.prompt_id, l.writer FROM experience e JOIN lineage l USING (seq) "
                        f"WHERE l.task = 'train' AND seq = {x}")
    assert joined == {"prompt_id": 13, "writer": "actor-B"}
    again.close()


def test_lineage_follows_the_ring_and_the_store_version_without_a_version_field():
    schema = {"name": "nov", "fields": {"x": {"dtype": "int64"}, "done": {"dtype": "bool"}}}
    store = ab.ExperienceStore(schema, capacity=64, chunk_rows=16, seed=0)
    for i in range(10):  # 10 x 16 rows through a ring of 64: recycled positions get their new row's lineage
        store.policy_version = i
        with acting_as(f"w{i}"):
            store.extend({"x": np.arange(16, dtype=np.int64), "done": np.zeros(16, bool)})
    with acting_as("w-append"):
        seq = store.append({"x": 1, "done": False})  # the one-row path
    table = store.sql("SELECT seq, writer, policy_version, task FROM lineage ORDER BY seq").to_pylist()
    assert [r["seq"] for r in table] == list(range(seq - 63, seq + 1))
    for r in table[:-1]:
        assert (r["writer"], r["policy_version"], r["task"]) == (f"w{r['seq'] // 16}", r["seq"] // 16, None)
    assert table[-1]["writer"] == "w-append" and table[-1]["policy_version"] == 9
    store.close()


def test_remote_writers_and_consumers_are_named_by_their_connection_and_observe_false_records_nothing():
    store = ab.ExperienceStore(SCHEMA, capacity=100, tasks=["t"], seed=0)
    with ab.serve(store, "grpc://127.0.0.1:0") as server, ab.connect(server.location) as client:
        client.extend(rows(0, 4, version=0))
        client.consume("t", 2)
        got = client.sql("SELECT DISTINCT writer, consumer FROM lineage WHERE consumer IS NOT NULL").to_pylist()
        assert len(got) == 1 and got[0]["writer"].startswith("flight:") and got[0]["consumer"].startswith("flight:")
    store.close()
    off = ab.ExperienceStore(SCHEMA, capacity=100, tasks=["t"], observe=False)
    off.extend(rows(0, 4, version=0))
    with pytest.raises(ab.InvalidArgument):
        off.sql("SELECT * FROM lineage")
    assert off.observability()["timings"] is None and off.observability()["lineage"] is None
    off.close()


def test_export_writes_the_lineage_into_its_metadata_folder_and_dataset_readers_skip_it(tmp_path):
    import pyarrow.parquet as pq

    store = ab.ExperienceStore(SCHEMA, capacity=100, tasks=["t"], seed=0)
    with acting_as("exporter-test"):
        store.extend(rows(0, 12, version=0))
    store.consume("t", 5)
    out = store.export(tmp_path / "data")
    lineage = pq.read_table(out["lineage"])
    assert out["lineage"] == str(tmp_path / "data" / "_arrowbuf" / "lineage.parquet")
    assert lineage.equals(store.lineage_table())
    assert set(lineage.column("writer").to_pylist()) == {"exporter-test"}
    assert lineage.filter(lineage.column("consumed_at").is_valid()).num_rows == 5
    ds = ab.open_dataset(tmp_path / "data")
    assert ds.to_table().num_rows == 12  # the lineage file is not taken for rows
    store.close()


def test_a_replay_can_put_back_who_wrote_and_consumed_and_when():
    """The hook a journal's replay uses: rows replayed now keep the writer, consumer and times the journal recorded."""
    store = ab.ExperienceStore(SCHEMA, capacity=100, tasks=["t"], seed=0)
    with acting_as("replayer"):
        ids = store.extend(rows(0, 4, version=0))
        store.consume("t", 2)
    lineage = store._core.lineage  # the replay path lives beside the store's internals (persist), as here
    lineage.restamp_written(ids % lineage.arena_rows, "actor-7", 1_700_000_000.0)
    lineage.restamp_consumed("t", ids[:2], "trainer-2", 1_700_000_100.0)
    got = store.sql("SELECT seq, writer, epoch(written_at) AS w, consumer, epoch(consumed_at) AS c FROM lineage "
                    "ORDER BY seq").to_pylist()
    assert [(r["writer"], r["w"]) for r in got] == [("actor-7", 1_700_000_000.0)] * 4
    assert [(r["consumer"], r["c"]) for r in got] == [("trainer-2", 1_700_000_100.0)] * 2 + [(None, None)] * 2
    store.close()


def test_lineage_is_bounded_by_the_ring():
    from arrowbuf.observe.lineage import MIN_RUN, ROW_BYTES, RUN_BYTES, TASK_BYTES

    store = ab.ExperienceStore(SCHEMA, capacity=64, chunk_rows=16, tasks=["a", "b"], seed=0)
    before = store.observability()["lineage_bytes"]
    arena_rows = 64 + 16  # the capacity and the spare chunk
    assert before == arena_rows * (ROW_BYTES + 2 * TASK_BYTES) + (arena_rows // MIN_RUN + 2) * RUN_BYTES
    for i in range(40):  # 40 x 16 rows through a ring of 64, every row consumed by both tasks
        store.extend(rows(i * 16, 16, version=0))
        store.consume("a", 16)
        store.consume("b", 16)
    assert store.observability()["lineage_bytes"] == before
    assert store.sql("SELECT count(*) AS n FROM lineage").to_pylist() == [{"n": 2 * 64}]
    store.close()
