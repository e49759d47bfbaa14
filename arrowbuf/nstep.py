"""n-step returns, computed vectorised over a batch by following each row's successor in its episode.

For a sampled row t and horizon k: `n_step_return = sum_{j<m} gamma^j r_{t+j}` over the m <= k steps that exist in
the episode; `n_step_discount = gamma^m`, or 0 when the episode terminated within those steps (a truncated episode
still bootstraps); the bootstrap observation is the next observation of step t+m-1. When a successor has not arrived
yet (the episode is still being written), the window stops at the last step whose next observation is known.
"""

from __future__ import annotations

from .errors import InvalidArgument

import numpy as np

from .index import RingIndex


def n_step_returns(index: RingIndex, reward: np.ndarray, terminal: list[np.ndarray], truncation: list[np.ndarray],
                   pos: np.ndarray, k: int, gamma: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Returns (n_step_return, n_step_discount, position of each window's last step); k - 1 successor hops.

    Args:
        index: the store's ring index (successors, sampleability).
        reward: the reward arena; terminal / truncation: arenas of the flags that end an episode with / without
            bootstrapping.
        pos: arena positions of the sampled rows (each sampleable).
    """
    if k < 1:
        raise InvalidArgument(f"n_step must be >= 1, got {k}")
    if not 0.0 <= gamma <= 1.0:
        raise InvalidArgument(f"gamma must be in [0, 1], got {gamma}")
    b = len(pos)
    ret = np.zeros(b, dtype=np.float64)
    scale = np.ones(b, dtype=np.float64)       # gamma^j for the current step
    terminated = np.zeros(b, dtype=bool)
    cur = pos.copy()
    active = np.ones(b, dtype=bool)
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
        step_on[step_on] = index.valid[nxt[step_on]]  # the successor's own next observation must be known
        cur = np.where(step_on, nxt, cur)
        active = step_on
    discount = np.where(terminated, 0.0, scale)
    return ret.astype(np.float32), discount.astype(np.float32), cur
