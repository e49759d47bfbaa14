"""The one internals object of a store (`StoreCore`): ring index, column arenas, sampler, locks, the open flag.

`ExperienceStore` (`arrowbuf.store.facade`) builds one `StoreCore`, then a `StoreWriter` (writer.py: append, extend,
end_episode; the one commit routine), a `StoreReader` (reader.py: sample, update_priorities, consistent snapshots), a
`StoreUpdater` and a `ConsumeTracker` over it, and delegates to them. They all see the same objects; none reaches into
another. persist (checkpoint, restore) reads and fills a StoreCore, and a placement policy is bound to one (it
satisfies the `arrowbuf.placement.PlacementTarget` Protocol): no other view of a store's internals exists.

Locks: `write_lock` is held by a writer while it reserves rows (writers then copy their rows in parallel and commit
in seq order: `arrowbuf.ring.reservations`); `lock` (with `cond`, a condition over it) guards the commit, the live
range, sampleability and the sampler's state. Lock order: `write_lock` before `lock`. For a shared tier both are
cross-process robust mutexes (`arrowbuf.tiers.shm`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np

from ..errors import StoreClosed
from ..observe.lineage import Lineage
from ..options import StoreOptions
from ..rate_limiters import Counters, RateLimiter
from ..ring.chunks import ChunkDirectory
from ..ring.columns import ColumnArenas
from ..ring.index import RingIndex
from ..ring.reservations import Reservations
from ..ring.tiered import TieredColumnArenas
from ..samplers import Sampler
from ..schema import ExperienceSchema
from ..tiers.base import Tier, TierLock
from .episodes import EpisodeTracker


class ConsumeRecord(Protocol):
    """What the rooms below the facade read and restore of a store's consumption (`arrowbuf.engine.consume.
    ConsumeTracker` is one): its tasks, and per live row what each task consumed (checkpoints, restore, progress)."""

    @property
    def tasks(self) -> list[str]: ...

    def state(self, seqs: np.ndarray, journaled: bool = False) -> tuple[dict[str, Any], dict[str, np.ndarray]]: ...

    def load_state(self, seqs: np.ndarray, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def progress_state(self, segments: list[tuple[int, int]]) -> dict[str, Any]: ...


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
    rate_limiter: RateLimiter | None
    rng: np.random.Generator
    episodes: EpisodeTracker
    final_owner: np.ndarray
    times_sampled: np.ndarray
    max_times_sampled: int
    lock: TierLock
    write_lock: TierLock
    reservations: Reservations
    cond: threading.Condition = field(init=False)
    closed: bool = False
    #: threads of this process waiting in `wait_for` (under `lock`); waits on `cond` go through `wait_for` only
    waiters: int = 0
    #: Called as `on_update(positions, fields)` after `store.update` wrote rows and notified `cond`, holding the
    #: write lock but not `lock` (`store.update` calls it; a tracker may install it).
    on_update: Callable[[np.ndarray, list[str]], None] | None = None
    #: The store's consumption (its `ConsumeTracker`: tasks, consumption per task, policy version); set once the
    #: facade built it.
    consume: ConsumeRecord | None = None
    #: Who wrote and consumed each row, or None: not recorded.
    lineage: Lineage | None = None
    #: The options the store was built from (`arrowbuf.options.StoreOptions`, as built); set by the facade.
    options: StoreOptions | None = None
    #: Calls that waited because the rate limiter held them back, this process (`/metrics`): inserts, samples.
    limiter_waits: dict[str, int] = field(default_factory=lambda: {"insert": 0, "sample": 0})
    final_sources: list[str] = field(init=False)
    end_fields: list[str] = field(init=False)
    derived: list[Any] = field(init=False)
    arena_rows: int = field(init=False)  # ring positions: the capacity plus the spare chunk

    def __post_init__(self) -> None:
        self.arena_rows = int(self.directory.arena_rows)
        # any lock with acquire/release serves a Condition (typeshed names threading's own only)
        self.cond = threading.Condition(cast(threading.Lock, self.lock))
        self.final_sources = sorted({d.next_of for d in self.schema.derived.values()})
        self.end_fields = list(self.schema.episode_end)
        self.derived = list(self.schema.derived.values())

    @property
    def final_capacity(self) -> int:
        """Rows kept for the final observations of ended episodes (0: none)."""
        return int(self.cols.final_capacity)

    @property
    def chunk_rows(self) -> int:
        """Rows per chunk (the unit of residency and of placement moves)."""
        return int(self.directory.chunk_rows)

    @property
    def tier_name(self) -> str:
        """"host", "shm", ... for a store in one tier; "tiered" for one whose columns span several."""
        return "tiered" if self.cols.tiered else self.tier.name

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

    def wait_for(self, predicate: Callable[[], object], timeout: float | None) -> bool:
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

    # ------------------------------------------------------------------ what a placement policy sees
    # (`arrowbuf.placement.PlacementTarget`: the policy is bound to this object and reads nothing else)
    @property
    def num_slots(self) -> int:
        """Chunk slots of the ring (its chunks and the spare one)."""
        return int(self.directory.num_slots)

    @property
    def tiered(self) -> bool:
        """Whether columns span several tiers (residency per column and chunk)."""
        return bool(self.cols.tiered)

    @property
    def tiers(self) -> list[Tier]:
        """The data tiers, top (fastest) to bottom; a tier code indexes this list."""
        return list(self.cols.tiers)

    @property
    def columns(self) -> list[str]:
        """The placed columns: a tiered store's fixed-width fields, in arena order; none with one tier."""
        cols = self.cols
        return list(cols.names) if isinstance(cols, TieredColumnArenas) else []

    @property
    def slotted(self) -> list[bool]:
        """Per tier: whether it holds fixed chunk slots (device memory) instead of the whole ring."""
        cols = self.cols
        return list(cols.slotted) if isinstance(cols, TieredColumnArenas) else [False]

    @property
    def bottom(self) -> int:
        """The code of the bottom tier (it holds every chunk)."""
        return len(self.cols.tiers) - 1

    @property
    def queue(self) -> bool:
        """Whether the sampler is a queue (each item delivered once: new chunks hold the mass)."""
        return bool(self.sampler.queue)

    def _tiered(self) -> TieredColumnArenas:
        """The columns of a tiered store (what the placement methods below read)."""
        cols = self.cols
        if not isinstance(cols, TieredColumnArenas):
            raise TypeError(f"store {self.name!r} keeps its columns in one tier: nothing to place")
        return cols

    def _placed(self) -> np.ndarray:
        """The arena rows of `columns` (indices into the per-column residency arrays)."""
        cols = self._tiered()
        return np.array([cols.ci[n] for n in self.columns], dtype=np.int64)

    def chunk_bytes(self) -> np.ndarray:
        """[C] bytes of one chunk of each column."""
        cols = self._tiered()
        return np.array([cols.chunk_bytes[n] for n in self.columns], dtype=np.int64)

    def residency(self) -> np.ndarray:
        """[C, S] the tier code (index into `tiers`) of each (column, chunk slot); a copy."""
        cols = self._tiered()
        return np.asarray(cols.res[self._placed()], dtype=np.int64)

    def moving(self) -> np.ndarray:
        """[C, S] whether a (column, chunk slot) is being moved or written now; a copy."""
        cols = self._tiered()
        return np.array(cols.moving[self._placed()])

    def write_tiers(self) -> np.ndarray:
        """[C] where writers put each column's new chunks (a tier code)."""
        cols = self._tiered()
        return np.asarray(cols.write_tier)[self._placed()].astype(np.int64)

    def set_write_tiers(self, codes: np.ndarray) -> None:
        """Where writers put each column's new chunks from now on (never a slotted tier)."""
        cols = self._tiered()
        for i, ci in enumerate(self._placed().tolist()):
            cols.write_tier[ci] = int(codes[i])

    def snapshot(self) -> dict[str, Any]:
        """A consistent view under `lock`: `lo`, `hi` (live seqs), `gens`/`lasts` (each slot's first and last seq),
        `inserts` and `access` ([C] rows read per column so far)."""
        idx = self.index
        cr = self.chunk_rows
        cols = self._tiered()
        cis = self._placed()
        first = np.arange(self.num_slots, dtype=np.int64) * cr
        with self.lock:
            return {"lo": idx.lo, "hi": idx.hi, "gens": idx.seq[first].copy(), "lasts": idx.seq[first + cr - 1].copy(),
                    "inserts": idx.counter("inserts"), "access": np.array(cols.access, dtype=np.int64)[cis]}

    def chunk_mass(self) -> np.ndarray:
        """[S] each chunk slot's sampling mass (unnormalised): the sum of `Sampler.mass` over its rows."""
        rows = self.num_slots * self.chunk_rows
        per_row = np.asarray(self.sampler.mass(np.arange(rows, dtype=np.int64)), dtype=np.float64)
        return per_row.reshape(self.num_slots, self.chunk_rows).sum(axis=1)

    def fixed_bytes(self, code: int) -> int:
        """Bytes tier `code` holds besides column chunks (the index, samplers, final observations on the host)."""
        cols = self._tiered()
        data = sum(int((cols.res[cols.ci[n]] == code).sum()) * cols.chunk_bytes[n] for n in self.columns)
        return max(0, int(cols.tiers[code].nbytes()) - data)

    def slots_total(self, code: int, column: str) -> int:
        """Chunk slots column `column` has in slotted tier `code` (0: no arena there yet)."""
        cols = self._tiered()
        return int(cols.slots_total(code, column))

    def ensure_arena(self, code: int, column: str, slots: int) -> bool:
        """Give `column` an arena of `slots` chunk slots in slotted tier `code`; False if it does not fit."""
        cols = self._tiered()
        return bool(cols.ensure_arena(code, column, slots))

    def migrate(self, column: str, slot: int, tier: int, gen: int | None) -> bool:
        """Copy chunk slot `slot` of `column` to tier `tier` and flip the slot table; False (nothing changed) if there
        is no room, it is already moving, or the chunk changed meanwhile. `gen`: the sealed chunk's first seq, or
        None for a slot that is not sealed (moved only while no writer is busy)."""
        cols = self._tiered()
        return bool(cols.migrate(column, slot, tier, gen, self.index, self.lock, self.write_lock))
