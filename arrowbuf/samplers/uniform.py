"""Uniform sampling with replacement over the sampleable rows."""

from __future__ import annotations

from typing import cast

import numpy as np

from .base import StatelessSampler


class UniformSampler(StatelessSampler):
    """Uniform over sampleable rows, with replacement (without, when the store asks for distinct items). Indices come
    back sorted by position (a faster gather)."""

    spec_name = "uniform"

    def select(self, n: int, *, distinct: bool = False) -> tuple[np.ndarray, None] | None:
        idx = self.index
        lo, hi = idx.lo, idx.hi
        if hi <= lo or (distinct and hi - lo < n):
            return None
        if distinct:
            pos = self._distinct(n, lo, hi)
            if pos is None:
                return None
        else:
            pos = self._draw(n, lo, hi)
            if pos is None:
                return None
        pos.sort()
        return idx.seqs_of(pos), None

    def _draw(self, n: int, lo: int, hi: int) -> np.ndarray | None:
        """Positions of `n` sampleable rows, with replacement."""
        idx = self.index
        seqs = self.rng.integers(lo, hi, size=n, dtype=np.int64)
        pos = seqs % idx.arena_rows
        ok = idx.valid[pos]
        for _ in range(16):
            if ok.all():
                return pos
            bad = np.flatnonzero(~ok)
            seqs[bad] = self.rng.integers(lo, hi, size=len(bad), dtype=np.int64)
            pos[bad] = seqs[bad] % idx.arena_rows
            ok[bad] = idx.valid[pos[bad]]
        if ok.all():
            return pos
        # most rows are not sampleable (e.g. many pending episodes): draw from the explicit list
        cand = idx.valid_seqs()
        if len(cand) == 0:
            return None
        return cand[self.rng.integers(0, len(cand), size=n)] % idx.arena_rows

    def _distinct(self, n: int, lo: int, hi: int) -> np.ndarray | None:
        """Positions of `n` different sampleable rows (uniform without replacement), or None when fewer exist."""
        idx = self.index
        got = np.empty(0, dtype=np.int64)
        for _ in range(8):
            draw = self.rng.integers(lo, hi, size=2 * (n - len(got)) + 8, dtype=np.int64)
            draw = draw[idx.valid[draw % idx.arena_rows]]
            both = np.concatenate([got, draw])
            _, first = np.unique(both, return_index=True)
            got = both[np.sort(first)]  # draw order: the first n distinct draws are a uniform sample without repeats
            if len(got) >= n:
                return cast(np.ndarray, got[:n] % idx.arena_rows)
        cand = idx.valid_seqs()
        if len(cand) < n:
            return None
        return self.rng.choice(cand, size=n, replace=False) % idx.arena_rows

    def available(self) -> int:
        return len(self.index)
