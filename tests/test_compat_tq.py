"""arrowbuf.compat.transfer_queue, called the way TransferQueue 0.1.11 documents its API: in one process and over a
real Flight server (in-process client, and a spawned child process), and inside a Ray job. TransferQueue's own test
suite runs against it in tests/test_compat_tq_suite.py; these check what that suite does not: arrowbuf's ways of
running it (Flight, Ray, shards: test_compat_tq_sharded.py), its refusals, checkpoints in arrowbuf's format, and the
decisions docs/integrations.md states (ragged fields, dense output, error types)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import threading
import time
from typing import Any

import numpy as np
import pyarrow.dataset as pads
import pyarrow.flight as flight
import pytest

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")
TensorDict = tensordict.TensorDict
NonTensorStack = tensordict.NonTensorStack

import arrowbuf.compat.transfer_queue as tq  # noqa: E402
from arrowbuf.compat.transfer_queue.columns import put_fields  # noqa: E402
from arrowbuf.compat.transfer_queue.server import TQServer  # noqa: E402
from arrowbuf.compat.transfer_queue.state import TQState  # noqa: E402
from arrowbuf.compat.transfer_queue.wire import ACTIONS  # noqa: E402
from arrowbuf.errors import SchemaError  # noqa: E402

POLLING = {"controller": {"polling_mode": True}}


@pytest.fixture(params=["local", "flight"])
def system(request: Any) -> Any:
    """An initialised tq module (polling_mode): an in-process system, or a client of one served over Flight."""
    tq.close()
    if request.param == "local":
        tq.init({**POLLING, "arrowbuf": {"capacity": 4096, "ray": False}})
        yield "local"
        tq.close()
        return
    state = TQState(capacity=4096, polling_mode=True)
    server = TQServer(state)
    tq.init({"arrowbuf": {"location": server.location}})
    yield "flight"
    tq.close()
    server.close()
    state.close()


def jagged(*lengths: int, dtype: Any = torch.int64) -> Any:
    return torch.nested.as_nested_tensor([torch.arange(n, dtype=dtype) + 10 * i for i, n in enumerate(lengths)],
                                         layout=torch.jagged)


def rows(t: Any) -> list[Any]:
    """Each sample's values as a list (nested tensors unbound), as TransferQueue's tests compare them."""
    return [x.tolist() for x in t.unbind(0)] if t.is_nested else t.tolist()


def test_kv_put_then_get_by_key_every_kind(system: str) -> None:
    fields = TensorDict({
        "obs": torch.randn(3, 2, 4),
        "mask": torch.tensor([True, False, True]),
        "input_ids": jagged(2, 5, 0),
        "text": NonTensorStack("héllo", "", "world"),
        "raw": NonTensorStack(b"\x00\xff", b"", b"z"),
    }, batch_size=3)
    meta = tq.kv_batch_put(keys=["k0", "k1", "k2"], partition_id="train", fields=fields,
                           tags=[{"score": 0.9}, {"score": 0.8}, {"score": 0.7}])
    assert isinstance(meta, tq.KVBatchMeta)
    assert meta.fields == ["input_ids", "mask", "obs", "raw", "text"]
    assert meta.tags == [{"score": 0.9}, {"score": 0.8}, {"score": 0.7}]
    got = tq.kv_batch_get(keys=["k2", "k0"], partition_id="train")
    assert isinstance(got, TensorDict) and got.batch_size == torch.Size([2])
    # as TransferQueue 0.1.11 returns them: every tensor field of non-0-dim samples a jagged nested tensor
    assert got["obs"].is_nested and got["obs"].dtype == torch.float32
    assert rows(got["obs"]) == fields["obs"][[2, 0]].tolist()
    assert not got["mask"].is_nested and got["mask"].tolist() == [True, True] and got["mask"].dtype == torch.bool
    assert got["input_ids"].is_nested and rows(got["input_ids"]) == [[], [0, 1]]
    assert got.get("text").tolist() == ["world", "héllo"] and got.get("raw").tolist() == [b"z", b"\x00\xff"]
    one = tq.kv_batch_get(keys="k1", partition_id="train", select_fields=["input_ids", "obs"])
    assert set(one.keys()) == {"input_ids", "obs"} and rows(one["input_ids"]) == [[10, 11, 12, 13, 14]]


def test_every_dtype_and_json_values_round_trip_exactly(system: str) -> None:
    """bfloat16, float8, complex (arrowbuf's logical dtypes) and JSON values (chat messages: dicts, lists, None)
    through put and get, in one process and over Flight; numpy strings and bytes keep their numpy type."""
    bf16 = torch.randn(3, 4).to(torch.bfloat16)
    f8 = torch.randn(3, 2).to(torch.float8_e5m2)
    cplx = torch.randn(3, dtype=torch.complex128)
    msgs = [[{"role": "user", "content": "hi"}], {"tool": None, "args": [1, 2.5]}, None]
    ragged = torch.nested.as_nested_tensor([torch.randn(n).to(torch.bfloat16) for n in (1, 4, 2)],
                                           layout=torch.jagged)
    fields = TensorDict({"bf16": bf16, "f8": f8, "c": cplx, "msgs": NonTensorStack(*msgs), "rag": ragged,
                         "b": tensordict.NonTensorData(np.array([b"x", b"yy", b"z"], dtype="|S3"), batch_size=[3]),
                         "s": tensordict.NonTensorData(np.array(["é€", "", "yz"]), batch_size=[3])},
                        batch_size=3)
    tq.kv_batch_put(keys=["a", "b", "c"], partition_id="p", fields=fields)
    got = tq.kv_batch_get(keys=["c", "a", "b"], partition_id="p")
    order = [2, 0, 1]
    assert got["bf16"].dtype == torch.bfloat16 and all(
        torch.equal(x, bf16[i]) for x, i in zip(got["bf16"].unbind(0), order, strict=True))
    assert got["f8"].dtype == torch.float8_e5m2 and all(
        torch.equal(x.view(torch.uint8), f8[i].view(torch.uint8)) for x, i in zip(got["f8"].unbind(0), order,
                                                                                   strict=True))
    assert got["c"].dtype == torch.complex128 and torch.equal(got["c"], cplx[order])
    assert got.get("msgs").tolist() == [msgs[i] for i in order]
    assert [x.tolist() for x in got["rag"].unbind(0)] == [ragged.unbind(0)[i].tolist() for i in order]
    raw = got.get("b").tolist()
    assert raw == [b"z", b"x", b"yy"] and all(type(v) is np.bytes_ for v in raw)
    text = got.get("s").tolist()
    assert text == ["yz", "é€", ""] and all(type(v) is np.str_ for v in text)


def test_dense_output_is_an_opt_in() -> None:
    tq.close()
    tq.init({**POLLING, "arrowbuf": {"ray": False, "output": "dense"}})
    try:
        obs = torch.randn(3, 2, 4)
        tq.kv_batch_put(keys=["a", "b", "c"], partition_id="p", fields=TensorDict(
            {"obs": obs, "ids": jagged(1, 2, 3)}, batch_size=3))
        got = tq.kv_batch_get(keys=["c", "a"], partition_id="p")
        assert not got["obs"].is_nested and torch.equal(got["obs"], obs[[2, 0]])
        assert got["ids"].is_nested and rows(got["ids"]) == [[20, 21, 22], [0]]  # shapes differ: still nested
    finally:
        tq.close()


def test_kv_put_of_a_plain_dict_adds_the_batch_dimension(system: str) -> None:
    meta = tq.kv_put(key="s1", partition_id="train", fields={"input_ids": torch.tensor([1, 2, 3]), "text": "hi"},
                     tag={"score": 1})
    assert meta.keys == ["s1"] and meta.fields == ["input_ids", "text"]
    got = tq.kv_batch_get(keys="s1", partition_id="train")
    assert rows(got["input_ids"]) == [[1, 2, 3]] and got.get("text").tolist() == ["hi"]


def test_a_field_whose_shape_changes_becomes_ragged(system: str) -> None:
    """Streaming rollouts put one finished sample at a time: a single-row put does not fix a field's shape."""
    for i, n in enumerate([3, 5, 3, 1]):
        tq.kv_put(key=f"s{i}", partition_id="p", fields={"tokens": torch.arange(n), "score": torch.tensor(float(i))})
    got = tq.kv_batch_get(keys=["s3", "s1", "s0", "s2"], partition_id="p")
    assert rows(got["tokens"]) == [[0], [0, 1, 2, 3, 4], [0, 1, 2], [0, 1, 2]]
    meta = tq.get_meta(["tokens"], 4, "p", mode="force_fetch")
    assert meta.field_schema["tokens"]["is_nested"] is True
    assert sorted(meta.field_schema["tokens"]["per_sample_shapes"]) == [[1], [3], [3], [5]]  # lists, as TransferQueue's
    # a batch padded to another width later: also taken, per-sample shapes kept
    tq.kv_batch_put(keys=["b0", "b1"], partition_id="p", fields={"tokens": torch.zeros(2, 7, dtype=torch.int64),
                                                                 "score": torch.ones(2)})
    assert rows(tq.kv_batch_get(keys=["b1", "s3"], partition_id="p")["tokens"]) == [[0] * 7, [0]]


def test_tags_updated_without_fields(system: str) -> None:
    tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields={"x": torch.arange(2)}, tags=[{"s": 1}, {"s": 2}])
    meta = tq.kv_put(key="a", partition_id="p", tag={"reviewed": True})
    assert meta.fields == ["x"] and meta.tags == [{"s": 1, "reviewed": True}]
    tq.kv_batch_put(keys=["b"], partition_id="p", tags=[{"s": 20}])
    assert tq.kv_list("p") == {"p": {"a": {"s": 1, "reviewed": True}, "b": {"s": 20}}}
    assert tq.kv_batch_get(keys=["a", "b"], partition_id="p")["x"].tolist() == [0, 1]


