"""Vectorised sum and min segment trees for prioritized experience replay.

`SumTree` holds one non-negative priority per slot and draws slots with probability proportional to their
priority; `MinTree` tracks the smallest priority (for the maximum importance-sampling weight). Both take whole
batches: every method runs a fixed number of numpy calls per tree level, never a Python loop over items, so a
batch of 256 costs about as much as a batch of one.

Typical prioritized-replay loop (Schaul et al., 2016)::

    import numpy as np
    from arrowbuf.samplers.sumtree import MinTree, SumTree

    capacity, alpha, beta = 1_000_000, 0.6, 0.4
    sums, mins = SumTree(capacity), MinTree(capacity)
    rng = np.random.default_rng(0)

    # new transitions enter with the highest priority seen so far
    slots = np.arange(1024)
    sums.update(slots, np.ones(1024))
    mins.update(slots, np.ones(1024))

    for step in range(1000):
        idx = sums.sample(256, rng)                   # stratified over [0, total)
        probs = sums.get(idx) / sums.total()
        weights = (probs * len(slots)) ** -beta
        weights /= (mins.min() / sums.total() * len(slots)) ** -beta
        td_error = ...                                # learner step, one |TD error| per sample
        prio = (np.abs(td_error) + 1e-6) ** alpha
        sums.update(idx, prio)
        mins.update(idx, prio)

Layout: a heap in one float64 array of size ``2 * P`` (``P`` = next power of two >= capacity): node ``i`` has
children ``2i`` and ``2i + 1`` and the leaves are ``P .. 2P - 1``; slots ``>= capacity`` hold the neutral element
(0 for sums, +inf for minima). Only the levels from depth ``D = min(depth, 11)`` down are kept as binary nodes,
each exactly ``left + right`` (or ``min``) of its children; the ``2**D`` nodes at depth ``D`` are summarised by
one numpy call (a cumulative sum, or a min) the first time a query needs it after an update, and `total` /
`min` read that summary. A search therefore costs one ``np.searchsorted`` over the summary plus one vectorised
step per level below it (9 steps for a million slots), and an update one step per level below ``D``; the ``D``
levels above it, which every update would touch, are never written.

Not thread-safe: guard a tree with a lock when several threads update or sample it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import InvalidArgument

__all__ = ["MinTree", "SumTree"]

# Depth of the summarised level: 2**11 = 2048 nodes. One cumulative sum over them costs about as much as two
# binary levels of search + update for a batch of a few hundred, so deeper would not pay.
_SUMMARY_DEPTH = 11

# Batches up to this size update ancestors without de-duplicating them (fewer numpy calls); larger ones
# de-duplicate per level and rebuild whole levels once they are mostly touched.
_SMALL_BATCH = 2048

# Bit pattern of +inf as an unsigned integer.
_INF_BITS = np.float64(np.inf).view(np.uint64)

# Targets are clamped below total * (1 - _CLAMP_EPS) so that a target can never fall past the last leaf.
_CLAMP_EPS = 1e-12


def _as_slots(indices: np.ndarray) -> np.ndarray:
    """Indices as an int64 array; floats and booleans are refused rather than truncated or read as masks."""
    idx = np.asarray(indices)
    if idx.dtype != np.int64:
        if idx.dtype.kind not in "iu" and idx.size:
            raise TypeError(f"slot indices must be integers, got dtype {idx.dtype}")
        idx = idx.astype(np.int64)
    return idx


class _SegmentTree:
    """Shared storage and batched update of a binary segment tree with a flat summary level.

    Args:
        capacity: Number of leaves (slots), at least 1.
        neutral: Value of an empty leaf (0.0 for sums, +inf for minima).
        tree: Storage of `nodes(capacity)` float64 values to use instead of a new array (e.g. shared memory);
            the caller initialises it (`clear()` does).
        shared: Other processes update the same storage: recompute the summary on every query (no cache).
    """

    _combine: np.ufunc

    @staticmethod
    def nodes(capacity: int) -> int:
        """Length of the storage array a tree of `capacity` slots uses."""
        return 2 << (int(capacity) - 1).bit_length()

    def __init__(self, capacity: int, neutral: float, tree: np.ndarray | None = None, shared: bool = False) -> None:
        capacity = int(capacity)
        if capacity < 1:
            raise InvalidArgument(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._depth = (capacity - 1).bit_length()  # leaves at depth L, P = 2**L
        self._leaf_base = 1 << self._depth
        self._summary_depth = min(self._depth, _SUMMARY_DEPTH)
        self._neutral = float(neutral)
        if tree is None:
            tree = np.full(2 * self._leaf_base, self._neutral, dtype=np.float64)
        elif tree.shape != (2 * self._leaf_base,) or tree.dtype != np.float64:
            raise InvalidArgument(f"tree storage must be float64[{2 * self._leaf_base}], "
                                  f"got {tree.dtype}{list(tree.shape)}")
        self._tree = tree
        self._tree_mv: Any = tree.data  # one-slot updates go through it (Python floats: ~3x cheaper each)
        self._shared = bool(shared)
        self._pairs = self._tree.view(np.complex128)
        # Heights of the binary levels kept below the summary level, as a column for one broadcast shift.
        self._shifts = np.arange(1, self._depth - self._summary_depth + 1, dtype=np.int64)[:, None]
        self._summary_level = self._tree[1 << self._summary_depth : 2 << self._summary_depth]
        self._stale = True

    @property
    def capacity(self) -> int:
        """Number of slots."""
        return self._capacity

    def __len__(self) -> int:
        return self._capacity

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self._capacity})"

    def _check_values(self, values: np.ndarray) -> None:
        raise NotImplementedError

    def _check_one(self, value: float) -> None:
        raise NotImplementedError

    @staticmethod
    def _combine_one(left: float, right: float) -> float:
        raise NotImplementedError

    def _refresh(self) -> None:
        raise NotImplementedError

    def _update_one(self, index: int, value: float) -> None:
        """`update` of one slot with scalar steps: a store's append sets one leaf at a time, and a few Python
        scalar operations per level cost less than the batch path's numpy calls. Same results, bit for bit."""
        if not 0 <= index < self._capacity:
            raise IndexError(f"index {index} is out of range for capacity {self._capacity}")
        self._check_one(value)
        tree = self._tree_mv
        p = index + self._leaf_base
        tree[p] = value
        if self._neutral == 0.0:  # a sum tree: the combine inlined (a call per level costs as much as the level)
            for _ in range(self._shifts.size):
                p >>= 1
                q = p + p
                tree[p] = tree[q] + tree[q + 1]
        else:
            combine = self._combine_one
            for _ in range(self._shifts.size):
                p >>= 1
                tree[p] = combine(tree[2 * p], tree[2 * p + 1])
        self._stale = True

    def update(self, indices: np.ndarray, values: np.ndarray | float) -> None:
        """Set the values of a batch of slots and recompute their ancestors.

        Args:
            indices: Slot numbers in ``[0, capacity)``, any integer dtype, any order; when a slot appears more
                than once the last write wins.
            values: One value per index (float64), or a scalar for all of them.

        Raises:
            IndexError: An index is outside ``[0, capacity)``.
            TypeError: The indices are not integers.
            ValueError: Shapes differ, or a value is not allowed (see the subclass).
        """
        if type(indices) is np.ndarray and indices.shape == (1,) and indices.dtype.kind in "iu":
            if type(values) is float:  # a store's append: one slot, one Python float
                self._update_one(int(indices[0]), values)
                return
            one = np.asarray(values, dtype=np.float64)
            if one.size == 1:
                self._update_one(int(indices[0]), float(one.reshape(-1)[0]))
                return
        idx = _as_slots(indices)
        if idx.ndim != 1:
            idx = idx.reshape(-1)
        vals = np.asarray(values, dtype=np.float64)
        n = idx.size
        if vals.ndim == 0:
            vals = np.full(n, vals, dtype=np.float64)
        elif vals.ndim != 1 or vals.size != n:
            vals = vals.reshape(-1)
            if vals.size != n:
                raise InvalidArgument(f"got {n} indices but {vals.size} values")
        if n == 0:
            return
        self._check_values(vals)
        if n > 1 and np.count_nonzero(idx[1:] > idx[:-1]) != n - 1:
            # Not strictly ascending: sort, which puts repeats side by side with the last write of each slot
            # last (stable sort), and keep that one.
            order = np.argsort(idx, kind="stable")
            idx = idx[order]
            vals = vals[order]
            keep = idx[1:] != idx[:-1]
            if np.count_nonzero(keep) != n - 1:
                keep = np.append(keep, True)
                idx = idx[keep]
                vals = vals[keep]
        if idx[0] < 0 or idx[-1] >= self._capacity:
            bad = idx[0] if idx[0] < 0 else idx[-1]
            raise IndexError(f"index {bad} is out of range for capacity {self._capacity}")
        tree = self._tree
        pos = idx + self._leaf_base
        tree[pos] = vals
        if self._shifts.size and n <= _SMALL_BATCH:
            # Row h holds the ancestors h levels up (ascending, so the gathers walk memory in order). A parent
            # shared by several slots is written several times with the same value, which for a small batch is
            # cheaper than de-duplicating. _pairs[p] is the complex number tree[2p] + 1j * tree[2p + 1]: one
            # gather fetches both children.
            pairs, combine = self._pairs, self._combine
            for parents in pos >> self._shifts:
                children = pairs[parents]
                tree[parents] = combine(children.real, children.imag)
        elif self._shifts.size:
            self._update_bulk(pos)
        self._stale = True

    def _update_bulk(self, pos: np.ndarray) -> None:
        """Recompute the ancestors of many ascending leaf positions, level by level without repeats.

        Once the parents cover a good part of a level, the rest of the levels are rebuilt whole with one
        strided call each, which is what filling a large tree comes down to.
        """
        tree, pairs, combine = self._tree, self._pairs, self._combine
        parents = pos
        depth = self._depth
        while depth > self._summary_depth:
            depth -= 1
            parents = parents >> 1
            first = np.empty(parents.size, dtype=bool)
            first[0] = True
            np.not_equal(parents[1:], parents[:-1], out=first[1:])
            parents = parents[first]
            if 4 * parents.size >= 1 << depth:
                for d in range(depth, self._summary_depth - 1, -1):
                    lo, hi = 1 << d, 2 << d
                    combine(tree[2 * lo : 2 * hi : 2], tree[2 * lo + 1 : 2 * hi : 2], out=tree[lo:hi])
                return
            children = pairs[parents]
            tree[parents] = combine(children.real, children.imag)

    def get(self, indices: np.ndarray) -> np.ndarray:
        """Read the values of a batch of slots.

        Args:
            indices: Slot numbers in ``[0, capacity)``, any integer dtype and shape.

        Returns:
            float64 array of the same shape as ``indices``.

        Raises:
            IndexError: An index is outside ``[0, capacity)``.
            TypeError: The indices are not integers.
        """
        idx = _as_slots(indices)
        # One comparison catches both ends: negative numbers become huge as uint64.
        if idx.size and idx.reshape(-1).view(np.uint64).max() >= self._capacity:
            bad = idx[(idx < 0) | (idx >= self._capacity)].reshape(-1)[0]
            raise IndexError(f"index {bad} is out of range for capacity {self._capacity}")
        return self._tree[idx + self._leaf_base]

    def clear(self) -> None:
        """Reset every slot to the neutral value."""
        self._tree.fill(self._neutral)
        self._stale = True


