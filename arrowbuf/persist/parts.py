"""What `arrowbuf.persist` sees of a store: its parts, handed over by the store itself (`store._persist_parts()`).

The store builds a `StoreParts` from its own components; persist reads and restores state only through these
objects' public surfaces (`ColumnArenas.view`/`write`, `RingIndex` arrays, `Sampler` state, `EpisodeTracker`), never
through the store's private attributes. Samplers and rate limiters are recorded as specs (`arrowbuf.samplers.spec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class StoreParts:
    """A store's components, as its `_persist_parts()` hands them to persist.

    Attributes:
        schema: the store's `ExperienceSchema`.
        cols: its `ColumnArenas` (or `TieredColumnArenas`).
        directory: its `ChunkDirectory` (ring geometry).
        index: its `RingIndex` (seqs, episode ids, steps, successors, sampleability, header counters).
        sampler: its `Sampler`.
        episodes: its `EpisodeTracker` (this process's open streams).
        rng: the `np.random.Generator` its sampler draws from.
        final_owner: per final-observation slot, the seq of the row that owns it (-1 none).
        times_sampled: per ring position, deliveries so far (empty without `max_times_sampled`).
        lock: the state lock (commits, sampling); write_lock: held by writers for a whole batch.
        config: the constructor arguments that rebuild an equal store (capacity, chunk_rows, ...).
        tier_name: "host", "shm", or "tiered".
        consume: its `ConsumeTracker` (tasks, consumption per task, policy version), or None.
    """

    schema: Any
    cols: Any
    directory: Any
    index: Any
    sampler: Any
    episodes: Any
    rng: np.random.Generator
    final_owner: np.ndarray
    times_sampled: np.ndarray
    lock: Any
    write_lock: Any
    config: dict[str, Any]
    rate_limiter: Any
    tier_name: str
    consume: Any = None

    @property
    def arena_rows(self) -> int:
        return int(self.directory.arena_rows)

    @property
    def chunk_rows(self) -> int:
        return int(self.directory.chunk_rows)
