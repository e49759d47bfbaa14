"""arrowbuf.compat.torchrl.ArrowbufStorage under TorchRL's ReplayBuffer and TensorDictReplayBuffer: extend, sample,
len, state_dict, checkpoints, shared memory and Flight across processes, and a DQN that learns CartPole."""

from __future__ import annotations

import copy
import io
import multiprocessing as mp
import queue
import uuid
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict")
pytest.importorskip("torchrl")

from tensordict import NonTensorData, NonTensorStack, TensorDict, assert_close  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers.samplers import RandomSampler, SamplerWithoutReplacement  # noqa: E402
from torchrl.data.replay_buffers.writers import TensorDictMaxValueWriter  # noqa: E402

import arrowbuf as ab  # noqa: E402
from arrowbuf.compat.torchrl import ArrowbufStorage  # noqa: E402


def transitions(n: int, start: int = 0) -> Any:
    k = torch.arange(start, start + n)
    return TensorDict({"observation": k[:, None].float().expand(n, 4).clone(), "action": k % 2,
                       "next": {"observation": (k + 1)[:, None].float().expand(n, 4).clone(),
                                "reward": k.float()[:, None], "done": (k % 7 == 6)[:, None]}}, batch_size=[n])


def test_extend_sample_len_and_slots_match_lazy_tensor_storage() -> None:
    ours = TensorDictReplayBuffer(storage=ArrowbufStorage(16), batch_size=8)
    ref = TensorDictReplayBuffer(storage=LazyTensorStorage(16), batch_size=8)
    for start, n in [(0, 5), (5, 9), (14, 11), (25, 40)]:  # wraps, and one extend larger than the capacity
        assert ours.extend(transitions(n, start)).tolist() == ref.extend(transitions(n, start)).tolist()
        assert len(ours) == len(ref)
        every = torch.arange(len(ref))
        a, b = ours[every], ref[every]
        for key in [("observation",), ("action",), ("next", "reward"), ("next", "done"), ("next", "observation")]:
            assert torch.equal(a[key], b[key]), key
    batch = ours.sample()
    assert batch.batch_size == torch.Size([8])
    assert torch.equal(batch["next", "observation"][:, 0], batch["observation"][:, 0] + 1)  # rows never mixed
    assert torch.equal(ours[batch["index"]]["action"], batch["action"])
    ours.add(transitions(1, 100)[0])
    assert ours[torch.tensor(1)]["action"].item() == 100 % 2 and len(ours) == 16


def test_plain_tensors_and_samplers() -> None:
    rb = ReplayBuffer(storage=ArrowbufStorage(5), batch_size=3, sampler=RandomSampler())
    rb.extend(torch.arange(7))
    rb.add(torch.tensor(100))
    assert rb[:].tolist() == [5, 6, 100, 3, 4] and len(rb) == 5
    assert set(rb.sample().tolist()) <= {5, 6, 100, 3, 4}
    rb = ReplayBuffer(storage=ArrowbufStorage(6), batch_size=2, sampler=SamplerWithoutReplacement())
    rb.extend(torch.arange(6.0))
    seen = torch.cat([rb.sample() for _ in range(3)]).tolist()
    assert sorted(seen) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_state_dict_and_checkpoint_keep_every_slot(tmp_path: Any) -> None:
    storage = ArrowbufStorage(8)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
    rb.extend(transitions(11))
    state = rb.state_dict()
    again = TensorDictReplayBuffer(storage=ArrowbufStorage(8), batch_size=4)
    again.load_state_dict(state)
    slots = torch.arange(8)
    assert len(again) == 8 and torch.equal(again[slots]["action"], rb[slots]["action"])
    assert torch.equal(again[slots]["observation"], rb[slots]["observation"])
    again.extend(transitions(2, 11))  # its writer continues where the first left off
    rb.extend(transitions(2, 11))
    assert torch.equal(again[slots]["observation"], rb[slots]["observation"])
    storage.dumps(tmp_path / "ckpt")
    restored = ArrowbufStorage(8)
    restored.loads(tmp_path / "ckpt")
    assert torch.equal(restored[slots]["observation"], rb[slots]["observation"])
    with pytest.raises(ab.InvalidArgument, match="8 slots"):
        ArrowbufStorage(4).load_state_dict(storage.state_dict())
    for s in (storage, again.storage, restored):
        s.close()


