"""Differential test: seeded random sequences of KV and metadata calls run on TransferQueue 0.1.11 itself and on
arrowbuf.compat.transfer_queue give the same values, dtypes, nested-ness, key order, global indexes and error types.

TransferQueue always runs its controller and storage as Ray actors, so its side needs a Ray cluster (the session's,
`ray_cluster`); arrowbuf's side runs in process, and again inside Ray (its system in the TransferQueueController
actor). The sequences put tensors (float32, int64, bool, bfloat16), str values and JSON values (chat-message dicts), use
polling_mode, as TransferQueue's own e2e tests do, and change a field's shape between puts (so it turns nested).
Skips only when transferqueue is not installed (scripts/setup.sh installs it)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")
TensorDict = tensordict.TensorDict
NonTensorStack = tensordict.NonTensorStack

CONF = {"controller": {"polling_mode": True},
        "backend": {"storage_backend": "SimpleStorage",
                    "SimpleStorage": {"total_storage_size": 100000, "num_data_storage_units": 1}}}
KEYS = [f"k{i}" for i in range(10)]
PARTS = ["p0", "p1"]
TASKS = ["t0", "t1"]


def _field(name: str, n: int, rng: random.Random) -> Any:
    if name == "dense":  # two widths: a later put of the other width makes the field nested
        return torch.randn(n, rng.choice([3, 3, 5]))
    if name == "scalar":
        return torch.arange(n, dtype=torch.int64) + rng.randint(0, 100)
    if name == "jag":
        return torch.nested.as_nested_tensor([torch.arange(rng.randint(1, 4), dtype=torch.int64) + i
                                              for i in range(n)], layout=torch.jagged)
    if name == "flag":
        return torch.tensor([rng.random() < 0.5 for _ in range(n)])
    if name == "bf":
        return torch.randn(n, 2).to(torch.bfloat16)
    if name == "msg":
        return NonTensorStack(*[{"role": rng.choice(["user", "assistant"]), "n": rng.randint(0, 9),
                                 "tools": [rng.random()] * rng.randint(0, 2)} for _ in range(n)])
    return NonTensorStack(*[f"s{rng.randint(0, 9)}" for _ in range(n)])


def _fields(rng: random.Random, n: int, names: list[str] | None = None) -> Any:
    names = names or rng.sample(["dense", "scalar", "jag", "flag", "text", "bf", "msg"], rng.randint(1, 3))
    return TensorDict({f: _field(f, n, rng) for f in names}, batch_size=n)


def program(seed: int, steps: int = 80) -> list[tuple[str, dict[str, Any]]]:
    """A seeded sequence of calls (name, kwargs); values are generated here, so both sides get the same."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    ops: list[tuple[str, dict[str, Any]]] = []
    for _ in range(steps):
        op = rng.choice(["kv_batch_put", "kv_batch_put", "kv_put", "kv_batch_get", "kv_batch_get", "kv_list",
                         "kv_clear", "put_insert", "get_meta", "get_meta", "put_meta", "status",
                         "reset_consumption", "clear_partition", "kv_by_meta", "clear_samples", "custom_meta"])
        pid = rng.choice(PARTS)
        if op == "kv_batch_put":
            keys = rng.sample(KEYS, rng.randint(1, 4))
            tags = [{"i": rng.randint(0, 9)} for _ in keys] if rng.random() < 0.6 else None
            ops.append((op, {"keys": keys, "partition_id": pid, "fields": _fields(rng, len(keys)), "tags": tags}))
        elif op == "kv_put":
            ops.append((op, {"key": rng.choice(KEYS), "partition_id": pid,
                             "fields": {"dense": torch.randn(rng.choice([3, 5]))} if rng.random() < 0.7 else None,
                             "tag": {"j": rng.randint(0, 9)}}))
        elif op == "kv_batch_get":
            keys = rng.sample(KEYS + ["nope"], rng.randint(1, 4))
            sel = rng.choice([None, None, ["scalar"], "dense", ["jag", "text"], ["bf", "msg"]])
            ops.append((op, {"keys": keys, "partition_id": pid, "select_fields": sel}))
        elif op == "kv_list":
            ops.append((op, {"partition_id": rng.choice([None, pid])}))
        elif op == "kv_clear":
            ops.append((op, {"keys": rng.sample(KEYS + ["nope"], rng.randint(1, 3)), "partition_id": pid}))
        elif op == "put_insert":
            n = rng.randint(1, 4)
            ops.append((op, {"partition_id": pid, "data": _fields(rng, n, rng.sample(["scalar", "dense"], 1))}))
        elif op == "get_meta":
            ops.append((op, {"partition_id": pid, "data_fields": rng.sample(["scalar", "dense", "jag"],
                                                                             rng.randint(1, 2)),
                             "batch_size": rng.randint(1, 4), "task_name": rng.choice(TASKS),
                             "mode": rng.choice(["fetch", "fetch", "force_fetch"])}))
        elif op == "put_meta":
            ops.append((op, {"partition_id": pid, "task_name": rng.choice(TASKS), "seed": rng.randint(0, 99)}))
        elif op == "status":
            ops.append((op, {"partition_id": pid, "fields": rng.sample(["scalar", "dense", "text", "reward"],
                                                                        rng.randint(1, 2)),
                             "task_name": rng.choice(TASKS)}))
        elif op == "reset_consumption":
            ops.append((op, {"partition_id": pid, "task_name": rng.choice([None, *TASKS])}))
        elif op == "kv_by_meta":
            ops.append((op, {"partition_id": pid, "select_fields": rng.choice([None, "scalar", ["nope"]])}))
        elif op in ("clear_samples", "custom_meta"):
            ops.append((op, {"partition_id": pid, "value": rng.randint(0, 9)}))
        else:
            ops.append((op, {"partition_id": pid}))
    return ops