def test_fields_added_to_existing_keys_and_gets_return_the_common_fields(system: str) -> None:
    tq.kv_batch_put(keys=["a", "b", "c"], partition_id="p", fields={"prompt": torch.arange(6).reshape(3, 2)})
    meta = tq.kv_batch_put(keys=["c", "a"], partition_id="p", fields={"reward": torch.tensor([3.0, 1.0])})
    assert meta.fields == ["prompt", "reward"]
    got = tq.kv_batch_get(keys=["a", "c"], partition_id="p")
    assert got["reward"].tolist() == [1.0, 3.0] and rows(got["prompt"]) == [[0, 1], [4, 5]]
    # b has no reward yet: TransferQueue returns the fields every key has
    both = tq.kv_batch_get(keys=["a", "b"], partition_id="p")
    assert list(both.keys()) == ["prompt"] and rows(both["prompt"]) == [[0, 1], [2, 3]]
    # asked for by name, a field not every key has is no field of the lookup: an empty TensorDict, as TransferQueue
    assert tq.kv_batch_get(keys=["a", "b"], partition_id="p", select_fields="reward").batch_size == torch.Size([0])
    tq.kv_batch_put(keys=["b", "d"], partition_id="p",
                    fields={"prompt": torch.tensor([[7, 7], [8, 8]]), "reward": torch.tensor([2.0, 4.0])})
    got = tq.kv_batch_get(keys=["a", "b", "c", "d"], partition_id="p", select_fields="reward")
    assert got["reward"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert rows(tq.kv_batch_get(keys="b", partition_id="p")["prompt"]) == [[7, 7]]


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


def test_unknown_keys_and_partitions_as_transfer_queue_treats_them(system: str) -> None:
    tq.kv_batch_put(keys=["k", "j"], partition_id="train", fields={"x": torch.tensor([1.0, 2.0])})
    with pytest.raises(ValueError, match="not found"):  # not KeyError: TransferQueue's error type
        tq.kv_batch_get(keys="nope", partition_id="train")
    with pytest.raises(ValueError, match="not found"):
        tq.kv_batch_get(keys="k", partition_id="nowhere")
    assert tq.kv_batch_get(keys=["nope", "j"], partition_id="train")["x"].tolist() == [2.0]  # unknown: left out
    tq.kv_clear(keys=["k", "nope"], partition_id="train")
    tq.kv_clear(keys=["k"], partition_id="train")  # again: a no-op
    tq.kv_clear(keys=["k"], partition_id="nowhere")
    assert tq.kv_list() == {"train": {"j": {}}} and tq.kv_list("nowhere") == {}
    tq.clear_partition("train")
    tq.clear_partition("train")  # again: a no-op
    assert tq.check_production_status(["x"], "train") is False  # a cleared partition: False, not an error
    assert tq.get_production_status(["x"], "train") == (None, None)
    assert tq.get_partition_list() == []


def test_per_task_consumption_and_production_status(system: str) -> None:
    meta = tq.put(TensorDict({"prompts": torch.arange(8)}, batch_size=8), partition_id="train_0")
    assert meta.size == 8 and meta.is_ready
    assert tq.get_meta(["prompts", "responses"], 4, "train_0", task_name="train").size == 0  # not produced
    gen = tq.get_meta(data_fields=["prompts"], batch_size=4, partition_id="train_0", task_name="generate")
    assert gen.global_indexes == [0, 1, 2, 3] and gen.is_ready
    batch = tq.get_data(gen)
    out = tq.put(TensorDict({"responses": batch["prompts"] * 10}, batch_size=4), metadata=gen)
    assert out is gen and gen.field_names == ["prompts", "responses"] and gen.is_ready  # put adds to meta
    idx, produced = tq.get_production_status(["prompts", "responses"], "train_0")
    assert idx.tolist() == list(range(8)) and produced.tolist() == [[1, 1]] * 4 + [[1, 0]] * 4
    assert not tq.check_production_status(["responses"], "train_0")
    _, consumed = tq.get_consumption_status("generate", "train_0")
    assert consumed.tolist() == [1] * 4 + [0] * 4
    train = tq.get_meta(["prompts", "responses"], 4, "train_0", task_name="train")
    assert train.global_indexes == [0, 1, 2, 3]
    assert tq.get_data(train)["responses"].tolist() == [0, 10, 20, 30]
    assert tq.get_meta(["prompts", "responses"], 4, "train_0", task_name="train").size == 0
    assert tq.get_meta(["prompts"], 4, "train_0", task_name="generate").global_indexes == [4, 5, 6, 7]
    assert tq.check_consumption_status("generate", "train_0")
    assert tq.reset_consumption("train_0", task_name="generate")
    assert not tq.check_consumption_status("generate", "train_0")
    assert tq.get_meta(["prompts"], 2, "train_0", task_name="generate").global_indexes == [0, 1]
    assert tq.check_consumption_status("train", "train_0") is False  # train consumed 4 of 8
    # force_fetch: every sample of the partition, produced or not, consumed or not; consumes nothing
    everything = tq.get_meta(["responses"], 3, "train_0", mode="force_fetch")
    assert sorted(everything.global_indexes) == list(range(8))
    assert sorted(everything.production_status.tolist()) == [0] * 4 + [1] * 4


def test_clear_keys_and_samples_and_global_indexes_are_reused(system: str) -> None:
    tq.kv_batch_put(keys=["a", "b", "c"], partition_id="p", fields={"x": torch.arange(3)})
    tq.kv_clear(keys=["a", "c"], partition_id="p")
    assert tq.kv_list("p") == {"p": {"b": {}}}
    tq.kv_put(key="a", partition_id="p", fields={"x": torch.tensor(9)})  # a new sample under the old key
    assert tq.kv_batch_get(keys=["a", "b"], partition_id="p")["x"].tolist() == [9, 1]
    # released indexes are handed out again, system-wide (TransferQueue's index manager)
    tq.kv_put(key="z", partition_id="q", fields={"x": torch.tensor(7)})
    keys = tq.get_client().kv_retrieve_meta(["a", "b", "z"], "p").global_indexes
    assert len(keys) == 2 and max(keys) < 3
    meta = tq.get_meta(["x"], 2, "p", task_name="t")
    assert meta.size == 2
    tq.clear_samples(meta.select_samples([0]))
    assert len(tq.kv_list("p")["p"]) == 1


def test_grpo_sampler_gives_whole_groups(system: str) -> None:
    n = 4
    tq.put(TensorDict({"prompt_id": torch.arange(12) // n}, batch_size=12), partition_id="grpo")
    everything = tq.get_meta(["prompt_id"], 12, "grpo", mode="force_fetch")
    order = sorted(range(12), key=lambda i: everything.global_indexes[i])
    everything = everything.select_samples(order)
    done = everything.select_samples([0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11])  # all but one sample of group 1
    tq.put(TensorDict({"reward": torch.arange(11, dtype=torch.float32)}, batch_size=11), metadata=done)
    sampler = tq.GRPOGroupNSampler(n_samples_per_prompt=n)
    meta = tq.get_meta(["prompt_id", "reward"], 8, "grpo", task_name="train", sampler=sampler)
    assert meta.global_indexes == [0, 1, 2, 3, 8, 9, 10, 11]
    assert tq.get_data(meta)["prompt_id"].tolist() == [0, 0, 0, 0, 2, 2, 2, 2]
    assert tq.get_meta(["prompt_id", "reward"], 4, "grpo", task_name="train", sampler=sampler).size == 0
    tq.put(TensorDict({"reward": torch.tensor([7.0])}, batch_size=1), metadata=everything.select_samples([7]))
    assert tq.get_meta(["prompt_id", "reward"], 4, "grpo", task_name="train",
                       sampler=sampler).global_indexes == [4, 5, 6, 7]
    with pytest.raises(RuntimeError, match="multiple"):  # TransferQueue's client: a controller error
        tq.get_meta(["prompt_id"], 6, "grpo", task_name="other", sampler=sampler)


def test_seqlen_balanced_sampler_splits_tokens_over_ranks(system: str) -> None:
    lengths = [100, 1, 1, 1, 50, 50, 2, 2]  # four groups of n=2
    tq.put(TensorDict({"x": torch.arange(8)}, batch_size=8), partition_id="b")
    meta = tq.get_meta(["x"], 8, "b", mode="force_fetch")
    meta = meta.select_samples(sorted(range(8), key=lambda i: meta.global_indexes[i]))
    meta.update_custom_meta([{"total_lengths": n} for n in lengths])
    tq.set_custom_meta(meta)
    sampler = tq.SeqlenBalancedSampler(n_samples_per_prompt=2, dp_size=2)
    cfg = {"batch_index": 0, "task_name": "t", "partition_id": "b"}
    r0 = tq.get_meta(["x"], 4, "b", task_name="t", sampler=sampler, sampling_config={**cfg, "dp_rank": 0})
    r1 = tq.get_meta(["x"], 4, "b", task_name="t", sampler=sampler, sampling_config={**cfg, "dp_rank": 1})
    a, b = set(r0.global_indexes), set(r1.global_indexes)
    assert a.isdisjoint(b) and a | b == set(range(8))
    for part in (a, b):  # groups whole
        assert all((i ^ 1) in part for i in part)
    assert sorted(sum(lengths[i] for i in p) for p in (a, b)) == [103, 104]


def test_streaming_loader_gives_each_rank_a_disjoint_share(system: str) -> None:
    tq.put(TensorDict({"input_ids": torch.arange(24).reshape(12, 2), "seq": jagged(*range(1, 13))},
                      batch_size=12), partition_id="train")
    sampler = tq.RankAwareSampler()
    loaders = [tq.StreamingDataLoader(tq.StreamingDataset(
        None, batch_size=2, micro_batch_size=1, data_fields=["input_ids", "seq"], partition_id="train",
        task_name="update_actor", dp_rank=r, should_check_consumption_status=True, sampler=sampler,
        poll_interval=0.01)) for r in range(3)]
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
            g = meta.global_indexes[0]
            assert batch.batch_size == torch.Size([1]) and meta.size == 1
            assert rows(batch["input_ids"]) == [[2 * g, 2 * g + 1]]
            assert len(rows(batch["seq"])[0]) == g + 1
            seen[r].extend(meta.global_indexes)
    assert all(seen)
    assert sorted(seen[0] + seen[1] + seen[2]) == list(range(12))
    assert not set(seen[0]) & set(seen[1]) and not set(seen[1]) & set(seen[2])


def test_rank_aware_same_dp_rank_gets_same_samples(system: str) -> None:
    tq.put(TensorDict({"x": torch.arange(6)}, batch_size=6), partition_id="p")
    sampler = tq.RankAwareSampler()
    cfg = {"batch_index": 0, "task_name": "t", "partition_id": "p"}
    got = [tq.get_meta(["x"], 2, "p", task_name="t", sampler=sampler,
                       sampling_config={**cfg, "dp_rank": 0}).global_indexes for _ in range(2)]
    other = tq.get_meta(["x"], 2, "p", task_name="t", sampler=sampler,
                        sampling_config={**cfg, "dp_rank": 1}).global_indexes
    assert got[0] == got[1] == [0, 1] and other == [2, 3]


def test_bad_input_is_a_clear_error_and_nothing_is_written(system: str) -> None:
    tq.kv_batch_put(keys=["a"], partition_id="p", fields={"x": torch.zeros(1, 2)}, tags=[{"t": 1}])
    before = tq.kv_list()

    def unchanged() -> None:
        assert tq.kv_list() == before
        assert rows(tq.kv_batch_get(keys="a", partition_id="p")["x"]) == [[0.0, 0.0]]

    with pytest.raises(ValueError, match="batch_size 2"):
        tq.kv_batch_put(keys=["b", "c", "d"], partition_id="p", fields=TensorDict({"x": torch.zeros(2, 2)}, [2]))
    unchanged()
    with pytest.raises(ValueError, match="length of tags"):
        tq.kv_batch_put(keys=["a"], partition_id="p", fields={"x": torch.zeros(1, 2)}, tags=[{}, {}])
    unchanged()
    with pytest.raises(SchemaError, match="mixed dtypes"):
        tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields={"y": [torch.zeros(3, dtype=torch.int32),
                                                                   torch.zeros(2, dtype=torch.int64)]})
    unchanged()
    with pytest.raises(SchemaError, match="keeps its kind"):  # x keeps its dtype; y is not written either
        tq.kv_batch_put(keys=["a"], partition_id="p", fields={"y": torch.ones(1), "x": torch.ones(1, 3).long()})
    unchanged()
    with pytest.raises(SchemaError, match="keeps its kind"):  # nor may it turn into text
        tq.kv_batch_put(keys=["a"], partition_id="p", fields={"x": ["s"]})
    unchanged()
    with pytest.raises(SchemaError, match="complex32 cannot be stored exactly"):  # never stored as something else
        tq.kv_batch_put(keys=["a"], partition_id="p", fields={"z": torch.ones(1, dtype=torch.complex32)})
    with pytest.raises(SchemaError, match="tuple"):  # no pickle: a JSON value, or refused (a tuple would be a list)
        tq.kv_batch_put(keys=["a"], partition_id="p", fields=TensorDict(
            {"msg": NonTensorStack({"role": ("user",)})}, batch_size=1))
    with pytest.raises(SchemaError, match="mixed value types"):
        tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields={"z": ["s", b"b"]})
    with pytest.raises(SchemaError, match="batch"):
        meta = tq.get_client().kv_retrieve_meta(["a"], "p")
        tq.put({"x": torch.zeros(2, 2)}, metadata=meta)
    unchanged()
    with pytest.raises(ValueError, match="at least one"):
        tq.kv_batch_put(keys=["b"], partition_id="p")
    # checked before samples are allocated for it (a put without metadata inserts them first)
    with pytest.raises(SchemaError, match="nested TensorDict"):
        tq.put(TensorDict({"x": torch.zeros(1, 2), "sub": TensorDict({"y": torch.zeros(1)}, [1])}, [1]),
               partition_id="p")
    unchanged()
    with pytest.raises(RuntimeError, match="Invalid mode"):
        tq.get_meta(["x"], 1, "p", task_name="t", mode="sideways")
    assert tq.get_meta(["x"], 1, "p", task_name="t").global_indexes == [0]  # only a is there


def test_fetch_without_polling_mode_waits_for_data_then_raises() -> None:
    tq.close()
    tq.init({"controller": {"polling_mode": False}, "arrowbuf": {"ray": False, "get_meta_wait": 0.5}})
    try:
        with pytest.raises(tq.GetMetaTimeout, match="Required: 2") as err:
            tq.get_meta(["x"], 2, "p", task_name="t")
        assert isinstance(err.value, RuntimeError)  # TransferQueue's client raises RuntimeError
    finally:
        tq.close()
    tq.init({"controller": {"polling_mode": False}, "arrowbuf": {"ray": False, "get_meta_wait": 60}})
    try:
        tq.kv_put(key="a", partition_id="p", fields={"x": torch.tensor(1)})
        late = threading.Timer(0.2, tq.kv_put, kwargs={"key": "b", "partition_id": "p",
                                                       "fields": {"x": torch.tensor(2)}})
        late.start()
        meta = tq.get_meta(["x"], 2, "p", task_name="t")  # woken by the other thread's put, long before 60 s
        late.join()
        assert meta.size == 2
    finally:
        tq.close()


def test_async_twins(system: str) -> None:
    client = tq.get_client()

    async def run() -> Any:
        await tq.async_kv_batch_put(keys=["a", "b"], partition_id="p", fields={"x": torch.arange(2)})
        await tq.async_kv_put(key="a", partition_id="p", tag={"s": 1})
        got = await tq.async_kv_batch_get(keys=["b", "a"], partition_id="p")
        listed = await tq.async_kv_list("p")
        await tq.async_kv_clear(keys="a", partition_id="p")
        after = await tq.async_kv_list()
        status = await client.async_check_production_status(["x"], "p")
        parts = await client.async_get_partition_list()
        meta = await client.async_kv_retrieve_meta(["b"], "p")
        await client.async_clear_samples(meta)
        return got, listed, after, status, parts

    got, listed, after, status, parts = asyncio.run(run())
    assert got["x"].tolist() == [1, 0] and listed == {"p": {"a": {"s": 1}, "b": {}}} and after == {"p": {"b": {}}}
    assert status is True and parts == ["p"]
    assert tq.kv_list("p") == {"p": {}}


def test_the_client_calls_verl_makes(system: str) -> None:
    """verl 0.9.1 (verl/utils/transferqueue_utils.py) bridges its KV metadata and the metadata path with
    `get_client()`'s async_kv_retrieve_meta / async_get_data / async_put / async_kv_retrieve_keys."""
    client = tq.get_client()

    async def step() -> Any:
        kv = tq.kv_batch_put(keys=["p0_0", "p0_1"], partition_id="global_steps_0",
                             fields={"prompts": torch.arange(4).reshape(2, 2)}, tags=[{"uid": "p0"}] * 2)
        meta = await client.async_kv_retrieve_meta(keys=kv.keys, partition_id=kv.partition_id, create=False)
        data = await client.async_get_data(meta.select_fields(["prompts"]))
        responses = torch.nested.as_nested_tensor([t + 100 for t in data["prompts"].unbind(0)], layout=torch.jagged)
        out = await client.async_put(data=TensorDict({"responses": responses}, batch_size=2), metadata=meta)
        keys = await client.async_kv_retrieve_keys(global_indexes=out.global_indexes, partition_id="global_steps_0")
        fresh = await client.async_kv_retrieve_meta(keys=["p1_0"], partition_id="global_steps_0", create=True)
        return meta, out, keys, fresh

    meta, out, keys, fresh = asyncio.run(step())
    assert out.field_names == ["prompts", "responses"] and out.is_ready
    assert keys == ["p0_0", "p0_1"] and fresh.size == 1 and fresh.field_names == []
    got = tq.kv_batch_get(keys=["p0_1"], partition_id="global_steps_0", select_fields=["responses"])
    assert rows(got["responses"]) == [[102, 103]]


def test_checkpoint_round_trip_in_arrowbufs_format(tmp_path: Any) -> None:
    """tq.save_checkpoint writes TransferQueue's metadata.json and arrowbuf's checkpoint of the system: each field
    group an arrowbuf checkpoint that pyarrow reads without arrowbuf; load_checkpoint restores values, keys, tags,
    consumption and the global index counter."""
    tq.close()
    tq.init({**POLLING, "arrowbuf": {"ray": False}})
    try:
        tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields=TensorDict(
            {"x": torch.tensor([[1, 2], [3, 4]]), "ids": jagged(1, 3), "t": NonTensorStack("u", "v")},
            batch_size=2), tags=[{"i": 0}, {"i": 1}])
        assert tq.get_meta(["x"], 1, "p", task_name="train").global_indexes == [0]
        tq.save_checkpoint(tmp_path / "ck", metadata={"step": 3})
        assert json.loads((tmp_path / "ck" / "metadata.json").read_text()) == {
            "storage_saved": True, "user_metadata": {"step": 3}}
        files = [str(f) for f in (tmp_path / "ck" / "arrowbuf" / "stores").rglob("*.arrow")]
        assert files and pads.dataset(files, format="ipc").to_table().num_rows >= 2
        tq.kv_clear(["a", "b"], "p")
        tq.kv_put(key="c", partition_id="p", fields={"x": torch.tensor([9, 9])})
        tq.load_checkpoint(tmp_path / "ck")
        assert tq.kv_list() == {"p": {"a": {"i": 0}, "b": {"i": 1}}}
        got = tq.kv_batch_get(keys=["b", "a"], partition_id="p")
        assert rows(got["x"]) == [[3, 4], [1, 2]] and rows(got["ids"]) == [[10, 11, 12], [0]]
        assert got.get("t").tolist() == ["v", "u"]
        assert tq.get_meta(["x"], 1, "p", task_name="train").global_indexes == [1]  # consumption restored
        tq.kv_put(key="d", partition_id="p", fields={"x": torch.tensor([5, 5])})
        assert tq.get_client().kv_retrieve_meta("d", "p").global_indexes == [2]  # the counter too
        with pytest.raises(FileNotFoundError, match="metadata.json"):
            (tmp_path / "empty").mkdir()
            tq.load_checkpoint(tmp_path / "empty")
    finally:
        tq.close()


def test_flight_refuses_malformed_requests_cleanly() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    state = TQState(capacity=64, polling_mode=True)
    with TQServer(state) as server:
        client = flight.FlightClient(server.location)
        values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=8),
                              lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c,
                                                                                     max_size=4), max_leaves=12)
        ops = st.sampled_from([*ACTIONS, "nope"])

        @settings(max_examples=80, deadline=None)
        @given(op=ops, body=st.dictionaries(st.sampled_from(["partition_id", "keys", "gidx", "custom_meta",
                                                             "data_fields", "batch_size", "task_name", "sampler",
                                                             "mode", "sampling_config", "partition_ids", "create"]),
                                            values, max_size=6))
        def check(op: str, body: dict[str, Any]) -> None:
            try:
                list(client.do_action(flight.Action(f"tq.v2.{op}", json.dumps(body).encode())))
            except flight.FlightServerError as e:
                assert "tq.v2 error" in str(e)

        check()
        with pytest.raises(flight.FlightServerError, match="not JSON"):
            list(client.do_action(flight.Action("tq.v2.kv_list", b"\xff{")))
        with pytest.raises(flight.FlightServerError, match="tq.v2 error"):
            client.do_get(flight.Ticket(b'{"op": "read", "partition_id": "p", "gidx": [-1], "fields": ["x"]}'))\
                .read_all()
        client.close()
    state.close()