def test_what_cannot_be_stored_is_refused_before_the_writer_moves() -> None:
    rb = TensorDictReplayBuffer(storage=ArrowbufStorage(8), batch_size=2)
    with pytest.raises(ab.SchemaError, match="tuple would come back as a list"):
        rb.extend(TensorDict({"x": torch.ones(2), "t": NonTensorStack(NonTensorData((1, 2)), NonTensorData((3,)))},
                             [2]))
    assert len(rb) == 0 and rb.writer._cursor == 0  # refused before TorchRL's writer moved its cursor
    with pytest.raises(ab.SchemaError, match="jagged"):
        rb.extend(TensorDict({"x": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)],
                                                              layout=torch.jagged)}, [2]))
    rb.extend(TensorDict({"x": torch.ones(2)}, [2]))
    with pytest.raises(ab.SchemaError, match="'y' is not in the storage"):
        rb.extend(TensorDict({"x": torch.ones(2), "y": torch.ones(2)}, [2]))
    with pytest.raises(ab.SchemaError, match="float64"):
        rb.extend(TensorDict({"x": torch.ones(2, dtype=torch.float64)}, [2]))
    with pytest.raises(ab.SchemaError, match=r"shape \[\]"):
        rb.extend(TensorDict({"x": torch.ones(2, 3)}, [2]))
    assert len(rb) == 2 and rb.writer._cursor == 2
    with pytest.raises(TypeError, match="tier='shm'"):
        import pickle

        pickle.dumps(rb.storage)


def test_dtypes_arrowbuf_columns_do_not_hold_round_trip_exactly() -> None:
    data = TensorDict({"bf": torch.randn(5, 3).to(torch.bfloat16), "c": torch.randn(5, 2, dtype=torch.complex64),
                       "c128": torch.randn(5, dtype=torch.complex128), "f8": torch.randn(5).to(torch.float8_e4m3fn),
                       "h": torch.randn(5).half(), "u16": torch.arange(5).to(torch.uint16)}, [5])
    rb = TensorDictReplayBuffer(storage=ArrowbufStorage(8), batch_size=2)
    rb.extend(data)
    got = rb[torch.arange(5)]
    for key in data.keys():
        assert got[key].dtype == data[key].dtype, key
        assert torch.equal(got[key].view(torch.uint8), data[key].view(torch.uint8)), key


def test_in_place_writes_match_lazy_tensor_storage() -> None:
    results = []
    for storage in (ArrowbufStorage(10), LazyTensorStorage(10)):
        rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
        rb.extend(TensorDict({"x": torch.arange(8.0), "y": {"z": torch.arange(8)}}, [8]))
        rb[3] = TensorDict({"x": torch.tensor(-3.0), "y": {"z": torch.tensor(-3)}}, [])
        rb[5:7] = TensorDict({"x": torch.tensor([-5.0, -6.0]), "y": {"z": torch.tensor([-5, -6])}}, [2])
        rb.storage[torch.tensor([0, 1])] = TensorDict({"x": torch.tensor([9.0, 9.0])}, [2])  # a subset of keys
        rb.writer.write_at(torch.tensor([2]), TensorDict({"x": torch.tensor([7.0]), "y": {"z": torch.tensor([7])}},
                                                         [1]))
        rb.extend(TensorDict({"x": torch.arange(20.0, 24.0), "y": {"z": torch.arange(20, 24)}}, [4]))  # wraps
        every = rb[torch.arange(len(rb))]
        results.append((len(rb), every["x"].tolist(), every["y", "z"].tolist(), rb.writer._cursor))
    assert results[0] == results[1]


def test_non_tensor_data_written_in_place() -> None:
    got = []
    for storage in (ArrowbufStorage(6), LazyTensorStorage(6)):
        rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
        rb.extend(TensorDict({"x": torch.arange(4), "note": NonTensorStack(*[NonTensorData(f"n{i}")
                                                                               for i in range(4)])}, [4]))
        rb[1] = rb[3]
        rb[2:4] = rb[torch.tensor([0, 0])]
        got.append(list(rb[torch.arange(4)]["note"]))
    assert got[0] == got[1] == ["n0", "n3", "n0", "n0"]


def test_keys_with_dots_and_named_like_store_columns() -> None:
    storage = ArrowbufStorage(4)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(TensorDict({"a.b": torch.arange(3), "seq": torch.ones(3), "50%": {"x.y": torch.zeros(3)}}, [3]))
    assert sorted(map(str, rb[0].keys(True, True))) == ["('50%', 'x.y')", "a.b", "index", "seq"]
    assert rb[torch.tensor([2])]["a.b"].tolist() == [2]
    assert set(storage.store.schema.fields) == {"a%2Eb", "seq__rl", "50%25.x%2Ey", "index", "slot"}


