"""n-step returns, computed vectorised over a batch by following each row's successor in its episode.

For a sampled row t and horizon k: `n_step_return = sum_{j<m} gamma^j r_{t+j}` over the m <= k steps that exist in
the episode; `n_step_discount = gamma^m`, or 0 when the episode terminated within those steps (a truncated episode
still bootstraps); the bootstrap observation is the next observation of step t+m-1. When a successor has not arrived
yet (the episode is still being written), the window stops at the last step whose next observation is known. Rows
that `max_times_sampled` removed from sampling still count as successors while they are stored. A reward declared
`later: true` and not filled yet (`store.update`) is treated the same way: the window stops before that step; a
sampled row whose own reward is still absent gets `n_step_return` NaN (never a silent 0).

Both columns follow the reward's dtype: float64 rewards give float64 returns and discounts; float32 and smaller
floats (and small integers) give float32; 32- and 64-bit integer rewards give float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from ..ring.index import RingIndex


def n_step_dtype(reward_dtype: np.dtype) -> np.dtype:
    """The dtype of `n_step_return` / `n_step_discount` for rewards of `reward_dtype` (at least float32)."""
    return np.result_type(reward_dtype, np.float32)


def n_step_returns(index: RingIndex, reward: np.ndarray, terminal: list[np.ndarray], truncation: list[np.ndarray],
                   pos: np.ndarray, k: int, gamma: float,
                   has_next: Callable[[np.ndarray], np.ndarray] | None = None,
                   has_reward: Callable[[np.ndarray], np.ndarray] | None = None,
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Returns (n_step_return, n_step_discount, position of each window's last step); k - 1 successor hops.

    Args:
        index: the store's ring index (successors, sampleability).
        reward: the reward arena; terminal / truncation: arenas of the flags that end an episode with / without
            bootstrapping.
        pos: arena positions of the sampled rows (each sampleable).
        has_next: mask of positions whose row is stored with its next observation known, sampleable or not
            (default: the sampleable rows, `index.valid`).
        has_reward: mask of positions whose reward is present (a reward filled later); None: every reward is.
    """
    if k < 1:
        raise InvalidArgument(f"n_step must be >= 1, got {k}")
    if not 0.0 <= gamma <= 1.0:
        raise InvalidArgument(f"gamma must be in [0, 1], got {gamma}")
    known = has_next if has_next is not None else index.valid.__getitem__
    dtype = n_step_dtype(np.asarray(reward[pos[:0]]).dtype)  # an arena or a tiered store's reader: host rows
    b = len(pos)
    ret = np.zeros(b, dtype=np.float64)
    scale = np.ones(b, dtype=np.float64)       # gamma^j for the current step
    terminated = np.zeros(b, dtype=bool)
    cur = pos.copy()
    active = np.ones(b, dtype=bool)
    no_reward = ~has_reward(pos) if has_reward is not None else None  # rows whose own reward is not filled yet
    for j in range(k):
        ret += np.where(active, scale * reward[cur], 0.0)
        term = np.zeros(b, dtype=bool)
        for flag in terminal:
            term |= flag[cur]
        ended = term.copy()
        for flag in truncation:
            ended |= flag[cur]
        terminated |= active & term
        scale = np.where(active, scale * gamma, scale)
        if j == k - 1:
            break
        nxt = index.next_pos[cur]
        inside = (nxt >= 0) & (nxt < index.arena_rows)
        step_on = active & ~ended & inside
        # the successor's own next observation must be known (it may have been removed from sampling)
        step_on[step_on] = known(nxt[step_on])
        if has_reward is not None:  # ... and its reward filled (the window stops before a step without one)
            step_on[step_on] = has_reward(nxt[step_on])
        cur = np.where(step_on, nxt, cur)
        active = step_on
    discount = np.where(terminated, 0.0, scale)
    if no_reward is not None and no_reward.any():
        ret[no_reward] = np.nan
    return ret.astype(dtype), discount.astype(dtype), cur


def n_step_returns_device(torch: Any, next_pos: Any, known: Any, reward: Any, terminal: list[Any],
                          truncation: list[Any], pos: Any, k: int, gamma: float, arena_rows: int,
                          out_dtype: Any) -> tuple[Any, Any, Any]:
    """`n_step_returns` over a device ring's mirrors, in torch ops with no host sync: the same windows, the same
    float64 accumulation, the same dtypes out.

    Args:
        torch: the torch module.
        next_pos, known: the ring's mirrors of `next_pos` and `valid` (the rows whose next observation is known).
        reward: the reward arena; terminal / truncation: arenas of the flags that end an episode with / without
            bootstrapping (device tensors indexed by ring position).
        pos: positions of the sampled rows (int64 device tensor).
        out_dtype: the torch dtype of the returns and discounts (`n_step_dtype` of the reward's dtype).

    Returns:
        (n_step_return, n_step_discount, position of each window's last step) as device tensors.
    """
    if k < 1:
        raise InvalidArgument(f"n_step must be >= 1, got {k}")
    if not 0.0 <= gamma <= 1.0:
        raise InvalidArgument(f"gamma must be in [0, 1], got {gamma}")
    ret = torch.zeros(pos.shape, dtype=torch.float64, device=pos.device)
    scale = torch.ones(pos.shape, dtype=torch.float64, device=pos.device)
    terminated = torch.zeros(pos.shape, dtype=torch.bool, device=pos.device)
    active = torch.ones(pos.shape, dtype=torch.bool, device=pos.device)
    cur = pos
    for j in range(k):
        ret = ret + torch.where(active, scale * reward.take(cur).to(torch.float64), 0.0)
        term = torch.zeros(pos.shape, dtype=torch.bool, device=pos.device)
        for flag in terminal:
            term = term | flag.take(cur).to(torch.bool)
        ended = term
        for flag in truncation:
            ended = ended | flag.take(cur).to(torch.bool)
        terminated = terminated | (active & term)
        scale = torch.where(active, scale * gamma, scale)
        if j == k - 1:
            break
        nxt = next_pos.take(cur)
        inside = (nxt >= 0) & (nxt < arena_rows)
        safe = torch.where(inside, nxt, 0)
        step_on = active & ~ended & inside & known.take(safe)
        cur = torch.where(step_on, nxt, cur)
        active = step_on
    discount = torch.where(terminated, 0.0, scale)
    return ret.to(out_dtype), discount.to(out_dtype), cur
