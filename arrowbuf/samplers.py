"""Samplers: which items a sample returns.

A sampler selects rows (by seq) from the store's `RingIndex`; the store calls it under its lock and gathers the data.
Usage loop (what the store does)::

    sampler.bind(index, rng)
    sampler.on_valid(positions)      # rows became sampleable (committed, next observation known)
    sampler.on_invalid(positions)    # rows stopped being sampleable (evicted, removed)
    seqs, weights = sampler.select(n)   # None when nothing can be served now
    sampler.on_sampled(seqs)         # after the batch is gathered
    sampler.update_priorities(positions, priorities)

Exported in `arrowbuf.samplers` as `Uniform`, `Fifo`, ...; `ExperienceStore(sampler="uniform" | "fifo" | instance)`.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from .errors import ArrowbufError
from .index import RingIndex


class Sampler(abc.ABC):
    """Selects items from a store's ring index."""

    #: True when each item is delivered once (a queue); rate limiting then also blocks on an empty queue.
    queue: bool = False

    def bind(self, index: RingIndex, rng: np.random.Generator) -> None:
        """Attach to a store's index; called once by the store."""
        self.index = index
        self.rng = rng

    def on_valid(self, positions: np.ndarray) -> None:
        """Rows at `positions` became sampleable."""

    def on_invalid(self, positions: np.ndarray) -> None:
        """Rows at `positions` stopped being sampleable."""

    @abc.abstractmethod
    def select(self, n: int) -> tuple[np.ndarray, np.ndarray | None] | None:
        """Choose `n` items: (seqs, importance weights or None), or None when they cannot be served now."""

    def on_sampled(self, seqs: np.ndarray) -> None:
        """The batch of `seqs` was delivered."""

    def available(self) -> int:
        """Items that could be selected now (an estimate for with-replacement samplers)."""
        return len(self.index)

    def update_priorities(self, positions: np.ndarray, priorities: np.ndarray) -> None:
        raise ArrowbufError(f"{type(self).__name__} has no priorities; use samplers.Prioritized(...)")

    def describe(self) -> dict[str, Any]:
        return {"sampler": type(self).__name__}


class UniformSampler(Sampler):
    """Uniform over sampleable rows, with replacement. Indices come back sorted by position (a faster gather)."""

    def select(self, n: int) -> tuple[np.ndarray, None] | None:
        idx = self.index
        lo, hi = idx.lo, idx.hi
        if hi <= lo:
            return None
        seqs = self.rng.integers(lo, hi, size=n, dtype=np.int64)
        pos = seqs % idx.arena_rows
        ok = idx.valid[pos]
        for _ in range(16):
            if ok.all():
                break
            bad = np.flatnonzero(~ok)
            seqs[bad] = self.rng.integers(lo, hi, size=len(bad), dtype=np.int64)
            pos[bad] = seqs[bad] % idx.arena_rows
            ok[bad] = idx.valid[pos[bad]]
        else:
            # most rows are not sampleable (e.g. many pending episodes): draw from the explicit list
            cand = idx.valid_seqs()
            if len(cand) == 0:
                return None
            seqs = cand[self.rng.integers(0, len(cand), size=n)]
            pos = seqs % idx.arena_rows
        pos.sort()
        return idx.seqs_of(pos), None

    def available(self) -> int:
        return len(self.index)


class FifoSampler(Sampler):
    """A queue: each item delivered once, in insert order. Items evicted before delivery are skipped (counted)."""

    queue = True

    def bind(self, index: RingIndex, rng: np.random.Generator) -> None:
        super().bind(index, rng)
        self.cursor = 0
        self.skipped = 0

    def _advance_past_evicted(self) -> None:
        if self.cursor < self.index.lo:
            self.skipped += self.index.lo - self.cursor
            self.cursor = self.index.lo

    def _ready(self, limit: int) -> int:
        """Rows from the cursor that are sampleable, contiguous, up to `limit`."""
        idx = self.index
        stop = min(idx.hi, self.cursor + limit)
        if stop <= self.cursor:
            return 0
        valid = idx.valid[np.arange(self.cursor, stop, dtype=np.int64) % idx.arena_rows]
        if valid.all():
            return stop - self.cursor
        return int(np.argmin(valid))

    def select(self, n: int) -> tuple[np.ndarray, None] | None:
        self._advance_past_evicted()
        if self._ready(n) < n:
            return None
        seqs = np.arange(self.cursor, self.cursor + n, dtype=np.int64)
        self.cursor += n
        return seqs, None

    def available(self) -> int:
        self._advance_past_evicted()
        return self._ready(self.index.hi - self.cursor)

    def describe(self) -> dict[str, Any]:
        return {"sampler": "FifoSampler", "cursor": self.cursor, "skipped_evicted": self.skipped}


# Short names for the namespace: ab.samplers.Uniform, ab.samplers.Fifo, ...
Uniform = UniformSampler
Fifo = FifoSampler

_BY_NAME = {"uniform": UniformSampler, "fifo": FifoSampler}


def make_sampler(spec: str | Sampler | None) -> Sampler:
    """A sampler from a name ("uniform", "fifo", ...) or an instance."""
    if spec is None:
        return UniformSampler()
    if isinstance(spec, Sampler):
        return spec
    if isinstance(spec, type) and issubclass(spec, Sampler):
        return spec()
    if isinstance(spec, str) and spec.lower() in _BY_NAME:
        return _BY_NAME[spec.lower()]()
    raise ValueError(f"unknown sampler {spec!r}; expected one of {sorted(_BY_NAME)} or an ab.samplers instance")


__all__ = ["Sampler", "UniformSampler", "FifoSampler", "Uniform", "Fifo", "make_sampler"]
