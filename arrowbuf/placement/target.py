"""What a placement policy sees of a store: tiers, chunk residency, access counts, per-chunk sampling mass,
and `migrate`, over the store's internals (any `PlacementSource`: `arrowbuf.store.core.StoreCore` is one)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from ..ring.chunks import ChunkDirectory
    from ..ring.columns import ColumnArenas
    from ..ring.index import RingIndex
    from ..samplers import Sampler
    from ..schema import ExperienceSchema


class PlacementSource(Protocol):
    """What a `PlacementTarget` is built from: a store's internals (`arrowbuf.store.core.StoreCore` is one)."""

    schema: ExperienceSchema
    name: str
    capacity: int
    cols: ColumnArenas
    directory: ChunkDirectory
    index: RingIndex
    sampler: Sampler
    lock: Any
    write_lock: Any


class PlacementTarget:
    """What a placement policy sees of its store, and the one thing it does to it (`migrate`).

    The store builds it from its internals (`PlacementTarget(core)`, at construction) and binds its policy to it; a
    policy reads nothing else. Columns are in `columns` order everywhere (arrays of shape [C] or [C, S], S chunk slots).

    Usage loop (a policy's step)::

        snap = target.snapshot()                   # lo, hi, each slot's first/last seq, inserts, access per column
        mass = target.chunk_mass()                 # [S] sampling mass per chunk slot (Sampler.mass)
        res = target.residency()                   # [C, S] tier code of each (column, chunk)
        target.migrate("obs", slot, tier, gen)     # copy one chunk of one column, off the sample path
    """

    def __init__(self, core: PlacementSource) -> None:
        cols: Any = core.cols
        self.schema = core.schema
        self.name = core.name
        self.capacity = int(core.capacity)
        self.directory = core.directory
        self.chunk_rows = core.directory.chunk_rows
        self.num_slots = core.directory.num_slots
        self.tiered = bool(cols.tiered)
        self.tiers: list[Any] = list(cols.tiers)
        self.closed = False
        self._cols = cols
        self._index = core.index
        self._sampler = core.sampler
        self._state_lock = core.lock
        self._write_lock = core.write_lock
        if self.tiered:
            self.columns: list[str] = list(cols.names)
            self._cis = np.array([cols.ci[n] for n in self.columns], dtype=np.int64)
            self.slotted: list[bool] = list(cols.slotted)
            self.bottom: int = int(cols.bottom)
            self.arena_rows: int = int(cols.arena_rows)

    # ------------------------------------------------------------------ reading
    @property
    def queue(self) -> bool:
        """Whether the sampler is a queue (each item delivered once: new chunks hold the mass)."""
        return bool(self._sampler.queue)

    def chunk_bytes(self) -> np.ndarray:
        """[C] bytes of one chunk of each column."""
        return np.array([self._cols.chunk_bytes[n] for n in self.columns], dtype=np.int64)

    def residency(self) -> np.ndarray:
        """[C, S] the tier code (index into `tiers`) of each (column, chunk slot); a copy."""
        return self._cols.res[self._cis].astype(np.int64)

    def moving(self) -> np.ndarray:
        """[C, S] whether a (column, chunk slot) is being moved or written now."""
        return self._cols.moving[self._cis].copy()

    def write_tiers(self) -> np.ndarray:
        """[C] where writers put each column's new chunks (a tier code)."""
        return np.asarray(self._cols.write_tier)[self._cis].astype(np.int64)

    def set_write_tiers(self, codes: np.ndarray) -> None:
        """Where writers put each column's new chunks from now on (never a slotted tier)."""
        for i, ci in enumerate(self._cis.tolist()):
            self._cols.write_tier[ci] = int(codes[i])

    def snapshot(self) -> dict[str, Any]:
        """A consistent view under the store's state lock: `lo`, `hi` (live seqs), `gens`/`lasts` (each slot's first
        and last seq), `inserts` and `access` ([C] rows read per column so far)."""
        idx = self._index
        cr = self.chunk_rows
        first = np.arange(self.num_slots, dtype=np.int64) * cr
        with self._state_lock:
            return {"lo": idx.lo, "hi": idx.hi, "gens": idx.seq[first].copy(), "lasts": idx.seq[first + cr - 1].copy(),
                    "inserts": idx.counter("inserts"),
                    "access": np.array(self._cols.access, dtype=np.int64)[self._cis]}

    def chunk_mass(self) -> np.ndarray:
        """[S] each chunk slot's sampling mass (unnormalised): the sum of `Sampler.mass` over its rows."""
        rows = self.num_slots * self.chunk_rows
        per_row = np.asarray(self._sampler.mass(np.arange(rows, dtype=np.int64)), dtype=np.float64)
        return per_row.reshape(self.num_slots, self.chunk_rows).sum(axis=1)

    def fixed_bytes(self, code: int) -> int:
        """Bytes tier `code` holds besides column chunks (the index, samplers, final observations on the host)."""
        cols = self._cols
        data = sum(int((cols.res[cols.ci[n]] == code).sum()) * cols.chunk_bytes[n] for n in self.columns)
        return max(0, self.tiers[code].nbytes() - data)

    def slots_total(self, code: int, column: str) -> int:
        """Chunk slots column `column` has in slotted tier `code` (0: no arena there yet)."""
        return int(self._cols.slots_total(code, column))

    # ------------------------------------------------------------------ acting
    def ensure_arena(self, code: int, column: str, slots: int) -> bool:
        """Give `column` an arena of `slots` chunk slots in slotted tier `code`; False if it does not fit."""
        return bool(self._cols.ensure_arena(code, column, slots))

    def migrate(self, column: str, slot: int, tier: int, gen: int | None) -> bool:
        """Copy chunk slot `slot` of `column` to tier `tier` and flip the slot table; False (nothing changed) if there
        is no room, it is already moving, or the chunk changed meanwhile. `gen`: the sealed chunk's first seq, or
        None for a slot that is not sealed (moved only while no writer is busy)."""
        return bool(self._cols.migrate(column, slot, tier, gen, self._index, self._state_lock, self._write_lock))
