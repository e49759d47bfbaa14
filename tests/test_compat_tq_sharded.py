"""arrowbuf.compat.transfer_queue on a sharded system (its `sharded` module): `init({"arrowbuf": {"shards": 2}})`
inside a Ray job starts one named Ray actor per shard, each serving a `TQState` over Flight; keys are routed by hash,
the new samples of a put go whole to one shard. The in-process tests of test_compat_tq.py run again here on that
system (their `system` fixture is this module's), plus checks that only hold or matter with several shards."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")
pytest.importorskip("ray")
TensorDict = tensordict.TensorDict

import arrowbuf.compat.transfer_queue as tq  # noqa: E402
from arrowbuf.compat.transfer_queue.ray import ACTOR_NAME, NAMESPACE  # noqa: E402
from arrowbuf.compat.transfer_queue.remote import RemoteBackend  # noqa: E402
from arrowbuf.compat.transfer_queue.server import TQServer  # noqa: E402
from arrowbuf.compat.transfer_queue.sharded import decode, key_shard  # noqa: E402
from arrowbuf.compat.transfer_queue.state import TQState  # noqa: E402
from arrowbuf.errors import SchemaError  # noqa: E402

# the same checks as in one process, on 2 shards (imported: pytest runs them again with this module's fixture)
from tests.test_compat_tq import (  # noqa: E402, F401
    rows,
    test_a_field_whose_shape_changes_becomes_ragged,
    test_async_twins,
    test_every_dtype_and_json_values_round_trip_exactly,
    test_fields_added_to_existing_keys_and_gets_return_the_common_fields,
    test_grpo_sampler_gives_whole_groups,
    test_kv_put_of_a_plain_dict_adds_the_batch_dimension,
    test_kv_put_then_get_by_key_every_kind,
    test_per_task_consumption_and_production_status,
    test_rank_aware_same_dp_rank_gets_same_samples,
    test_seqlen_balanced_sampler_splits_tokens_over_ranks,
    test_streaming_loader_gives_each_rank_a_disjoint_share,
    test_tags_updated_without_fields,
    test_the_client_calls_verl_makes,
    test_unknown_keys_and_partitions_as_transfer_queue_treats_them,
)

SHARDS = 2


@pytest.fixture(params=["flight", pytest.param("ray", marks=[pytest.mark.slow, pytest.mark.ray])])
def system(request: Any) -> Any:
    """A 2-shard system: two systems served over Flight in this process, joined with `locations`; or, in the
    session's Ray cluster, one shard actor each, started by this process's init (`shards`) and stopped by its close."""
    tq.close()
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
        tq.init({"controller": {"polling_mode": True}, "arrowbuf": {"shards": SHARDS, "capacity": 4096}})
        yield "ray"
        tq.close()
        return
    states = [TQState(capacity=4096, polling_mode=True) for _ in range(SHARDS)]
    servers = [TQServer(s) for s in states]
    tq.init({"arrowbuf": {"locations": [str(s.location) for s in servers], "ray": False}})
    yield "flight"
    tq.close()
    for server, state in zip(servers, states, strict=True):
        server.close()
        state.close()


def shard_backends() -> list[RemoteBackend]:
    """A client of each shard on its own (to check where things landed)."""
    return [RemoteBackend(b.location) for b in tq.get_client().backend.backends]


KEYS = [f"k{i}" for i in range(16)]


def test_keys_live_on_their_hash_shard_and_read_back_in_order(system: str) -> None:
    assert {key_shard(k, SHARDS) for k in KEYS} == {0, 1}  # the test's keys do span both shards
    x = torch.arange(32, dtype=torch.float32).reshape(16, 2)
    tq.kv_batch_put(keys=KEYS, partition_id="p", fields={"x": x}, tags=[{"i": i} for i in range(16)])
    per_shard = [b.kv_list("p").get("p", {}) for b in shard_backends()]
    for k, listed in enumerate(per_shard):
        assert sorted(listed) == sorted(key for key in KEYS if key_shard(key, SHARDS) == k) and listed
    order = KEYS[::-1]
    got = tq.kv_batch_get(keys=order, partition_id="p")
    assert rows(got["x"]) == x.flip(0).tolist()
    assert tq.kv_list("p")["p"] == {k: {"i": i} for i, k in enumerate(KEYS)}
    meta = tq.get_meta(["x"], 16, "p", mode="force_fetch")
    assert sorted(set(decode(np.asarray(meta.global_indexes))[0].tolist())) == [0, 1]
    assert sorted(tq.get_client().kv_retrieve_keys(meta.global_indexes, "p")) == sorted(KEYS)


def test_clear_keys_on_every_shard(system: str) -> None:
    tq.kv_batch_put(keys=KEYS, partition_id="p", fields={"x": torch.arange(16)})
    gone = [k for i, k in enumerate(KEYS) if i % 3]
    tq.kv_clear(keys=[*gone, "nope"], partition_id="p")  # an unknown key is ignored, as TransferQueue does
    kept = [k for k in KEYS if k not in gone]
    assert sorted(tq.kv_list("p")["p"]) == sorted(kept)
    assert tq.kv_batch_get(keys=kept, partition_id="p")["x"].tolist() == [KEYS.index(k) for k in kept]
    with pytest.raises(ValueError, match="not found"):
        tq.kv_batch_get(keys=gone[:1], partition_id="p")
    meta = tq.get_meta(["x"], 16, "p", mode="force_fetch")
    assert meta.size == len(kept)  # cleared samples are never offered
    tq.clear_samples(meta.select_samples([0]))
    assert len(tq.kv_list("p")["p"]) == len(kept) - 1


def test_bad_input_is_a_clear_error_and_nothing_is_written_on_any_shard(system: str) -> None:
    tq.kv_batch_put(keys=KEYS, partition_id="p", fields={"x": torch.zeros(16, 2)})
    before = [b.kv_list(None) for b in shard_backends()]

    def unchanged() -> None:
        assert [b.kv_list(None) for b in shard_backends()] == before
        assert rows(tq.kv_batch_get(keys=KEYS, partition_id="p")["x"]) == [[0.0, 0.0]] * 16

    with pytest.raises(ValueError, match="batch_size 2"):
        tq.kv_batch_put(keys=["n1", "n2", "n3"], partition_id="p", fields=TensorDict({"x": torch.zeros(2, 2)}, [2]))
    unchanged()
    with pytest.raises(SchemaError, match="mixed dtypes"):
        tq.kv_batch_put(keys=["n1", "n2"], partition_id="p",
                        fields={"y": [torch.zeros(3), torch.zeros(3, dtype=torch.int32)]})
    unchanged()
    # x's dtype differs from every shard's: refused before any shard writes, new keys not created either
    with pytest.raises(SchemaError, match="keeps its kind"):
        tq.kv_batch_put(keys=[*KEYS, "n1"], partition_id="p", fields={"x": torch.ones(17, 2, dtype=torch.int64)})
    unchanged()
    with pytest.raises(SchemaError, match="batch"):
        meta = tq.get_meta(["x"], 1, "p", mode="force_fetch")
        tq.put({"x": torch.zeros(2, 2)}, metadata=meta)
    unchanged()


def test_puts_rotate_over_shards_groups_stay_whole_and_ranks_get_disjoint_shares(system: str) -> None:
    n = 4
    for step in range(2):  # two puts of 3 GRPO groups each: one on each shard
        tq.put(TensorDict({"prompt_id": torch.arange(12) // n + 3 * step, "reward": torch.ones(12)},
                          batch_size=12), partition_id="grpo")
    idx, _ = tq.get_production_status(["prompt_id"], "grpo")
    assert sorted(set(decode(idx.numpy())[0].tolist())) == [0, 1] and len(idx) == 24
    sampler = tq.GRPOGroupNSampler(n_samples_per_prompt=n)
    seen: list[int] = []
    while True:
        meta = tq.get_meta(["prompt_id", "reward"], 8, "grpo", task_name="train", sampler=sampler)
        if meta.size == 0:
            break
        ids = tq.get_data(meta)["prompt_id"].tolist()
        assert ids == sorted(ids) and all(ids.count(g) == n for g in set(ids))  # whole groups
        seen.extend(meta.global_indexes)
    # 3 groups per shard, batches of 2 groups: one group per shard is left (a batch does not span shards)
    assert len(seen) == len(set(seen)) == 16
    assert tq.get_meta(["prompt_id"], 4, "grpo", task_name="train", sampler=sampler).size == 4
    # the streaming loader, 2 ranks over both shards: disjoint shares covering every sample
    sampler2 = tq.RankAwareSampler()
    shares: list[list[int]] = [[], []]
    its = [iter(tq.StreamingDataLoader(tq.StreamingDataset(
        None, batch_size=2, micro_batch_size=2, data_fields=["prompt_id"], partition_id="grpo",
        task_name="loader", dp_rank=r, should_check_consumption_status=True, sampler=sampler2,
        poll_interval=0.01)))
        for r in range(2)]
    live = [0, 1]
    while live:
        for r in list(live):
            try:
                _, meta = next(its[r])
            except StopIteration:
                live.remove(r)
                continue
            shares[r].extend(meta.global_indexes)
    assert shares[0] and shares[1] and not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == sorted(idx.tolist())


@pytest.mark.slow
@pytest.mark.ray
def test_put_then_get_by_key_across_processes_and_close_stops_the_shards(ray_cluster: Any) -> None:
    """A Ray actor (another process) joins the 2-shard system with the same conf, reads what the driver wrote and
    writes more; the driver's close stops every shard actor."""
    import ray

    @ray.remote(num_cpus=0)
    class Worker:
        def run(self, keys: list[str]) -> Any:
            import arrowbuf.compat.transfer_queue as tq

            tq.init({"controller": {"polling_mode": True}, "arrowbuf": {"shards": SHARDS}})
            got = tq.kv_batch_get(keys=keys, partition_id="train")
            tq.kv_batch_put(keys=[k + "'" for k in keys], partition_id="train", fields={"x": got["x"] * 10})
            meta = tq.get_meta(["x"], 8, "train", task_name="learner")
            tq.close()
            return [t.tolist() for t in got["x"].unbind(0)], meta.size

    tq.close()
    tq.init({"controller": {"polling_mode": True}, "arrowbuf": {"shards": SHARDS}})
    try:
        x = torch.arange(16).reshape(8, 2)
        tq.kv_batch_put(keys=KEYS[:8], partition_id="train", fields={"x": x})
        worker = Worker.remote()
        got, taken = ray.get(worker.run.remote(KEYS[:8]), timeout=120)
        assert got == x.tolist() and taken > 0
        assert rows(tq.kv_batch_get(keys=[k + "'" for k in KEYS[:8]], partition_id="train")["x"]) == (
            (x * 10).tolist())
        _, consumed = tq.get_consumption_status("learner", "train")
        assert int(consumed.sum()) == taken  # consumption recorded where the worker consumed
        ray.kill(worker)
    finally:
        tq.close()
    for k in range(SHARDS):
        with pytest.raises(ValueError):
            ray.get_actor(f"{ACTOR_NAME}-{k}-of-{SHARDS}", namespace=NAMESPACE)


