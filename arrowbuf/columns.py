"""Column storage of a store: one arena per column, addressed by ring position.

The store owns the ring (seqs, positions, the index); `ColumnArenas` owns the bytes of the columns. Positions are
`seq % arena_rows`; a column of a `next_of` source (the schema derives `next_obs` from `obs`) also keeps the final
observations of ended episodes in `final_capacity` extra rows, addressed as `arena_rows + slot`. Usage (what the
store does)::

    cols = ColumnArenas(schema, directory, tier, final_capacity, final_sources)
    cols.write("obs", first_pos, values)          # rows [first_pos, first_pos + len) inside one arena segment
    cols.write_final("obs", slots, values)        # final observations
    cols.take("obs", positions)                   # the sample path: one gather per column
    cols.take_next("obs", next_positions)         # ring rows or final slots (a derived column)
    cols.view("obs", p0, p1)                      # rows of one chunk, zero-copy where the tier allows

Ragged (list) fields are kept as one Arrow array per chunk slot.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from .chunks import ChunkDirectory
from .schema import ExperienceSchema
from .tiers.base import Tier


class ColumnArenas:
    """The arenas of a store's fields in one tier: identity addressing, one `np.take` per column per gather.

    Args:
        schema: the store's schema.
        directory: ring geometry (chunk rows, slots, arena rows).
        tier: where the arenas live.
        final_capacity: final-observation rows kept after the ring rows of each `next_of` source column.
        final_sources: names of the `next_of` source columns.
    """

    #: True when `arrays[name]` is the whole column (ring rows then final rows), so callers may index it directly.
    direct = True

    def __init__(self, schema: ExperienceSchema, directory: ChunkDirectory, tier: Tier, final_capacity: int,
                 final_sources: list[str]) -> None:
        self.schema = schema
        self.directory = directory
        self.chunk_rows = directory.chunk_rows
        self.arena_rows = directory.arena_rows
        self.final_capacity = int(final_capacity)
        self.final_sources = list(final_sources)
        self.arrays: dict[str, np.ndarray] = {}
        self.ragged: dict[str, list[pa.Array]] = {}
        for f in schema.fields.values():
            if f.ragged:
                empty = pa.nulls(self.chunk_rows, type=f.arrow_type())
                self.ragged[f.name] = [empty] * directory.num_slots
            else:
                extra = self.final_capacity if f.name in self.final_sources else 0
                self.arrays[f.name] = tier.allocate(f.name, f.dtype, self.arena_rows + extra, f.shape)

    # ------------------------------------------------------------------ writes (free rows; no lock needed)
    def write(self, name: str, first_pos: int, values: Any) -> None:
        """Rows [first_pos, first_pos + len(values)) of column `name`; the range must not wrap the ring."""
        self.arrays[name][first_pos:first_pos + len(values)] = values

    def write_row(self, name: str, pos: int, value: Any) -> None:
        self.arrays[name][pos] = value

    def write_final(self, name: str, slots: np.ndarray | int, values: Any) -> None:
        """Final observations into final-observation `slots` of source column `name`."""
        self.arrays[name][self.arena_rows + slots] = values

    def write_ragged(self, name: str, values: pa.Array, first_pos: int) -> None:
        pos, done = first_pos, 0
        slots = self.ragged[name]
        while done < len(values):
            slot, off = divmod(pos, self.chunk_rows)
            take = min(len(values) - done, self.chunk_rows - off)
            old = slots[slot]
            parts = [old.slice(0, off), values.slice(done, take), old.slice(off + take)]
            slots[slot] = pa.concat_arrays([p for p in parts if len(p)])
            done += take
            pos = (pos + take) % self.arena_rows

    # ------------------------------------------------------------------ reads
    def take(self, name: str, positions: np.ndarray) -> Any:
        """Rows at ring `positions` of column `name` (one gather)."""
        return np.take(self.arrays[name], positions, axis=0)

    def take_next(self, name: str, positions: np.ndarray) -> Any:
        """Rows at `positions` that are ring positions or final-observation slots (`arena_rows + slot`)."""
        return np.take(self.arrays[name], positions, axis=0)

    def take_ragged(self, name: str, positions: np.ndarray) -> pa.Array:
        return pa.chunked_array(self.ragged[name]).take(pa.array(positions)).combine_chunks()

    def column(self, name: str) -> Any:
        """Something indexable by a position array (`col[pos]`) giving host rows: n-step returns read through it."""
        return self.arrays[name]

    def view(self, name: str, p0: int, p1: int) -> np.ndarray:
        """Rows [p0, p1) of one chunk: a zero-copy view of the arena."""
        return self.arrays[name][p0:p1]

    def ragged_snapshot(self) -> dict[str, list[pa.Array]]:
        """The per-slot arrays of the ragged fields (take under the store's lock: writers replace them)."""
        return {k: list(v) for k, v in self.ragged.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.arrays

    def close(self) -> None:
        self.arrays.clear()
        self.ragged.clear()
