"""The scale run (issue 28, benchmarks/bench_scale.py), bounded: 32 writer/updater/consumer processes on the session's
3-node Ray cluster, one sharded store with three tasks, checked for exactly-once per task, whole groups and bounded
memory. The run kills its actors and shuts its shards down before it returns, also when it fails; the cluster is
the session's (`ray_cluster`), which checks at teardown that none of its processes is left."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # benchmarks/ is a top-level folder of the repository, not part of the package
    sys.path.insert(0, str(ROOT))


@pytest.mark.slow
def test_32_processes_on_3_nodes_consume_each_row_once_per_task_in_bounded_memory(ray_cluster):
    import ray

    from benchmarks import bench_scale

    assert len([n for n in ray.nodes() if n["Alive"]]) == 3
    # 8 writers, 8 reward updaters, 8 ref updaters, 8 trainers; modest rates for a 2-core machine
    res = bench_scale.run(seconds=30.0, writers=8, updaters=8, trainers=8, period=0.5, capacity_per_shard=512,
                          drain_s=90.0, window=1, version_every=4.0)
    assert res["processes"] == 32 and res["nodes"] == 3 and res["shards"] == 3
    assert res["checks"] == {"exactly_once": [], "whole_groups_and_fields": [], "bounded_memory": [],
                             "errors": [], "progress": []}, bench_scale.table(res, None)
    written = res["roles"]["writers"]["rows"]
    assert written >= 8 * 8 * 10  # every writer wrote (at least 10 groups each in 30 s at one per 0.5 s)
    assert res["consumed"] == {"reward": written, "ref": written, "train": written}
    # the ring (3 x 512 rows) is smaller than what was written: eviction held rows until every task consumed them
    assert written > 3 * 512
    # trainers consumed oldest-first under a moving version window (1; a new version every 4 s, every 5th group two
    # versions old): slow rollouts waited behind it, counted, and were admitted in the drain, none dropped
    assert res["admission"]["most_waiting"]["waiting_stale"] > 0
    assert res["admission"]["end"] == {"admitted": written, "waiting": 0, "waiting_ahead": 0, "waiting_stale": 0,
                                       "dropped": 0}
