"""Sharded stores and checkpoints (issue 15): a killed shard comes back with its checkpointed rows. Local Ray."""

from __future__ import annotations

import os
import signal

import pytest

ray = pytest.importorskip("ray")

from arrowbuf.persist import manifest as mf  # noqa: E402
from arrowbuf.ray import ShardedStore  # noqa: E402

from conftest import SMALL, make_episodes  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             object_store_memory=80 << 20)
    try:
        yield
    finally:
        ray.shutdown()


def test_killed_shard_comes_back_with_its_checkpointed_rows(local_ray, tmp_path):
    root = tmp_path / "ckpt"
    s = ShardedStore.create(SMALL, 2, 2000, seed=0, tier="host", strategy=None, checkpoint_root=str(root))
    try:
        s.extend(make_episodes([300, 200, 100], seed=0)[0])
        sizes = [st["size"] for st in s.stats()["shards"]]
        assert sum(sizes) == 600
        infos = s.checkpoint()
        assert [i["rows"] for i in infos] == sizes
        assert all(mf.verify(str(root / f"shard-{k}")) == [] for k in range(2))
        old = s.infos[0]
        os.kill(old["pid"], signal.SIGKILL)  # the shard's process dies; Ray restarts the actor
        new = old
        for _ in range(50):  # a call sent while it dies fails; the next ones wait for the new incarnation
            try:
                new = ray.get(s.actors[0].get_info.remote(), timeout=120)
            except ray.exceptions.RayActorError:
                continue
            if new["pid"] != old["pid"]:
                break
        assert new["pid"] != old["pid"] and new["generation"] != old["generation"]
        assert new["restored_from"]["rows"] == sizes[0]
        assert ray.get(s.actors[0].stats.remote(), timeout=60)["size"] == sizes[0]
        b = s.sample(64, timeout=30)  # the learner's handle serves again, from both shards' rows
        assert len(b.indices) == 64
    finally:
        s.shutdown()
    assert os.path.isdir(root / "shard-0")
