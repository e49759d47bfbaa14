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
import inspect
from typing import Any, cast

import numpy as np

from .errors import ArrowbufError, InvalidArgument
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
        # [cursor, skipped] in tier memory: the processes sharing a store share one queue
        self._state = index.tier.allocate("sampler.fifo", np.dtype(np.int64), 2)
        if index.tier.fresh:
            self._state[:] = 0

    @property
    def cursor(self) -> int:
        return int(self._state[0])

    @cursor.setter
    def cursor(self, value: int) -> None:
        self._state[0] = value

    @property
    def skipped(self) -> int:
        return int(self._state[1])

    @skipped.setter
    def skipped(self, value: int) -> None:
        self._state[1] = value

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


class LifoSampler(Sampler):
    """The newest `n` sampleable rows (a stack when combined with `max_times_sampled=1`)."""

    def select(self, n: int) -> tuple[np.ndarray, None] | None:
        idx = self.index
        hi, lo = idx.hi, idx.lo
        window = n
        while True:  # look back far enough to find n sampleable rows (pending rows are skipped)
            start = max(lo, hi - window)
            seqs = np.arange(start, hi, dtype=np.int64)
            seqs = seqs[idx.valid[seqs % idx.arena_rows]]
            if len(seqs) >= n:
                return seqs[-n:], None
            if start == lo:
                return None
            window *= 2


class PrioritizedSampler(Sampler):
    """Prioritized replay (Schaul et al. 2016): P(i) = p_i^alpha / sum_k p_k^alpha, with IS weights.

    New rows get the largest priority seen so far. Weights are `(N * P(i))^-beta` normalised by the largest possible
    weight, `(N * P_min)^-beta` (so max 1), N the number of sampleable rows. Selection uses a vectorised sum tree
    (stratified draws, one segment per item) and a min tree for P_min; both are O(log N) numpy steps per batch.

    Args:
        alpha: priority exponent (0 = uniform).
        beta: importance-sampling exponent (0 = no correction, 1 = full).
        eps: added to every priority so none is zero.
        stratified: one draw per equal slice of the priority mass (lower variance) instead of iid draws.
    """

    def __init__(self, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6, stratified: bool = True) -> None:
        if alpha < 0 or beta < 0 or eps < 0:
            raise InvalidArgument(f"alpha, beta and eps must be >= 0, got {alpha}, {beta}, {eps}")
        self.alpha, self.beta, self.eps, self.stratified = float(alpha), float(beta), float(eps), stratified

    def bind(self, index: RingIndex, rng: np.random.Generator) -> None:
        from .sumtree import MinTree, SumTree

        super().bind(index, rng)
        # trees and [max_priority, count] in tier memory: the processes of a shared store sample one distribution
        tier, rows = index.tier, index.arena_rows
        nodes = SumTree.nodes(rows)
        self.sum_tree = SumTree(rows, tier.allocate("sampler.prioritized.sum", np.dtype(np.float64), nodes),
                                shared=tier.shared)
        self.min_tree = MinTree(rows, tier.allocate("sampler.prioritized.min", np.dtype(np.float64), nodes),
                                shared=tier.shared)
        self._state = tier.allocate("sampler.prioritized.state", np.dtype(np.float64), 2)
        if tier.fresh:
            self.sum_tree.clear()
            self.min_tree.clear()
            self._state[:] = (1.0, 0.0)

    @property
    def max_priority(self) -> float:
        return float(self._state[0])

    @max_priority.setter
    def max_priority(self, value: float) -> None:
        self._state[0] = value

    @property
    def count(self) -> int:
        return int(self._state[1])

    @count.setter
    def count(self, value: int) -> None:
        self._state[1] = value

    def on_valid(self, positions: np.ndarray) -> None:
        value = np.full(len(positions), self.max_priority ** self.alpha)
        self.sum_tree.update(positions, value)
        self.min_tree.update(positions, value)
        self.count += len(positions)

    def on_invalid(self, positions: np.ndarray) -> None:
        self.sum_tree.update(positions, np.zeros(len(positions)))
        self.min_tree.update(positions, np.full(len(positions), np.inf))
        self.count -= len(positions)

    def select(self, n: int) -> tuple[np.ndarray, np.ndarray] | None:
        total = self.sum_tree.total()
        if self.count <= 0 or total <= 0:
            return None
        pos = self.sum_tree.sample(n, self.rng, stratified=self.stratified)
        order = np.argsort(pos, kind="stable")
        pos = pos[order]
        return self.index.seqs_of(pos), self.weights(pos, total)

    def weights(self, positions: np.ndarray, total: float | None = None) -> np.ndarray:
        """Importance-sampling weights of rows at `positions` (max possible weight = 1)."""
        total = self.sum_tree.total() if total is None else total
        p = self.sum_tree.get(positions) / total
        p_min = self.min_tree.min() / total
        w = (p / p_min) ** (-self.beta)
        return w.astype(np.float32)

    def probabilities(self, positions: np.ndarray) -> np.ndarray:
        return self.sum_tree.get(positions) / self.sum_tree.total()

    def update_priorities(self, positions: np.ndarray, priorities: np.ndarray) -> None:
        p = np.asarray(priorities, dtype=np.float64) + self.eps
        if len(p):
            self.max_priority = max(self.max_priority, float(p.max()))
        valid = self.index.valid[positions]  # removed rows keep priority 0
        value = p[valid] ** self.alpha
        self.sum_tree.update(positions[valid], value)
        self.min_tree.update(positions[valid], value)

    def describe(self) -> dict[str, Any]:
        return {"sampler": "PrioritizedSampler", "alpha": self.alpha, "beta": self.beta,
                "max_priority": self.max_priority, "priority_sum": self.sum_tree.total()}


