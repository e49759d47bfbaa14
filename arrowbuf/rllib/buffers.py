"""RLlib replay buffers backed by arrowbuf: DQN and SAC (new API stack) keep their experience in an arrowbuf store.

RLlib's DQN config accepts only subclasses of `EpisodeReplayBuffer` on the new API stack, and recognises them by
the class path, so the classes here subclass RLlib's and are named by path::

    from ray.rllib.algorithms.dqn import DQNConfig
    from arrowbuf.rllib import replay_buffer_config

    config = (DQNConfig().environment("CartPole-v1")
              .training(replay_buffer_config=replay_buffer_config(capacity=50_000, prioritized=True)))
    algo = config.build_algo()
    algo.train()
    algo.local_replay_buffer.store.sql("SELECT count(*) FROM experience")   # the buffer is a queryable store

`replay_buffer_config(..., num_shards=3)` puts the buffer on a `ShardedStore` (shards over the Ray cluster);
`store=` takes any existing store (an `ExperienceStore`, a Flight `RemoteStore`, a `ShardedStore`) whose schema fits.

What maps to what: RLlib hands `add` episode chunks (observations, actions, rewards, terminated/truncated); each
chunk's steps are appended to the store under the stream key `actor = episode id`, so the store stitches chunks of one
episode together and derives `next_obs` from the successor step (or the episode's final observation). On a
`ShardedStore` each episode goes to the shard its id hashes to, so it stays whole on one shard. `sample` draws
transitions with the store's n-step returns (`n_step`, `gamma` as DQN asks) and returns them as the 1-step
`SingleAgentEpisode`s RLlib's learner connectors expect: observations `[o_t, o_{t+m}]`, the action `a_t`, the reward
`sum_{j<m} gamma^j r_{t+j}`, `terminated` when the episode terminated within the m <= n steps, and the extra model
outputs `n_step = m` and `weights` (IS weights; 1 for the uniform buffer). Observations must be Box (arrays, stored
as float32) and actions Discrete (int64) or Box (float32). Checkpoints (`get_state`) hold the counters, not the
experience: a restored algorithm starts with an empty buffer.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

from ..errors import InvalidArgument, SchemaError, require
from ..samplers import Prioritized

require("ray.rllib", "ray")  # a missing RLlib is MissingDependency naming the extra, not a bare ImportError

from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer  # noqa: E402
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import (  # noqa: E402
    PrioritizedEpisodeReplayBuffer,
)


def replay_buffer_config(capacity: int = 50_000, *, prioritized: bool = False, alpha: float = 0.6,
                         beta: float = 0.4, num_shards: int | None = None, store: Any = None,
                         **kwargs: Any) -> dict[str, Any]:
    """The `replay_buffer_config` dict for RLlib's DQN/SAC config that puts the buffer in arrowbuf."""
    cls = ArrowbufPrioritizedEpisodeReplayBuffer if prioritized else ArrowbufEpisodeReplayBuffer
    out: dict[str, Any] = {"type": f"arrowbuf.rllib.{cls.__name__}", "capacity": int(capacity), **kwargs}
    if prioritized:
        out.update(alpha=alpha, beta=beta)
    if num_shards is not None:
        out["num_shards"] = int(num_shards)
    if store is not None:
        out["store"] = store
    return out


