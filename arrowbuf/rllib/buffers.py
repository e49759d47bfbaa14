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
as float32) and actions Discrete (int64) or Box (float32). `get_state` holds the counters, and with the buffer
option `checkpoint_dir=` the experience by reference (a checkpoint written there; `set_state` restores it). RLlib
2.60's new API stack does not put buffer state into `algo.save()`: `arrowbuf.rllib.save_with_buffer(algo, path)` and
`from_checkpoint_with_buffer(path)` do (arrowbuf/rllib/checkpoint.py).

Scheduling (`replay_buffer_config(..., schedule=True)`, docs/rllib.md): `sample` returns a batch an `ab.Loader`
drew, gathered and converted to episodes in the background while the learner updated on the previous one; `add`
queues its episodes for a background commit (bounded queue, back-pressure); priority updates are applied before the
next draw. Per call of `sample`, the experience-path metrics (`LoaderMetrics` definitions) go to the buffer's RLlib
metrics logger, so they appear in the algorithm's result under `replay_buffer/arrowbuf`.
"""

from __future__ import annotations

import math
import os
import time
import zlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgument, require
from ..samplers import Prioritized

require("ray.rllib", "ray")  # a missing RLlib is MissingDependency naming the extra, not a bare ImportError

from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer  # noqa: E402
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import (  # noqa: E402
    PrioritizedEpisodeReplayBuffer,
)

from ..surface import StoreSurface  # noqa: E402
from .convert import BatchConverter, Converted, episodes_to_columns, schema_for  # noqa: E402
from .scheduling import BackgroundCommitter, QueuedSource  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

    from ..delivery.batch import SampleBatch
    from ..delivery.loader import Loader
    from ..samplers import Sampler
    from ..surface import WriterSurface


class NStepStore(StoreSurface, Protocol):
    """A store whose `sample` computes n-step returns (`n_step=`, `gamma=`): every arrowbuf store does (the buffer's
    `store=`)."""

    def sample(self, n: int, columns: Iterable[str] | None = None, timeout: float | None = None, *,
               n_step: int | None = None, gamma: float = 0.99) -> SampleBatch: ...


@runtime_checkable
class _Sharded(Protocol):
    """A store of shards (`ShardedStore`): each episode is written through the writer of the shard its id hashes to."""

    @property
    def num_shards(self) -> int: ...

    def writer(self, shard: int | None = None) -> WriterSurface: ...

#: Where the experience-path metrics go in the buffer's metrics logger (so: `result["replay_buffer"]["arrowbuf"]`).
METRICS_KEY = "arrowbuf"
#: The metrics logged per `sample` call (seconds unless named otherwise); see docs/rllib.md.
METRIC_NAMES = ("wait_for_batch_s", "blocking_add_s", "conversion_s", "exposed_s", "path_s", "exposed_path_s",
                "hidden_fraction", "background_conversion_s", "background_commit_s", "scheduled")
_COLUMNS = ["obs", "action"]


def replay_buffer_config(capacity: int = 50_000, *, prioritized: bool = False, alpha: float = 0.6,
                         beta: float = 0.4, num_shards: int | None = None, store: NStepStore | None = None,
                         schedule: bool = False, prefetch: int = 1, max_pending_adds: int = 2,
                         **kwargs: Any) -> dict[str, Any]:
    """The `replay_buffer_config` dict for RLlib's DQN/SAC config that puts the buffer in arrowbuf.

    Args:
        capacity: steps held.
        prioritized: prioritized replay (`alpha`, `beta`) instead of uniform.
        num_shards: a `ShardedStore` of this many shards on the Ray cluster.
        store: an existing store to use.
        schedule: hide the experience path (background sampling, conversion and adds; docs/rllib.md).
        prefetch: batches drawn ahead with `schedule` (the priority-update and rate-limiter window).
        max_pending_adds: adds that may wait for the background commit before `add` blocks.
        **kwargs: more buffer options (`seed`, `shard_options`, `fast_episodes`, `batch_size_B`).
    """
    cls = ArrowbufPrioritizedEpisodeReplayBuffer if prioritized else ArrowbufEpisodeReplayBuffer
    out: dict[str, Any] = {"type": f"arrowbuf.rllib.{cls.__name__}", "capacity": int(capacity), **kwargs}
    if prioritized:
        out.update(alpha=alpha, beta=beta)
    if num_shards is not None:
        out["num_shards"] = int(num_shards)
    if store is not None:
        out["store"] = store
    if schedule:
        out.update(schedule=True, prefetch=int(prefetch), max_pending_adds=int(max_pending_adds))
    return out


def _scale_weights(weights: np.ndarray | None, beta: float | None, beta0: float | None, b: int) -> np.ndarray:
    """IS weights for RLlib: 1 for the uniform buffer; the store's `(P_i / P_min)^-beta0` rescaled to `beta`."""
    if weights is None or beta0 is None:
        return np.ones(b, dtype=np.float32)
    w = np.asarray(weights, dtype=np.float64)
    beta = beta0 if beta is None else float(beta)
    return (w ** (beta / beta0)).astype(np.float32)


