"""arrowbuf.compat.transfer_queue, called the way TransferQueue 0.1.x documents its API: in one process and over a
real Flight server (in-process client, and a spawned child process)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
from typing import Any

import pyarrow.flight as flight
import pytest

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")
TensorDict = tensordict.TensorDict

import arrowbuf.compat.transfer_queue as tq  # noqa: E402
from arrowbuf.compat.transfer_queue.server import TQServer  # noqa: E402
from arrowbuf.compat.transfer_queue.state import TQState  # noqa: E402
from arrowbuf.errors import SchemaError  # noqa: E402


@pytest.fixture(params=["local", "flight"])
def system(request: Any) -> Any:
    """An initialised tq module: an in-process system, or a client of a system served over Flight."""
    tq.close()
    if request.param == "local":
        tq.init({"arrowbuf": {"capacity": 4096, "ray": False}})
        yield "local"
        tq.close()
        return
    state = TQState(capacity=4096)
    server = TQServer(state)
    tq.init({"arrowbuf": {"location": server.location}})
    yield "flight"
    tq.close()
    server.close()
    state.close()


def jagged(*lengths: int, dtype: Any = torch.int64) -> Any:
    return torch.nested.as_nested_tensor([torch.arange(n, dtype=dtype) + 10 * i for i, n in enumerate(lengths)],
                                         layout=torch.jagged)


def unbind(t: Any) -> list[list[Any]]:
    return [x.tolist() for x in t.unbind(0)]


def test_kv_put_then_get_by_key_every_kind(system: str) -> None:
    fields = TensorDict({
        "obs": torch.randn(3, 2, 4),
        "mask": torch.tensor([True, False, True]),
        "input_ids": jagged(2, 5, 0),
        "text": tensordict.NonTensorStack.from_list(["héllo", "", "world"]),
    }, batch_size=3)
    meta = tq.kv_batch_put(keys=["k0", "k1", "k2"], partition_id="train", fields=fields,
                           tags=[{"score": 0.9}, {"score": 0.8}, {"score": 0.7}])
    assert isinstance(meta, tq.KVBatchMeta)
    assert meta.fields == ["input_ids", "mask", "obs", "text"]
    assert meta.tags == [{"score": 0.9}, {"score": 0.8}, {"score": 0.7}]
    got = tq.kv_batch_get(keys=["k2", "k0"], partition_id="train")
    assert isinstance(got, TensorDict) and got.batch_size == torch.Size([2])
    assert torch.equal(got["obs"], fields["obs"][[2, 0]])
    assert got["mask"].tolist() == [True, True] and got["mask"].dtype == torch.bool
    assert got["input_ids"].is_nested and unbind(got["input_ids"]) == [[], [0, 1]]
    assert got.get("text").tolist() == ["world", "héllo"]
    one = tq.kv_batch_get(keys="k1", partition_id="train", select_fields=["input_ids", "obs"])
    assert set(one.keys()) == {"input_ids", "obs"} and unbind(one["input_ids"]) == [[10, 11, 12, 13, 14]]


def test_kv_put_single_key_adds_batch_dim_and_plain_dicts_work(system: str) -> None:
    meta = tq.kv_put(key="s1", partition_id="train", fields={"input_ids": torch.tensor([1, 2, 3]), "r": 0.5},
                     tag={"score": 1})
    assert meta.keys == ["s1"] and meta.fields == ["input_ids", "r"]
    got = tq.kv_batch_get(keys="s1", partition_id="train")
    assert got["input_ids"].tolist() == [[1, 2, 3]] and got["r"].tolist() == [0.5]


def test_tags_updated_without_fields(system: str) -> None:
    tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields={"x": torch.arange(2)}, tags=[{"s": 1}, {"s": 2}])
    meta = tq.kv_put(key="a", partition_id="p", tag={"reviewed": True})
    assert meta.fields == ["x"] and meta.tags == [{"s": 1, "reviewed": True}]
    tq.kv_batch_put(keys=["b"], partition_id="p", tags=[{"s": 20}])
    assert tq.kv_list("p") == {"p": {"a": {"s": 1, "reviewed": True}, "b": {"s": 20}}}
    assert tq.kv_batch_get(keys=["a", "b"], partition_id="p")["x"].tolist() == [0, 1]


def test_fields_added_to_existing_keys(system: str) -> None:
    tq.kv_batch_put(keys=["a", "b", "c"], partition_id="p", fields={"prompt": torch.arange(6).reshape(3, 2)})
    meta = tq.kv_batch_put(keys=["c", "a"], partition_id="p", fields={"reward": torch.tensor([3.0, 1.0])})
    assert meta.fields == ["prompt", "reward"]
    got = tq.kv_batch_get(keys=["a", "c"], partition_id="p")
    assert got["reward"].tolist() == [1.0, 3.0] and got["prompt"].tolist() == [[0, 1], [4, 5]]
    with pytest.raises(SchemaError, match="reward"):  # b has no reward yet
        tq.kv_batch_get(keys=["a", "b"], partition_id="p")
    # a field may be overwritten; a new key may arrive with both fields at once
    tq.kv_batch_put(keys=["b", "d"], partition_id="p",
                    fields={"prompt": torch.tensor([[7, 7], [8, 8]]), "reward": torch.tensor([2.0, 4.0])})
    got = tq.kv_batch_get(keys=["a", "b", "c", "d"], partition_id="p", select_fields="reward")
    assert got["reward"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert tq.kv_batch_get(keys="b", partition_id="p")["prompt"].tolist() == [[7, 7]]


def test_new_field_is_a_column_in_sql_of_its_store() -> None:
    tq.close()
    tq.init({"arrowbuf": {"ray": False}})
    try:
        tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields={"prompt": torch.arange(2)})
        tq.kv_batch_put(keys=["a"], partition_id="p", fields={"reward": torch.tensor([0.25])})
        stores = tq.stores("p")
        assert len(stores) == 2
        reward = next(s for s in stores.values() if "reward" in s.schema.fields)
        table = reward.sql("SELECT reward FROM experience")
        assert table.column("reward").to_pylist() == [0.25]
    finally:
        tq.close()


def test_partitions_are_isolated(system: str) -> None:
    tq.kv_batch_put(keys=["k"], partition_id="train", fields={"x": torch.tensor([1.0])})
    tq.kv_batch_put(keys=["k"], partition_id="val", fields={"x": torch.tensor([[2, 2]])})  # other shape, other part
    assert tq.kv_batch_get(keys="k", partition_id="val")["x"].tolist() == [[2, 2]]
    assert set(tq.kv_list()) == {"train", "val"}
    tq.clear_partition("val")
    assert tq.kv_list() == {"train": {"k": {}}}
    assert tq.kv_batch_get(keys="k", partition_id="train")["x"].tolist() == [1.0]
    with pytest.raises(KeyError):
        tq.kv_batch_get(keys="k", partition_id="val")


def test_per_task_consumption_and_production_status(system: str) -> None:
    meta = tq.put(TensorDict({"prompts": torch.arange(8)}, batch_size=8), partition_id="train_0")
    assert meta.size == 8 and meta.is_ready
    assert tq.get_meta(["prompts", "responses"], 4, "train_0", task_name="train").size == 0  # not produced
    gen = tq.get_meta(data_fields=["prompts"], batch_size=4, partition_id="train_0", task_name="generate")
    assert gen.global_indexes == [0, 1, 2, 3]
    batch = tq.get_data(gen)
    out = tq.put(TensorDict({"responses": batch["prompts"] * 10}, batch_size=4), metadata=gen)
    assert out.field_names == ["prompts", "responses"] and out.is_ready
    idx, produced = tq.get_production_status(["prompts", "responses"], "train_0")
    assert idx.tolist() == list(range(8)) and produced.tolist() == [1] * 4 + [0] * 4
    assert not tq.check_production_status(["responses"], "train_0")
    _, consumed = tq.get_consumption_status("generate", "train_0")
    assert consumed.tolist() == [1] * 4 + [0] * 4
    # another task sees every sample once, independently
    train = tq.get_meta(["prompts", "responses"], 8, "train_0", task_name="train")
    assert train.global_indexes == [0, 1, 2, 3]
    assert tq.get_data(train)["responses"].tolist() == [0, 10, 20, 30]
    assert tq.get_meta(["prompts", "responses"], 8, "train_0", task_name="train").size == 0
    assert tq.get_meta(["prompts"], 8, "train_0", task_name="generate").global_indexes == [4, 5, 6, 7]
    assert tq.check_consumption_status("generate", "train_0")
    assert tq.reset_consumption("train_0", task_name="generate")
    assert not tq.check_consumption_status("generate", "train_0")
    assert tq.get_meta(["prompts"], 2, "train_0", task_name="generate").global_indexes == [0, 1]
    assert tq.check_consumption_status("train", "train_0") is False  # train consumed 4 of 8
    # force_fetch ignores readiness and consumption, and consumes nothing
    assert tq.get_meta(["responses"], 3, "train_0", mode="force_fetch").global_indexes == [0, 1, 2]


def test_clear_keys_and_samples(system: str) -> None:
    tq.kv_batch_put(keys=["a", "b", "c"], partition_id="p", fields={"x": torch.arange(3)})
    tq.kv_clear(keys=["a", "c"], partition_id="p")
    assert tq.kv_list("p") == {"p": {"b": {}}}
    with pytest.raises(KeyError):
        tq.kv_batch_get(keys="a", partition_id="p")
    tq.kv_put(key="a", partition_id="p", fields={"x": torch.tensor(9)})  # a new sample under the old key
    assert tq.kv_batch_get(keys=["a", "b"], partition_id="p")["x"].tolist() == [9, 1]
    meta = tq.get_meta(["x"], 10, "p", task_name="t")
    assert sorted(meta.global_indexes) == [1, 3]  # the cleared samples are never offered
    tq.clear_samples(meta.select_samples([0]))
    assert len(tq.kv_list("p")["p"]) == 1


def test_grpo_sampler_gives_whole_groups(system: str) -> None:
    n = 4
    tq.put(TensorDict({"prompt_id": torch.arange(12) // n}, batch_size=12), partition_id="grpo")
    everything = tq.get_meta(["prompt_id"], 12, "grpo", mode="force_fetch")
    # rewards arrive for group 0, all but one sample of group 1, and group 2
    done = everything.select_samples([0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11])
    tq.put(TensorDict({"reward": torch.arange(11, dtype=torch.float32)}, batch_size=11), metadata=done)
    sampler = tq.GRPOGroupNSampler(n_samples_per_prompt=n)
    meta = tq.get_meta(["prompt_id", "reward"], 8, "grpo", task_name="train", sampler=sampler)
    assert meta.global_indexes == [0, 1, 2, 3, 8, 9, 10, 11]
    ids = tq.get_data(meta)["prompt_id"].tolist()
    assert ids == [0, 0, 0, 0, 2, 2, 2, 2]
    assert tq.get_meta(["prompt_id", "reward"], 4, "grpo", task_name="train", sampler=sampler).size == 0
    tq.put(TensorDict({"reward": torch.tensor([7.0])}, batch_size=1), metadata=everything.select_samples([7]))
    assert tq.get_meta(["prompt_id", "reward"], 4, "grpo", task_name="train",
                       sampler=sampler).global_indexes == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="multiple"):
        tq.get_meta(["prompt_id"], 6, "grpo", task_name="other", sampler=sampler)


def test_seqlen_balanced_sampler_splits_tokens_over_ranks(system: str) -> None:
    lengths = [100, 1, 1, 1, 50, 50, 2, 2]  # two prompts of n=2 ... four groups
    tq.put(TensorDict({"x": torch.arange(8)}, batch_size=8), partition_id="b")
    meta = tq.get_meta(["x"], 8, "b", mode="force_fetch")
    meta.update_custom_meta([{"total_lengths": n} for n in lengths])
    tq.set_custom_meta(meta)
    sampler = tq.SeqlenBalancedSampler(n_samples_per_prompt=2, dp_size=2)
    cfg = {"batch_index": 0}
    r0 = tq.get_meta(["x"], 4, "b", task_name="t", sampler=sampler, sampling_config={**cfg, "dp_rank": 0})
    r1 = tq.get_meta(["x"], 4, "b", task_name="t", sampler=sampler, sampling_config={**cfg, "dp_rank": 1})
    a, b = set(r0.global_indexes), set(r1.global_indexes)
    assert a.isdisjoint(b) and a | b == set(range(8))
    for part in (a, b):  # groups whole
        assert all((i ^ 1) in part for i in part)
    tok = [sum(lengths[i] for i in p) for p in (a, b)]
    assert sorted(tok) == [103, 104]


def test_streaming_loader_gives_each_rank_a_disjoint_share(system: str) -> None:
    tq.put(TensorDict({"input_ids": torch.arange(24).reshape(12, 2), "seq": jagged(*range(1, 13))},
                      batch_size=12), partition_id="train")
    sampler = tq.RankAwareSampler()
    loaders = [tq.StreamingDataLoader(tq.StreamingDataset(
        None, batch_size=2, micro_batch_size=1, data_fields=["input_ids", "seq"], partition_id="train",
        task_name="update_actor", dp_rank=r, should_check_consumption_status=True, sampler=sampler))
        for r in range(3)]
    its = [iter(x) for x in loaders]
    seen: list[list[int]] = [[], [], []]
    live = [0, 1, 2]
    while live:
        for r in list(live):
            try:
                batch, meta = next(its[r])
            except StopIteration:
                live.remove(r)
                continue
            assert batch.batch_size == torch.Size([1]) and meta.size == 1
            assert batch["input_ids"].tolist() == [[2 * meta.global_indexes[0], 2 * meta.global_indexes[0] + 1]]
            assert len(unbind(batch["seq"])[0]) == meta.global_indexes[0] + 1
            seen[r].extend(meta.global_indexes)
    assert all(seen)
    assert sorted(seen[0] + seen[1] + seen[2]) == list(range(12))
    assert not set(seen[0]) & set(seen[1]) and not set(seen[1]) & set(seen[2])


def test_rank_aware_same_dp_rank_gets_same_samples(system: str) -> None:
    tq.put(TensorDict({"x": torch.arange(6)}, batch_size=6), partition_id="p")
    sampler = tq.RankAwareSampler()
    got = [tq.get_meta(["x"], 2, "p", task_name="t", sampler=sampler,
                       sampling_config={"dp_rank": 0, "batch_index": 0}).global_indexes for _ in range(2)]
    other = tq.get_meta(["x"], 2, "p", task_name="t", sampler=sampler,
                        sampling_config={"dp_rank": 1, "batch_index": 0}).global_indexes
    assert got[0] == got[1] == [0, 1] and other == [2, 3]


def test_bad_input_is_a_clear_error_and_nothing_is_written(system: str) -> None:
    tq.kv_batch_put(keys=["a"], partition_id="p", fields={"x": torch.zeros(1, 2)}, tags=[{"t": 1}])
    before = tq.kv_list()

    def unchanged() -> None:
        assert tq.kv_list() == before
        assert tq.kv_batch_get(keys="a", partition_id="p")["x"].tolist() == [[0.0, 0.0]]

    with pytest.raises(KeyError, match="nope"):
        tq.kv_batch_get(keys=["a", "nope"], partition_id="p")
    with pytest.raises(ValueError, match="batch_size 2"):
        tq.kv_batch_put(keys=["b", "c", "d"], partition_id="p", fields=TensorDict({"x": torch.zeros(2, 2)}, [2]))
    unchanged()
    with pytest.raises(ValueError, match="length of tags"):
        tq.kv_batch_put(keys=["b"], partition_id="p", fields={"x": torch.zeros(1, 2)}, tags=[{}, {}])
    unchanged()
    with pytest.raises(SchemaError, match="mixed dtypes"):
        tq.kv_batch_put(keys=["b", "c"], partition_id="p",
                        fields={"x": torch.zeros(2, 2), "y": [torch.zeros(3), torch.zeros(3, dtype=torch.int32)]})
    unchanged()
    with pytest.raises(SchemaError, match="first put"):  # x keeps its dtype and shape; y is not written either
        tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields={"y": torch.ones(2), "x": torch.ones(2, 3)})
    unchanged()
    with pytest.raises(SchemaError, match="bfloat16"):
        tq.kv_batch_put(keys=["b"], partition_id="p", fields={"z": torch.ones(1, dtype=torch.bfloat16)})
    with pytest.raises(SchemaError, match="mixed str"):
        tq.kv_batch_put(keys=["b", "c"], partition_id="p", fields={"z": ["s", torch.ones(1)]})
    with pytest.raises(SchemaError, match="batch"):
        meta = tq.get_meta(["x"], 1, "p", mode="force_fetch")
        tq.put({"x": torch.zeros(2, 2)}, metadata=meta)
    unchanged()
    with pytest.raises(ValueError, match="at least one"):
        tq.kv_batch_put(keys=["b"], partition_id="p")
    assert tq.get_meta(["x"], 4, "p", task_name="t").global_indexes == [0]  # only a is there


def test_async_twins(system: str) -> None:
    async def run() -> Any:
        await tq.async_kv_batch_put(keys=["a", "b"], partition_id="p", fields={"x": torch.arange(2)})
        await tq.async_kv_put(key="a", partition_id="p", tag={"s": 1})
        got = await tq.async_kv_batch_get(keys=["b", "a"], partition_id="p")
        listed = await tq.async_kv_list("p")
        await tq.async_kv_clear(keys="a", partition_id="p")
        return got, listed, await tq.async_kv_list()

    got, listed, after = asyncio.run(run())
    assert got["x"].tolist() == [1, 0] and listed == {"p": {"a": {"s": 1}, "b": {}}} and after == {"p": {"b": {}}}


def test_the_client_calls_verl_makes(system: str) -> None:
    """verl 0.9.1 (verl/utils/transferqueue_utils.py) bridges its KV metadata and the metadata path with
    `get_client()`'s async_kv_retrieve_meta / async_get_data / async_put / async_kv_retrieve_keys."""
    client = tq.get_client()

    async def step() -> Any:
        kv = tq.kv_batch_put(keys=["p0_0", "p0_1"], partition_id="global_steps_0",
                             fields={"prompts": torch.arange(4).reshape(2, 2)}, tags=[{"uid": "p0"}] * 2)
        meta = await client.async_kv_retrieve_meta(keys=kv.keys, partition_id=kv.partition_id, create=False)
        data = await client.async_get_data(meta.select_fields(["prompts"]))
        out = await client.async_put(data=TensorDict({"responses": data["prompts"] + 100}, batch_size=2),
                                     metadata=meta)
        keys = await client.async_kv_retrieve_keys(global_indexes=out.global_indexes, partition_id="global_steps_0")
        fresh = await client.async_kv_retrieve_meta(keys=["p1_0"], partition_id="global_steps_0", create=True)
        return meta, out, keys, fresh

    meta, out, keys, fresh = asyncio.run(step())
    assert meta.field_names == ["prompts"] and out.field_names == ["prompts", "responses"] and out.is_ready
    assert keys == ["p0_0", "p0_1"] and fresh.size == 1 and fresh.field_names == []
    got = tq.kv_batch_get(keys=["p0_1"], partition_id="global_steps_0", select_fields=["responses"])
    assert got["responses"].tolist() == [[102, 103]]
    with pytest.raises(NotImplementedError, match="stores"):
        tq.save_checkpoint("x")