class _ArrowbufBuffer:
    """The arrowbuf side shared by both buffers (a mixin placed before RLlib's class)."""

    _sampler: Any = "uniform"
    batch_size_B: int  # set by RLlib's __init__

    def _setup(self, capacity: int, store: Any, num_shards: int | None, seed: int | None,
               shard_options: dict[str, Any] | None) -> None:
        self.store = store
        self._num_shards = num_shards
        self._seed = seed
        self._shard_options = dict(shard_options or {})
        self._writer: list[Any] | None = None
        self._capacity_rows = int(capacity)
        self._last_ids = np.zeros(0, dtype=np.int64)
        self._added = 0
        self._sampled = 0

    # ------------------------------------------------------------------ schema and store
    def _schema_for(self, episode: SingleAgentEpisode) -> dict[str, Any]:
        obs = np.asarray(episode.get_observations(0))
        act = np.asarray(episode.get_actions(0)) if len(episode) else None
        if obs.dtype.kind not in "fiub":
            raise SchemaError(f"arrowbuf's RLlib buffer stores Box observations; got {obs.dtype} {obs.shape}")
        fields: dict[str, Any] = {"obs": {"dtype": "float32", "shape": list(obs.shape)}}
        space = getattr(episode, "action_space", None)
        discrete = space is not None and type(space).__name__ == "Discrete"
        if discrete or (act is not None and act.dtype.kind in "iu" and act.ndim == 0):
            fields["action"] = {"dtype": "int64"}
        else:
            fields["action"] = {"dtype": "float32", "shape": list(act.shape) if act is not None else []}
        fields.update(reward={"dtype": "float32"}, terminated={"dtype": "bool"}, truncated={"dtype": "bool"})
        return {"name": "rllib", "fields": fields, "derived": {"next_obs": {"next_of": "obs"}}}

    def _ensure_store(self, episode: SingleAgentEpisode) -> None:
        if self.store is not None:
            return
        schema = self._schema_for(episode)
        if self._num_shards:
            from ..ray import ShardedStore

            per_shard = max(1, math.ceil(self._capacity_rows / self._num_shards))
            self.store = ShardedStore.create(schema, self._num_shards, per_shard, self._sampler, seed=self._seed,
                                             **self._shard_options)
        else:
            from ..store import ExperienceStore

            self.store = ExperienceStore(schema, self._capacity_rows, self._sampler, seed=self._seed)

    def _write(self, batch: dict[str, Any]) -> None:
        if not hasattr(self.store, "num_shards"):
            self.store.extend(batch)
            return
        # a sharded store: one writer per shard, each episode to the shard its id hashes to (it stays there)
        if self._writer is None:
            self._writer = [self.store.writer(shard=k) for k in range(self.store.num_shards)]
        owner = np.array([zlib.crc32(a.encode()) for a in batch["actor"]]) % len(self._writer)
        for k in np.unique(owner):
            rows = np.flatnonzero(owner == k)
            self._writer[int(k)].extend({c: v[rows] for c, v in batch.items()})

    # ------------------------------------------------------------------ RLlib surface
    def add(self, episodes: Any) -> None:  # type: ignore[override]
        """Append the steps of each episode chunk (stream key: the episode id)."""
        from ray.rllib.utils import force_list

        cols: dict[str, list[Any]] = {k: [] for k in ("obs", "action", "reward", "terminated", "truncated",
                                                      "next_obs", "actor")}
        for ep in force_list(episodes):
            n = len(ep)
            if n == 0:
                continue
            self._ensure_store(ep)
            obs = np.asarray(ep.get_observations(slice(0, n + 1)), dtype=np.float32)
            cols["obs"].append(obs[:n])
            cols["next_obs"].append(obs[1:])  # read only on the step that ends the episode (its final obs)
            cols["action"].append(np.asarray(ep.get_actions(slice(0, n))))
            cols["reward"].append(np.asarray(ep.get_rewards(slice(0, n)), dtype=np.float32))
            last = np.arange(n) == n - 1
            cols["terminated"].append(last & bool(ep.is_terminated))
            cols["truncated"].append(last & bool(ep.is_truncated))
            cols["actor"].append(np.full(n, str(ep.id_)))
        if not cols["obs"]:
            return
        batch = {k: np.concatenate(v) for k, v in cols.items()}
        spec = self.store.schema.fields["action"]
        batch["action"] = batch["action"].astype(spec.dtype, copy=False).reshape((-1, *spec.shape))
        self._write(batch)
        self._added += len(batch["reward"])

    def _flush(self) -> None:
        for w in self._writer or ():
            w.flush()

    def sample(self, num_items: int | None = None, *, batch_size_B: int | None = None,
               batch_length_T: int | None = None, n_step: Any = None, beta: float | None = None,
               gamma: float = 0.99, sample_episodes: bool | None = True,
               **kwargs: Any) -> list[SingleAgentEpisode]:  # type: ignore[override]
        """`num_items` transitions as 1-step episodes (what DQN's and SAC's learners take)."""
        if batch_length_T:
            raise NotImplementedError("arrowbuf's RLlib buffer samples transitions (batch_length_T=0); "
                                      "stateful modules need sequence sampling, not wired to RLlib yet")
        b = int(num_items or batch_size_B or self.batch_size_B)
        k = n_step if isinstance(n_step, int) else (int(np.random.randint(n_step[0], n_step[1] + 1))
                                                    if isinstance(n_step, tuple) else 1)
        self._flush()
        batch = self.store.sample(b, ["obs", "action"], timeout=30.0, n_step=k, gamma=gamma)
        self._last_ids = np.asarray(batch.indices, dtype=np.int64).copy()
        weights = self._weights(batch.weights, beta, b)
        disc = np.asarray(batch["n_step_discount"], dtype=np.float64)
        terminated = disc == 0.0
        if 0.0 < gamma < 1.0:
            m = np.where(terminated, k, np.rint(np.log(np.maximum(disc, 1e-300)) / math.log(gamma)))
        else:
            m = np.full(b, k)
        obs, nxt = batch["obs"], batch["n_step_next_obs"]
        act, ret = batch["action"], batch["n_step_return"]
        self._sampled += b
        return [SingleAgentEpisode(observations=[obs[i], nxt[i]], actions=[act[i]], rewards=[float(ret[i])],
                                   terminated=bool(terminated[i]), truncated=False, len_lookback_buffer=0,
                                   extra_model_outputs={"n_step": [int(m[i])], "weights": [float(weights[i])]},
                                   t_started=0)
                for i in range(b)]

    def _weights(self, weights: Any, beta: float | None, b: int) -> np.ndarray:
        return np.ones(b, dtype=np.float32)

    def get_num_timesteps(self, module_id: Any = None) -> int:
        return len(self.store) if self.store is not None else 0

    def __len__(self) -> int:
        return self.get_num_timesteps()

    def get_added_timesteps(self, module_id: Any = None) -> int:
        return self._added

    def get_sampled_timesteps(self, module_id: Any = None) -> int:
        return self._sampled

    def get_num_episodes(self, module_id: Any = None) -> int:
        if self.store is None or not hasattr(self.store, "episodes"):
            return 0
        return self.store.episodes().num_rows

    def get_state(self) -> dict[str, Any]:
        return {"added": self._added, "sampled": self._sampled}

    def set_state(self, state: dict[str, Any]) -> None:
        self._added = int(state.get("added", 0))
        self._sampled = int(state.get("sampled", 0))