class _StoreWriter:
    """Commits RLlib episode chunks to the store: locally, or each episode to the shard its id hashes to.

    Holds no reference to the buffer, so the background threads never keep a buffer alive.
    """

    def __init__(self, store: StoreSurface) -> None:
        self.store = store
        self._writers: list[WriterSurface] | None = None

    def write(self, episodes: list[SingleAgentEpisode]) -> None:
        batch = episodes_to_columns(episodes, self.store.schema)
        if batch is None:
            return
        store = self.store
        if not isinstance(store, _Sharded):
            store.extend(batch)
            return
        if self._writers is None:  # one writer per shard; an episode stays on the shard its id hashes to
            self._writers = [store.writer(shard=k) for k in range(store.num_shards)]
        owner = np.array([zlib.crc32(a.encode()) for a in batch["actor"]]) % len(self._writers)
        for k in np.unique(owner):
            rows = np.flatnonzero(owner == k)
            self._writers[int(k)].extend({c: v[rows] for c, v in batch.items()})

    def flush(self) -> None:
        for w in self._writers or ():
            w.flush()


def _collate_fn(converter: BatchConverter, beta: float | None,
                beta0: float | None) -> Callable[[SampleBatch], Converted]:
    """The Loader's collate (background thread): a SampleBatch to `Converted` episodes. References no buffer."""

    def collate(batch: SampleBatch) -> Converted:
        t0 = time.perf_counter()
        weights = _scale_weights(batch.weights, beta, beta0, len(batch))
        episodes = converter(batch, weights)
        return Converted(episodes, np.asarray(batch.indices, dtype=np.int64).copy(), time.perf_counter() - t0)

    return collate


