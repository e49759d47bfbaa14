"""TorchRL's tutorial loops with only the storage class changed: PPO (on-policy minibatches of each collected batch),
SAC (off-policy, a ring that wraps) and a recurrent DQN over sequences (`SliceSampler`), small and on the CPU.
Each runs twice from the same seeds, over LazyTensorStorage and over ArrowbufStorage: the storage holds and
returns the same data, so the two runs train to bit-identical parameters."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict")
pytest.importorskip("torchrl")
pytest.importorskip("gymnasium")

from tensordict.nn import NormalParamExtractor, TensorDictModule, TensorDictSequential  # noqa: E402
from torch import nn  # noqa: E402
from torchrl.collectors import Collector  # noqa: E402
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement, SliceSampler  # noqa: E402
from torchrl.envs import Compose, GymEnv, InitTracker, StepCounter, TransformedEnv  # noqa: E402
from torchrl.modules import (  # noqa: E402
    MLP,
    EGreedyModule,
    LSTMModule,
    ProbabilisticActor,
    QValueModule,
    TanhNormal,
    ValueOperator,
    set_recurrent_mode,
)
from torchrl.objectives import ClipPPOLoss, DQNLoss, SACLoss, SoftUpdate  # noqa: E402
from torchrl.objectives.value import GAE  # noqa: E402

from arrowbuf.compat.torchrl import ArrowbufStorage  # noqa: E402

STORAGES = {"lazy_tensor": LazyTensorStorage, "arrowbuf": ArrowbufStorage}


def _pendulum_actor(env: Any) -> Any:
    net = nn.Sequential(nn.Linear(3, 32), nn.Tanh(), nn.Linear(32, 2), NormalParamExtractor())
    return ProbabilisticActor(TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
                              spec=env.action_spec, in_keys=["loc", "scale"], distribution_class=TanhNormal,
                              distribution_kwargs={"low": env.action_spec.space.low,
                                                   "high": env.action_spec.space.high},
                              return_log_prob=True)


def ppo(storage_cls: Any) -> list[Any]:
    """TorchRL's PPO tutorial loop (reduced): GAE over each collected batch, then minibatch epochs from a storage of
    exactly one batch, sampled without replacement."""
    torch.manual_seed(0)
    env = GymEnv("Pendulum-v1")
    env.set_seed(0)
    policy = _pendulum_actor(env)
    value = ValueOperator(nn.Sequential(nn.Linear(3, 32), nn.Tanh(), nn.Linear(32, 1)), in_keys=["observation"])
    collector = Collector(env, policy, frames_per_batch=200, total_frames=600)
    rb = ReplayBuffer(storage=storage_cls(200), sampler=SamplerWithoutReplacement(), batch_size=50)
    advantage = GAE(gamma=0.99, lmbda=0.95, value_network=value, average_gae=True)
    loss = ClipPPOLoss(policy, value, clip_epsilon=0.2, entropy_bonus=True, entropy_coeff=1e-4)
    opt = torch.optim.Adam(loss.parameters(), 3e-4)
    for data in collector:
        for _ in range(2):
            advantage(data)
            rb.extend(data.reshape(-1).cpu())
            for _ in range(200 // 50):
                lv = loss(rb.sample())
                (lv["loss_objective"] + lv["loss_critic"] + lv["loss_entropy"]).backward()
                opt.step()
                opt.zero_grad()
    collector.shutdown()
    return [p.detach().clone() for p in loss.parameters()]


def sac(storage_cls: Any) -> list[Any]:
    """TorchRL's SAC loop (reduced): random frames first, a ring of 300 transitions that wraps, soft updates."""
    torch.manual_seed(0)
    env = GymEnv("Pendulum-v1")
    env.set_seed(0)
    actor = _pendulum_actor(env)
    qnet = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[32]), in_keys=["observation", "action"])
    loss = SACLoss(actor_network=actor, qvalue_network=qnet, num_qvalue_nets=2)
    loss.make_value_estimator(gamma=0.99)
    updater = SoftUpdate(loss, eps=0.995)
    opt = torch.optim.Adam(loss.parameters(), 3e-4)
    collector = Collector(env, actor, frames_per_batch=50, total_frames=500, init_random_frames=100)
    rb = TensorDictReplayBuffer(storage=storage_cls(300), batch_size=32)
    for data in collector:
        rb.extend(data)
        if len(rb) >= 100:
            for _ in range(4):
                lv = loss(rb.sample())
                (lv["loss_actor"] + lv["loss_qvalue"] + lv["loss_alpha"]).backward()
                opt.step()
                opt.zero_grad()
                updater.step()
    collector.shutdown()
    return [p.detach().clone() for p in loss.parameters()]


def recurrent_dqn(storage_cls: Any) -> list[Any]:
    """TorchRL's recurrent DQN recipe (an LSTM Q-network trained on sequences): `SliceSampler` draws 4 slices of 8
    consecutive steps of one episode each, across the ring's wrap-around."""
    torch.manual_seed(0)
    env = TransformedEnv(GymEnv("CartPole-v1"), Compose(StepCounter(), InitTracker()))
    env.set_seed(0)
    lstm = LSTMModule(input_size=4, hidden_size=32, in_key="observation", out_key="embed")
    env.append_transform(lstm.make_tensordict_primer())
    mlp = TensorDictModule(MLP(out_features=2, num_cells=[32]), in_keys=["embed"], out_keys=["action_value"])
    qnet = TensorDictSequential(lstm, mlp, QValueModule(spec=env.action_spec))
    explore = EGreedyModule(env.action_spec, annealing_num_steps=500, eps_init=0.5)
    policy = TensorDictSequential(qnet, explore)
    loss = DQNLoss(qnet, action_space=env.action_spec, delay_value=True)
    updater = SoftUpdate(loss, eps=0.95)
    opt = torch.optim.Adam(loss.parameters(), 3e-3)
    collector = Collector(env, policy, frames_per_batch=50, total_frames=500)
    rb = TensorDictReplayBuffer(storage=storage_cls(300), batch_size=32,
                                sampler=SliceSampler(slice_len=8, end_key=("next", "done")))
    for data in collector:
        rb.extend(data)
        if len(rb) >= 100:
            for _ in range(2):
                batch = rb.sample().reshape(4, 8)
                with set_recurrent_mode(True):
                    lv = loss(batch)
                lv["loss"].backward()
                opt.step()
                opt.zero_grad()
                updater.step()
        explore.step(data.numel())
        collector.update_policy_weights_()
    collector.shutdown()
    return [p.detach().clone() for p in loss.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [ppo, sac, recurrent_dqn], ids=["ppo", "sac", "recurrent_dqn_slices"])
def test_recipe_trains_identically_with_arrowbuf_storage(recipe: Any) -> None:
    ref = recipe(LazyTensorStorage)
    ours = recipe(ArrowbufStorage)
    assert len(ref) == len(ours) and ref
    for a, b in zip(ref, ours):
        assert torch.equal(a, b)
