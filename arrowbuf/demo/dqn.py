"""The demo's DQN pieces (also used by benchmarks/parity.py): hyperparameters, Q-network, actor policy, learner."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import require

if TYPE_CHECKING:  # pragma: no cover
    import gymnasium
    import numpy.typing as npt
    import torch


@dataclasses.dataclass
class DQNConfig:
    """Hyperparameters shared by the demo and the parity benchmark.

    `train_every` is the replay ratio: one gradient step per `train_every` environment steps (across all actors).
    """

    hidden: int = 128
    lr: float = 1e-3
    gamma: float = 0.99
    n_step: int = 3
    batch_size: int = 64
    train_every: int = 2
    target_every: int = 250      # gradient steps between target-network syncs
    warmup: int = 1_000          # rows stored before the first gradient step
    eps_start: float = 1.0
    eps_end: float = 0.02
    eps_fraction: float = 0.3    # share of the run over which epsilon decays linearly
    grad_clip: float = 10.0
    alpha: float = 0.6           # prioritized replay exponents
    beta: float = 0.4


def epsilon_at(cfg: DQNConfig, progress: float) -> float:
    """Linear decay from eps_start to eps_end over the first `eps_fraction` of the run (progress in [0, 1])."""
    frac = min(1.0, max(0.0, progress) / max(cfg.eps_fraction, 1e-9))
    return cfg.eps_start + frac * (cfg.eps_end - cfg.eps_start)


def make_qnetwork(obs_dim: int, n_actions: int, hidden: int) -> torch.nn.Module:
    torch = require("torch", "demo")
    nn = torch.nn
    return nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, n_actions))


class EpsilonGreedy:
    """An actor's policy: a Q-network copy, epsilon-greedy over its argmax."""

    def __init__(self, cfg: DQNConfig, obs_dim: int = 4, n_actions: int = 2, seed: int = 0) -> None:
        self.torch = require("torch", "demo")
        self.q = make_qnetwork(obs_dim, n_actions, cfg.hidden)
        self.q.eval()
        self.n_actions = n_actions
        self.rng = np.random.default_rng(seed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.q.load_state_dict(state)

    def act(self, obs: np.ndarray, eps: float) -> int:
        if self.rng.random() < eps:
            return int(self.rng.integers(self.n_actions))
        with self.torch.no_grad():
            return int(self.q(self.torch.as_tensor(obs, dtype=self.torch.float32)[None]).argmax(1).item())


class DQNLearner:
    """Double DQN on n-step returns (columns `obs`, `action`, `n_step_return`, `n_step_discount`,
    `n_step_next_obs`), Huber loss weighted by importance weights when the batch carries them."""

    def __init__(self, cfg: DQNConfig, obs_dim: int = 4, n_actions: int = 2, seed: int = 0) -> None:
        torch = self.torch = require("torch", "demo")
        torch.manual_seed(seed)
        self.cfg = cfg
        self.q = make_qnetwork(obs_dim, n_actions, cfg.hidden)
        self.target = make_qnetwork(obs_dim, n_actions, cfg.hidden)
        self.target.load_state_dict(self.q.state_dict())
        self.opt = torch.optim.Adam(self.q.parameters(), lr=cfg.lr)
        self.updates = 0

    def train(self, batch: dict[str, Any], weights: npt.ArrayLike | None = None) -> np.ndarray:
        """One gradient step on a batch (numpy arrays); returns |TD error| per row (the new priorities)."""
        torch = self.torch
        t = {k: torch.as_tensor(_writable(batch[k])) for k in
             ("obs", "action", "n_step_return", "n_step_discount", "n_step_next_obs")}
        obs, nxt = t["obs"].float(), t["n_step_next_obs"].float()
        act = t["action"].long().view(-1, 1)
        q = self.q(obs).gather(1, act).squeeze(1)
        with torch.no_grad():
            best = self.q(nxt).argmax(1, keepdim=True)
            target = t["n_step_return"].float() + t["n_step_discount"].float() * self.target(nxt).gather(
                1, best).squeeze(1)
        td = target - q
        loss = torch.nn.functional.smooth_l1_loss(q, target, reduction="none")
        if weights is not None:
            loss = loss * torch.as_tensor(_writable(weights), dtype=torch.float32)
        self.opt.zero_grad(set_to_none=True)
        loss.mean().backward()
        torch.nn.utils.clip_grad_norm_(self.q.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.updates += 1
        if self.updates % self.cfg.target_every == 0:
            self.target.load_state_dict(self.q.state_dict())
        return td.detach().abs().numpy()

    def greedy(self) -> Callable[[np.ndarray], int]:
        torch = self.torch

        def act(obs: np.ndarray) -> int:
            with torch.no_grad():
                return int(self.q(torch.as_tensor(obs, dtype=torch.float32)[None]).argmax(1).item())

        return act


def _writable(a: npt.ArrayLike) -> np.ndarray:
    """Arrays received over Flight are read-only views of the message; torch wants writable memory."""
    a = np.asarray(a)
    return a if a.flags.writeable else a.copy()


def make_env(seed: int) -> gymnasium.Env:
    gym = require("gymnasium", "demo")
    env = gym.make("CartPole-v1")
    env.action_space.seed(seed)
    return env
