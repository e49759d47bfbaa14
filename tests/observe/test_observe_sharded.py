"""/metrics of a ShardedStore (issue 26): totals per store and one series per shard, on the session's Ray cluster."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest

pytest.importorskip("ray")
parser = pytest.importorskip("prometheus_client.parser")

from arrowbuf.observe.metrics import MetricsEndpoint  # noqa: E402
from arrowbuf.ray import ShardedStore  # noqa: E402

pytestmark = pytest.mark.slow
SCHEMA = {"name": "sharded", "fields": {"x": {"dtype": "int64"}, "done": {"dtype": "bool"}}}


def test_a_sharded_store_is_reported_in_total_and_per_shard(ray_cluster):
    sharded = ShardedStore.create(SCHEMA, 2, 1000, seed=0, failure_timeout=20.0)
    try:
        w = sharded.writer()
        for i in range(10):
            w.extend({"x": np.arange(i * 30, (i + 1) * 30, dtype=np.int64), "done": np.ones(30, bool)})
        w.flush()
        w.close()
        sharded.sample(16)
        st = sharded.stats()
        with MetricsEndpoint.start("127.0.0.1:0", stores={"sharded": sharded}) as ep:
            with urllib.request.urlopen(ep.url, timeout=30) as r:
                text = r.read().decode()
        got = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in parser.text_string_to_metric_families(text) for s in fam.samples}
        assert got[("arrowbuf_rows_inserted_total", (("store", "sharded"),))] == st["inserts"] == 300
        assert got[("arrowbuf_capacity_rows", (("store", "sharded"),))] == 2000
        per = [got[("arrowbuf_shard_rows", (("shard", str(k)), ("store", "sharded")))] for k in range(2)]
        assert per == [sh["size"] for sh in st["shards"]] and sum(per) == 300
        assert [got[("arrowbuf_shard_up", (("shard", str(k)), ("store", "sharded")))] for k in range(2)] == [1, 1]
    finally:
        sharded.shutdown()


def test_a_sharded_store_has_a_lineage_table_with_the_shard(ray_cluster):
    """`sharded.sql` sees every shard's lineage as `lineage`, with the shard: who wrote each row (the Flight peer of
    the handle's writer), and who consumed it for the task, at which staleness."""
    sharded = ShardedStore.create(SCHEMA, 2, 1000, seed=0, tasks=["t"], failure_timeout=20.0)  # tasks: host tier
    try:
        for i in range(6):  # 60 rows to each shard
            w = sharded.writer(shard=i % 2)
            w.extend({"x": np.arange(i * 20, (i + 1) * 20, dtype=np.int64), "done": np.ones(20, bool)})
            w.flush()
            w.close()
        sharded.policy_version = 2
        took = sharded.consume("t", 50, timeout=10.0)
        st = sharded.stats()
        lineage = sharded.lineage_table()
        assert lineage.column_names[:2] == ["shard", "seq"] and lineage.num_rows == 120  # one task: a row each
        per = sharded.sql("SELECT shard, count(*) AS n FROM lineage GROUP BY 1 ORDER BY 1").to_pylist()
        assert per == [{"shard": k, "n": sh["size"]} for k, sh in enumerate(st["shards"])] == [
            {"shard": 0, "n": 60}, {"shard": 1, "n": 60}]
        joined = sharded.sql("SELECT e.x, l.writer, l.consumer, l.staleness FROM experience e "
                             "JOIN lineage l USING (shard, seq) ORDER BY e.x").to_pylist()
        assert [r["x"] for r in joined] == list(range(120))  # every row has its lineage, matched by (shard, seq)
        assert all(r["writer"].startswith("flight:") for r in joined)
        consumed = [r for r in joined if r["consumer"] is not None]
        assert len(consumed) == len(took.indices) == 50
        assert {r["staleness"] for r in consumed} == {2}  # written under version 0, delivered under 2
        assert sorted(r["x"] for r in consumed) == sorted(took.data.column("x").to_pylist())
    finally:
        sharded.shutdown()


def test_shared_memory_shards_say_they_record_no_lineage(ray_cluster):
    from arrowbuf.errors import InvalidArgument

    sharded = ShardedStore.create(SCHEMA, 2, 100, seed=0, tier="shm", failure_timeout=20.0)
    try:
        with pytest.raises(InvalidArgument, match="record no lineage"):
            sharded.sql("SELECT count(*) FROM lineage")
    finally:
        sharded.shutdown()


def test_durable_shards_report_their_journal_progress(ray_cluster, tmp_path):
    """A durable ShardedStore: the journal counters are the sums over the shards, the last durable lsn is per shard."""
    sharded = ShardedStore.create(SCHEMA, 2, 1000, seed=0, durable=str(tmp_path / "run"), failure_timeout=20.0)
    try:
        for k in range(2):
            w = sharded.writer(shard=k)
            for i in range(3):
                w.extend({"x": np.arange(i * 10, (i + 1) * 10, dtype=np.int64), "done": np.ones(10, bool)})
            w.flush()
            w.close()
        shards = sharded.stats()["shards"]
        with MetricsEndpoint.start("127.0.0.1:0", stores={"sharded": sharded}) as ep:
            with urllib.request.urlopen(ep.url, timeout=30) as r:
                text = r.read().decode()
        got = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in parser.text_string_to_metric_families(text) for s in fam.samples}
        journals = [sh["journal"] for sh in shards]
        assert all(j["records"] >= 3 for j in journals)
        for key in ("records", "bytes", "fsyncs"):
            assert got[(f"arrowbuf_journal_{key}_total", (("store", "sharded"),))] == sum(j[key] for j in journals)
        assert [got[("arrowbuf_shard_journal_durable_lsn", (("shard", str(k)), ("store", "sharded")))]
                for k in range(2)] == [j["durable_lsn"] for j in journals]
    finally:
        sharded.shutdown()