def test_flight_refuses_malformed_requests_cleanly() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    state = TQState(capacity=64)
    with TQServer(state) as server:
        client = flight.FlightClient(server.location)
        values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=8),
                              lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c,
                                                                                     max_size=4), max_leaves=12)
        ops = st.sampled_from(["get_meta", "production_status", "consumption_status", "reset_consumption",
                               "clear_keys", "clear_samples", "clear_partition", "kv_list", "tags_of",
                               "key_indexes", "keys_of", "field_names", "field_kinds", "put_tags", "nope"])

        @settings(max_examples=60, deadline=None)
        @given(op=ops, body=st.dictionaries(st.sampled_from(["partition_id", "keys", "gidx", "tags", "data_fields",
                                                             "batch_size", "task_name", "sampler", "mode",
                                                             "sampling_config"]), values, max_size=6))
        def check(op: str, body: dict[str, Any]) -> None:
            try:
                list(client.do_action(flight.Action(f"tq.v1.{op}", json.dumps(body).encode())))
            except flight.FlightServerError as e:
                assert "tq.v1 error" in str(e)

        check()
        with pytest.raises(flight.FlightServerError, match="not JSON"):
            list(client.do_action(flight.Action("tq.v1.kv_list", b"\xff{")))
        with pytest.raises(flight.FlightServerError, match="tq.v1 error"):
            client.do_get(flight.Ticket(b'{"op": "read", "partition_id": "p", "gidx": [-1]}')).read_all()
        client.close()
    state.close()


