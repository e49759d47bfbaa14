"""arrowbuf.compat.torchrl.ArrowbufStorage under TorchRL's ReplayBuffer and TensorDictReplayBuffer: extend, sample,
len, state_dict, checkpoints, shared memory and Flight across processes, and a DQN that learns CartPole."""

from __future__ import annotations

import copy
import multiprocessing as mp
import queue
import uuid
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict")
pytest.importorskip("torchrl")

from tensordict import TensorDict  # noqa: E402
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


def test_what_cannot_be_stored_is_refused() -> None:
    rb = TensorDictReplayBuffer(storage=ArrowbufStorage(8), batch_size=2)
    with pytest.raises(ab.SchemaError, match="bfloat16"):
        rb.extend(TensorDict({"x": torch.ones(2, dtype=torch.bfloat16)}, [2]))
    assert len(rb) == 0
    rb.extend(TensorDict({"x": torch.ones(2)}, [2]))  # an empty storage follows the writer's cursor
    assert rb[torch.arange(2, 4)]["x"].tolist() == [1.0, 1.0]
    with pytest.raises(ab.SchemaError, match="'y'"):
        rb.extend(TensorDict({"x": torch.ones(2), "y": torch.ones(2)}, [2]))
    assert len(rb) == 2
    with pytest.raises(NotImplementedError, match="round-robin"):
        rb[0] = TensorDict({"x": torch.zeros(())}, [])
    other = TensorDictReplayBuffer(storage=ArrowbufStorage(4), batch_size=2,
                                   writer=TensorDictMaxValueWriter(rank_key="x"))
    other.extend(TensorDict({"x": torch.arange(6.0)}, [6]))  # its first fill is in round-robin order
    with pytest.raises(NotImplementedError, match="round-robin"):
        other.extend(TensorDict({"x": torch.tensor([9.0])}, [1]))  # then it replaces the smallest: refused
    with pytest.raises(TypeError, match="tier='shm'"):
        import pickle

        pickle.dumps(rb.storage)


def _child(storage: Any, out: Any) -> None:
    import torch
    from torchrl.data import TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=storage, batch_size=5)
    batch = rb.sample()
    ok = bool(torch.equal(batch["next", "observation"][:, 0], batch["observation"][:, 0] + 1))
    state = storage.state_dict()
    storage.store.extend({"observation": np.full((2, 4), 50.0, np.float32), "action": np.array([1, 1]),
                          "next.observation": np.full((2, 4), 51.0, np.float32),
                          "next.reward": np.zeros((2, 1), np.float32), "next.done": np.zeros((2, 1), bool),
                          "index": np.array([10, 11])})
    out.put([len(rb), ok, int(state["table"].num_rows), rb[torch.arange(3)]["action"].tolist()])
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
    assert len(rb) == 12 and rb[torch.tensor([10, 11])]["observation"][:, 0].tolist() == [50.0, 50.0]


@pytest.mark.slow
def test_shared_memory_storage_across_processes() -> None:
    storage = ArrowbufStorage(32, tier="shm", name=f"torchrl-{uuid.uuid4().hex[:8]}")
    try:
        _across(storage, TensorDictReplayBuffer(storage=storage, batch_size=4))
    finally:
        storage.close()


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