class ArrowbufEpisodeReplayBuffer(_ArrowbufBuffer, EpisodeReplayBuffer):  # type: ignore[misc]
    """RLlib `EpisodeReplayBuffer` over an arrowbuf store, uniform sampling (see the module docstring).

    Args:
        capacity: steps held.
        batch_size_B: default batch size.
        store: an existing store (`ExperienceStore`, `RemoteStore`, `ShardedStore`) to use; else one is made on the
            first `add`, from the episodes' observation and action shapes.
        num_shards: make a `ShardedStore` of this many shards over the Ray cluster instead of a local store.
        seed: sampling seed.
        shard_options: extra keyword arguments of `ShardedStore.create`.
    """

    def __init__(self, capacity: int = 10_000, *, batch_size_B: int = 16, batch_length_T: int = 1,
                 store: Any = None, num_shards: int | None = None, seed: int | None = None,
                 shard_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        EpisodeReplayBuffer.__init__(self, capacity, batch_size_B=batch_size_B, batch_length_T=batch_length_T,
                                     **{k: v for k, v in kwargs.items() if k == "metrics_num_episodes_for_smoothing"})
        self._setup(capacity, store, num_shards, seed, shard_options)


class ArrowbufPrioritizedEpisodeReplayBuffer(_ArrowbufBuffer, PrioritizedEpisodeReplayBuffer):  # type: ignore[misc]
    """RLlib `PrioritizedEpisodeReplayBuffer` over an arrowbuf store with `ab.samplers.Prioritized(alpha, beta)`.

    RLlib's DQN updates priorities with the TD errors of the last sampled batch (`update_priorities(td_errors)`);
    they go to the store (to the owning shards of a `ShardedStore`). The `beta` DQN passes to `sample` rescales the
    store's weights: `w^(beta / beta_0)` = `(P_i / P_min)^-beta`, beta_0 the sampler's beta.
    """

    def __init__(self, capacity: int = 10_000, *, batch_size_B: int = 16, batch_length_T: int = 1,
                 alpha: float = 0.6, beta: float = 0.4, store: Any = None, num_shards: int | None = None,
                 seed: int | None = None, shard_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # RLlib's own segment trees are not used: skip PrioritizedEpisodeReplayBuffer.__init__ (which sizes them)
        EpisodeReplayBuffer.__init__(self, capacity, batch_size_B=batch_size_B, batch_length_T=batch_length_T,
                                     **{k: v for k, v in kwargs.items() if k == "metrics_num_episodes_for_smoothing"})
        self._alpha = float(alpha)
        self._beta0 = float(beta) if beta else 1.0
        self._sampler = Prioritized(alpha=alpha, beta=self._beta0)
        self._last_sampled_indices: list[int] = []
        self._setup(capacity, store, num_shards, seed, shard_options)

    def _weights(self, weights: Any, beta: float | None, b: int) -> np.ndarray:
        if weights is None:
            return np.ones(b, dtype=np.float32)
        w = np.asarray(weights, dtype=np.float64)
        beta = self._beta0 if beta is None else float(beta)
        return (w ** (beta / self._beta0)).astype(np.float32)

    def sample(self, *args: Any, **kwargs: Any) -> list[SingleAgentEpisode]:  # type: ignore[override]
        out = super().sample(*args, **kwargs)
        self._last_sampled_indices = self._last_ids.tolist()
        return out

    def update_priorities(self, priorities: Any, module_id: Any = None) -> None:
        """New priorities (|TD error|) for the items of the last `sample`."""
        pri = np.abs(np.asarray(priorities, dtype=np.float64).reshape(-1))
        if len(pri) != len(self._last_ids):
            raise InvalidArgument(f"{len(pri)} priorities for the {len(self._last_ids)} items of the last sample")
        self.store.update_priorities(self._last_ids, np.maximum(pri, 1e-12))
        self._last_sampled_indices = []


__all__ = ["ArrowbufEpisodeReplayBuffer", "ArrowbufPrioritizedEpisodeReplayBuffer", "replay_buffer_config"]