def _child(location: str, out: Any) -> None:
    import torch

    import arrowbuf.compat.transfer_queue as tq

    tq.init({"arrowbuf": {"location": location}})
    got = tq.kv_batch_get(keys=["b", "a"], partition_id="train")
    out.put([[t.tolist() for t in got["x"].unbind(0)], [t.tolist() for t in got["ids"].unbind(0)]])
    tq.kv_batch_put(keys=["c"], partition_id="train", fields={"x": torch.tensor([[5.0, 6.0]]),
                                                            "ids": [torch.tensor([9], dtype=torch.int64)]},
                    tags=[{"from": "child"}])
    meta = tq.get_meta(["x", "ids"], 3, "train", task_name="learner")
    out.put(meta.global_indexes)
    tq.close()


@pytest.mark.slow
def test_put_then_get_by_key_across_processes() -> None:
    tq.close()
    tq.init({**POLLING, "arrowbuf": {"ray": False}})
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
        assert rows(got["x"]) == [[5.0, 6.0]] and tq.kv_list("train")["train"]["c"] == {"from": "child"}
        assert tq.check_consumption_status("learner", "train")
    finally:
        tq.close()


def test_init_in_a_ray_job_beside_transfer_queues_own_controller_raises_a_clear_error(ray_cluster: Any) -> None:
    """TransferQueue's own controller has the actor name this system uses: an init that finds it says so (it raised
    "'ActorHandle' object has no attribute 'location'" in CI, and the next test failed the same way), and an init
    after that system is gone starts this one."""
    import ray

    @ray.remote(num_cpus=0)
    class Foreign:
        def list_partitions(self) -> list[str]:
            return []

    tq.close()
    foreign = Foreign.options(name="TransferQueueController", namespace="transfer_queue").remote()
    try:
        assert ray.get(foreign.list_partitions.remote(), timeout=60) == []
        with pytest.raises(RuntimeError, match="not arrowbuf's TransferQueue system"):
            tq.init(POLLING)
    finally:
        ray.kill(foreign)
    end = time.monotonic() + 60
    while time.monotonic() < end:  # the name is freed once the actor is dead (ray.kill does not wait for that)
        try:
            ray.get_actor("TransferQueueController", namespace="transfer_queue")
        except ValueError:
            break
        time.sleep(0.1)
    tq.init(POLLING)
    try:
        tq.kv_batch_put(keys=["a"], partition_id="p", fields={"x": torch.tensor([7])})
        assert tq.kv_batch_get(keys="a", partition_id="p")["x"].tolist() == [7]
    finally:
        tq.close()