def _child(location: str, out: Any) -> None:
    import torch

    import arrowbuf.compat.transfer_queue as tq

    tq.init({"arrowbuf": {"location": location}})
    got = tq.kv_batch_get(keys=["b", "a"], partition_id="train")
    out.put([got["x"].tolist(), [t.tolist() for t in got["ids"].unbind(0)]])
    tq.kv_batch_put(keys=["c"], partition_id="train", fields={"x": torch.tensor([[5.0, 6.0]]),
                                                            "ids": [torch.tensor([9], dtype=torch.int64)]},
                    tags=[{"from": "child"}])
    meta = tq.get_meta(["x", "ids"], 3, "train", task_name="learner")
    out.put(meta.global_indexes)
    tq.close()


@pytest.mark.slow
def test_put_then_get_by_key_across_processes() -> None:
    tq.close()
    tq.init({"arrowbuf": {"ray": False}})
    try:
        tq.kv_batch_put(keys=["a", "b"], partition_id="train",
                        fields=TensorDict({"x": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "ids": jagged(1, 3)},
                                          batch_size=2))
        with tq.serve() as server:
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            child = ctx.Process(target=_child, args=(server.location, out))
            child.start()
            try:
                assert out.get(timeout=120) == [[[3.0, 4.0], [1.0, 2.0]], [[10, 11, 12], [0]]]
                assert out.get(timeout=60) == [0, 1, 2]
            finally:
                child.join(60)
            assert child.exitcode == 0
        got = tq.kv_batch_get(keys="c", partition_id="train")
        assert got["x"].tolist() == [[5.0, 6.0]] and tq.kv_list("train")["train"]["c"] == {"from": "child"}
        assert tq.check_consumption_status("learner", "train")
    finally:
        tq.close()


