"""TransferQueue 0.1.11's samplers, with its semantics (its public tests check them pick by pick).

A sampler picks, from the ready global indexes of a partition (every required field produced, not yet consumed by
the task), the indexes to return and the indexes to mark consumed::

    sampled, consumed = sampler(ready, batch_size, task_name=..., partition_id=..., dp_rank=..., batch_index=...,
                                partition=...)   # partition: an object with get_custom_meta(indexes) -> {i: dict}

- `SequentialSampler`: the first `batch_size` ready indexes.
- `GRPOGroupNSampler(n_samples_per_prompt)`: whole groups of n consecutive global indexes (the n samples of a
  prompt are put one after another), scanned from the lowest ready index; nothing until `batch_size // n` groups
  are ready. With a `dp_rank`, a pick is cached per (partition, task, dp_rank, batch_index).
- `RankAwareSampler`: the first rank of a data-parallel group to ask for a `batch_index` picks, the others of the
  same `dp_rank` get the same indexes.
- `SeqlenBalancedSampler(n_samples_per_prompt, dp_size)`: GRPO groups for all `dp_size` ranks at once, split by
  `get_seqlen_balanced_partitions` (Karmarkar-Karp) on each sample's `total_lengths` custom metadata so that every
  rank gets about the same number of tokens, groups kept whole.

Across processes (a system in a Ray actor or behind Flight) a sampler travels as `sampler_spec`: its class name and
its parameters, so `GRPOGroupNSampler(4)` stays a 4-sampler there; a sampler class that is not one of these has no
spec and is refused there with a clear error (it runs in the process that holds the system).
"""

from __future__ import annotations

import heapq
import logging
from abc import ABC, abstractmethod
from typing import Any, Protocol, cast

import numpy as np

logger = logging.getLogger(__name__)

Pick = tuple[list[int], list[int]]


class BaseSampler(ABC):
    """TransferQueue's sampler interface: `sample(ready_indexes, batch_size, ...) -> (sampled, consumed)`; cached
    picks live in `_states[partition_id][task_name][dp_rank][batch_index]`."""

    def __init__(self) -> None:
        self._states: dict[Any, Any] = {}

    @abstractmethod
    def sample(self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any) -> Pick:
        """Pick `batch_size` of `ready_indexes`; returns (sampled, consumed), both lists of global indexes."""

    def __call__(self, *args: Any, **kwargs: Any) -> Pick:
        return self.sample(*args, **kwargs)

    def has_cached_result(self, partition_id: str, task_name: str,
                          sampling_config: dict[str, Any] | None = None) -> bool:
        """Whether a pick for (partition, task, dp_rank, batch_index of `sampling_config`) is cached."""
        config = sampling_config or {}
        dp_rank = config.get("dp_rank")
        if dp_rank is None:
            return False
        states = self._states.get(partition_id, {}).get(task_name, {})
        return dp_rank in states and config.get("batch_index") in states[dp_rank]

    def clear_cache(self, partition_id: str) -> None:
        """Forget the cached picks of a partition (it was cleared)."""
        self._states.pop(partition_id, None)

    def save_checkpoint(self) -> dict[str, Any]:
        """The sampler's state (its cached picks)."""
        return {"_states": self._states}

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        """Restore `save_checkpoint`'s state."""
        self._states = state["_states"]


class SequentialSampler(BaseSampler):
    """The first `batch_size` ready indexes (fewer when fewer are ready), consumed as sampled."""

    def sample(self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any) -> Pick:
        picked = ready_indexes[:batch_size]
        return picked, picked


