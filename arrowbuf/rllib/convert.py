"""Between RLlib's episodes and arrowbuf's columns: episode chunks in, one-step episodes out.

In: `episodes_to_columns` turns RLlib's episode chunks into one column batch (stream key `actor` = episode id), so the
store stitches the chunks of an episode and derives `next_obs` and n-step returns itself; nothing of RLlib's episode
bookkeeping is redone in Python.

Out: `BatchConverter` turns a sampled batch into the 1-step `SingleAgentEpisode`s RLlib's learner connectors take.
The column work is vectorised (one numpy expression per column for the whole batch); what remains per item is the
episode object itself. RLlib's constructor costs about 40-60 us per episode (space lookups, validation); the converter
builds one template episode with that constructor per batch and copies its slots for each item (about 2.5x cheaper),
falling back to the constructor if RLlib's `SingleAgentEpisode` layout is not the one this was written for.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402  (arrowbuf.rllib checked RLlib)
from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer  # noqa: E402

from ..errors import SchemaError

if TYPE_CHECKING:  # pragma: no cover
    from ..delivery.batch import SampleBatch
    from ..schema import ExperienceSchema

#: `SingleAgentEpisode.__slots__` as of Ray 2.60, the layout the fast copy was checked against.
_KNOWN_SLOTS = ("actions", "agent_id", "extra_model_outputs", "id_", "infos", "is_terminated", "is_truncated",
                "module_id", "multi_agent_episode_id", "observations", "rewards", "t", "t_started", "_action_space",
                "_last_added_observation", "_last_added_infos", "_last_step_time", "_observation_space",
                "_start_time", "_custom_data")
FAST_COPY = tuple(getattr(SingleAgentEpisode, "__slots__", ())) == _KNOWN_SLOTS

COLUMNS = ("obs", "action", "reward", "terminated", "truncated", "next_obs", "actor")


def schema_for(episode: SingleAgentEpisode) -> dict[str, Any]:
    """The store schema for an RLlib episode's observations and actions (observations keep their dtype)."""
    obs = np.asarray(episode.get_observations(0))
    act = np.asarray(episode.get_actions(0)) if len(episode) else None
    if obs.dtype.kind not in "fiub":
        raise SchemaError(f"arrowbuf's RLlib buffer stores Box observations (numeric arrays); got {obs.dtype} "
                          f"{obs.shape}: flatten Dict/Tuple observations with a connector first")
    dtype = "float32" if obs.dtype.kind == "f" and obs.dtype.itemsize <= 4 else str(obs.dtype)
    fields: dict[str, Any] = {"obs": {"dtype": dtype, "shape": list(obs.shape)}}
    space = getattr(episode, "action_space", None)
    discrete = space is not None and type(space).__name__ == "Discrete"
    if discrete or (act is not None and act.dtype.kind in "iu" and act.ndim == 0):
        fields["action"] = {"dtype": "int64"}
    else:
        fields["action"] = {"dtype": "float32", "shape": list(act.shape) if act is not None else []}
    fields.update(reward={"dtype": "float32"}, terminated={"dtype": "bool"}, truncated={"dtype": "bool"})
    return {"name": "rllib", "fields": fields, "derived": {"next_obs": {"next_of": "obs"}}}


def episodes_to_columns(episodes: list[SingleAgentEpisode], schema: ExperienceSchema) -> dict[str, np.ndarray] | None:
    """One column batch from RLlib episode chunks (None when they hold no step)."""
    cols: dict[str, list[Any]] = {k: [] for k in COLUMNS}
    obs_dtype = schema.fields["obs"].dtype
    for ep in episodes:
        n = len(ep)
        if n == 0:
            continue
        obs = np.asarray(ep.get_observations(slice(0, n + 1)), dtype=obs_dtype)
        cols["obs"].append(obs[:n])
        cols["next_obs"].append(obs[1:])  # the store reads it only on the step that ends the episode (final obs)
        cols["action"].append(np.asarray(ep.get_actions(slice(0, n))))
        cols["reward"].append(np.asarray(ep.get_rewards(slice(0, n)), dtype=np.float32))
        last = np.arange(n) == n - 1
        cols["terminated"].append(last & bool(ep.is_terminated))
        cols["truncated"].append(last & bool(ep.is_truncated))
        cols["actor"].append(np.full(n, str(ep.id_)))
    if not cols["obs"]:
        return None
    batch = {k: np.concatenate(v) for k, v in cols.items()}
    spec = schema.fields["action"]
    batch["action"] = batch["action"].astype(spec.dtype, copy=False).reshape((-1, *spec.shape))
    return batch


@dataclass
class Converted:
    """A sampled batch as RLlib episodes, with what priority updates and metrics need."""

    episodes: list[SingleAgentEpisode]
    ids: np.ndarray
    convert_s: float