class SequenceSampler(Sampler):
    """Windows of consecutive steps inside one episode, never crossing an episode boundary.

    A window is `burn_in + length` steps starting at a row whose step index is a multiple of `stride`; batches come
    back shaped [B, burn_in + length, ...] (the first `burn_in` steps warm up a recurrent state). Steps follow each
    row's successor in its episode, so interleaved actors are fine. Start rows are drawn uniformly, or by priority
    with `priority=Prioritized(...)` (a window's priority is its start row's priority); draws whose window is not
    (yet) complete are redrawn, so the distribution is the one over complete windows.
    """

    def __init__(self, length: int, stride: int = 1, burn_in: int = 0,
                 priority: "PrioritizedSampler | None" = None) -> None:
        if length < 1 or stride < 1 or burn_in < 0:
            raise InvalidArgument(f"need length >= 1, stride >= 1, burn_in >= 0; got {length}, {stride}, {burn_in}")
        self.length, self.stride, self.burn_in = int(length), int(stride), int(burn_in)
        self.window = self.length + self.burn_in
        self.priority = priority

    def bind(self, index: RingIndex, rng: np.random.Generator) -> None:
        super().bind(index, rng)
        self.starts: Sampler = self.priority if self.priority is not None else UniformSampler()
        self.starts.bind(index, rng)

    def on_valid(self, positions: np.ndarray) -> None:
        self.starts.on_valid(positions)

    def on_invalid(self, positions: np.ndarray) -> None:
        self.starts.on_invalid(positions)

    def update_priorities(self, positions: np.ndarray, priorities: np.ndarray) -> None:
        self.starts.update_priorities(positions, priorities)

    def windows(self, start_pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions [B, window] following each start's successors, and a mask of complete windows."""
        idx = self.index
        pos = np.empty((len(start_pos), self.window), dtype=np.int64)
        pos[:, 0] = start_pos
        ok = idx.step[start_pos] % self.stride == 0
        cur = start_pos
        for j in range(1, self.window):
            nxt = idx.next_pos[cur]
            inside = (nxt >= 0) & (nxt < idx.arena_rows)
            cur = np.where(inside, nxt, cur)
            ok &= inside
            pos[:, j] = cur
        ok &= idx.valid[cur]
        return pos, ok

    def select(self, n: int) -> tuple[np.ndarray, np.ndarray | None] | None:
        idx = self.index
        out_pos = np.empty((n, self.window), dtype=np.int64)
        out_w = np.ones(n, dtype=np.float32) if self.priority is not None else None
        need = np.arange(n)
        for _ in range(64):
            got = self.starts.select(len(need))
            if got is None:
                return None
            seqs, w = got
            pos, ok = self.windows(seqs % idx.arena_rows)
            k = int(ok.sum())
            out_pos[need[:k]] = pos[ok]
            if out_w is not None and w is not None:
                out_w[need[:k]] = w[ok]
            need = need[k:]
            if len(need) == 0:
                lo_pos = idx.lo % idx.arena_rows
                return idx.lo + (out_pos - lo_pos) % idx.arena_rows, out_w
        return None

    def describe(self) -> dict[str, Any]:
        return {"sampler": "SequenceSampler", "length": self.length, "stride": self.stride,
                "burn_in": self.burn_in, **({"priority": self.priority.describe()} if self.priority else {})}


# Short names for the namespace: ab.samplers.Uniform, ab.samplers.Fifo, ...
Uniform = UniformSampler
Fifo = FifoSampler
Lifo = LifoSampler
Prioritized = PrioritizedSampler
Sequence = SequenceSampler

_BY_NAME = {"uniform": UniformSampler, "fifo": FifoSampler, "lifo": LifoSampler, "prioritized": PrioritizedSampler}


def make_sampler(spec: str | Sampler | None) -> Sampler:
    """A sampler from a name ("uniform", "fifo", ...) or an instance."""
    if spec is None:
        return UniformSampler()
    if isinstance(spec, Sampler):
        return spec
    if isinstance(spec, type) and issubclass(spec, Sampler) and not inspect.isabstract(spec):
        return cast(Sampler, spec())
    if isinstance(spec, str) and spec.lower() in _BY_NAME:
        return cast(Sampler, cast(Any, _BY_NAME[spec.lower()])())
    raise InvalidArgument(f"unknown sampler {spec!r}; expected one of {sorted(_BY_NAME)} or an ab.samplers instance")


__all__ = ["Sampler", "UniformSampler", "FifoSampler", "LifoSampler", "PrioritizedSampler", "SequenceSampler",
           "Uniform", "Fifo", "Lifo", "Prioritized", "Sequence", "make_sampler"]