class _ArrowbufBuffer:
    """The arrowbuf side shared by both buffers (a mixin placed before RLlib's class)."""

    _sampler: str | Sampler = "uniform"
    _beta0: float | None = None
    batch_size_B: int  # set by RLlib's __init__
    metrics: MetricsLogger  # set by EpisodeReplayBuffer.__init__

    def _setup(self, capacity: int, store: NStepStore | None, num_shards: int | None, seed: int | None,
               shard_options: dict[str, Any] | None, schedule: bool = False, prefetch: int = 1,
               max_pending_adds: int = 2, fast_episodes: bool = True,
               checkpoint_dir: str | os.PathLike[str] | None = None) -> None:
        if schedule and (not isinstance(prefetch, int) or prefetch < 1):
            raise InvalidArgument(f"prefetch must be >= 1 batches drawn ahead, got {prefetch!r}")
        self.store = store
        self.checkpoint_dir = None if checkpoint_dir is None else os.path.abspath(os.fspath(checkpoint_dir))
        self._num_shards = num_shards
        self._seed = seed
        self._shard_options = dict(shard_options or {})
        self._capacity_rows = int(capacity)
        self._last_ids = np.zeros(0, dtype=np.int64)
        self._added = 0
        self._sampled = 0
        self.scheduled = bool(schedule)
        self.prefetch = int(prefetch)
        self._fast = bool(fast_episodes)
        self._store_writer: _StoreWriter | None = _StoreWriter(store) if store is not None else None
        self._committer = BackgroundCommitter(int(max_pending_adds)) if schedule else None
        self._source: QueuedSource | None = None
        self.loader: Loader | None = None  # the ab.Loader serving `sample` with scheduling (made on the first sample)
        self._loader_key: tuple[Any, ...] | None = None
        self._add_s = 0.0  # blocking add time since the last sample (synchronous mode)
        self._totals = dict.fromkeys(("wait_s", "insert_s", "exposed_s", "path_s", "exposed_path_s"), 0.0)

    # ------------------------------------------------------------------ store
    def _ensure_store(self, episode: SingleAgentEpisode) -> None:
        if self.store is None:
            schema = schema_for(episode)
            if self._num_shards:
                from ..ray import ShardedStore

                per_shard = max(1, math.ceil(self._capacity_rows / self._num_shards))
                self.store = ShardedStore.create(schema, self._num_shards, per_shard, self._sampler, seed=self._seed,
                                                 **self._shard_options)
            else:
                from ..store.facade import ExperienceStore

                self.store = ExperienceStore(schema, self._capacity_rows, self._sampler, seed=self._seed)
        if self._store_writer is None:
            self._store_writer = _StoreWriter(self.store)
        if self._committer is not None:
            self._queued_source()

    def _queued_source(self) -> QueuedSource:
        """The scheduled buffer's source (sampling from the store, adds through the committer), made once."""
        if self._source is None:
            store, committer, writer = self.store, self._committer, self._store_writer
            assert store is not None and committer is not None and writer is not None, "a scheduled buffer's store"
            self._source = QueuedSource(store, committer, writer.write)
        return self._source

    def _flush(self) -> None:
        """Every add so far committed and visible to `sample`."""
        if self._committer is not None:
            self._committer.flush()
        if self._store_writer is not None:
            self._store_writer.flush()

    # ------------------------------------------------------------------ RLlib surface
    def add(self, episodes: SingleAgentEpisode | list[SingleAgentEpisode]) -> None:
        """Append the steps of each episode chunk (stream key: the episode id); with scheduling, in the background."""
        from ray.rllib.utils import force_list

        t0 = time.perf_counter()
        eps = [ep for ep in force_list(episodes) if len(ep)]
        if not eps:
            return
        self._ensure_store(eps[0])
        self._added += sum(len(ep) for ep in eps)
        if self._source is None:
            self._store_writer.write(eps)  # type: ignore[union-attr]
        elif self.loader is not None:
            self.loader.extend(eps)  # the Loader times the blocking part (its insert_s)
        else:
            self._source.extend(eps)
        self._add_s += time.perf_counter() - t0

    def sample(self, num_items: int | None = None, *, batch_size_B: int | None = None,
               batch_length_T: int | None = None, n_step: int | tuple[int, int] | None = None,
               beta: float | None = None, gamma: float = 0.99, sample_episodes: bool | None = True,
               **kwargs: Any) -> list[SingleAgentEpisode]:
        """`num_items` transitions as 1-step episodes (what DQN's and SAC's learners take)."""
        if batch_length_T:
            raise NotImplementedError("arrowbuf's RLlib buffer samples transitions (batch_length_T=0); "
                                      "stateful modules need sequence sampling, not wired to RLlib yet")
        if self.store is None:
            raise InvalidArgument("sample() before any add(): the buffer is empty (RLlib's "
                                  "num_steps_sampled_before_learning_starts keeps DQN from sampling this early)")
        b = int(num_items or batch_size_B or self.batch_size_B)
        if self.scheduled and not isinstance(n_step, tuple):
            return self._sample_scheduled(b, int(n_step or 1), float(gamma), beta)
        # synchronous: a tuple n_step draws k per batch, so the next batch's request is unknown in advance
        k = n_step if isinstance(n_step, int) else (int(np.random.randint(n_step[0], n_step[1] + 1))
                                                    if isinstance(n_step, tuple) else 1)
        t0 = time.perf_counter()
        self._flush()
        batch = self.store.sample(b, _COLUMNS, timeout=30.0, n_step=k, gamma=gamma)
        t1 = time.perf_counter()
        self._last_ids = np.asarray(batch.indices, dtype=np.int64).copy()
        weights = _scale_weights(batch.weights, beta, self._beta0, b)
        episodes = BatchConverter(k, gamma, self._fast)(batch, weights)
        t2 = time.perf_counter()
        self._sampled += b
        add_s, self._add_s = self._add_s, 0.0
        self._log({"wait_for_batch_s": t1 - t0, "blocking_add_s": add_s, "conversion_s": t2 - t1,
                   "exposed_s": t2 - t0 + add_s, "path_s": t2 - t0, "exposed_path_s": t2 - t0,
                   "hidden_fraction": 0.0, "background_conversion_s": 0.0, "background_commit_s": 0.0,
                   "scheduled": 0.0})
        return episodes

    def _sample_scheduled(self, b: int, k: int, gamma: float, beta: float | None) -> list[SingleAgentEpisode]:
        loader = self._loader_for(b, k, gamma, beta)
        item: Converted = next(loader)
        self._last_ids = item.ids
        self._sampled += b
        self._add_s = 0.0
        totals = loader.metrics.totals
        d = {key: totals[key] - self._totals[key] for key in self._totals}
        self._totals = dict(totals)
        hidden = 1.0 - d["exposed_path_s"] / d["path_s"] if d["path_s"] > 0 else 1.0
        self._log({"wait_for_batch_s": d["wait_s"], "blocking_add_s": d["insert_s"], "conversion_s": 0.0,
                   "exposed_s": d["exposed_s"], "path_s": d["path_s"], "exposed_path_s": d["exposed_path_s"],
                   "hidden_fraction": min(1.0, max(0.0, hidden)), "background_conversion_s": item.convert_s,
                   "background_commit_s": self._committer.take_commit_s() if self._committer else 0.0,
                   "scheduled": 1.0})
        return item.episodes

    def _loader_for(self, b: int, k: int, gamma: float, beta: float | None) -> Loader:
        """The Loader serving this request (one per request shape; a new shape replaces it)."""
        key = (b, k, gamma, beta)
        if self.loader is not None and key == self._loader_key:
            return self.loader
        from ..delivery.loader import Loader

        if self.loader is not None:
            self.loader.close()
        self._flush()  # the first scheduled batch sees every add before it, as a synchronous one would
        collate = _collate_fn(BatchConverter(k, gamma, self._fast), beta, self._beta0)
        # a store given to the buffer may be sampled before the first add made the source
        self.loader = Loader(self._queued_source(), b, prefetch=self.prefetch, columns=_COLUMNS, collate=collate,
                             history=1024, n_step=k, gamma=gamma)
        self._loader_key = key
        self._totals = dict(self.loader.metrics.totals)
        return self.loader

    def _log(self, values: dict[str, float]) -> None:
        """This sample call's experience-path metrics into the buffer's RLlib metrics logger (mean per iteration)."""
        for name, value in values.items():
            self.metrics.log_value((METRICS_KEY, name), float(value), reduce="mean")

    def close(self) -> None:
        """Stop the background sampling and commit (queued adds are committed first); idempotent."""
        if self.loader is not None:
            self.loader.close()
        if self._committer is not None:
            self._committer.close()

    def get_num_timesteps(self, module_id: str | None = None) -> int:
        """Committed steps (with scheduling, adds still queued are not counted yet)."""
        return len(self.store) if self.store is not None else 0

    def __len__(self) -> int:
        return self.get_num_timesteps()

    def get_added_timesteps(self, module_id: str | None = None) -> int:
        return self._added

    def get_sampled_timesteps(self, module_id: str | None = None) -> int:
        return self._sampled

    def get_num_episodes(self, module_id: str | None = None) -> int:
        if self.store is None or not hasattr(self.store, "episodes"):
            return 0
        return self.store.episodes().num_rows

    def get_state(self) -> dict[str, Any]:
        """Counters, and with `checkpoint_dir` the experience by reference: the local store is checkpointed there
        (incremental, the last 2 kept) and the state names the checkpoint."""
        state: dict[str, Any] = {"added": self._added, "sampled": self._sampled}
        if self.checkpoint_dir is not None and self.store is not None and hasattr(self.store, "checkpoint") \
                and not hasattr(self.store, "num_shards"):
            self._flush()
            info = self.store.checkpoint(self.checkpoint_dir, keep=2)
            state["checkpoint"] = {"path": self.checkpoint_dir, "generation": int(info["generation"])}
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Counters, and a buffer without rows restores the checkpoint the state names (same rows, sampler state)."""
        self._added = int(state.get("added", 0))
        self._sampled = int(state.get("sampled", 0))
        ref = state.get("checkpoint")
        if ref is not None and (self.store is None or len(self.store) == 0):
            from ..store.facade import ExperienceStore

            self.store = ExperienceStore.restore(ref["path"], generation=ref.get("generation"))
            self._store_writer = _StoreWriter(self.store)


_CLASS_ARGS = """
    Args:
        capacity: steps held.
        batch_size_B: default batch size.
        store: an existing store (`ExperienceStore`, `RemoteStore`, `ShardedStore`) to use; else one is made on the
            first `add`, from the episodes' observation and action shapes.
        num_shards: make a `ShardedStore` of this many shards over the Ray cluster instead of a local store.
        seed: sampling seed.
        shard_options: extra keyword arguments of `ShardedStore.create`.
        schedule: hide the experience path: background sampling and conversion (an `ab.Loader`) and background adds.
        prefetch: batches drawn ahead with `schedule`.
        max_pending_adds: adds that may wait for the background commit before `add` blocks.
        checkpoint_dir: with it, `get_state` checkpoints the store there and returns a reference to it, and
            `set_state` on an empty buffer restores it (the experience survives RLlib's buffer state round trip).
        fast_episodes: build the sampled episodes by copying a template's slots (falls back to RLlib's constructor
            when RLlib's episode layout is not the known one).
"""


def _own_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items()
            if k in ("schedule", "prefetch", "max_pending_adds", "fast_episodes", "checkpoint_dir")}


class ArrowbufEpisodeReplayBuffer(_ArrowbufBuffer, EpisodeReplayBuffer):  # type: ignore[misc]
    __doc__ = "RLlib `EpisodeReplayBuffer` over an arrowbuf store, uniform sampling (see the module docstring).\n" \
        + _CLASS_ARGS

    def __init__(self, capacity: int = 10_000, *, batch_size_B: int = 16, batch_length_T: int = 1,
                 store: NStepStore | None = None, num_shards: int | None = None, seed: int | None = None,
                 shard_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        EpisodeReplayBuffer.__init__(self, capacity, batch_size_B=batch_size_B, batch_length_T=batch_length_T,
                                     **{k: v for k, v in kwargs.items() if k == "metrics_num_episodes_for_smoothing"})
        self._setup(capacity, store, num_shards, seed, shard_options, **_own_kwargs(kwargs))


class ArrowbufPrioritizedEpisodeReplayBuffer(_ArrowbufBuffer, PrioritizedEpisodeReplayBuffer):  # type: ignore[misc]
    __doc__ = """RLlib `PrioritizedEpisodeReplayBuffer` over an arrowbuf store with `ab.samplers.Prioritized`.

    RLlib's DQN updates priorities with the TD errors of the last sampled batch (`update_priorities(td_errors)`);
    they go to the store (to the owning shards of a `ShardedStore`); with scheduling, through the Loader, which
    applies them before its next draw. The `beta` DQN passes to `sample` rescales the store's weights:
    `w^(beta / beta_0)` = `(P_i / P_min)^-beta`, beta_0 the sampler's beta.
""" + _CLASS_ARGS + """        alpha: priority exponent.
        beta: the sampler's IS exponent (beta_0).
"""

    def __init__(self, capacity: int = 10_000, *, batch_size_B: int = 16, batch_length_T: int = 1,
                 alpha: float = 0.6, beta: float = 0.4, store: NStepStore | None = None, num_shards: int | None = None,
                 seed: int | None = None, shard_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # RLlib's own segment trees are not used: skip PrioritizedEpisodeReplayBuffer.__init__ (which sizes them)
        EpisodeReplayBuffer.__init__(self, capacity, batch_size_B=batch_size_B, batch_length_T=batch_length_T,
                                     **{k: v for k, v in kwargs.items() if k == "metrics_num_episodes_for_smoothing"})
        self._alpha = float(alpha)
        self._beta0 = float(beta) if beta else 1.0
        self._sampler = Prioritized(alpha=alpha, beta=self._beta0)
        self._last_sampled_indices: list[int] = []
        self._setup(capacity, store, num_shards, seed, shard_options, **_own_kwargs(kwargs))

    def sample(self, *args: Any, **kwargs: Any) -> list[SingleAgentEpisode]:  # type: ignore[override]
        out = super().sample(*args, **kwargs)
        self._last_sampled_indices = self._last_ids.tolist()
        return out

    def update_priorities(self, priorities: npt.ArrayLike, module_id: str | None = None) -> None:
        """New priorities (|TD error|) for the items of the last `sample` (queued to the Loader with scheduling)."""
        pri = np.abs(np.asarray(priorities, dtype=np.float64).reshape(-1))
        if len(pri) != len(self._last_ids):
            raise InvalidArgument(f"{len(pri)} priorities for the {len(self._last_ids)} items of the last sample")
        pri = np.maximum(pri, 1e-12)
        if self.loader is not None:
            self.loader.update_priorities(self._last_ids, pri)
        elif self.store is not None:  # (no store: no sample yet, and no priorities to set)
            self.store.update_priorities(self._last_ids, pri)
        self._last_sampled_indices = []


__all__ = ["METRICS_KEY", "METRIC_NAMES", "ArrowbufEpisodeReplayBuffer", "ArrowbufPrioritizedEpisodeReplayBuffer",
           "replay_buffer_config"]
