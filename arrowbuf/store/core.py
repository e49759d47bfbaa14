"""The one internals object of a store (`StoreCore`): ring index, column arenas, sampler, locks, the open flag.

`ExperienceStore` (`arrowbuf.store.facade`) builds one `StoreCore`, then a `StoreWriter` (writer.py: append, extend,
end_episode; the one commit routine), a `StoreReader` (reader.py: sample, update_priorities, consistent snapshots), a
`StoreUpdater` and a `ConsumeTracker` over it, and delegates to them. They all see the same objects; none reaches into
another. persist (checkpoint, restore) reads and fills a StoreCore, and placement binds to one through
`arrowbuf.placement.PlacementTarget`: no other view of a store's internals exists.

Locks: `write_lock` is held by a writer while it reserves rows (writers then copy their rows in parallel and commit
in seq order: `arrowbuf.ring.reservations`); `lock` (with `cond`, a condition over it) guards the commit, the live
range, sampleability and the sampler's state. Lock order: `write_lock` before `lock`. For a shared tier both are
cross-process robust mutexes (`arrowbuf.tiers.shm`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import StoreClosed
from ..rate_limiters import Counters
from ..ring.chunks import ChunkDirectory
from ..ring.columns import ColumnArenas
from ..ring.index import RingIndex
from ..ring.reservations import Reservations
from ..samplers import Sampler
from ..schema import ExperienceSchema
from ..tiers.base import Tier
from .episodes import EpisodeTracker


@dataclass
class StoreCore:
    """A store's components and the few facts derived from its schema (see the module docstring).

    Attributes:
        schema: the store's schema; name: its name; capacity: rows the ring holds.
        tier: where the index and samplers live (a shared tier for `tier="shm"`).
        cols: the column arenas; directory: the ring geometry; index: the ring index.
        sampler, rate_limiter, rng: sampling; episodes: this process's episode streams.
        final_owner: per final-observation slot, the seq of the row owning it (-1: free).
        times_sampled: per ring position, deliveries so far (empty without `max_times_sampled`).
        max_times_sampled: 0 for no limit.
        lock, cond, write_lock: see the module docstring.
        reservations: the open row reservations of parallel writers (`arrowbuf.ring.reservations`).
    """

    schema: ExperienceSchema
    name: str
    capacity: int
    tier: Tier
    cols: ColumnArenas
    directory: ChunkDirectory
    index: RingIndex
    sampler: Sampler
    rate_limiter: Any
    rng: np.random.Generator
    episodes: EpisodeTracker
    final_owner: np.ndarray
    times_sampled: np.ndarray
    max_times_sampled: int
    lock: Any
    write_lock: Any
    reservations: Reservations
    cond: threading.Condition = field(init=False)
    closed: bool = False
    #: threads of this process waiting in `wait_for` (under `lock`); waits on `cond` go through `wait_for` only
    waiters: int = 0
    #: Called as `on_update(positions, fields)` after `store.update` wrote rows and notified `cond`, holding the
    #: write lock but not `lock` (`store.update` calls it; a tracker may install it).
    on_update: Any = None
    #: The store's `ConsumeTracker` (tasks, consumption per task, policy version); set once the facade built it.
    consume: Any = None
    final_sources: list[str] = field(init=False)
    end_fields: list[str] = field(init=False)
    derived: list[Any] = field(init=False)
    arena_rows: int = field(init=False)  # ring positions: the capacity plus the spare chunk

    def __post_init__(self) -> None:
        self.arena_rows = int(self.directory.arena_rows)
        self.cond = threading.Condition(self.lock)
        self.final_sources = sorted({d.next_of for d in self.schema.derived.values()})
        self.end_fields = list(self.schema.episode_end)
        self.derived = list(self.schema.derived.values())

    @property
    def final_capacity(self) -> int:
        return int(self.cols.final_capacity)

    @property
    def chunk_rows(self) -> int:
        return int(self.directory.chunk_rows)

    @property
    def tier_name(self) -> str:
        """"host", "shm", ... for a store in one tier; "tiered" for one whose columns span several."""
        return "tiered" if self.cols.tiered else self.tier.name

    def config(self) -> dict[str, Any]:
        """The constructor arguments that rebuild a store of the same geometry (checkpoints record them)."""
        return {"name": self.name, "capacity": self.capacity, "chunk_rows": self.chunk_rows,
                "final_obs_capacity": self.final_capacity or None,
                "max_times_sampled": self.max_times_sampled or None}

    def present(self, fields: list[str], positions: np.ndarray) -> np.ndarray:
        """True where every one of `fields` has a value at ring `positions` (a field not filled later always has
        one). Fields helper: see `arrowbuf.ring.presence`.

        Raises:
            SchemaError: a name that is not a field of the schema.
        """
        return self.cols.present(fields, positions)

    def check_open(self) -> None:
        """Raise `StoreClosed` once the store was closed."""
        if self.closed:
            raise StoreClosed(f"store {self.name!r} is closed")

    def counters(self) -> Counters:
        """What the rate limiter decides on (read under the lock)."""
        idx = self.index
        size = self.sampler.available() if self.sampler.queue else len(idx)
        return Counters(inserts=idx.counter("inserts"), samples=idx.counter("samples"), size=size)

    def wait_for(self, predicate: Any, timeout: float | None) -> bool:
        """Wait on `cond` (held by the caller) until `predicate()`; False on timeout. None waits not at all."""
        if timeout is None or timeout <= 0:
            return bool(predicate())
        deadline = time.monotonic() + timeout
        pause = 0.0005  # shared tier: other processes' commits cannot notify this condition, so poll (bounded backoff)
        self.waiters += 1
        try:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return False
                if self.tier.shared:
                    self.cond.wait(min(left, pause))
                    pause = min(2 * pause, 0.02)
                else:
                    self.cond.wait(left)
            return True
        finally:
            self.waiters -= 1

    def notify(self) -> None:
        """Under `lock`: wake this process's threads waiting in `wait_for` (skipped when there are none: a commit
        per step would otherwise pay for `Condition.notify_all`, about 0.5 us)."""
        if self.waiters:
            self.cond.notify_all()
