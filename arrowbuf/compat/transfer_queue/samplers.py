"""TransferQueue's samplers (0.1.x signatures) on arrowbuf's grouping and balancing.

A sampler picks, from the ready global indexes of a partition (every required field produced, not yet consumed by
the task), the indexes to return and the indexes to mark consumed::

    sampled, consumed = sampler(ready, batch_size, task_name=..., partition_id=..., dp_rank=..., batch_index=...)

`GRPOGroupNSampler` selects whole groups with `arrowbuf.samplers.group.complete_groups` (a group is a block of
`n_samples_per_prompt` consecutive indexes starting at a multiple of n, the layout TransferQueue documents: the n
samples of a prompt are put one after another); `SeqlenBalancedSampler` splits the selected groups over `dp_size`
ranks with `arrowbuf.delivery.balance.partition` (Karmarkar-Karp on each sample's `total_lengths` tag, groups kept
whole); `RankAwareSampler` gives every rank of one data-parallel group the same indexes; `SequentialSampler` takes
the oldest ready indexes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from ...delivery.balance import partition as balanced_partition
from ...samplers.group import complete_groups

Pick = tuple[list[int], list[int]]


class BaseSampler(ABC):
    """TransferQueue's sampler interface: `sample(ready_indexes, batch_size, ...) -> (sampled, consumed)`."""

    def __init__(self) -> None:
        self._states: dict[Any, Any] = {}

    @abstractmethod
    def sample(self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any) -> Pick:
        """Pick `batch_size` of `ready_indexes`; returns (sampled, consumed), both lists of global indexes."""

    def __call__(self, *args: Any, **kwargs: Any) -> Pick:
        return self.sample(*args, **kwargs)

    def clear_cache(self, partition_id: str) -> None:
        """Forget cached picks of a partition (it was cleared)."""
        self._states.pop(partition_id, None)

    def _cached(self, partition_id: str, task_name: str, kwargs: dict[str, Any]) -> Pick | None:
        dp_rank, batch_index = kwargs.get("dp_rank"), kwargs.get("batch_index")
        if dp_rank is None:
            return None
        hit = self._states.get(partition_id, {}).get(task_name, {}).get(dp_rank, {}).get(batch_index)
        return None if hit is None else (list(hit), list(hit))

    def _cache(self, partition_id: str, task_name: str, kwargs: dict[str, Any], picked: list[int]) -> None:
        dp_rank, batch_index = kwargs.get("dp_rank"), kwargs.get("batch_index")
        if dp_rank is not None and picked:
            self._states.setdefault(partition_id, {}).setdefault(task_name, {}).setdefault(dp_rank, {})[
                batch_index] = list(picked)


class SequentialSampler(BaseSampler):
    """The first `batch_size` ready indexes (fewer when fewer are ready), consumed as sampled."""

    def sample(self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any) -> Pick:
        picked = list(ready_indexes[:batch_size])
        return picked, list(picked)


class RankAwareSampler(BaseSampler):
    """Ranks with the same `dp_rank` get the same indexes for the same `batch_index`; different `dp_rank`s get
    disjoint ones (the first caller's pick is consumed). Returns nothing until `batch_size` are ready."""

    def sample(self, ready_indexes: list[int], batch_size: int, dp_rank: int = 0, batch_index: int = 0,
               task_name: str = "", partition_id: str = "", *args: Any, **kwargs: Any) -> Pick:
        if dp_rank < 0:
            raise ValueError(f"dp_rank {dp_rank} must be greater than or equal to 0")
        kw = {"dp_rank": dp_rank, "batch_index": batch_index}
        hit = self._cached(partition_id, task_name, kw)
        if hit is not None:
            return hit[0], []
        picked = list(ready_indexes[:batch_size])
        if len(picked) < batch_size:
            return [], []
        self._cache(partition_id, task_name, kw, picked)
        return picked, list(picked)