def norm(value: Any) -> Any:
    """A comparable picture of a result: tensors by dtype, nested-ness and per-sample values."""
    if isinstance(value, TensorDict):
        return {"td": int(value.batch_size[0]) if len(value.batch_size) else None,
                "fields": {k: norm(value.get(k)) for k in sorted(value.keys())}}
    if isinstance(value, (tensordict.NonTensorStack, tensordict.NonTensorData)):
        return ("nontensor", value.tolist())
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return ("nested", str(value.dtype), str(value.layout), [t.tolist() for t in value.unbind(0)])
        return ("tensor", str(value.dtype), value.tolist())
    if type(value).__name__ == "KVBatchMeta":
        return ("kv", value.keys, value.tags, value.partition_id, value.fields)
    if type(value).__name__ == "BatchMeta":
        return ("meta", value.global_indexes, value.partition_ids, value.field_names, value.is_ready,
                value.production_status.tolist(), value.custom_meta,
                {f: {k: _shape(v) if "shape" in k else str(v) for k, v in e.items()}
                 for f, e in value.field_schema.items()})
    if isinstance(value, tuple):
        return tuple(norm(v) for v in value)
    if isinstance(value, list):
        return [norm(v) for v in value]
    if isinstance(value, dict):
        return {k: norm(v) for k, v in value.items()}
    return value


def _shape(v: Any) -> Any:
    """A shape or per-sample shapes as tuples (TransferQueue's own wire turns torch.Size into lists and keeps
    tuples: the container type is no part of the answer)."""
    if v is None:
        return None
    if len(v) and (v[0] is None or isinstance(v[0], (list, tuple))):
        return [None if s is None else tuple(s) for s in v]
    return tuple(v)


