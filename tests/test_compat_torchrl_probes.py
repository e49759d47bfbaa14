"""Probes for the silent deviations issue 41 found in `ArrowbufStorage` (each gave a different answer than
LazyTensorStorage without an error), SliceSampler in both of its modes across the ring's wrap-around, and
`torch.load(weights_only=True)` of a state_dict. Each compares with LazyTensorStorage running the same code."""

from __future__ import annotations

import io
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict")
pytest.importorskip("torchrl")

from tensordict import NonTensorData, NonTensorStack, TensorDict, assert_close, tensorclass  # noqa: E402
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers.samplers import SliceSampler  # noqa: E402

import arrowbuf as ab  # noqa: E402
from arrowbuf.compat.torchrl import ArrowbufStorage  # noqa: E402


@tensorclass
class Transition:
    obs: torch.Tensor
    reward: torch.Tensor


def both(max_size: int, **kw: Any) -> tuple[Any, Any]:
    return ArrowbufStorage(max_size, **kw), LazyTensorStorage(max_size, **kw)


def test_boolean_mask_selects_the_true_rows() -> None:
    for storage in both(10):
        rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
        rb.extend(TensorDict({"x": torch.arange(10, 14)}, [4]))
        got = rb[torch.tensor([True, False, True, False])]
        assert got["x"].tolist() == [10, 12], type(storage).__name__
        assert rb.storage[torch.tensor([False, True, False, True])]["x"].tolist() == [11, 13]


def test_non_tensor_data_comes_back_in_samples() -> None:
    out = []
    for storage in both(10):
        rb = TensorDictReplayBuffer(storage=storage, batch_size=3)
        rb.extend(TensorDict({"x": torch.arange(4), "note": NonTensorData("hello", batch_size=[4])}, [4]))
        rb.extend(TensorDict({"x": torch.arange(4, 6), "note": NonTensorStack(NonTensorData("a"),
                                                                              NonTensorData("b"))}, [2]))
        every = rb[torch.arange(6)]
        assert "note" in every.keys()
        out.append(every["note"])
        sample = rb.sample()
        assert "note" in sample.keys() and len(sample["note"]) == 3
        assert rb[5]["note"] == "b"
    assert list(out[0]) == list(out[1]) == ["hello"] * 4 + ["a", "b"]


def test_extra_batch_dims_are_kept() -> None:
    shapes = []
    for storage in both(10):
        rb = TensorDictReplayBuffer(storage=storage, batch_size=3)
        rb.extend(TensorDict({"x": torch.arange(20).reshape(4, 5), "y": torch.ones(4, 5, 2)}, [4, 5]))
        sample = rb.sample()
        assert sample.batch_size == torch.Size([3, 5]) and sample["y"].shape == (3, 5, 2)
        assert len(rb) == 4
        shapes.append((rb[:].batch_size, rb[1]["x"].tolist()))
    assert shapes[0] == shapes[1]


def test_collector_over_two_envs_keeps_the_time_dim() -> None:
    from torchrl.collectors import Collector
    from torchrl.envs import SerialEnv
    from torchrl.testing.mocking_classes import CountingEnv

    shapes = []
    for storage in both(100):
        rb = TensorDictReplayBuffer(storage=storage, batch_size=16)
        env = SerialEnv(2, CountingEnv)
        collector = Collector(env, frames_per_batch=100, total_frames=200, replay_buffer=rb)
        for _ in collector:
            pass
        collector.shutdown()
        shapes.append(rb.sample().batch_size)
        assert len(rb) == 4  # 2 batches of 2 envs x 50 steps
    assert shapes[0] == shapes[1] == torch.Size([16, 50])


def test_tensorclass_comes_back_as_its_class() -> None:
    for storage in both(10):
        rb = ReplayBuffer(storage=storage, batch_size=3)
        rb.extend(Transition(obs=torch.arange(8.0).reshape(4, 2), reward=torch.arange(4.0), batch_size=[4]))
        sample = rb.sample()
        assert isinstance(sample, Transition), type(sample)
        assert isinstance(rb[1], Transition) and rb[1].reward.item() == 1.0
        assert torch.equal(rb[torch.tensor([2, 0])].obs, torch.tensor([[4.0, 5.0], [0.0, 1.0]]))


def test_load_state_dict_keeps_a_prioritized_store_sampler() -> None:
    from arrowbuf.compat.torchrl import ArrowbufSampler

    def storage() -> Any:
        return ArrowbufStorage(16, sampler=ab.samplers.Prioritized(alpha=1.0, beta=1.0), seed=0)

    rb = TensorDictReplayBuffer(storage=storage(), sampler=ArrowbufSampler(), batch_size=64)
    rb.extend(TensorDict({"x": torch.arange(16)}, [16]))
    again = TensorDictReplayBuffer(storage=storage(), sampler=ArrowbufSampler(), batch_size=64)
    again.load_state_dict(rb.state_dict())
    prio = torch.full((16,), 1e-3)
    prio[5] = 1e3
    again.update_priority(torch.arange(16), prio)
    batch = again.sample()
    assert (batch["x"] == 5).float().mean() > 0.9
    rb.storage.close()
    again.storage.close()


def _trajectories(n: int, start: int = 0) -> Any:
    """Episodes of lengths 3, 4, 5, ... (ids from 0), `n` steps, the step counter as observation."""
    ids, done, k, length = [], [], 0, 3
    while len(ids) < n:
        ids += [k] * length
        done += [False] * (length - 1) + [True]
        k, length = k + 1, length + 1
    steps = torch.arange(start, start + n)
    return TensorDict({"obs": steps.float(), "episode": torch.tensor(ids[:n]),
                       ("next", "done"): torch.tensor(done[:n])[:, None]}, [n])


@pytest.mark.parametrize("mode", [{"end_key": ("next", "done"), "slice_len": 3},
                                  {"traj_key": "episode", "num_slices": 4}])
def test_slice_sampler_matches_lazy_tensor_storage_across_the_wrap(mode: dict[str, Any]) -> None:
    samples = []
    for storage in both(20):
        torch.manual_seed(0)
        rb = TensorDictReplayBuffer(storage=storage, sampler=SliceSampler(**mode), batch_size=12)
        rb.extend(_trajectories(14))
        rb.extend(_trajectories(12, start=100))  # the ring wraps: positions 0..5 hold the newest steps
        got = [rb.sample() for _ in range(5)]
        for batch in got:
            assert batch.batch_size == torch.Size([12])
        samples.append(got)
    for a, b in zip(*samples):
        assert_close(a.exclude("index"), b.exclude("index"))
        assert torch.equal(a["index"], b["index"])


@pytest.mark.parametrize("kind", ["tensordict", "tensor"])
def test_state_dict_loads_with_weights_only(kind: str) -> None:
    rb = ReplayBuffer(storage=ArrowbufStorage(8), batch_size=2)
    data: Any = torch.arange(11.0) if kind == "tensor" else TensorDict(
        {"x": torch.arange(11.0), "y": {"z": torch.ones(11, 2, dtype=torch.int64)}}, [11])
    rb.extend(data)
    buf = io.BytesIO()
    torch.save(rb.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    again = ReplayBuffer(storage=ArrowbufStorage(8), batch_size=2)
    again.load_state_dict(state)
    every = torch.arange(8)
    if kind == "tensor":
        assert torch.equal(again[every], rb[every])
    else:
        assert_close(again[every], rb[every])
