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