def test_init_in_a_ray_job_finds_one_system(ray_cluster: Any, tmp_path: Any) -> None:
    """As TransferQueue's controller: the first init in a Ray job starts the system in the actor named
    "TransferQueueController" (namespace "transfer_queue"); an init in another process of the job (here a Ray
    actor) joins it; the controller answers TransferQueue's calls (list_partitions, get_partition_snapshot,
    clear_partition); a sampler instance keeps its parameters in the actor; checkpoints go through the actor; the
    process that started it stops it in close()."""
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
    tq.init({**POLLING, "controller": {"polling_mode": True, "sampler": tq.GRPOGroupNSampler(4)}})
    try:
        controller = ray.get_actor("TransferQueueController", namespace="transfer_queue")
        tq.kv_batch_put(keys=["a", "b"], partition_id="train", fields={"x": torch.tensor([1, 2])},
                        tags=[{"i": 0}, {}])
        worker = Worker.remote()
        assert ray.get(worker.run.remote(), timeout=120) == [1, 2]
        assert tq.kv_batch_get(keys="c", partition_id="train")["x"].tolist() == [10]
        ray.kill(worker)
        snap = ray.get(controller.get_partition_snapshot.remote("train"))
        assert list(snap.keys_mapping) == ["a", "b", "c"] and snap.custom_meta[snap.keys_mapping["a"]] == {"i": 0}
        assert snap.production_status[snap.keys_mapping["c"], snap.field_name_mapping["x"]] == 1
        # the system's sampler is GRPOGroupNSampler(4) in the actor too: 3 samples are no group, 6 no multiple
        assert tq.get_meta(["x"], 4, "train", task_name="t").size == 0
        tq.put(TensorDict({"x": torch.arange(5)}, batch_size=5), partition_id="train")
        with pytest.raises(RuntimeError, match="multiple of n_samples_per_prompt \\(4\\)"):
            tq.get_meta(["x"], 6, "train", task_name="t")
        tq.save_checkpoint(tmp_path / "ck")
        ray.get(controller.clear_partition.remote("train"))
        assert ray.get(controller.list_partitions.remote()) == []
        tq.load_checkpoint(tmp_path / "ck")
        assert tq.kv_batch_get(keys=["c", "a"], partition_id="train")["x"].tolist() == [10, 1]
    finally:
        tq.close()
    with pytest.raises(ValueError):
        ray.get_actor("TransferQueueController", namespace="transfer_queue")