def test_a_field_keeps_its_kind_across_shards(system: str) -> None:
    """One system refuses a field whose dtype differs from its first put; so do N shards, even when the first put
    and the later one land on different shards, and nothing is written."""
    on = {k: [key for key in KEYS if key_shard(key, SHARDS) == k] for k in range(SHARDS)}
    tq.kv_batch_put(keys=on[0][:2], partition_id="p", fields={"x": torch.zeros(2, 2)})
    with pytest.raises(SchemaError, match="keeps its kind"):
        tq.kv_batch_put(keys=on[1][:2], partition_id="p", fields={"x": torch.zeros(2, 2, dtype=torch.int64)})
    assert sorted(tq.kv_list("p")["p"]) == sorted(on[0][:2])
    with pytest.raises(SchemaError, match="keeps its kind"):  # the metadata path too, wherever the put lands
        for _ in range(SHARDS):
            tq.put({"x": torch.zeros(1, 3, dtype=torch.int64)}, partition_id="p")
    tq.kv_batch_put(keys=on[1][:2], partition_id="p", fields={"x": torch.ones(2, 2)})  # the same kind: fine
    assert rows(tq.kv_batch_get(keys=[on[1][0], on[0][0]], partition_id="p")["x"]) == [[1.0, 1.0], [0.0, 0.0]]