def test_max_value_writer_matches_lazy_tensor_storage() -> None:
    results = []
    for storage in (ArrowbufStorage(4), LazyTensorStorage(4)):
        rb = TensorDictReplayBuffer(storage=storage, batch_size=2, writer=TensorDictMaxValueWriter(rank_key="x"))
        rb.extend(TensorDict({"x": torch.tensor([3.0, 1.0, 4.0, 1.5, 5.0, 9.0, 2.0])}, [7]))
        rb.extend(TensorDict({"x": torch.tensor([6.0])}, [1]))
        results.append(sorted(rb[torch.arange(len(rb))]["x"].tolist()))
    assert results[0] == results[1] == [4.0, 5.0, 6.0, 9.0]


def test_index_forms_match_lazy_tensor_storage() -> None:
    ours, ref = (TensorDictReplayBuffer(storage=s, batch_size=2) for s in (ArrowbufStorage(10), LazyTensorStorage(10)))
    for rb in (ours, ref):
        rb.extend(TensorDict({"x": torch.arange(6), "y": torch.arange(12).reshape(6, 2)}, [6]))  # not full
    for index in [slice(None), slice(-2, None), slice(None, None, 2), slice(1, 5, 3), slice(-4, -1), 3, -1,
                  torch.tensor(2), torch.tensor([[0, 1], [5, 4]]), torch.tensor([True, False] * 3), [0, 2, -1],
                  torch.tensor([], dtype=torch.long)]:
        a, b = ours[index], ref[index]
        assert a.batch_size == b.batch_size, index
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"]), index
        assert torch.equal(ours.storage[index]["x"], ref.storage[index]["x"]), index
    for index in [6, torch.tensor([0, 7]), -7]:
        for rb in (ours, ref):
            with pytest.raises(IndexError):
                rb.storage[index]


def test_two_dimensional_storage_matches_lazy_tensor_storage() -> None:
    data = TensorDict({"obs": torch.arange(24.0).reshape(4, 3, 2), "r": torch.arange(12).reshape(4, 3)}, [4, 3])
    out = []
    for storage in (ArrowbufStorage(10, ndim=2), LazyTensorStorage(10, ndim=2)):
        rb = TensorDictReplayBuffer(storage=storage, batch_size=5)
        rb.extend(data[:2])  # dim_extend=1: the buffer writes along the second dim (time), as TorchRL does
        first = (storage.max_size, len(rb), storage.shape, storage._len_along_dim0)
        rb.extend(data[2:])
        rb.extend(data[:2] + 100)  # wraps along dim 0
        torch.manual_seed(0)
        sample = rb.sample()
        out.append((first, sample["obs"].tolist(), sample["index"].tolist(), len(rb), storage[(torch.tensor([1, 3]),
                                                                                     torch.tensor([1, 0]))]["r"]
                    .tolist(), storage[1]["r"].tolist(), storage[:, 1]["r"].tolist()))
    assert out[0] == out[1]


def test_pytrees_lists_and_tensors_round_trip_like_lazy_tensor_storage() -> None:
    tree = {"a": torch.arange(4)[:, None], "b": {"c": [torch.zeros(4, 3), (torch.ones(4, 2),)]}, 30: torch.zeros(4, 2)}
    items = [(torch.full((2,), i), {"k": torch.tensor(i)}) for i in range(3)]
    for data in (tree, items, torch.arange(12).reshape(4, 3)):
        got = []
        for storage in (ArrowbufStorage(10), LazyTensorStorage(10)):
            rb = ReplayBuffer(storage=storage, batch_size=2)
            rb.extend(data)
            got.append((rb[torch.tensor([1, 0])], rb[-1]))
        for x, y in zip(pytree.tree_flatten(got[0])[0], pytree.tree_flatten(got[1])[0]):
            assert torch.equal(x, y)
        assert pytree.tree_structure(got[0]) == pytree.tree_structure(got[1])


