"""How a sharded sample splits its rows over the shards: counts whose expectation is exact in each shard's sampling
mass (the global distribution over all shards is the one a single store would sample), with the least variance
(`allocate`) or over at most `fanout` shards (`allocate_fanout`, fewer calls per batch)."""

from __future__ import annotations

import numpy as np


def allocate(n: int, masses: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Counts summing to `n` with `E[count_k] = n * m_k / sum(m)` (systematic sampling: each count is within one
    of its expectation, so a batch splits with the least variance that keeps the expectation exact)."""
    masses = np.maximum(np.asarray(masses, dtype=np.float64), 0.0)
    total = masses.sum()
    if total <= 0:
        return np.zeros(len(masses), dtype=np.int64)
    cum = np.concatenate([[0.0], np.cumsum(masses) / total * n])
    edges = np.floor(cum + rng.random()).astype(np.int64)
    edges[0], edges[-1] = 0, n  # floor(u) == 0 and floor(n + u) == n for u in [0, 1), whatever the rounding
    return np.diff(edges)


def allocate_fanout(n: int, masses: np.ndarray, fanout: int, rng: np.random.Generator) -> np.ndarray:
    """Counts over at most `fanout` shards: `fanout` draws of a shard with probability `m_k / sum(m)`, each bringing
    `n / fanout` rows (the remainder spread one row each over the first draws). `E[count_k] = n * m_k / sum(m)`."""
    masses = np.maximum(np.asarray(masses, dtype=np.float64), 0.0)
    picks = rng.choice(len(masses), size=fanout, p=masses / masses.sum())
    share = np.full(fanout, n // fanout, dtype=np.int64)
    share[rng.permutation(fanout)[: n % fanout]] += 1  # which draws carry the remainder: at random (unbiased)
    return np.bincount(picks, weights=share, minlength=len(masses)).astype(np.int64)
