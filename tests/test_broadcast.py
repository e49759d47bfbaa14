"""Hoplite-style broadcast (`arrowbuf.ray.Broadcast`) on a real local multi-node Ray cluster (the session's: 3 nodes
of 1 CPU, conftest's ray_cluster; a 4th added for the late joiner and removed after it)."""

from __future__ import annotations

import glob
import sys
import time

import numpy as np
import pyarrow as pa
import pytest

from arrowbuf.ray import Broadcast
from arrowbuf.ray.hoplite.relay import digest_of, shm_prefix

ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Ray clusters, demo runs and processes: the developer loop (-m 'not slow') leaves these to CI
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    return ray_cluster


@pytest.fixture
def extra_node(cluster):
    """Adds a node (1 CPU) to the session's cluster; removed after the test (after its broadcasts are closed: ask for
    this fixture before `bcast`), so the other tests see the session's nodes only."""
    added = []

    def add():
        added.append(cluster.add_node(num_cpus=1, object_store_memory=80 << 20))
        cluster.wait_for_nodes()
        return added[-1]

    yield add
    for node in added:
        cluster.remove_node(node)
    end = time.monotonic() + 60  # a bounded wait for the cluster to see the node gone, not a timing assert
    while time.monotonic() < end and {n.node_id for n in added} & set(_nodes()):
        time.sleep(0.1)
    assert not {n.node_id for n in added} & set(_nodes()), "a removed node is still alive"


@pytest.fixture
def bcast(cluster):
    made: list[Broadcast] = []

    def make(**kw) -> Broadcast:
        made.append(Broadcast.create(**kw))
        return made[-1]

    yield make
    for b in made:
        b.close()
        assert not glob.glob(shm_prefix(b.uid) + "*"), "the broadcast left /dev/shm files behind"


def _nodes() -> list[str]:
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])


@ray.remote(num_cpus=0)
class Consumer:
    def read(self, bc, version):
        obj = bc.get(version, timeout=120)
        arrays = obj["weights"]
        table = obj["table"]
        h = digest_of(b"".join(np.ascontiguousarray(arrays[k]).tobytes() for k in sorted(arrays))
                      + table.column("x").to_numpy().tobytes())
        return {"node": ray.get_runtime_context().get_node_id(), "digest": h, "version": obj["version"],
                "writeable": any(a.flags.writeable for a in arrays.values())}


def _on(node_id: str) -> dict:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def _weights(version: int, mb: int = 4) -> dict:
    rng = np.random.default_rng(version)
    n = (mb << 20) // 4 // 4
    return {"version": version,
            "weights": {f"layer{i}": rng.standard_normal(n).astype(np.float32) for i in range(4)},
            "table": pa.table({"x": np.arange(1000, dtype=np.int64) * version})}


def _expected(obj: dict) -> str:
    a = obj["weights"]
    return digest_of(b"".join(a[k].tobytes() for k in sorted(a)) + obj["table"].column("x").to_numpy().tobytes())


def test_every_consumer_on_every_node_reads_identical_bytes_zero_copy(bcast):
    bc = bcast(block_size=256 << 10)
    obj = _weights(1)
    v = bc.publish(obj)
    consumers = [Consumer.options(**_on(n)).remote() for n in _nodes() for _ in range(2)]
    got = ray.get([c.read.remote(bc, v) for c in consumers], timeout=180)
    assert {g["node"] for g in got} == set(_nodes())
    assert {g["digest"] for g in got} == {_expected(obj)}
    assert not any(g["writeable"] for g in got)  # views on the node's mapped file, not copies
    meta = bc.wait(v, timeout=60)
    assert {bc.digest(v, key=n, timeout=60) for n in _nodes()} == {meta["digest"]}
    st = bc.state()
    assert set(st["count"]) == set(_nodes()) and set(st["count"].values()) == {meta["nblocks"]}
    for c in consumers:
        ray.kill(c)