def test_init_in_a_ray_job_finds_one_system(ray_cluster: Any) -> None:
    """As TransferQueue's controller: the first init in a Ray job starts the system in a named actor; an init in
    another process of the job (here a Ray actor) joins it; the process that started it stops it in close()."""
    import ray

    @ray.remote(num_cpus=0)
    class Worker:
        def run(self) -> Any:
            import arrowbuf.compat.transfer_queue as tq

            tq.init()
            got = tq.kv_batch_get(keys=["a", "b"], partition_id="train")
            tq.kv_batch_put(keys=["c"], partition_id="train", fields={"x": got["x"][:1] * 10})
            tq.close()
            return got["x"].tolist()

    tq.close()
    tq.init()
    try:
        from arrowbuf.compat.transfer_queue.ray import ACTOR_NAME, NAMESPACE

        assert ray.get_actor(ACTOR_NAME, namespace=NAMESPACE) is not None
        tq.kv_batch_put(keys=["a", "b"], partition_id="train", fields={"x": torch.tensor([[1, 2], [3, 4]])})
        worker = Worker.remote()
        assert ray.get(worker.run.remote(), timeout=120) == [[1, 2], [3, 4]]
        assert tq.kv_batch_get(keys="c", partition_id="train")["x"].tolist() == [[10, 20]]
        ray.kill(worker)
    finally:
        tq.close()
    with pytest.raises(ValueError):
        ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)


def test_capacity_follows_transfer_queues_total_storage_size() -> None:
    tq.close()
    tq.init({"backend": {"storage_backend": "SimpleStorage", "SimpleStorage": {"total_storage_size": 8}},
             "arrowbuf": {"ray": False}})
    try:
        tq.kv_batch_put(keys=[f"k{i}" for i in range(4)], partition_id="p", fields={"x": torch.arange(4)})
        (store,) = tq.stores("p").values()
        assert store.capacity == 8
        for _ in range(2):  # the same keys rewritten: their old rows are evicted, the live values stay readable
            tq.kv_batch_put(keys=[f"k{i}" for i in range(4)], partition_id="p", fields={"x": torch.arange(4) + 1})
        assert tq.kv_batch_get(keys=["k3", "k0"], partition_id="p")["x"].tolist() == [4, 1]
    finally:
        tq.close()
