"""Prioritized experience replay: items drawn proportionally to (p + eps)^alpha over sum trees, with
importance-sampling weights normalised by the smallest probability in the buffer."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidArgument
from .base import MAX_LEAF, Sampler


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

    spec_name = "prioritized"

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
        if len(leaves) and not (leaves <= MAX_LEAF).all():  # NaN and inf fail too
            raise InvalidArgument(f"priorities up to {float(np.max(p)):g} give (p + eps)^alpha above {MAX_LEAF:g} "
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