class BatchConverter:
    """Sampled columns (`obs`, `action`, `n_step_return`, `n_step_discount`, `n_step_next_obs`) to 1-step episodes.

    Each episode: observations `[o_t, o_{t+m}]`, the action `a_t`, the reward `sum_{j<m} gamma^j r_{t+j}`,
    `terminated` when the episode terminated within the m <= n steps, extra model outputs `n_step = m` and `weights`.

    Args:
        n_step: the n of the store's n-step returns.
        gamma: their discount.
        fast: copy a template episode's slots (default: when RLlib's layout is the known one).
    """

    def __init__(self, n_step: int, gamma: float, fast: bool | None = None) -> None:
        self.n_step = int(n_step)
        self.gamma = float(gamma)
        self.fast = FAST_COPY if fast is None else bool(fast) and FAST_COPY

    def columns(self, batch: SampleBatch) -> tuple[np.ndarray, ...]:
        """The vectorised part: observations, next observations, actions, rewards, terminated, m."""
        k, gamma = self.n_step, self.gamma
        disc = np.asarray(batch["n_step_discount"], dtype=np.float64)
        terminated = disc == 0.0
        if 0.0 < gamma < 1.0:
            m = np.where(terminated, k, np.rint(np.log(np.maximum(disc, 1e-300)) / math.log(gamma)))
        else:
            m = np.full(len(disc), k)
        ret = np.asarray(batch["n_step_return"], dtype=np.float64)
        return (np.asarray(batch["obs"]), np.asarray(batch["n_step_next_obs"]), np.asarray(batch["action"]), ret,
                terminated, m.astype(np.int64))

    def __call__(self, batch: SampleBatch, weights: np.ndarray) -> list[SingleAgentEpisode]:
        obs, nxt, act, ret, terminated, m = self.columns(batch)
        rewards = ret.tolist()
        term = terminated.tolist()
        steps = m.tolist()
        w = np.asarray(weights, dtype=np.float64).tolist()
        actions = list(act) if act.ndim > 1 else act.tolist()
        if not self.fast:
            return [SingleAgentEpisode(observations=[obs[i], nxt[i]], actions=[actions[i]], rewards=[rewards[i]],
                                       terminated=term[i], truncated=False, len_lookback_buffer=0,
                                       extra_model_outputs={"n_step": [steps[i]], "weights": [w[i]]}, t_started=0)
                    for i in range(len(rewards))]
        return self._fast(obs, nxt, actions, rewards, term, steps, w)

    def _fast(self, obs: np.ndarray, nxt: np.ndarray, actions: list[Any], rewards: list[float], term: list[bool],
              steps: list[int], w: list[float]) -> list[SingleAgentEpisode]:
        if not rewards:
            return []
        # one episode through RLlib's constructor (validated), then its slots per item with that item's data
        tpl = SingleAgentEpisode(observations=[obs[0], nxt[0]], actions=[actions[0]], rewards=[rewards[0]],
                                 terminated=term[0], truncated=False, len_lookback_buffer=0,
                                 extra_model_outputs={"n_step": [steps[0]], "weights": [w[0]]}, t_started=0)
        slots = {s: getattr(tpl, s) for s in _KNOWN_SLOTS if hasattr(tpl, s)}
        bufs = {name: vars(getattr(tpl, name)) for name in ("observations", "actions", "rewards", "infos")}
        emo = {k: vars(v) for k, v in tpl.extra_model_outputs.items()}
        prefix = uuid.uuid4().hex[:24]
        new_ep = SingleAgentEpisode.__new__
        new_buf = InfiniteLookbackBuffer.__new__
        out = [tpl]
        for i in range(1, len(rewards)):
            ep = new_ep(SingleAgentEpisode)
            for s, v in slots.items():
                object.__setattr__(ep, s, v)
            data = {"observations": [obs[i], nxt[i]], "actions": [actions[i]], "rewards": [rewards[i]],
                    "infos": [{}, {}]}
            for name, state in bufs.items():
                b = new_buf(InfiniteLookbackBuffer)
                b.__dict__.update(state)
                b.data = data[name]
                object.__setattr__(ep, name, b)
            extra = {}
            for key, state in emo.items():
                b = new_buf(InfiniteLookbackBuffer)
                b.__dict__.update(state)
                b.data = [steps[i]] if key == "n_step" else [w[i]]
                extra[key] = b
            ep.extra_model_outputs = extra
            ep.is_terminated = term[i]
            ep.id_ = f"{prefix}{i:08x}"
            ep._custom_data = {}
            out.append(ep)
        return out


__all__ = ["BatchConverter", "Converted", "FAST_COPY", "episodes_to_columns", "schema_for"]
