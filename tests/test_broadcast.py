"""Hoplite-style broadcast (`arrowbuf.ray.Broadcast`) on a real local multi-node Ray cluster (the session's: 3 nodes
of 1 CPU, conftest's ray_cluster; a 4th added for the late joiner and removed after it)."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import sys
import time
import uuid

import numpy as np
import pyarrow as pa
import pytest
from conftest import SCHEMAS

import arrowbuf as ab
from arrowbuf import errors as ab_errors
from arrowbuf.errors import BroadcastRefused
from arrowbuf.ray import Broadcast
from arrowbuf.ray.hoplite import wire
from arrowbuf.ray.hoplite.relay import digest_of, file_name, shm_prefix
from arrowbuf.tiers.shm import private

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


def test_every_consumer_on_every_node_reads_identical_bytes_zero_copy(bcast, receivers):
    bc = bcast(block_size=256 << 10)
    obj = _weights(1)
    v = bc.publish(obj)
    consumers = [receivers(n, i) for n in _nodes() for i in range(2)]
    got = ray.get([c.read.remote(bc, v) for c in consumers], timeout=180)
    assert {g["node"] for g in got} == set(_nodes())
    assert {g["digest"] for g in got} == {_expected(obj)}
    assert not any(g["writeable"] for g in got)  # views on the node's mapped file, not copies
    meta = bc.wait(v, timeout=60)
    assert {bc.digest(v, key=n, timeout=60) for n in _nodes()} == {meta["digest"]}
    st = bc.state()
    assert set(st["count"]) == set(_nodes()) and set(st["count"].values()) == {meta["nblocks"]}


def test_a_newer_version_supersedes_one_in_flight(bcast):
    bc = bcast(block_size=128 << 10, egress_bytes_per_s=8 << 20)
    bc.publish(_weights(1))
    v2 = bc.publish(_weights(2))  # v1 is still moving at 8 MB/s when v2 arrives
    obj = _weights(2)
    for n in _nodes():
        assert bc.wait(v2, key=n, timeout=120)["version"] == v2
        assert bc.digest(v2, key=n, timeout=60) == bc.wait(v2, key=n)["digest"]
    assert _expected(bc.get(v2, timeout=60)) == _expected(obj)


def test_a_killed_relay_mid_broadcast_does_not_stop_the_others(bcast, receivers):
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
    assert ray.get(receivers(middle).read.remote(bc, v), timeout=120)["digest"] == _expected(obj)


def test_a_late_joining_node_completes(extra_node, bcast):
    bc = bcast(block_size=128 << 10, egress_bytes_per_s=1 << 20)  # ~4 s per hop: still running when the node joins
    obj = _weights(4)
    v = bc.publish(obj)
    node = extra_node()
    late = node.node_id
    bc.relay(late, late)  # its relay joins the running broadcast
    c = Receiver.options(**_on(late)).remote()
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


# ---------------------------------------------------------------- issue 29: tensors, private files, fences, crashes
def _model(seed: int, width: int = 512):
    """A real torch model (~4 MB of float32 parameters, a bfloat16 buffer and an int64 counter)."""
    import torch

    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                            torch.nn.LayerNorm(width), torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width))
    m.register_buffer("scale", torch.randn(width).to(torch.bfloat16))
    m[5].num_batches_tracked.fill_(seed)
    return m


def _sd_digest(sd) -> str:
    import torch

    return digest_of(b"".join(sd[k].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                              for k in sorted(sd)))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


@ray.remote(num_cpus=0)
class Receiver:
    """A consumer process on a node. The module's tests share them (`receivers`): starting an actor's process and
    importing torch in it was most of this module's CPU time. It keeps nothing between calls (each call unpickles
    a Broadcast handle of its own and drops what it mapped when it returns)."""

    def read(self, bc, version):
        obj = bc.get(version, timeout=120)
        arrays = obj["weights"]
        table = obj["table"]
        h = digest_of(b"".join(np.ascontiguousarray(arrays[k]).tobytes() for k in sorted(arrays))
                      + table.column("x").to_numpy().tobytes())
        return {"node": ray.get_runtime_context().get_node_id(), "digest": h, "version": obj["version"],
                "writeable": any(a.flags.writeable for a in arrays.values())}

    def views(self, bc, version):
        v, tree = bc.tensors(version, timeout=120)
        return {"node": ray.get_runtime_context().get_node_id(), "version": v, "digest": _sd_digest(tree)}

    def load(self, bc, version, seed):
        """Load into a model built with another seed, in place: same storages, peak RSS growth measured."""
        m = _model(seed)
        ptrs = {k: t.data_ptr() for k, t in m.state_dict().items()}
        size = sum(t.nbytes for t in m.state_dict().values())
        bc.wait(version, timeout=120)  # delivered to this node first: the measurement is the load only
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
        before = _status_kb("VmRSS")
        v = bc.load_into(m, version, timeout=120)
        grew = (_status_kb("VmHWM") - before) << 10
        sd = m.state_dict()
        return {"node": ray.get_runtime_context().get_node_id(), "version": v, "digest": _sd_digest(sd),
                "same_storage": all(sd[k].data_ptr() == p for k, p in ptrs.items()), "size": size, "grew": grew}


@pytest.fixture(scope="module")
def receivers(cluster):
    """`on(node, i=0)`: the module's `i`-th receiver on `node` (started on first use, killed after the module's
    last test). Nodes a test adds get receivers of their own (`Receiver.options(**_on(node)).remote()`)."""
    made: dict[tuple[str, int], object] = {}

    def on(node: str, i: int = 0):
        if (node, i) not in made:
            made[node, i] = Receiver.options(**_on(node)).remote()
        return made[node, i]

    yield on
    for a in made.values():
        ray.kill(a)


def test_a_state_dict_round_trips_bit_exact_on_every_node_and_loads_in_place(bcast, receivers):
    bc = bcast(bucket_size=256 << 10)
    src = _model(1).state_dict()
    v = bc.publish(src, 7)
    assert v == 7
    want = _sd_digest(src)
    views = ray.get([receivers(n).views.remote(bc, v) for n in _nodes()], timeout=180)
    assert {g["node"] for g in views} == set(_nodes()) and {g["digest"] for g in views} == {want}
    loaders = [receivers(n) for n in _nodes()]
    got = ray.get([a.load.remote(bc, v, 2) for a in loaders], timeout=180)
    for g in got:
        assert g["version"] == 7 and g["digest"] == want and g["same_storage"], g
        # the load maps the node's copy (its pages count once, ~size) and copies into the parameters: an extra full
        # copy would add another ~size of private memory
        assert g["grew"] < 1.5 * g["size"], g
    for f in bc.files():
        assert os.stat(f).st_mode & 0o777 == 0o600 and os.stat(f).st_uid == os.geteuid()
    assert os.stat(private.user_dir()).st_mode & 0o777 == 0o700
    with pytest.raises(ab_errors.InvalidArgument):
        bc.publish(src, 7)  # versions grow


@pytest.fixture
def own_root():
    """A shared-memory root of the test's own: `arrowbuf shm gc` or a broadcast's start in another test running at the
    same time (pytest-xdist) sweeps the default root, planted links included, by design."""
    root = f"/dev/shm/pt-bcplant-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.mkdir(root, 0o700)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_planted_links_and_foreign_files_at_every_path_are_refused(bcast, receivers, tmp_path, own_root):
    bc = bcast(block_size=256 << 10, root=own_root)
    sd = _model(3).state_dict()
    here = ray.get_runtime_context().get_node_id()
    others = [n for n in _nodes() if n != here]
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    d = private.user_dir(own_root)
    os.makedirs(d, mode=0o700, exist_ok=True)  # as any earlier broadcast on the root leaves it
    # 1. the producer's file of the next version: a symlink, then a foreign file
    for plant in ("symlink", "foreign"):
        p = os.path.join(d, file_name(bc.uid, "~src", 1))
        _plant(p, victim, plant)
        with pytest.raises(BroadcastRefused):
            bc.publish(sd, 1)
        assert victim.read_bytes() == b"keep me" and os.path.lexists(p)
        os.unlink(p)
    # 2. the relay files of the receiving nodes: one symlink, one foreign file
    planted = {}
    for n, plant in zip(others, ("symlink", "foreign")):
        planted[n] = os.path.join(d, file_name(bc.uid, n, 2, 0))
        _plant(planted[n], victim, plant)
    v = bc.publish(sd, 2)
    for n in others:
        with pytest.raises(BroadcastRefused, match="exists"):
            bc.wait(v, key=n, timeout=60)
        with pytest.raises(BroadcastRefused):
            ray.get(receivers(n).views.remote(bc, v), timeout=60)
    assert victim.read_bytes() == b"keep me"
    for p in planted.values():
        os.unlink(p)
    # 3. a node's copy replaced after delivery: consumers open it once and accept only the relay's own inode
    v = bc.publish(sd, 3)
    n = others[0]
    name = bc.wait(v, key=n, timeout=60)
    path = os.path.join(d, file_name(bc.uid, n, 3, 0))
    assert os.path.exists(path) and name["digest"] == bc.digest(v, key=n)
    os.rename(path, path + ".moved")
    try:
        for plant in ("symlink", "foreign", "copy"):
            if plant == "copy":
                import shutil

                shutil.copyfile(path + ".moved", path)
                os.chmod(path, 0o600)
            else:
                _plant(path, path + ".moved" if plant == "symlink" else victim, plant)
            with pytest.raises(BroadcastRefused):
                ray.get(receivers(n).views.remote(bc, v), timeout=60)
            os.unlink(path)
    finally:
        os.rename(path + ".moved", path)
    assert ray.get(receivers(n).views.remote(bc, v), timeout=60)["digest"] == _sd_digest(sd)


def test_a_planted_private_directory_is_refused_before_anything_starts(cluster, tmp_path):
    root = f"/dev/shm/pt-bcroot-{os.getpid()}"
    os.mkdir(root, 0o755)
    try:
        os.symlink(tmp_path, private.user_dir(root))
        with pytest.raises(BroadcastRefused):
            Broadcast.create(root=root)
        os.unlink(private.user_dir(root))
        os.mkdir(private.user_dir(root), 0o700)
        os.chown(private.user_dir(root), 65534, 65534)
        with pytest.raises(BroadcastRefused):
            Broadcast.create(root=root)
        assert not os.listdir(tmp_path) and not os.listdir(private.user_dir(root))
    finally:
        if os.path.islink(private.user_dir(root)):
            os.unlink(private.user_dir(root))
        elif os.path.isdir(private.user_dir(root)):
            os.rmdir(private.user_dir(root))
        os.rmdir(root)
    assert not [a for a in ray.util.list_named_actors() if a.startswith("arrowbuf-bc-")]


def _plant(path: str, victim, how: str) -> None:
    os.close(private.open_dir())  # the private directory exists (a sweep removes it whenever it is empty)
    if how == "symlink":
        os.symlink(victim, path)
    else:
        with open(path, "wb") as f:
            f.write(b"planted by another user")
        os.chmod(path, 0o644)
        os.chown(path, 65534, 65534)


def test_a_tampered_bucket_is_refused_before_any_consumer_sees_it(bcast, receivers):
    # a chain at 4 MB/s: the 4 MB model takes about a second per hop, so the last buckets are still at the root
    bc = bcast(block_size=128 << 10, upload_slots=1, egress_bytes_per_s=4 << 20)
    sd = _model(4).state_dict()
    here = ray.get_runtime_context().get_node_id()
    v = bc.publish(sd, 1)
    meta = bc.wait(v, key=here)
    bad = meta["nblocks"] - 2
    src = os.path.join(private.user_dir(), file_name(bc.uid, "~src", 1))  # the root relay serves this mapping
    with open(src, "r+b") as f:  # tampered after the root checked it (the same user could; nobody else can)
        f.seek(bad * meta["block_size"] + 100)
        f.write(b"\xff" * 8)
    for n in [n for n in _nodes() if n != here]:
        with pytest.raises(BroadcastRefused, match=f"bucket {bad} .*digest mismatch"):
            bc.wait(v, key=n, timeout=120)
        assert bc.state()["count"].get(n, 0) <= bad  # the bad bucket never counted as held, so never forwarded
        with pytest.raises(BroadcastRefused):
            ray.get(receivers(n).views.remote(bc, v), timeout=60)
    v2 = bc.publish(sd, 2)  # the next version goes through
    assert {bc.wait(v2, key=n, timeout=120)["version"] for n in _nodes()} == {2}


def test_a_relay_killed_mid_bucket_still_delivers_the_state_dict(bcast, receivers):
    bc = bcast(block_size=512 << 10, upload_slots=1, egress_bytes_per_s=2 << 20, window=2)  # 0.25 s per bucket
    sd = _model(5).state_dict()
    v = bc.publish(sd, 1)
    root = ray.get_runtime_context().get_node_id()
    others = [n for n in _nodes() if n != root]
    for n in others:
        ray.get(bc.directory.wait_count.remote(n, 1), timeout=60)
    up = bc.state()["upstream"]
    middle = next(n for n in others if up[n] == root)
    ray.get(bc.directory.wait_count.remote(middle, bc.wait(0, key=root)["nblocks"] // 2), timeout=60)
    bc.kill_relay(middle)  # with buckets in flight to the tail and from the root
    got = ray.get([receivers(n).views.remote(bc, v) for n in others], timeout=180)
    assert {g["digest"] for g in got} == {_sd_digest(sd)}


def test_the_orphan_of_a_killed_relay_switches_to_its_backup_at_once_and_resumes_the_cut_bucket(bcast, receivers):
    """Failover without a directory round trip: the receiver the killed relay fed sees the connection close, connects
    straight to the backup the directory named with its upstream (here the producer's node, whose slot the death
    freed), keeps the bytes of the bucket in flight that had landed and asks only for the rest; the result is
    bit-exact on every node (the resumed bucket is checked whole against the producer's digest)."""
    from arrowbuf.ray.hoplite import relay as relay_mod

    bucket = 512 << 10
    bc = bcast(block_size=bucket, upload_slots=1, egress_bytes_per_s=2 << 20, window=2)  # 0.25 s per bucket
    sd = _model(6, width=1024).state_dict()  # ~13 MB: 25 buckets
    v = bc.publish(sd, 1)
    root = ray.get_runtime_context().get_node_id()
    others = [n for n in _nodes() if n != root]
    for n in others:
        ray.get(bc.directory.wait_count.remote(n, 1), timeout=60)
    up = bc.state()["upstream"]
    middle = next(n for n in others if up[n] == root)
    tail = next(n for n in others if n != middle)
    assert up[tail] == middle
    half = bc.wait(0, key=root)["nblocks"] // 2
    ray.get(bc.directory.wait_count.remote(middle, half), timeout=60)
    time.sleep(0.1)  # into the stream of the next bucket to the tail (a kill mid-bucket)
    bc.kill_relay(middle)
    got = ray.get([receivers(n).views.remote(bc, v) for n in others], timeout=180)
    assert {g["digest"] for g in got} == {_sd_digest(sd)}
    log = [f for f in ray.get(bc.relay(tail).failover_log.remote()) if f["version"] == v]
    assert len(log) == 1, log  # one loss, one switch: the backup worked the first time
    f = log[0]
    assert f["upstream"] == middle and f["via"] == "backup" and f["to"] == root  # never asked the directory first
    assert f["last_bucket"] <= f["detected"] <= f["attached"] <= f["resumed"]
    # the cut bucket resumes at the bytes that landed: what it asked for again is less than the bucket whenever the
    # kill fell inside the bucket's bytes (and never more than the bucket)
    assert 0 <= f["kept"] < f["bucket_bytes"] == bucket
    print(f"tail kept {f['kept']} of {bucket} bytes of the cut bucket; attached to the backup "
          f"{(f['attached'] - f['detected']) * 1e3:.1f} ms after detection; pieces of {relay_mod.LINK_PIECE}")


def test_an_orphan_mid_chain_switches_to_the_dead_relays_upstream_not_the_source(bcast):
    """Four emulated nodes on this Ray node in a chain src -> x -> y -> z: when y (fed by x, not by the source) dies,
    z's backup is y's upstream x, whose upload slot y's death frees (the source's link stays x's alone); every
    survivor ends bit-exact."""
    here = ray.get_runtime_context().get_node_id()
    bc = bcast(block_size=256 << 10, upload_slots=1, egress_bytes_per_s=2 << 20, window=2, nodes=False)
    for k in ["src", "r0", "r1", "r2"]:
        bc.relay(k, here)
    sd = _model(7).state_dict()
    v = bc.publish(sd, 1, source="src")
    for k in ["r0", "r1", "r2"]:
        ray.get(bc.directory.wait_count.remote(k, 1), timeout=60)
    up = bc.state()["upstream"]
    x = next(k for k, u in up.items() if u == "src")
    y = next(k for k, u in up.items() if u == x)
    z = next(k for k, u in up.items() if u == y)
    ray.get(bc.directory.wait_count.remote(y, 4), timeout=60)
    bc.kill_relay(y)
    src_meta = bc.wait(v, key="src", timeout=60)
    for k in (x, z):
        assert bc.wait(v, key=k, timeout=120)["version"] == v
        assert bc.digest(v, key=k, timeout=60) == src_meta["digest"]
    log = [f for f in ray.get(bc.relay(z).failover_log.remote()) if f["version"] == v]
    assert [(f["upstream"], f["via"], f.get("to")) for f in log] == [(y, "backup", x)]


def test_the_version_fence_follows_delivery_and_loads(bcast, receivers):
    store = ab.ExperienceStore(SCHEMAS / "cartpole.yaml", capacity=100)
    try:
        bc = bcast(block_size=256 << 10)
        assert bc.fence(store) == 0 and store.policy_version == 0
        sd = _model(6).state_dict()
        v = bc.publish(sd, 4)
        assert bc.fence(store, wait=v, timeout=120) == 4 and store.policy_version == 4  # every node holds v4
        assert bc.fence(receivers=len(_nodes()) + 1) == 0  # more nodes than there are: nothing
        assert bc.fence(loads=True, receivers=1) == 0  # delivered, but nobody loaded it yet
        loaders = [receivers(n) for n in _nodes()[:2]]
        ray.get([a.load.remote(bc, v, 0) for a in loaders], timeout=180)
        assert bc.fence(loads=True, receivers=2, wait=4, timeout=60) == 4
        assert bc.fence(loads=True, receivers=3) == 0
        store.policy_version = 9
        assert bc.fence(store) == 4 and store.policy_version == 9  # never lowers it
    finally:
        store.close()


GC = "import sys; from arrowbuf.cli import main; sys.exit(main(['shm', 'gc']))"  # `arrowbuf shm gc`


def test_close_and_a_killed_driver_plus_shm_gc_leave_nothing_in_dev_shm(cluster, procs):
    import signal
    import subprocess
    import textwrap

    script = textwrap.dedent(f"""
        import sys, time, numpy as np, ray
        from arrowbuf.ray import Broadcast
        ray.init(address={cluster.address!r}, logging_level="ERROR", log_to_driver=False)
        bc = Broadcast.create(block_size=256 << 10)
        v = bc.publish({{"w": np.arange(1 << 20, dtype=np.float32)}}, 1)
        for n in ray.nodes():
            if n["Alive"]:
                bc.wait(v, key=n["NodeID"], timeout=120)
        print(bc.uid, flush=True)
        time.sleep(600)
    """)
    p = procs([sys.executable, "-c", script])
    try:
        uid = p.stdout.readline().decode().strip()
        assert uid, "the driver did not publish"
        mine = glob.glob(shm_prefix(uid) + "*")
        assert len(mine) == len(_nodes())  # one copy per node (the root's is the producer's file)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    end = time.monotonic() + 90  # Ray kills the dead driver's actors; a bounded wait, not a timing assert
    while glob.glob(shm_prefix(uid) + "*") and time.monotonic() < end:
        subprocess.run([sys.executable, "-c", GC], check=True, capture_output=True)
        time.sleep(0.5)
    assert not glob.glob(shm_prefix(uid) + "*")
    assert not [f for f in glob.glob("/dev/shm/**", recursive=True) if uid in f]


def test_a_relay_serves_no_bucket_without_the_broadcast_secret(bcast):
    bc = bcast(block_size=64 << 10)
    v = bc.publish(_model(1).state_dict(), 1)
    here = ray.get_runtime_context().get_node_id()
    bc.wait(v, key=here, timeout=60)
    host, port = ray.get(bc.relay(here).address.remote(), timeout=60)
    for secret in (bytes(16), b"\x01" * 16):  # a local process that is not part of the broadcast guesses
        with socket.create_connection((host, port), timeout=30) as s:
            s.sendall(wire.hello(secret, v, "intruder") + b"".join(wire.REQUEST.pack(i, 0) for i in range(4)))
            got = b""
            try:
                while chunk := s.recv(1 << 16):
                    got += chunk
            except ConnectionResetError:  # closed with our requests unread: a reset, and nothing sent
                pass
        assert got == b"", "a relay answered a connection without the secret"
    assert len({bc.digest(v, key=n) for n in _nodes()}) == 1  # and the broadcast itself is unharmed