class SumTree(_SegmentTree):
    """Sum segment tree: proportional sampling over ``capacity`` non-negative priorities.

    All slots start at 0 (never sampled). Priorities must be finite and >= 0.

    Args:
        capacity: Number of slots (up to tens of millions; memory is ``16 * P`` bytes, ``P`` the next power
            of two >= capacity).

    Example:
        >>> tree = SumTree(5)
        >>> tree.update(np.array([0, 3]), np.array([1.0, 3.0]))
        >>> tree.total()
        4.0
        >>> tree.find_prefixsum(np.array([0.5, 1.0, 3.9])).tolist()
        [0, 3, 3]
    """

    _combine = np.add

    def __init__(self, capacity: int, tree: np.ndarray | None = None, shared: bool = False) -> None:
        super().__init__(capacity, 0.0, tree, shared)
        n = self._summary_level.size
        # _prefix[j] = sum of summary nodes before node j; _prefix[n] = total.
        self._prefix = np.zeros(n + 1, dtype=np.float64)
        self._prefix_ends = self._prefix[1:]
        self._arange: np.ndarray = np.arange(0, dtype=np.float64)
        self._rng: np.random.Generator | None = None

    def _check_values(self, values: np.ndarray) -> None:
        # As unsigned integers, the bit patterns of +0.0 .. the largest float lie below that of +inf, while
        # negatives (sign bit), inf and NaN do not: one reduction. The exact test runs only when it trips, so
        # that -0.0 still passes.
        if values.view(np.uint64).max() >= _INF_BITS and not (values.min() >= 0.0 and math.isfinite(values.sum())):
            raise InvalidArgument("SumTree priorities must be finite and >= 0")

    def _check_one(self, value: float) -> None:
        if not 0.0 <= value < math.inf:  # NaN fails too; -0.0 passes
            raise InvalidArgument("SumTree priorities must be finite and >= 0")

    @staticmethod
    def _combine_one(left: float, right: float) -> float:
        return left + right

    def _refresh(self) -> None:
        np.cumsum(self._summary_level, out=self._prefix[1:])
        self._stale = False

    def total(self) -> float:
        """Sum of all priorities.

        Returns:
            The sum, as a Python float (0.0 for an empty tree).
        """
        if self._stale or self._shared:
            self._refresh()
        return float(self._prefix[-1])

    def find_prefixsum(self, targets: np.ndarray) -> np.ndarray:
        """Find, for each target mass, the slot whose prefix-sum interval contains it.

        For ``t`` in ``[0, total)`` this is the smallest slot ``i`` with ``sum(values[: i + 1]) > t``, i.e.
        ``np.searchsorted(np.cumsum(values), t, side="right")`` up to floating-point rounding. Targets are
        clamped into ``[0, total * (1 - 1e-12)]`` (and strictly below ``total`` however small it is), and the
        result never names a slot of priority 0 or one ``>= capacity``.

        Args:
            targets: float64 masses, any shape.

        Returns:
            int64 slot numbers, same shape as ``targets``.

        Raises:
            ValueError: The tree is empty (total is 0) or a target is NaN.
        """
        t = np.array(targets, dtype=np.float64)  # a copy: clamped in place
        shape = t.shape
        t = t.reshape(-1)
        total = self.total()
        if not total > 0.0:
            raise InvalidArgument("cannot search a SumTree whose total is 0")
        if np.isnan(t).any():
            raise InvalidArgument("targets must not be NaN")
        np.maximum(t, 0.0, out=t)
        np.minimum(t, self._upper(total), out=t)
        return self._find(t).reshape(shape)

    def sample(self, n: int, rng: np.random.Generator | None = None, *, stratified: bool = True) -> np.ndarray:
        """Draw ``n`` slots with probability proportional to their priority.

        Args:
            n: Number of draws.
            rng: Source of randomness; when None, a generator the tree creates once (unseeded).
            stratified: Split ``[0, total)`` into ``n`` equal segments and draw one uniform target in each
                (Schaul et al.): lower variance, and the slots come out (almost always) in ascending order.
                False draws ``n`` iid targets over ``[0, total)``.

        Returns:
            int64 array of ``n`` slot numbers (repeats possible).

        Raises:
            ValueError: The tree is empty (total is 0) or ``n < 0``.
        """
        n = int(n)
        if n < 0:
            raise InvalidArgument(f"n must be >= 0, got {n}")
        total = self.total()
        if not total > 0.0:
            raise InvalidArgument("cannot sample from a SumTree whose total is 0")
        if n == 0:
            return np.empty(0, dtype=np.int64)
        if rng is None:
            if self._rng is None:
                self._rng = np.random.default_rng()
            rng = self._rng
        t = rng.random(n)
        if stratified:
            if self._arange.size != n:
                self._arange = np.arange(n, dtype=np.float64)
            t += self._arange
            t *= total / n
        else:
            t *= total
        np.minimum(t, self._upper(total), out=t)
        return self._find(t)

    @staticmethod
    def _upper(total: float) -> float:
        """Largest target allowed: ``total * (1 - 1e-12)``, and strictly below ``total`` even when subnormal."""
        upper = total * (1.0 - _CLAMP_EPS)
        return upper if upper < total else math.nextafter(total, 0.0)

    def _find(self, targets: np.ndarray) -> np.ndarray:
        """Search 1-D targets in ``[0, _upper(total)]`` (the hot path of `sample`)."""
        # Summary node j covers [prefix[j], prefix[j + 1]); side="right" never lands on a zero-mass node, and
        # as every target is < prefix[-1] = total, never past the last node.
        node = np.searchsorted(self._prefix_ends, targets, side="right")
        t = targets - self._prefix[node]
        steps = self._shifts.size
        if steps:
            tree = self._tree
            greater_equal = np.greater_equal
            # From here node is the heap index of a left child; each step goes right when t >= its mass.
            node += self._summary_level.size
            node += node
            for _ in range(steps - 1):
                left = tree[node]
                right = greater_equal(t, left)
                left *= right
                t -= left
                node += right
                node += node
            node += greater_equal(t, tree[node])
            found = tree[node]
            node -= self._leaf_base
        else:
            found = self._summary_level[node]
        # Rounding can, rarely, carry a residual just past the end of its subtree and onto an empty slot
        # (padding slots >= capacity included): redo those few with the guarded search.
        if not found.min() > 0.0:
            bad = found <= 0.0
            node[bad] = self._find_guarded(targets[bad])
        return node

    def _find_guarded(self, t: np.ndarray) -> np.ndarray:
        """Slow-path search that only ever steps into nodes of positive mass; ``t`` is overwritten.

        Every kept node equals ``left + right`` of its children, computed in float64 from non-negative
        values, so a node of positive mass always has a child of positive mass: the walk ends on a leaf > 0.
        """
        prefix = self._prefix
        level = self._summary_level
        positive = np.flatnonzero(level > 0.0)  # not empty: the caller checked total > 0
        node = np.searchsorted(prefix[1:], t, side="right")
        np.minimum(node, positive[-1], out=node)
        zero = level[node] <= 0.0
        if np.count_nonzero(zero):  # defensive; searchsorted(side="right") should never pick these
            node[zero] = positive[np.maximum(np.searchsorted(positive, node[zero], side="right") - 1, 0)]
        t -= prefix[node]
        np.maximum(t, 0.0, out=t)
        node += level.size
        tree = self._tree
        for _ in range(self._shifts.size):
            left = tree[2 * node]
            right = tree[2 * node + 1]
            go_right = ((t >= left) & (right > 0.0)) | (left <= 0.0)
            t -= left * go_right
            node = 2 * node + go_right
        return node - self._leaf_base


class MinTree(_SegmentTree):
    """Min segment tree over ``capacity`` slots; empty slots hold +inf.

    Args:
        capacity: Number of slots.

    Example:
        >>> tree = MinTree(5)
        >>> tree.update(np.array([1, 4]), np.array([0.5, 0.25]))
        >>> tree.min()
        0.25
    """

    _combine = np.minimum

    def __init__(self, capacity: int, tree: np.ndarray | None = None, shared: bool = False) -> None:
        super().__init__(capacity, np.inf, tree, shared)
        self._min = np.inf

    def _check_values(self, values: np.ndarray) -> None:
        if np.isnan(values.min()):
            raise InvalidArgument("MinTree values must not be NaN")

    def _check_one(self, value: float) -> None:
        if value != value:
            raise InvalidArgument("MinTree values must not be NaN")

    @staticmethod
    def _combine_one(left: float, right: float) -> float:
        return left if left <= right else right

    def _refresh(self) -> None:
        self._min = float(self._summary_level.min())
        self._stale = False

    def min(self) -> float:
        """Smallest value over all slots.

        Returns:
            The minimum as a Python float; +inf when no slot was set.
        """
        if self._stale or self._shared:
            self._refresh()
        return self._min