def run(tq: Any, ops: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """Each call's normalized result, or ("error", the exception)."""
    client = tq.get_client()
    metas: dict[str, Any] = {}
    kv_metas: dict[str, Any] = {}
    out: list[Any] = []
    for name, kw in ops:
        try:
            if name == "kv_batch_put":
                got: Any = tq.kv_batch_put(**kw)
                kv_metas[kw["partition_id"]] = got
            elif name == "kv_by_meta":
                kv = kv_metas.get(kw["partition_id"])
                got = "no meta" if kv is None else tq.kv_batch_get_by_meta(kv, kw["select_fields"])
            elif name == "clear_samples":
                meta = metas.get(kw["partition_id"])
                got = "no meta" if meta is None or meta.size == 0 else client.clear_samples(meta.select_samples([0]))
            elif name == "custom_meta":
                meta = metas.get(kw["partition_id"])
                if meta is None or meta.size == 0:
                    got = "no meta"
                else:
                    meta.update_custom_meta([{"c": kw["value"]}] * meta.size)
                    got = client.set_custom_meta(meta)
            elif name == "kv_put":
                got = tq.kv_put(**kw)
            elif name == "kv_batch_get":
                got = tq.kv_batch_get(**kw)
            elif name == "kv_list":
                got = tq.kv_list(**kw)
            elif name == "kv_clear":
                got = tq.kv_clear(**kw)
            elif name == "put_insert":
                got = client.put(kw["data"], partition_id=kw["partition_id"])
            elif name == "get_meta":
                got = client.get_meta(data_fields=kw["data_fields"], batch_size=kw["batch_size"],
                                      partition_id=kw["partition_id"], mode=kw["mode"], task_name=kw["task_name"])
                metas[kw["partition_id"]] = got
                if got.size:
                    got = (got, client.get_data(got))
            elif name == "put_meta":  # a later stage fills "reward" of the samples it fetched
                meta = metas.get(kw["partition_id"])
                if meta is None or meta.size == 0:
                    got = "no meta"
                else:
                    g = torch.Generator().manual_seed(kw["seed"])
                    got = client.put(TensorDict({"reward": torch.rand(meta.size, generator=g)},
                                                batch_size=meta.size), metadata=meta)
            elif name == "status":
                pid = kw["partition_id"]
                got = (client.check_production_status(kw["fields"], pid),
                       client.check_consumption_status(kw["task_name"], pid),
                       client.get_production_status(kw["fields"], pid),
                       client.get_consumption_status(kw["task_name"], pid), client.get_partition_list())
            elif name == "reset_consumption":
                got = client.reset_consumption(kw["partition_id"], kw["task_name"])
            else:  # a put into a cleared partition raises in arrowbuf (TransferQueue drops it): not generated
                got = client.clear_partition(kw["partition_id"])
                metas.pop(kw["partition_id"], None)
            out.append(norm(got))
        except Exception as e:  # compared by type below
            out.append(("error", e))
    return out


def same(theirs: list[Any], ours: list[Any], ops: list[tuple[str, dict[str, Any]]]) -> None:
    for i, (a, b, (name, kw)) in enumerate(zip(theirs, ours, ops, strict=True)):
        if isinstance(a, tuple) and a and a[0] == "error":
            assert isinstance(b, tuple) and b and b[0] == "error", (
                f"step {i} {name}({kw}): TransferQueue raised {a[1]!r}, arrowbuf returned {b}")
            builtin = next(c for c in type(a[1]).__mro__ if c.__module__ == "builtins")
            named = type(a[1]).__module__ == "builtins" or type(a[1]).__name__ == type(b[1]).__name__
            assert isinstance(b[1], builtin) and named, (
                f"step {i} {name}: TransferQueue raised {type(a[1]).__name__}, arrowbuf {type(b[1]).__name__}: {b[1]}")
            continue
        assert not (isinstance(b, tuple) and b and b[0] == "error"), (
            f"step {i} {name}({kw}): arrowbuf raised {b[1]!r}, TransferQueue returned {a}")
        assert a == b, f"step {i} {name}({kw}):\n TransferQueue {a}\n arrowbuf      {b}"


#: few programs of many steps: each program costs TransferQueue's system a fresh start (17 s in a loaded run), the
#: steps cost little
SEEDS = range(3)


#: seconds TransferQueue's own system gets to start and to run one program (its storage start waits on Ray with no
#: limit of its own: `peer_node`)
PEER_TIMEOUT_S = 120


def _bounded(call: Any, what: str) -> Any:
    """`call()` in a daemon thread, failing the test (not hanging the run) when it takes over PEER_TIMEOUT_S."""
    import threading

    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as e:  # handed to the test's thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True, name=f"tq-peer-{what}")
    t.start()
    t.join(PEER_TIMEOUT_S)
    if t.is_alive():
        pytest.fail(f"TransferQueue 0.1.11's {what} did not return within {PEER_TIMEOUT_S} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


#: the custom resource of the node that TransferQueue's storage unit is placed on (`peer_node`)
PEER_RESOURCE = "tq_peer_storage"
#: TransferQueue's own side: CONF, with its storage unit on `peer_node`
PEER_CONF = {**CONF, "backend": {**CONF["backend"], "SimpleStorage": {
    **CONF["backend"]["SimpleStorage"], "required_node_resource": PEER_RESOURCE}}}


@contextlib.contextmanager
def peer_node(ray_cluster: Any) -> Iterator[None]:
    """A node for TransferQueue's system (3 CPUs, `PEER_RESOURCE`) while the block runs; afterwards its actors are
    gone, also when its init or close hung.

    TransferQueue 0.1.11 pins each storage unit (1 CPU) to a node, round-robin over the alive nodes sorted by node
    id, and places its controller (1 CPU) where Ray likes, the driver's node first. On the session's nodes of 1 CPU,
    when the driver's node sorts first both want its one CPU and the storage unit waits forever in init: 1 of 3
    fresh clusters (the head's id is random). On this node there is room for both and one CPU more."""
    import ray

    node = ray_cluster.add_node(num_cpus=3, resources={PEER_RESOURCE: 1}, object_store_memory=80 << 20)
    ray_cluster.wait_for_nodes()
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # a controller left by an init or close that did not return
            ray.kill(ray.get_actor("TransferQueueController", namespace="transfer_queue"))
        ray_cluster.remove_node(node)  # and its storage unit with it


def peer_init(tq: Any) -> None:
    _bounded(lambda: tq.init(PEER_CONF), "init")


@pytest.fixture(scope="module")
def traces(ray_cluster: Any) -> dict[int, list[Any]]:
    """TransferQueue's results for every seed (its system on the session's Ray cluster, on `peer_node`)."""
    tq = pytest.importorskip("transfer_queue")
    out = {}
    with peer_node(ray_cluster):
        for seed in SEEDS:
            peer_init(tq)
            try:
                out[seed] = _bounded(lambda: run(tq, program(seed)), f"program {seed}")  # noqa: B023 (called at once)
            finally:
                _bounded(tq.close, "close")
    return out


@pytest.mark.slow
def test_the_peer_starts_when_the_node_that_sorts_first_is_full(ray_cluster: Any) -> None:
    """TransferQueue's storage unit goes to the first node by id; with that node's CPU taken (as by its controller
    on the driver's node when the driver's node sorts first) its init on CONF waits forever. Through `peer_node` it
    starts. (Failed in 2 of 3 full runs and in CI, erroring the 8 differential tests before `peer_node`.)"""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    tq = pytest.importorskip("transfer_queue")

    @ray.remote(num_cpus=1)
    class Holder:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    with peer_node(ray_cluster):
        first = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])[0]
        holder = Holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(first, soft=False)).remote()
        try:
            assert ray.get(holder.node.remote(), timeout=60) == first
            peer_init(tq)
            try:
                tq.kv_put(key="k", partition_id="p", fields=TensorDict({"x": torch.arange(3)[None]}, batch_size=1))
                got = tq.kv_batch_get(keys=["k"], partition_id="p")["x"]
                assert [t.tolist() for t in got.unbind()] == [[0, 1, 2]]
            finally:
                _bounded(tq.close, "close")
        finally:
            ray.kill(holder)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_same_results_as_transfer_queue_in_process(traces: dict[int, list[Any]], seed: int) -> None:
    import arrowbuf.compat.transfer_queue as ab

    ab.close()
    ab.init({**CONF, "arrowbuf": {"ray": False}})
    try:
        same(traces[seed], run(ab, program(seed)), program(seed))
    finally:
        ab.close()


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS[:2])
def test_same_results_as_transfer_queue_inside_ray(traces: dict[int, list[Any]], seed: int) -> None:
    import arrowbuf.compat.transfer_queue as ab

    ab.close()
    ab.init(CONF)  # the session's Ray cluster is connected: the system lives in the TransferQueueController actor
    try:
        same(traces[seed], run(ab, program(seed)), program(seed))
    finally:
        ab.close()