def test_a_newer_version_supersedes_one_in_flight(bcast):
    bc = bcast(block_size=128 << 10, egress_bytes_per_s=8 << 20)
    bc.publish(_weights(1))
    v2 = bc.publish(_weights(2))  # v1 is still moving at 8 MB/s when v2 arrives
    obj = _weights(2)
    for n in _nodes():
        assert bc.wait(v2, key=n, timeout=120)["version"] == v2
        assert bc.digest(v2, key=n, timeout=60) == bc.wait(v2, key=n)["digest"]
    assert _expected(bc.get(v2, timeout=60)) == _expected(obj)


def test_a_killed_relay_mid_broadcast_does_not_stop_the_others(bcast):
    # a chain (one upload slot each) at 4 MB/s per node: each hop takes ~1 s for the 4 MB object
    bc = bcast(block_size=128 << 10, upload_slots=1, egress_bytes_per_s=4 << 20)
    obj = _weights(3)
    v = bc.publish(obj)
    root = ray.get_runtime_context().get_node_id()
    others = [n for n in _nodes() if n != root]
    n_blocks = bc.wait(0, key=root)["nblocks"]
    for n in others:  # both receivers have attached and started
        ray.get(bc.directory.wait_count.remote(n, 1), timeout=60)
    up = bc.state()["upstream"]
    middle = next(n for n in others if up[n] == root)
    tail = next(n for n in others if n != middle)
    assert up[tail] == middle  # a chain root -> middle -> tail, built as the receivers asked
    ray.get(bc.directory.wait_count.remote(middle, n_blocks // 2), timeout=60)
    bc.kill_relay(middle)
    meta = bc.wait(v, key=tail, timeout=120)  # the tail re-attaches (to the root) and resumes
    assert bc.digest(v, key=tail, timeout=60) == meta["digest"]
    assert middle in bc.state()["dead"]
    # a consumer on the killed relay's node gets a new relay, which joins the running broadcast
    c = Consumer.options(**_on(middle)).remote()
    assert ray.get(c.read.remote(bc, v), timeout=120)["digest"] == _expected(obj)
    ray.kill(c)


def test_a_late_joining_node_completes(extra_node, bcast):
    bc = bcast(block_size=128 << 10, egress_bytes_per_s=1 << 20)  # ~4 s per hop: still running when the node joins
    obj = _weights(4)
    v = bc.publish(obj)
    node = extra_node()
    late = node.node_id
    bc.relay(late, late)  # its relay joins the running broadcast
    c = Consumer.options(**_on(late)).remote()
    got = ray.get(c.read.remote(bc, v), timeout=120)
    assert got["node"] == late and got["digest"] == _expected(obj)
    ray.kill(c)


def test_the_ray_demo_ships_weight_versions_to_every_actor_by_broadcast_even_past_a_killed_relay(cluster):
    """The Ray variant of the demo (`python -m arrowbuf.demo ray`), short: 3 actors on 3 nodes, writing to a
    2-shard `ShardedStore`; the learner publishes a weight version every 10 gradient steps and kills one actor
    node's relay after the second; every actor ends on version >= 3 and every version it loaded has the learner's
    digest. Nothing of the run is left: its relays' /dev/shm files are gone (the module's cluster fixture checks the
    processes)."""
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    from arrowbuf.demo import DQNConfig
    from arrowbuf.demo.ray_app import run

    res = run(actors=3, steps=900, shards=2, cfg=DQNConfig(warmup=200), publish_every=10, min_version=3,
              kill_relay=True, progress=False, log=lambda _: None)
    assert res.steps == 900 and res.updates >= 20 and res.episodes
    assert len({a["node"] for a in res.actors}) == 3 and {a["node"] for a in res.actors} <= set(_nodes())
    assert res.killed_relay in {a["node"] for a in res.actors}
    for a in res.actors:
        assert max(a["received"]) >= 3, a  # new versions reached this actor (the killed node's through a new relay)
        assert {v: res.published[v] for v in a["received"]} == a["received"]  # identical bytes, by digest
    assert not glob.glob(shm_prefix(res.broadcast_uid) + "*")