def consecutive_groups(ready: list[int], n: int, want: int) -> list[int]:
    """The first `want` groups of `n` consecutive indexes of sorted `ready`, scanning from the lowest: each maximal
    run of consecutive values gives its groups from the run's start. Empty when fewer than `want` exist."""
    if want <= 0:
        return []
    arr = np.sort(np.asarray(ready, dtype=np.int64))
    if len(arr) < n * want:
        return []
    breaks = np.flatnonzero(np.diff(arr) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(arr)]])
    picked: list[int] = []
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        for g in range((e - s) // n):
            picked.extend(arr[s + g * n: s + (g + 1) * n].tolist())
            if len(picked) == n * want:
                return picked
    return []


class GRPOGroupNSampler(BaseSampler):
    """Whole groups of `n_samples_per_prompt` consecutive indexes; `batch_size` must be a multiple of n."""

    def __init__(self, n_samples_per_prompt: int = 1) -> None:
        super().__init__()
        if n_samples_per_prompt <= 0:
            raise ValueError(f"n_samples_per_prompt must be positive, got {n_samples_per_prompt}")
        self.n_samples_per_prompt = n_samples_per_prompt

    def sample(self, ready_indexes: list[int], batch_size: int, task_name: str = "", partition_id: str = "",
               *args: Any, **kwargs: Any) -> Pick:
        states = self._states.get(partition_id, {}).get(task_name, {})
        dp_rank, batch_index = kwargs.get("dp_rank"), kwargs.get("batch_index")
        if dp_rank in states and batch_index in states[dp_rank]:
            return states[dp_rank][batch_index]
        n = self.n_samples_per_prompt
        if batch_size % n:
            raise ValueError(f"batch_size ({batch_size}) must be a multiple of n_samples_per_prompt ({n})")
        picked = consecutive_groups(ready_indexes, n, batch_size // n)
        if len(picked) < batch_size:
            return [], []
        result = (picked, list(picked))
        if dp_rank is not None:
            states.setdefault(dp_rank, {}).setdefault(batch_index, result)
            self._states.setdefault(partition_id, {})[task_name] = states
        return result


class RankAwareSampler(BaseSampler):
    """Ranks with the same `dp_rank` get the same indexes for the same `batch_index` (the first to ask picks the
    first `batch_size` ready ones); nothing until `batch_size` are ready."""

    def sample(self, ready_indexes: list[int], batch_size: int, dp_rank: int, batch_index: int, task_name: str,
               partition_id: str, *args: Any, **kwargs: Any) -> Pick:
        if dp_rank < 0:
            raise ValueError(f"dp_rank {dp_rank} must be greater than or equal to 0")
        cache = self._states.setdefault(partition_id, {}).setdefault(task_name, {}).setdefault(dp_rank, {})
        if batch_index in cache:
            picked = cache[batch_index]
            return picked, picked
        picked = ready_indexes[:batch_size]
        if len(picked) < batch_size:
            return [], []
        cache[batch_index] = picked
        return picked, picked


class SeqlenBalancedSampler(GRPOGroupNSampler):
    """GRPO groups for all `dp_size` ranks at once (`batch_size` is per rank), balanced over the ranks by the
    samples' `total_lengths` custom metadata (1 without it) with groups kept whole; each `dp_rank` then gets its
    share of that `batch_index`. Without a `partition` (no custom metadata at hand) the groups are split in equal
    consecutive parts."""

    def __init__(self, n_samples_per_prompt: int = 1, dp_size: int = 1) -> None:
        super().__init__(n_samples_per_prompt=n_samples_per_prompt)
        if dp_size <= 0:
            raise ValueError(f"dp_size must be positive, got {dp_size}")
        self.dp_size = dp_size
        self._balanced_cache: dict[tuple[Any, ...], list[list[int]]] = {}

    def sample(self, ready_indexes: list[int], batch_size: int, task_name: str = "", partition_id: str = "",
               *args: Any, **kwargs: Any) -> Pick:
        dp_rank, batch_index = kwargs.get("dp_rank", 0), kwargs.get("batch_index", 0)
        key = (partition_id, task_name, batch_index)
        if key in self._balanced_cache:
            parts = self._balanced_cache[key]
            mine = parts[dp_rank] if dp_rank < len(parts) else []
            return mine, list(mine)
        picked, _ = super().sample(ready_indexes, batch_size * self.dp_size, task_name=task_name,
                                   partition_id=partition_id)
        if not picked:
            return [], []
        partition = kwargs.get("partition")
        k = self.dp_size
        if partition is None:
            logger.warning("SeqlenBalancedSampler: no partition object provided, falling back to equal-split "
                           "without balancing.")
            size = len(picked) // k
            parts = [picked[i * size: (i + 1) * size if i < k - 1 else len(picked)] for i in range(k)]
        else:
            meta = partition.get_custom_meta(picked)
            lengths = [meta.get(i, {}).get("total_lengths", 1) for i in picked]
            n = self.n_samples_per_prompt
            if len(lengths) // n > 0 and len(lengths) % n == 0:
                group_len = [sum(lengths[g * n:(g + 1) * n]) for g in range(len(lengths) // n)]
                parts = [[picked[g * n + s] for g in groups for s in range(n)]
                         for groups in get_seqlen_balanced_partitions(group_len, k, equal_size=True)]
            else:
                parts = [[picked[i] for i in part]
                         for part in get_seqlen_balanced_partitions(lengths, k, equal_size=False)]
        self._balanced_cache[key] = parts
        # every rank's share is a cached pick, so polling ranks see it even once earlier ranks consumed theirs
        states = self._states.setdefault(partition_id, {}).setdefault(task_name, {})
        for r in range(k):
            share = parts[r] if r < len(parts) else []
            states.setdefault(r, {})[batch_index] = (share, list(share))
        mine = parts[dp_rank] if dp_rank < len(parts) else []
        return mine, list(mine)

    def clear_cache(self, partition_id: str) -> None:
        super().clear_cache(partition_id)
        for key in [k for k in self._balanced_cache if k[0] == partition_id]:
            del self._balanced_cache[key]

    def save_checkpoint(self) -> dict[str, Any]:
        return {**super().save_checkpoint(), "_balanced_cache": self._balanced_cache}

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        super().load_checkpoint(state)
        self._balanced_cache = state["_balanced_cache"]


# ---------------------------------------------------------------------- Karmarkar-Karp
class _Bin:
    """One part of a partial partition: its items (index, weight) and their sum. Ordered by sum, then item count,
    then items, so that every implementation breaks ties the same way."""

    __slots__ = ("items", "total")

    def __init__(self) -> None:
        self.items: list[tuple[int, int]] = []
        self.total = 0

    def add(self, idx: int, weight: int) -> None:
        self.items.append((idx, weight))
        self.total += weight

    def _key(self) -> tuple[Any, ...]:
        return self.total, len(self.items), self.items

    def __lt__(self, other: _Bin) -> bool:
        return self._key() < other._key()


class _Partial:
    """A k-way partial partition (bins in decreasing order); the heap pops the largest spread first."""

    __slots__ = ("bins",)

    def __init__(self, items: list[tuple[int, int]], k: int) -> None:
        self.bins = [_Bin() for _ in range(k)]
        for b, (idx, weight) in zip(self.bins, items, strict=False):
            b.add(idx, weight)
        self.bins.sort(reverse=True)

    @property
    def spread(self) -> int:
        return self.bins[0].total - self.bins[-1].total

    def absorb(self, other: _Partial) -> None:
        """Pair this partition's largest bin with the other's smallest, and so on (the differencing step)."""
        k = len(self.bins)
        for i in range(k):
            for idx, weight in other.bins[k - 1 - i].items:
                self.bins[i].add(idx, weight)
        self.bins.sort(reverse=True)

    def __lt__(self, other: _Partial) -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return other.bins[0] < self.bins[0]


def get_seqlen_balanced_partitions(seqlen_list: list[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Split item positions into `k_partitions` parts of about equal total length (Karmarkar-Karp largest
    differencing); with `equal_size` every part gets the same number of items. Each part is sorted.

    Raises:
        AssertionError: fewer items than parts, a count not divisible by k with `equal_size`, or an empty part
        (as TransferQueue's, whose tests expect it).
    """
    k = k_partitions
    if len(seqlen_list) < k:
        raise AssertionError(f"number of items:[{len(seqlen_list)}] < k_partitions:[{k}]")
    order = sorted((w, i) for i, w in enumerate(seqlen_list))
    heap: list[_Partial] = []
    if equal_size:
        if len(seqlen_list) % k:
            raise AssertionError(f"{len(seqlen_list)} % {k} != 0")
        for start in range(0, len(order), k):
            heapq.heappush(heap, _Partial([(i, w) for w, i in order[start:start + k]], k))
    else:
        for w, i in order:
            heapq.heappush(heap, _Partial([(i, w)], k))
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.absorb(second)
        heapq.heappush(heap, first)
    parts = [sorted(idx for idx, _ in b.items) for b in heap[0].bins]
    for i, part in enumerate(parts):
        if not part:
            raise AssertionError(f"the {i}-th partition is empty")
        if equal_size and len(part) * k != len(seqlen_list):
            raise AssertionError(f"{len(part)} * {k} != {len(seqlen_list)}")
    return parts


# ---------------------------------------------------------------------- names and specs
class SampleFn(Protocol):
    """A sampler of another library with TransferQueue's call signature (used in process only)."""

    def sample(self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any) -> Pick: ...


#: What `init`, `get_meta` and the streaming dataset take as a sampler: an instance, a class, a name of `SAMPLERS`, a
#: `sampler_spec` dict, or None (the system's default).
SamplerArg = BaseSampler | SampleFn | type[BaseSampler] | str | dict[str, Any] | None

SAMPLERS: dict[str, type[BaseSampler]] = {
    "SequentialSampler": SequentialSampler, "RankAwareSampler": RankAwareSampler,
    "GRPOGroupNSampler": GRPOGroupNSampler, "SeqlenBalancedSampler": SeqlenBalancedSampler,
}
#: The constructor parameters of each shipped sampler, which its spec carries.
PARAMS: dict[str, tuple[str, ...]] = {
    "SequentialSampler": (), "RankAwareSampler": (), "GRPOGroupNSampler": ("n_samples_per_prompt",),
    "SeqlenBalancedSampler": ("n_samples_per_prompt", "dp_size"),
}


def sampler_spec(sampler: SamplerArg) -> dict[str, Any] | None:
    """A JSON spec (`{"name", "args"}`) of a sampler instance, class or name, with every constructor parameter
    (None stays None: the system's default). Raises ValueError for a sampler that is not one of `SAMPLERS`: it
    cannot be rebuilt in another process."""
    if sampler is None:
        return None
    if isinstance(sampler, dict):
        return sampler
    args: dict[str, int] = {}
    if isinstance(sampler, str):
        cls_name = sampler
    elif isinstance(sampler, type):
        cls_name = sampler.__name__
    else:
        cls_name = type(sampler).__name__
        args = {p: int(getattr(sampler, p)) for p in PARAMS.get(cls_name, ())}
    cls = SAMPLERS.get(cls_name)
    if cls is None or (not isinstance(sampler, str) and (sampler if isinstance(sampler, type)
                                                         else type(sampler)) is not cls):
        raise ValueError(f"sampler {cls_name} cannot run in another process (a Ray actor or a Flight server holds "
                         f"this system); pass one of {sorted(SAMPLERS)} (parameters travel with it), or use an "
                         "in-process system (tq.init with arrowbuf.ray=false) for a sampler of your own")
    return {"name": cls_name, "args": args}


def make_sampler(spec: SamplerArg) -> BaseSampler:
    """A sampler from an instance (kept as is), a class, a name or a `sampler_spec` dict."""
    if isinstance(spec, BaseSampler):
        return spec
    if spec is None:
        return SequentialSampler()
    if isinstance(spec, type) and issubclass(spec, BaseSampler):
        return spec()
    if isinstance(spec, str) and spec in SAMPLERS:
        return SAMPLERS[spec]()
    if isinstance(spec, dict) and spec.get("name") in SAMPLERS:
        args = spec.get("args") or {}
        allowed = PARAMS[spec["name"]]
        if not isinstance(args, dict) or not all(k in allowed and isinstance(v, int) and not isinstance(v, bool)
                                                 and 0 < v < 1 << 20 for k, v in args.items()):
            raise ValueError(f"bad sampler spec {spec!r}: {spec['name']} takes int parameters {list(allowed)} in "
                             "[1, 2**20)")
        return SAMPLERS[spec["name"]](**args)
    if callable(getattr(spec, "sample", None)):
        return cast(BaseSampler, spec)  # a sampler of another library with the same call signature
    raise ValueError(f"Could not find sampler {spec!r}; expected one of {sorted(SAMPLERS)} or a BaseSampler")