def test_lazy_tensor_storage_state_dict_loads_into_arrowbuf_storage() -> None:
    ref = TensorDictReplayBuffer(storage=LazyTensorStorage(8), batch_size=2)
    ref.extend(TensorDict({"x": torch.arange(11.0), "n": {"y": torch.ones(11, 2, 3)}}, [11]))
    ours = TensorDictReplayBuffer(storage=ArrowbufStorage(8), batch_size=2)
    ours.load_state_dict(ref.state_dict())
    every = torch.arange(8)
    assert_close(ours[every].exclude("index"), ref[every].exclude("index"))
    assert ours.storage.layout.extra == () and ours[0]["n", "y"].shape == (2, 3)
    for rb in (ours, ref):
        rb.extend(TensorDict({"x": torch.tensor([50.0]), "n": {"y": torch.zeros(1, 2, 3)}}, [1]))
    assert_close(ours[every].exclude("index"), ref[every].exclude("index"))
    with pytest.raises(KeyError, match="_storage"):  # the other direction does not work (docs/integrations.md)
        LazyTensorStorage(8).load_state_dict(ours.storage.state_dict())
    empty = ArrowbufStorage(8)
    empty.load_state_dict(LazyTensorStorage(8).state_dict())
    assert len(empty) == 0
    with pytest.raises(ab.InvalidArgument, match="8 slots"):
        ArrowbufStorage(4).load_state_dict(ref.storage.state_dict())


def test_torchrl_keywords_have_their_meaning(tmp_path: Any) -> None:
    rb = ReplayBuffer(storage=ArrowbufStorage(16, compilable=True), batch_size=4, compilable=True)
    rb.extend(torch.arange(10))
    assert len(rb) == 10 and isinstance(rb.storage._mutation_revision, int)
    with pytest.raises(RuntimeError, match="compilable"):
        ArrowbufStorage(16, compilable=True, shared_init=True)
    disk = ArrowbufStorage(16, scratch_dir=tmp_path / "cols")
    ReplayBuffer(storage=disk).extend(TensorDict({"x": torch.arange(10.0)}, [10]))
    assert disk.store.placement().column("tier").to_pylist()[0] == "disk"
    assert any((tmp_path / "cols").iterdir())  # the columns live there, memory-mapped
    assert disk[torch.tensor([9])]["x"].tolist() == [9.0]
    disk.close()
    auto = ArrowbufStorage(4, device="auto")
    ReplayBuffer(storage=auto).extend(torch.arange(3.0))
    assert auto.device == torch.device("cpu")
    meta = ArrowbufStorage(4, device="meta")
    ReplayBuffer(storage=meta).extend(torch.arange(3.0))
    assert meta[torch.tensor([0, 1])].device.type == "meta"


def test_prioritized_replay_with_torchrls_own_buffers() -> None:
    from torchrl.data import PrioritizedReplayBuffer, TensorDictPrioritizedReplayBuffer

    from arrowbuf.compat.torchrl import ArrowbufPrioritizedSampler, use_arrowbuf_sum_trees

    def make(kind: str) -> Any:
        if kind == "sampler":
            return TensorDictReplayBuffer(storage=ArrowbufStorage(32), priority_key="td_error", batch_size=256,
                                          sampler=ArrowbufPrioritizedSampler(32, alpha=1.0, beta=1.0))
        return TensorDictPrioritizedReplayBuffer(alpha=1.0, beta=1.0, storage=ArrowbufStorage(32),
                                                 priority_key="td_error", batch_size=256)

    assert use_arrowbuf_sum_trees()  # torchrl's C++ trees do not load against torch 2.13
    for kind in ("sampler", "torchrl"):
        rb = make(kind)
        rb.extend(TensorDict({"x": torch.arange(40), "td_error": torch.full((40,), 1e-4)}, [40]))  # wraps
        batch = rb.sample()
        batch["td_error"] = torch.where(batch["x"] == 37, 100.0, 1e-4)
        rb.update_tensordict_priority(batch)
        batch = rb.sample()
        assert (batch["x"] == 37).float().mean() > 0.95, kind
        w = batch["priority_weight"]
        expected = ((100.0 + 1e-8) / (1e-4 + 1e-8)) ** -1.0
        assert torch.allclose(w[batch["x"] == 37], torch.tensor(expected, dtype=w.dtype), rtol=1e-3), kind
        buf = io.BytesIO()
        torch.save(rb.state_dict(), buf)
        buf.seek(0)
        again = make(kind)
        again.load_state_dict(torch.load(buf, weights_only=(kind == "sampler")))
        assert (again.sample()["x"] == 37).float().mean() > 0.95, kind
    plain = PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=ArrowbufStorage(16),
                                    sampler=ArrowbufPrioritizedSampler(16, alpha=0.7, beta=0.5), batch_size=8)
    idx = plain.extend(torch.arange(16.0))
    plain.update_priority(idx, torch.linspace(0.1, 10.0, 16))
    data, info = plain.sample(return_info=True)
    assert data.shape == (8,) and info["priority_weight"].max() <= 1.0


