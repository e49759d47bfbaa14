"""The sampler interface (`Sampler`): which items a sample returns.

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

"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from ..errors import InvalidArgument
from ..ring.index import RingIndex

#: Largest priority `update_priorities` accepts: far above any TD error, far below where sums of many priorities (or
#: their `alpha` powers) overflow float64.
MAX_PRIORITY = 1e100

# Largest sum-tree leaf (p^alpha): a tree of 2**40 such leaves still sums to a finite number.
MAX_LEAF = 1e250


def validate_priorities(indices: Any, priorities: Any) -> tuple[np.ndarray, np.ndarray]:
    """Check a priority update before anything is applied: the one copy of this check in arrowbuf.

    Args:
        indices: item ids (any integer array-like, a torch tensor on any device too; flattened).
        priorities: one priority per id (flattened).

    Returns:
        (ids as int64, priorities as float64), both 1-D.

    Raises:
        InvalidArgument: the counts differ, or a priority is NaN, infinite, negative or above `MAX_PRIORITY`.
    """
    ids = np.asarray(_host(indices), dtype=np.int64).reshape(-1)
    pri = np.asarray(_host(priorities), dtype=np.float64).reshape(-1)
    if len(ids) != len(pri):
        raise InvalidArgument(f"{len(ids)} indices but {len(pri)} priorities; pass one priority per index")
    if len(pri) and not ((pri >= 0).all() and (pri <= MAX_PRIORITY).all()):  # NaN fails both comparisons
        bad = pri[~((pri >= 0) & (pri <= MAX_PRIORITY))]
        raise InvalidArgument(f"priorities must be finite, >= 0 and <= {MAX_PRIORITY:g}; got {bad[:3].tolist()}"
                              f"{' ...' if len(bad) > 3 else ''} among {len(pri)}: pass e.g. |TD error|, "
                              "and check the learner for NaN/inf; nothing was applied")
    return ids, pri


def _host(values: Any) -> Any:
    """A torch tensor's values in host memory (a device tensor is copied back: the caller waits for the device), so
    that a journal or a host sampler can take the ids and priorities of a device batch; anything else as it is."""
    if type(values).__module__.startswith("torch"):
        return values.detach().cpu().numpy()
    return values


class Sampler(abc.ABC):
    """Selects items from a store's ring index.

    A sampler instance binds to one store (`bind`); pass a fresh instance to each store. Subclasses set up their
    state in `_on_bind`.
    """

    #: True when each item is delivered once (a queue); rate limiting then also blocks on an empty queue.
    queue: bool = False
    #: The name specs record this class under (checkpoints, shared-memory manifests: `arrowbuf.samplers.spec`);
    #: empty for classes that cannot be recorded.
    spec_name: ClassVar[str] = ""
    #: Capability: delivers whole groups of `size` rows (`consume` then counts groups, shards keep groups whole).
    whole_groups: ClassVar[bool] = False
    #: Capability: its state lives in this process's heap, so a store in shared memory cannot use it.
    process_local: ClassVar[bool] = False

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


class StatelessSampler(Sampler):
    """A sampler whose only state is the index it reads (nothing to checkpoint)."""

    def state(self, positions: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        return {}, {}

    def load_state(self, positions: np.ndarray, meta: dict[str, Any], arrays: dict[str, np.ndarray],
                   dropped_valid: int = 0) -> None:
        pass
