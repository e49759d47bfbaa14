"""Samplers: which items a sample returns.

A sampler selects items (rows by seq, or windows of rows) from the store's `RingIndex`; the store calls it under its
lock and gathers the data. Usage loop (what the store does)::

    sampler.bind(index, rng)         # once: a sampler instance serves one store (a second store raises)
    sampler.on_valid(positions)      # rows became sampleable (committed, next observation known)
    sampler.on_invalid(positions)    # rows stopped being sampleable (evicted, removed)
    seqs, weights = sampler.select(n)   # None when nothing can be served now
    sampler.on_sampled(seqs)         # after the batch is gathered
    sampler.update_priorities(positions, priorities)   # priorities checked first by `validate_priorities`
    sampler.mass(positions); sampler.total_mass(); sampler.min_mass()   # the sampling distribution, for placement

Sampling mass: every sampler states how likely each ring position is to be drawn, unnormalised, through `mass`
(1 per sampleable row for uniform, FIFO and LIFO sampling; the sum-tree leaf `p^alpha` for prioritized sampling; a
sequence sampler's start rows as its start distribution sees them), so callers never branch on sampler classes.

Importance-sampling weights (prioritized sampling) are `(P(i) / P_min)^-beta` with `P_min` the smallest positive
probability over the whole buffer, not over the batch: the largest weight a batch can hold is 1, and a batch whose
rows all have more than the smallest probability has its largest weight below 1. Items enter at the running maximum
priority seen by `update_priorities` (1.0 before any update). A priority of 0 gives probability 0 (with `eps=0`).

Exported in `arrowbuf.samplers` as `Uniform`, `Fifo`, ...; `ExperienceStore(sampler="uniform" | "fifo" | instance)`.
"""

from __future__ import annotations

import abc
import inspect
from typing import Any, Callable, cast

import numpy as np

from .errors import InvalidArgument
from .index import RingIndex

#: Largest priority `update_priorities` accepts: far above any TD error, far below where sums of many priorities (or
#: their `alpha` powers) overflow float64.
MAX_PRIORITY = 1e100

# Largest sum-tree leaf (p^alpha): a tree of 2**40 such leaves still sums to a finite number.
_MAX_LEAF = 1e250


def validate_priorities(indices: Any, priorities: Any) -> tuple[np.ndarray, np.ndarray]:
    """Check a priority update before anything is applied: the one copy of this check in arrowbuf.

    Args:
        indices: item ids (any integer array-like; flattened).
        priorities: one priority per id (flattened).

    Returns:
        (ids as int64, priorities as float64), both 1-D.

    Raises:
        InvalidArgument: the counts differ, or a priority is NaN, infinite, negative or above `MAX_PRIORITY`.
    """
    ids = np.asarray(indices, dtype=np.int64).reshape(-1)
    pri = np.asarray(priorities, dtype=np.float64).reshape(-1)
    if len(ids) != len(pri):
        raise InvalidArgument(f"{len(ids)} indices but {len(pri)} priorities; pass one priority per index")
    if len(pri) and not ((pri >= 0).all() and (pri <= MAX_PRIORITY).all()):  # NaN fails both comparisons
        bad = pri[~((pri >= 0) & (pri <= MAX_PRIORITY))]
        raise InvalidArgument(f"priorities must be finite, >= 0 and <= {MAX_PRIORITY:g}; got {bad[:3].tolist()}"
                              f"{' ...' if len(bad) > 3 else ''} among {len(pri)}: pass e.g. |TD error|, "
                              "and check the learner for NaN/inf; nothing was applied")
    return ids, pri