def _child(storage: Any, out: Any) -> None:
    import torch
    from torchrl.data import TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=storage, batch_size=5)
    batch = rb.sample()
    ok = bool(torch.equal(batch["next", "observation"][:, 0], batch["observation"][:, 0] + 1))
    state = storage.state_dict()
    if "slot" in storage.store.schema.fields:  # a store ArrowbufStorage made: write through the storage
        new = transitions(2, 50)
        new["index"] = torch.tensor([10, 11])
        storage.set(torch.tensor([10, 11]), new)
    else:  # a store made elsewhere (served over Flight): rows written by the store API take the next positions
        storage.store.extend({"observation": np.repeat([[50.0], [51.0]], 4, 1).astype(np.float32),
                              "action": np.array([0, 1]),
                              "next.observation": np.repeat([[51.0], [52.0]], 4, 1).astype(np.float32),
                              "next.reward": np.zeros((2, 1), np.float32), "next.done": np.zeros((2, 1), bool),
                              "index": np.array([10, 11])})
    out.put([len(rb), ok, int(state["_len"]), rb[torch.arange(3)]["action"].tolist()])
    storage.store.close()


def _across(storage: Any, rb: Any) -> None:
    rb.extend(transitions(10))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_child, args=(storage, out))
    child.start()
    try:
        got = None
        while got is None and (child.is_alive() or not out.empty()):
            try:
                got = out.get(timeout=2)
            except queue.Empty:
                pass
        assert got is not None, "the child process died (see its stderr)"
        n, ok, rows, actions = got
    finally:
        child.join(60)
    assert child.exitcode == 0
    assert (n, ok, rows, actions) == (12, True, 10, [0, 1, 0])  # len after the child wrote 2
    assert len(rb) == 12 and rb[torch.tensor([10, 11])]["observation"][:, 0].tolist() == [50.0, 51.0]


@pytest.mark.slow
def test_shared_memory_storage_across_processes() -> None:
    storage = ArrowbufStorage(32, tier="shm", name=f"torchrl-{uuid.uuid4().hex[:8]}")
    try:
        _across(storage, TensorDictReplayBuffer(storage=storage, batch_size=4))
    finally:
        storage.close()


def _first_writer(rb: Any, worker: int, out: Any) -> None:
    import torch
    from tensordict import TensorDict

    data = TensorDict({"x": torch.full((2,), worker), "obs": torch.full((2, 3), float(worker))}, [2])
    index = rb.extend(data)
    out.put((worker, index.tolist(), bool((rb[index]["x"] == worker).all())))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_shared_storage_handed_to_workers_before_its_first_write(method: str) -> None:
    """Every worker writes first (no StoreExists race, no hang); the process that made the storage owns the store,
    so its rows outlive the workers."""
    storage = ArrowbufStorage(100, shared_init=True, name=f"torchrl-{uuid.uuid4().hex[:8]}")
    try:
        rb = ReplayBuffer(storage=storage, batch_size=2).share(True)
        ctx = mp.get_context(method)
        out = ctx.Queue()
        workers = [ctx.Process(target=_first_writer, args=(rb, i, out)) for i in range(4)]
        for w in workers:
            w.start()
        got = [out.get(timeout=120) for _ in workers]
        for w in workers:
            w.join(60)
            assert w.exitcode == 0
        assert all(ok for _, _, ok in got)
        assert sorted(i for _, index, _ in got for i in index) == list(range(8))
        every = storage[torch.arange(8)]
        for worker, index, _ in got:  # read after every worker has exited
            assert every["x"][index].tolist() == [worker, worker]
            assert every["obs"][index].tolist() == [[float(worker)] * 3] * 2
        assert len(rb) == 8 and storage.store is not None
    finally:
        storage.close()
    with pytest.raises(ab.StoreNotFound):
        ab.ExperienceStore.attach(storage._name)