class GRPOGroupNSampler(BaseSampler):
    """Whole groups of `n_samples_per_prompt` consecutive indexes (`batch_size` must be a multiple of n); nothing
    until `batch_size // n` complete groups are ready."""

    def __init__(self, n_samples_per_prompt: int = 1) -> None:
        super().__init__()
        if n_samples_per_prompt <= 0:
            raise ValueError(f"n_samples_per_prompt must be positive, got {n_samples_per_prompt}")
        self.n_samples_per_prompt = n_samples_per_prompt

    def groups(self, ready_indexes: list[int], batch_size: int) -> list[int]:
        n = self.n_samples_per_prompt
        if batch_size % n:
            raise ValueError(f"batch_size ({batch_size}) must be a multiple of n_samples_per_prompt ({n})")
        ready = np.sort(np.asarray(ready_indexes, dtype=np.int64))
        full = complete_groups(ready, ready // n, n)
        want = batch_size // n
        if len(full) < want:
            return []
        return [int(i) for i in full[:want].reshape(-1)]

    def sample(self, ready_indexes: list[int], batch_size: int, task_name: str = "", partition_id: str = "",
               *args: Any, **kwargs: Any) -> Pick:
        hit = self._cached(partition_id, task_name, kwargs)
        if hit is not None:
            return hit[0], []
        picked = self.groups(ready_indexes, batch_size)
        self._cache(partition_id, task_name, kwargs, picked)
        return picked, list(picked)


class SeqlenBalancedSampler(GRPOGroupNSampler):
    """GRPO groups for all `dp_size` ranks at once (`batch_size` is per rank), split so that each rank gets about
    the same number of tokens: a sample's weight is its `total_lengths` tag (1 without one); groups stay whole.
    Each `dp_rank` then receives its share for that `batch_index`."""

    def __init__(self, n_samples_per_prompt: int = 1, dp_size: int = 1) -> None:
        super().__init__(n_samples_per_prompt)
        if dp_size <= 0:
            raise ValueError(f"dp_size must be positive, got {dp_size}")
        self.dp_size = dp_size
        self._balanced: dict[tuple[str, str, Any], list[list[int]]] = {}

    def clear_cache(self, partition_id: str) -> None:
        super().clear_cache(partition_id)
        self._balanced = {k: v for k, v in self._balanced.items() if k[0] != partition_id}

    def sample(self, ready_indexes: list[int], batch_size: int, task_name: str = "", partition_id: str = "",
               *args: Any, **kwargs: Any) -> Pick:
        dp_rank = int(kwargs.get("dp_rank", 0))
        key = (partition_id, task_name, kwargs.get("batch_index", 0))
        if key in self._balanced:
            parts = self._balanced[key]
            return (list(parts[dp_rank]) if dp_rank < len(parts) else []), []
        picked = self.groups(ready_indexes, batch_size * self.dp_size)
        if not picked:
            return [], []
        tags = kwargs.get("tags")
        lengths = [float((tags(i) if tags else {}).get("total_lengths", 1)) for i in picked]
        arr = np.asarray(picked, dtype=np.int64)
        parts_pos = balanced_partition(np.asarray(lengths), self.dp_size, groups=arr // self.n_samples_per_prompt)
        parts = [[int(i) for i in arr[p]] for p in parts_pos]
        self._balanced[key] = parts
        return (list(parts[dp_rank]) if dp_rank < len(parts) else []), list(picked)


SAMPLERS: dict[str, type[BaseSampler]] = {
    "SequentialSampler": SequentialSampler, "RankAwareSampler": RankAwareSampler,
    "GRPOGroupNSampler": GRPOGroupNSampler, "SeqlenBalancedSampler": SeqlenBalancedSampler,
}


def make_sampler(spec: Any) -> BaseSampler:
    """A sampler from an instance, a class or a name (as TransferQueue's `controller.sampler` config takes)."""
    if isinstance(spec, BaseSampler):
        return spec
    if isinstance(spec, type) and issubclass(spec, BaseSampler):
        return spec()
    if isinstance(spec, str) and spec in SAMPLERS:
        return SAMPLERS[spec]()
    if spec is None:
        return SequentialSampler()
    if callable(getattr(spec, "sample", None)):
        return spec  # a TransferQueue sampler instance: same call signature
    raise ValueError(f"Could not find sampler {spec!r}; expected one of {sorted(SAMPLERS)} or a BaseSampler")