def test_a_sampler_without_a_spec_is_refused_across_processes(system: str) -> None:
    class Mine(tq.SequentialSampler):
        pass

    tq.put(TensorDict({"x": torch.arange(2)}, batch_size=2), partition_id="p")
    if system == "local":  # in the process that holds the system any sampler runs
        assert tq.get_meta(["x"], 1, "p", task_name="t", sampler=Mine()).size == 1
    else:
        with pytest.raises(ValueError, match="cannot run in another process"):
            tq.get_meta(["x"], 1, "p", task_name="t", sampler=Mine())


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


def test_a_partition_that_clears_after_use_reuses_its_store() -> None:
    """perftest's loop (put a batch, get it, clear it) keeps one batch of rows: the ring overwrites dead rows in
    place instead of growing; a live row is never overwritten while the store may still grow."""
    state = TQState(capacity=10_000, polling_mode=True)
    try:
        for i in range(6):
            keys = [f"it{i}-{k}" for k in range(64)]
            x = torch.full((64, 8), float(i))
            tq_values, _ = put_fields({"x": x}, 64)
            state.kv_put("p", keys, tq_values, [], None)
            meta = state.kv_retrieve_meta("p", keys)
            assert state.read("p", meta["global_indexes"], ["x"])["x"].dense.tolist() == x.tolist()
            state.clear_samples(["p"] * 64, meta["global_indexes"])
        (store,) = state.stores("p").values()
        assert store.capacity == 64  # one batch: never grew
        keep = [f"keep-{k}" for k in range(32)]
        state.kv_put("p", keep, put_fields({"x": torch.ones(32, 8)}, 32)[0], [], None)
        state.kv_put("p", ["more"] * 1 + [f"m{k}" for k in range(63)], put_fields({"x": torch.zeros(64, 8)}, 64)[0],
                     [], None)  # would overwrite live rows of `keep`: grows instead
        (store,) = state.stores("p").values()
        assert store.capacity > 64
        meta = state.kv_retrieve_meta("p", keep)
        assert state.read("p", meta["global_indexes"], ["x"])["x"].dense.tolist() == [[1.0] * 8] * 32
    finally:
        state.close()


def test_a_process_that_only_serves_a_system_does_not_import_torch() -> None:
    """The system's Ray actors (`ray`, `sharded`) and a standalone server import the package, not torch: torch's
    import was most of an actor's start (the 20 Ray-system tests of test_compat_tq_sharded.py: 126 s -> 66 s)."""
    import subprocess
    import sys

    code = ("import sys; import arrowbuf.compat.transfer_queue as tq, arrowbuf.compat.transfer_queue.ray, "
            "arrowbuf.compat.transfer_queue.sharded, arrowbuf.compat.transfer_queue.server; "
            "print('torch' in sys.modules); tq.StreamingDataLoader; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr[-2000:]