@pytest.mark.slow
def test_flight_storage_across_processes() -> None:
    schema = {"name": "rl", "episode_end": [], "truncation": [], "fields": {
        "observation": {"dtype": "float32", "shape": [4]}, "action": {"dtype": "int64"},
        "next.observation": {"dtype": "float32", "shape": [4]}, "next.reward": {"dtype": "float32", "shape": [1]},
        "next.done": {"dtype": "bool", "shape": [1]}, "index": {"dtype": "int64"}}}
    with ab.ExperienceStore(schema, capacity=32) as store, ab.serve(store) as server:
        storage = ArrowbufStorage(store=ab.connect(server.location))
        assert storage.max_size == 32
        _across(storage, TensorDictReplayBuffer(storage=storage, batch_size=4))
        assert len(store) == 12


# ---------------------------------------------------------------------------------------------- DQN on CartPole
def dqn_cartpole(storage: Any, seed: int = 0, steps: int = 6000) -> float:
    """A collector-free DQN (target network, epsilon-greedy, Huber loss); returns the greedy policy's mean return
    over 5 evaluation episodes."""
    gym = pytest.importorskip("gymnasium")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    env = gym.make("CartPole-v1")
    q = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 2))
    target = copy.deepcopy(q)
    opt = torch.optim.Adam(q.parameters(), lr=1e-3)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=64, sampler=RandomSampler())
    obs, _ = env.reset(seed=seed)
    for t in range(steps):
        eps = max(0.05, 1.0 - t / 2500)
        if rng.random() < eps:
            action = int(rng.integers(2))
        else:
            with torch.no_grad():
                action = int(q(torch.as_tensor(obs)).argmax())
        nxt, reward, term, trunc, _ = env.step(action)
        rb.add(TensorDict({"observation": torch.as_tensor(obs), "action": torch.tensor(action),
                           "next": {"observation": torch.as_tensor(nxt), "reward": torch.tensor([reward],
                                                                                              dtype=torch.float32),
                                    "done": torch.tensor([term])}}, []))
        obs = nxt
        if term or trunc:
            obs, _ = env.reset()
        if t >= 500:
            b = rb.sample()
            with torch.no_grad():
                best = target(b["next", "observation"]).max(-1, keepdim=True).values
                y = b["next", "reward"] + 0.99 * best * (~b["next", "done"]).float()
            pred = q(b["observation"]).gather(-1, b["action"].long()[:, None])
            loss = torch.nn.functional.smooth_l1_loss(pred, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if t % 250 == 0:
            target.load_state_dict(q.state_dict())
    returns = []
    for ep in range(5):
        obs, _ = env.reset(seed=1000 + ep)
        total, done = 0.0, False
        while not done:
            with torch.no_grad():
                obs, r, term, trunc, _ = env.step(int(q(torch.as_tensor(obs)).argmax()))
            total += float(r)
            done = term or trunc
        returns.append(total)
    env.close()
    return float(np.mean(returns))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["arrowbuf", "lazy_tensor"])
def test_dqn_learns_cartpole(kind: str) -> None:
    storage = ArrowbufStorage(10_000) if kind == "arrowbuf" else LazyTensorStorage(10_000)
    score = dqn_cartpole(storage, seed=0)
    # a random policy scores about 22; learning within 6000 seeded steps lifts the greedy policy far above it
    assert score >= 100, score


def test_arrowbuf_sampler_delegates_to_the_stores_prioritized_sampler() -> None:
    from arrowbuf.compat.torchrl import ArrowbufSampler

    storage = ArrowbufStorage(8, sampler=ab.samplers.Prioritized(alpha=1.0, beta=1.0), seed=0)
    rb = TensorDictReplayBuffer(storage=storage, sampler=ArrowbufSampler(), batch_size=256)
    rb.extend(transitions(11))  # wraps: slots 0..2 hold 8..10
    batch = rb.sample()
    assert torch.equal(rb[batch["index"]]["action"], batch["action"]) and "priority_weight" in batch.keys()
    prio = torch.full((8,), 1e-3)
    prio[1] = 100.0  # slot 1 holds transition 9
    rb.update_priority(torch.arange(8), prio)
    batch = rb.sample()
    hits = (batch["observation"][:, 0] == 9).float().mean().item()
    assert hits > 0.95, hits
    w = batch["priority_weight"]
    assert ((w > 0) & (w <= 1)).all()  # importance weights (arrowbuf normalises by the largest possible weight)
    assert (w[batch["observation"][:, 0] == 9] < 1e-3).all()  # the over-sampled item is weighted down
    storage.close()