class Sampler(abc.ABC):
    """Selects items from a store's ring index.

    A sampler instance binds to one store (`bind`); pass a fresh instance to each store. Subclasses set up their
    state in `_on_bind`.
    """

    #: True when each item is delivered once (a queue); rate limiting then also blocks on an empty queue.
    queue: bool = False

    def bind(self, index: RingIndex, rng: np.random.Generator, *,
             has_next: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """Attach to a store's index; called once by the store.

        Args:
            index: the store's ring index.
            rng: the store's random generator.
            has_next: mask of ring positions whose row is stored with its next observation known, sampleable or not
                (rows `max_times_sampled` removed from sampling still serve as successors and window members);
                default: the sampleable rows.

        Raises:
            InvalidArgument: the sampler is already bound to another store.
        """
        bound = getattr(self, "index", None)
        if bound is not None:
            if bound is index:
                return
            raise InvalidArgument(f"this {type(self).__name__} instance already serves another store; a sampler "
                                  "binds to one store: pass a new instance (e.g. ab.samplers.Prioritized(...)) "
                                  "to each store")
        self.index = index
        self.rng = rng
        self.has_next: Callable[[np.ndarray], np.ndarray] = (
            has_next if has_next is not None else index.valid.__getitem__)
        self._on_bind()

    def _on_bind(self) -> None:
        """Set up per-store state (after `index`, `rng` and `has_next` are set)."""

    def on_valid(self, positions: np.ndarray) -> None:
        """Rows at `positions` became sampleable."""

    def on_invalid(self, positions: np.ndarray) -> None:
        """Rows at `positions` stopped being sampleable."""

    @abc.abstractmethod
    def select(self, n: int, *, distinct: bool = False) -> tuple[np.ndarray, np.ndarray | None] | None:
        """Choose `n` items: (seqs, importance weights or None), or None when they cannot be served now.

        With `distinct=True` (a store with `max_times_sampled`) no item appears twice in the batch, and fewer than
        `n` eligible items means None: the store waits for more (up to its `timeout`), it never returns fewer.
        """

    def on_sampled(self, seqs: np.ndarray) -> None:
        """The batch of `seqs` was delivered."""

    def available(self) -> int:
        """Items that could be selected now (an estimate for with-replacement samplers)."""
        return len(self.index)

    def update_priorities(self, positions: np.ndarray, priorities: np.ndarray) -> None:
        """Set priorities of the rows at `positions` (checked by `validate_priorities`); prioritized samplers only."""
        raise InvalidArgument(f"{type(self).__name__} has no priorities; use samplers.Prioritized(...)")

    def mass(self, positions: np.ndarray) -> np.ndarray:
        """Unnormalised sampling weight of each ring position (float64; 0 for rows that cannot be drawn).

        The default: 1 per sampleable row (uniform over the sampleable rows).
        """
        return self.index.valid[np.asarray(positions, dtype=np.int64)].astype(np.float64)

    def total_mass(self) -> float:
        """Sum of `mass` over every ring position."""
        return float(np.count_nonzero(self.index.valid))

    def min_mass(self) -> float:
        """Smallest positive `mass` of any position (the denominator of IS weights); +inf when none is positive."""
        return 1.0 if self.total_mass() > 0 else float("inf")

    def state(self, positions: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """What a checkpoint keeps of this sampler for the rows at `positions` (`arrowbuf.persist`, docs/format.md):
        JSON-able scalars, and per-row arrays aligned with `positions`.

        Raises:
            InvalidArgument: the sampler does not say (a custom sampler without `state`/`load_state`).
        """
        raise InvalidArgument(f"{type(self).__name__} cannot be checkpointed yet: it defines no state()/load_state() "
                              "(arrowbuf's Uniform, Fifo, Lifo, Prioritized and Sequence samplers do)")

    def load_state(self, positions: np.ndarray, meta: dict[str, Any], arrays: dict[str, np.ndarray],
                   dropped_valid: int = 0) -> None:
        """Put back what `state` recorded, for the rows now at `positions` (a fresh store's sampler).

        Args:
            dropped_valid: sampleable rows of the checkpoint that were not restored.
        """
        raise InvalidArgument(f"{type(self).__name__} cannot be restored: it defines no load_state()")

    def describe(self) -> dict[str, Any]:
        return {"sampler": type(self).__name__}


class _StatelessSampler(Sampler):
    """A sampler whose only state is the index it reads (nothing to checkpoint)."""

    def state(self, positions: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        return {}, {}

    def load_state(self, positions: np.ndarray, meta: dict[str, Any], arrays: dict[str, np.ndarray],
                   dropped_valid: int = 0) -> None:
        pass


class UniformSampler(_StatelessSampler):
    """Uniform over sampleable rows, with replacement (without, when the store asks for distinct items). Indices come
    back sorted by position (a faster gather)."""

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
        return cast(np.ndarray, cand[self.rng.integers(0, len(cand), size=n)] % idx.arena_rows)

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
        return cast(np.ndarray, self.rng.choice(cand, size=n, replace=False) % idx.arena_rows)

    def available(self) -> int:
        return len(self.index)


class FifoSampler(Sampler):
    """A queue: each item delivered once, in insert order. Items evicted before delivery are skipped (counted).

    A row becomes sampleable once its next observation is known (the episode's next step arrived, or it ended). In
    the default strict order a row that is not yet sampleable holds back every later row: an idle actor's open step
    stalls the queue until that actor writes again or the ring evicts the row (`describe()["blocked_at"]` names the
    row). With `skip_pending=True` the queue delivers the oldest rows that are sampleable now and comes back for a
    skipped row once it becomes sampleable (if the ring has not evicted it): each row still once, in insert order
    among the rows ready at each sample, and no actor can stall the others.

    Args:
        skip_pending: serve around rows whose next observation has not arrived instead of waiting for them.
    """

    queue = True

    def __init__(self, skip_pending: bool = False) -> None:
        self.skip_pending = bool(skip_pending)

    def _on_bind(self) -> None:
        # [cursor, skipped, frontier] in tier memory: the processes sharing a store share one queue. With
        # skip_pending, `frontier` is one past the newest row delivered, every row below `cursor` is delivered or
        # evicted, and `_delivered[pos] == seq` marks the rows delivered between them.
        tier = self.index.tier
        self._state = tier.allocate("sampler.fifo", np.dtype(np.int64), 3)
        self._delivered = (tier.allocate("sampler.fifo.delivered", np.dtype(np.int64), self.index.arena_rows)
                           if self.skip_pending else np.zeros(0, np.int64))
        if tier.fresh:
            self._state[:] = 0
            self._delivered.fill(-1)

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

    @property
    def frontier(self) -> int:
        return max(int(self._state[2]), self.cursor)

    @frontier.setter
    def frontier(self, value: int) -> None:
        self._state[2] = value

    def _advance_past_evicted(self) -> None:
        lo = self.index.lo
        if self.cursor >= lo:
            return
        if self.skip_pending:  # rows behind the frontier may have been delivered out of order
            gone = np.arange(self.cursor, min(lo, self.frontier), dtype=np.int64)
            self.skipped += int(np.count_nonzero(self._delivered[gone % self.index.arena_rows] != gone))
            self.skipped += max(0, lo - self.frontier)
            self.frontier = max(self.frontier, lo)
        else:
            self.skipped += lo - self.cursor
        self.cursor = lo

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

    def _late(self) -> np.ndarray:
        """skip_pending: rows behind the frontier, skipped while pending, that are sampleable now (oldest first)."""
        idx = self.index
        back = np.arange(self.cursor, self.frontier, dtype=np.int64)
        bp = back % idx.arena_rows
        return back[idx.valid[bp] & (self._delivered[bp] != back)]

    def _fresh(self, n: int) -> np.ndarray:
        """skip_pending: up to `n` sampleable rows from the frontier on (oldest first)."""
        idx = self.index
        start, hi, window = self.frontier, idx.hi, max(n, 64)
        while True:
            seqs = np.arange(start, min(hi, start + window), dtype=np.int64)
            seqs = seqs[idx.valid[seqs % idx.arena_rows]]
            if len(seqs) >= n or start + window >= hi:
                return seqs[:n]
            window *= 2

    def select(self, n: int, *, distinct: bool = False) -> tuple[np.ndarray, None] | None:
        self._advance_past_evicted()
        if not self.skip_pending:
            if self._ready(n) < n:
                return None
            seqs = np.arange(self.cursor, self.cursor + n, dtype=np.int64)
            self.cursor += n
            return seqs, None
        late = self._late()[:n]
        fresh = self._fresh(n - len(late)) if len(late) < n else late[:0]
        if len(late) + len(fresh) < n:
            return None
        idx = self.index
        seqs = np.concatenate([late, fresh])
        self._delivered[seqs % idx.arena_rows] = seqs
        if len(fresh):
            self.frontier = int(fresh[-1]) + 1
        back = np.arange(self.cursor, self.frontier, dtype=np.int64)  # move the cursor over the delivered prefix
        open_ = self._delivered[back % idx.arena_rows] != back
        self.cursor = int(back[np.argmax(open_)]) if open_.any() else self.frontier
        return np.sort(seqs), None

    def _undelivered(self, seqs: np.ndarray) -> np.ndarray:
        """Mask: the rows `seqs` are sampleable and not yet delivered."""
        idx = self.index
        pos = seqs % idx.arena_rows
        ok = idx.valid[pos] & (seqs >= self.cursor)
        if self.skip_pending:
            ok &= self._delivered[pos] != seqs
        return ok

    def available(self) -> int:
        self._advance_past_evicted()
        if self.skip_pending:
            return int(np.count_nonzero(self._undelivered(np.arange(self.cursor, self.index.hi, dtype=np.int64))))
        return self._ready(self.index.hi - self.cursor)

    def mass(self, positions: np.ndarray) -> np.ndarray:
        """1 per sampleable row not yet delivered, else 0."""
        pos = np.asarray(positions, dtype=np.int64)
        return self._undelivered(self.index.seq[pos]).astype(np.float64)

    def total_mass(self) -> float:
        idx = self.index
        return float(np.count_nonzero(self._undelivered(np.arange(max(self.cursor, idx.lo), idx.hi, dtype=np.int64))))

    def state(self, positions: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta = {"cursor": self.cursor, "skipped": self.skipped}
        if not self.skip_pending:
            return meta, {}
        seqs = self.index.seq[positions]
        return {**meta, "frontier": self.frontier}, {"fifo_delivered": self._delivered[positions] == seqs}

    def load_state(self, positions: np.ndarray, meta: dict[str, Any], arrays: dict[str, np.ndarray],
                   dropped_valid: int = 0) -> None:
        self.cursor = int(meta["cursor"])
        self.skipped = int(meta["skipped"])
        if self.skip_pending:
            self.frontier = int(meta.get("frontier", self.cursor))
            done = positions[np.asarray(arrays.get("fifo_delivered", np.zeros(len(positions), bool)), bool)]
            self._delivered[done] = self.index.seq[done]

    def describe(self) -> dict[str, Any]:
        out = {"sampler": "FifoSampler", "cursor": self.cursor, "skipped_evicted": self.skipped}
        if self.skip_pending:
            out["skip_pending"] = True
        elif self.cursor < self.index.hi and not self.index.valid[self.cursor % self.index.arena_rows]:
            out["blocked_at"] = self.cursor  # the queue waits for this row's next observation
        return out


class LifoSampler(_StatelessSampler):
    """The newest `n` sampleable rows (a stack when combined with `max_times_sampled=1`)."""

    def select(self, n: int, *, distinct: bool = False) -> tuple[np.ndarray, None] | None:
        idx = self.index  # the newest n rows are always distinct
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

    New rows enter at the running maximum priority: the largest `priority + eps` any `update_priorities` has set
    (1.0 before the first update). Weights are `(N * P(i))^-beta` normalised by the largest possible weight,
    `(N * P_min)^-beta`, with `P_min` the smallest positive probability over the whole buffer (not the batch): so
    weights are at most 1, and a batch's largest weight is below 1 unless it holds a row of smallest probability.
    A priority of 0 (possible with `eps=0`) gives probability 0: the row is never drawn and does not count for
    `P_min`. Selection uses a vectorised sum tree (stratified draws, one segment per item) and a min tree (over
    positive leaves) for P_min; both are O(log N) numpy steps per batch.

    With a store's `max_times_sampled`, a batch holds distinct rows: draws repeat, without the rows already taken,
    until `n` distinct rows are found (sampling without replacement, in proportion to the remaining priority mass);
    fewer than `n` rows of positive priority means the store waits. Weights are those of P(i) above.

    Priorities are validated (`validate_priorities`: finite, >= 0, <= MAX_PRIORITY), and a priority whose
    `(p + eps)^alpha` exceeds 1e250 is refused, so the trees' sums stay finite; nothing of a refused update is
    applied.

    Args:
        alpha: priority exponent (0 = uniform over rows of positive priority).
        beta: importance-sampling exponent (0 = no correction, 1 = full).
        eps: added to every priority (so none is zero when eps > 0).
        stratified: one draw per equal slice of the priority mass (lower variance) instead of iid draws.
    """

    def __init__(self, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6, stratified: bool = True) -> None:
        if not (alpha >= 0 and beta >= 0 and eps >= 0) or not np.isfinite([alpha, beta, eps]).all():
            raise InvalidArgument(f"alpha, beta and eps must be finite and >= 0, got {alpha}, {beta}, {eps}")
        self.alpha, self.beta, self.eps, self.stratified = float(alpha), float(beta), float(eps), stratified

    def _on_bind(self) -> None:
        from .sumtree import MinTree, SumTree

        # trees and [max_priority, count] in tier memory: the processes of a shared store sample one distribution
        tier, rows = self.index.tier, self.index.arena_rows
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

    def _set(self, positions: np.ndarray, leaves: np.ndarray) -> None:
        """Set sum-tree leaves; the min tree holds only positive leaves (+inf elsewhere), so P_min is positive."""
        self.sum_tree.update(positions, leaves)
        self.min_tree.update(positions, np.where(leaves > 0, leaves, np.inf))

    def on_valid(self, positions: np.ndarray) -> None:
        value = self.max_priority ** self.alpha  # > 0: max_priority starts at 1.0 and only grows
        self.sum_tree.update(positions, value)
        self.min_tree.update(positions, value)
        self.count += len(positions)

    def on_invalid(self, positions: np.ndarray) -> None:
        self.sum_tree.update(positions, 0.0)
        self.min_tree.update(positions, np.inf)
        self.count -= len(positions)

    def select(self, n: int, *, distinct: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
        total = self.sum_tree.total()
        if self.count <= 0 or not total > 0:
            return None
        if distinct:
            found = self._distinct(n)
            if found is None:
                return None
            pos = found
        else:
            pos = self.sum_tree.sample(n, self.rng, stratified=self.stratified)
        pos.sort()
        return self.index.seqs_of(pos), self.weights(pos, total)

    def _distinct(self, n: int) -> np.ndarray | None:
        """`n` different positions, drawn in rounds; each round's rows are hidden from the next (their leaves set to
        0 for the duration, under the store's lock) and put back before returning."""
        tree = self.sum_tree
        chosen: list[np.ndarray] = []
        hidden: list[tuple[np.ndarray, np.ndarray]] = []
        got = 0
        try:
            while got < n:
                if not tree.total() > 0:
                    return None  # fewer than n rows of positive priority
                new = np.unique(tree.sample(n - got, self.rng, stratified=self.stratified))
                chosen.append(new)
                got += len(new)
                if got < n:
                    hidden.append((new, tree.get(new)))
                    tree.update(new, 0.0)
        finally:
            for p, v in reversed(hidden):
                tree.update(p, v)
        return np.concatenate(chosen)

    def weights(self, positions: np.ndarray, total: float | None = None) -> np.ndarray:
        """Importance-sampling weights of rows at `positions`: `(P(i) / P_min)^-beta`, P_min over the whole buffer."""
        total = self.sum_tree.total() if total is None else total
        p = self.sum_tree.get(positions) / total
        p_min = self.min_tree.min() / total
        w = (p / p_min) ** (-self.beta)
        return w.astype(np.float32)

    def probabilities(self, positions: np.ndarray) -> np.ndarray:
        return self.sum_tree.get(positions) / self.sum_tree.total()

    def update_priorities(self, positions: np.ndarray, priorities: np.ndarray) -> None:
        p = np.asarray(priorities, dtype=np.float64) + self.eps
        with np.errstate(over="ignore"):
            leaves = np.where(p > 0, p ** self.alpha, 0.0)
        if len(leaves) and not (leaves <= _MAX_LEAF).all():  # NaN and inf fail too
            raise InvalidArgument(f"priorities up to {float(np.max(p)):g} give (p + eps)^alpha above {_MAX_LEAF:g} "
                                  f"(alpha={self.alpha}): the priority sums would overflow; pass smaller priorities "
                                  "(e.g. |TD error| clipped); nothing was applied")
        if len(p):
            self.max_priority = max(self.max_priority, float(p.max()))
        valid = self.index.valid[positions]  # removed rows keep priority 0
        self._set(positions[valid], leaves[valid])

    def mass(self, positions: np.ndarray) -> np.ndarray:
        """The sum-tree leaf `(p + eps)^alpha` of each position (0 for rows that are not sampleable)."""
        return self.sum_tree.get(np.asarray(positions, dtype=np.int64)).astype(np.float64)

    def total_mass(self) -> float:
        return self.sum_tree.total()

    def min_mass(self) -> float:
        return self.min_tree.min()

    def state(self, positions: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        return ({"max_priority": self.max_priority, "count": self.count},
                {"priority_sum": self.sum_tree.get(positions), "priority_min": self.min_tree.get(positions)})

    def load_state(self, positions: np.ndarray, meta: dict[str, Any], arrays: dict[str, np.ndarray],
                   dropped_valid: int = 0) -> None:
        if len(positions):  # the min tree follows from the leaves (+inf where 0): priority_min is not trusted
            self._set(positions, np.asarray(arrays["priority_sum"], dtype=np.float64))
        self.max_priority = float(meta["max_priority"])
        self.count = int(meta["count"]) - dropped_valid

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

    The item is the window, named by its start row: `batch.indices` are start ids, `max_times_sampled` counts
    deliveries of each window (rows inside a delivered window stay available to the windows that start elsewhere),
    and with `max_times_sampled` a batch holds distinct windows. `mass` is the start distribution's.
    """

    def __init__(self, length: int, stride: int = 1, burn_in: int = 0,
                 priority: "PrioritizedSampler | None" = None) -> None:
        if length < 1 or stride < 1 or burn_in < 0:
            raise InvalidArgument(f"need length >= 1, stride >= 1, burn_in >= 0; got {length}, {stride}, {burn_in}")
        self.length, self.stride, self.burn_in = int(length), int(stride), int(burn_in)
        self.window = self.length + self.burn_in
        self.priority = priority

    def _on_bind(self) -> None:
        self.starts: Sampler = self.priority if self.priority is not None else UniformSampler()
        self.starts.bind(self.index, self.rng, has_next=self.has_next)

    def on_valid(self, positions: np.ndarray) -> None:
        self.starts.on_valid(positions)

    def on_invalid(self, positions: np.ndarray) -> None:
        self.starts.on_invalid(positions)

    def update_priorities(self, positions: np.ndarray, priorities: np.ndarray) -> None:
        self.starts.update_priorities(positions, priorities)

    def mass(self, positions: np.ndarray) -> np.ndarray:
        return self.starts.mass(positions)

    def total_mass(self) -> float:
        return self.starts.total_mass()

    def min_mass(self) -> float:
        return self.starts.min_mass()

    def state(self, positions: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta, arrays = self.starts.state(positions)
        return {"starts": meta}, arrays

    def load_state(self, positions: np.ndarray, meta: dict[str, Any], arrays: dict[str, np.ndarray],
                   dropped_valid: int = 0) -> None:
        self.starts.load_state(positions, meta["starts"], arrays, dropped_valid)

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
        ok &= self.has_next(cur)  # the last step's next observation is known (it may itself be a used-up start)
        return pos, ok

    def select(self, n: int, *, distinct: bool = False) -> tuple[np.ndarray, np.ndarray | None] | None:
        idx = self.index
        out_pos = np.empty((n, self.window), dtype=np.int64)
        out_w = np.ones(n, dtype=np.float32) if self.priority is not None else None
        need = np.arange(n)
        taken = np.empty(0, dtype=np.int64)
        for _ in range(64):
            got = self.starts.select(len(need), distinct=distinct)
            if got is None:
                return None
            seqs, w = got
            start_pos = seqs % idx.arena_rows
            pos, ok = self.windows(start_pos)
            if distinct and len(taken):
                ok &= ~np.isin(start_pos, taken)
            k = int(ok.sum())
            out_pos[need[:k]] = pos[ok]
            if out_w is not None and w is not None:
                out_w[need[:k]] = w[ok]
            if distinct:
                taken = np.concatenate([taken, start_pos[ok]])
            need = need[k:]
            if len(need) == 0:
                break
        else:
            # complete windows are rare among the start draws (e.g. most episodes shorter than a window): draw
            # the rest from the explicit list of complete windows, by the same start distribution
            if not self._select_listed(need, out_pos, out_w, taken if distinct else None):
                return None
        lo_pos = idx.lo % idx.arena_rows
        return idx.lo + (out_pos - lo_pos) % idx.arena_rows, out_w

    def _select_listed(self, need: np.ndarray, out_pos: np.ndarray, out_w: np.ndarray | None,
                       taken: np.ndarray | None) -> bool:
        """Fill rows `need` of `out_pos` (and `out_w`) from every complete window, drawn by start mass (O(capacity);
        fallback path only). With `taken` (distinct windows) no start repeats; False when too few windows exist."""
        start_pos = self.index.live_positions()
        m = self.starts.mass(start_pos)
        start_pos, m = start_pos[m > 0], m[m > 0]
        pos, ok = self.windows(start_pos)
        if taken is not None:
            ok &= ~np.isin(start_pos, taken)
        pos, m = pos[ok], m[ok]
        if len(pos) == 0 or (taken is not None and len(pos) < len(need)):
            return False
        pick = self.rng.choice(len(pos), size=len(need), replace=taken is None, p=m / m.sum())
        out_pos[need] = pos[pick]
        if out_w is not None and self.priority is not None:
            out_w[need] = self.priority.weights(pos[pick, 0])
        return True

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


__all__ = ["MAX_PRIORITY", "validate_priorities", "Sampler", "UniformSampler", "FifoSampler", "LifoSampler",
           "PrioritizedSampler", "SequenceSampler", "Uniform", "Fifo", "Lifo", "Prioritized", "Sequence",
           "make_sampler"]

# issue 16 (owner: consume): whole groups; arrowbuf/groups.py imports `Sampler` from this module, so this comes last
from .groups import Group, GroupSampler  # noqa: E402

__all__ += ["Group", "GroupSampler"]
