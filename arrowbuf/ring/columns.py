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

Ragged (list) fields are kept in one arena per column (`arrowbuf.ring.ragged_arena.RaggedArena`) in host memory
(growable), in shared memory and in a tiered store's bottom tier (the disk spills token data), so that a gather is
one ranged copy per row; the arena is shown through a per-slot interface (`ragged[name][slot]`, a copy of the slot)
for snapshots. A tier that is neither shared nor growable (none ships today) keeps one Arrow array per chunk slot.

Fields filled later (`later: true` in the schema) also have a validity array per ring position (`presence`, see
`arrowbuf.ring.presence`): `write`/`write_ragged` record which rows were given a value, `update_rows` fills live rows in
place (arrowbuf.engine.update), and `take_later`/`snapshot_later` deliver them as Arrow columns whose nulls are the rows
without a value::

    cols.present(["reward"], positions)           # bool per position
    cols.update_rows("reward", positions, values) # under the store's write lock
    cols.take_later("reward", positions, shape)   # numpy when all present, else an Arrow array with nulls

`TieredColumnArenas` (a store made with `tiers=`) has the same surface over several tiers: residency per (column,
chunk slot), moves by `migrate` (what `arrowbuf.placement` calls), and a gather that takes from each tier a row
lives in. Why host and disk arenas span the whole ring (rows keep their positions) instead of holding a few slots
behind a slot table: a gather then needs no position translation, a move copies `[p0, p1)` to the same rows of
another arena, and the columns share a tier's budget freely (the bytes a column holds in the host are what it has
resident, not a fixed share decided at construction), which is what lets a cold column leave the host whole. Host
memory is committed and returned page by page (`HostTier.allocate_sparse`), disk space is reserved up front. Only
device memory, which cannot be over-committed, is slotted.

`TieredColumnArenas` lives in arrowbuf/tiered_columns.py.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from ..errors import SchemaError
from ..schema import ExperienceSchema
from ..schema import jsonvalues as _json
from ..schema.dtypes import unwrap_list
from ..tiers.base import Tier
from . import ragged_gather as _ragged
from .chunks import ChunkDirectory
from .presence import Presence, nullable_array, to_nullable
from .ragged_arena import RaggedArena, SlotView


class ColumnArenas:
    """The arenas of a store's fields in one tier: identity addressing, one `np.take` per column per gather.

    Args:
        schema: the store's schema.
        directory: ring geometry (chunk rows, slots, arena rows).
        tier: where the arenas live.
        final_capacity: final-observation rows kept after the ring rows of each `next_of` source column.
        final_sources: names of the `next_of` source columns.
    """

    #: Capability: columns live in several tiers, with residency per (column, chunk) (`arrowbuf.ring.tiered`).
    tiered: ClassVar[bool] = False


    #: True when `arrays[name]` is the whole column (ring rows then final rows), so callers may index it directly.
    direct = True
    pages: Any = None  # a `tiers.prefault.PagePreparer` when the tier prepares pages (a tiered store: never)

    def __init__(self, schema: ExperienceSchema, directory: ChunkDirectory, tier: Tier, final_capacity: int,
                 final_sources: list[str]) -> None:
        self.schema = schema
        self.directory = directory
        self.chunk_rows = directory.chunk_rows
        self.arena_rows = directory.arena_rows
        self.final_capacity = int(final_capacity)
        self.final_sources = list(final_sources)
        self.tiers: list[Tier] = [tier]  # where the columns live (a tiered store has several)
        self.arrays: dict[str, np.ndarray] = {}
        self.ragged: dict[str, Any] = {}  # per ragged field: its per-slot list arrays (or a SlotView)
        self.tier_ragged: dict[str, RaggedArena] = {}  # ragged fields in tier memory (a shared tier; a tiered store)
        self.presence = Presence(schema, tier, self.arena_rows)
        self.later = self.presence.valid  # membership: the fields filled later
        for f in schema.fields.values():
            if f.ragged and (tier.shared or getattr(tier, "growable", False)):
                arena = RaggedArena(f, tier, self.chunk_rows, directory.num_slots, self.arena_rows)
                self.tier_ragged[f.name] = arena
                read = self._consistent(f.name, arena.take) if f.later else None
                self.ragged[f.name] = SlotView(arena, read)
            elif f.ragged:
                empty = pa.nulls(self.chunk_rows, type=f.physical_type())
                self.ragged[f.name] = [empty] * directory.num_slots
            else:
                extra = self.final_capacity if f.name in self.final_sources else 0
                self.arrays[f.name] = tier.allocate(f.name, f.dtype, self.arena_rows + extra, f.shape)
        self.pages = tier.prepare_pages(list(self.arrays), self.arena_rows, schema.name)  # the writer advances it

    def _consistent(self, name: str, take: Any) -> Any:
        """`take(positions)` of later field `name` under the presence seqlock (never half an update)."""
        return lambda positions: self.presence.read(name, positions, take)[0]

    # ------------------------------------------------------------------ writes (free rows; no lock needed)
    def write(self, name: str, first_pos: int, values: Any) -> None:
        """Rows [first_pos, first_pos + len(values)) of column `name`; the range must not wrap the ring."""
        if self.later and name in self.later:
            values = self.presence.mark(name, first_pos, values)
        self.arrays[name][first_pos:first_pos + len(values)] = values

    def write_row(self, name: str, pos: int, value: Any) -> None:
        if self.later and name in self.later:
            self.presence.mark_row(name, pos)
        self.arrays[name][pos] = value

    def write_final(self, name: str, slots: np.ndarray | int, values: Any) -> None:
        """Final observations into final-observation `slots` of source column `name`."""
        self.arrays[name][self.arena_rows + slots] = values

    def write_ragged(self, name: str, values: pa.Array, first_pos: int) -> None:
        if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)):
            values = _json.to_physical(values)  # a json column as checkpoint files hold it (arrow.json): its bytes
        else:
            values = unwrap_list(values)  # a ragged bfloat16/float8 column as files hold it: its bits
        if self.later and name in self.later:  # a range that wraps the ring: mark it in two pieces
            head = min(len(values), self.arena_rows - first_pos)
            self.presence.mark(name, first_pos, values.slice(0, head))
            if head < len(values):
                self.presence.mark(name, 0, values.slice(head))
        if name in self.tier_ragged:
            self.tier_ragged[name].write(first_pos, values)
            return
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

    # ------------------------------------------------------------------ fields filled later
    def update_rows(self, name: str, positions: np.ndarray, values: Any) -> None:
        """Write values of later field `name` into live rows at `positions` (distinct) and mark them present.

        Callers hold the store's write lock (`arrowbuf.engine.update`); readers see all of an update's rows or none of a
        row (the presence seqlock). `values`: [n, *shape] numpy, or a `pa.ListArray` for a ragged field.
        """
        self.update_fields(positions, {name: values})

    def update_fields(self, positions: np.ndarray, values: dict[str, Any]) -> None:
        """Write several later fields of live rows at `positions` (distinct) as one update: every value is written,
        then every field's presence is published, all inside one seqlock bracket, so a reader (a consume with
        `require=`, a gather, `to_table`) sees all of a row's update or none of it. Callers hold the write lock."""
        with self.presence.updating():
            for name, part in values.items():
                if name in self.ragged:
                    self._update_ragged(name, positions, part)
                else:
                    self._put_rows(name, positions, part)
            for name in values:
                self.later[name][positions] = True

    def _put_rows(self, name: str, positions: np.ndarray, values: np.ndarray) -> None:
        self.arrays[name][positions] = values

    def _update_ragged(self, name: str, positions: np.ndarray, values: pa.Array) -> None:
        """Replace rows of a ragged column: one new array per chunk slot touched, built with ranged copies (a slot
        whose every row is replaced takes the new rows as they are)."""
        if name in self.tier_ragged:
            self.tier_ragged[name].update(positions, values)
            return
        slots = self.ragged[name]
        order = np.argsort(positions, kind="stable")
        pos = positions[order]
        cut = np.flatnonzero(np.diff(pos // self.chunk_rows)) + 1
        for part in np.split(np.arange(len(pos)), cut):
            slot = int(pos[part[0]] // self.chunk_rows)
            old = slots[slot]
            new = _ragged.take(values, order[part])
            if new.type != old.type:
                new = new.cast(old.type)
            if len(part) == len(old):  # every row of the slot, in position order (positions are distinct)
                # a consecutive take is a slice of the caller's array (maybe over its numpy memory): own a copy
                rows = order[part]
                sliced = len(rows) < 2 or bool(np.all(np.diff(rows) == 1))
                slots[slot] = pa.concat_arrays([new]) if sliced else new
                continue
            idx = np.arange(len(old), dtype=np.int64)
            idx[pos[part] - slot * self.chunk_rows] = len(old) + np.arange(len(part))
            slots[slot] = _ragged.take(pa.concat_arrays([old, new]), idx)

    def present(self, fields: list[str], positions: np.ndarray) -> np.ndarray:
        """True where every one of `fields` has a value at ring `positions` (fields not filled later always do)."""
        return self.presence.present(fields, positions, self.schema)

    def take_later(self, name: str, positions: np.ndarray, shape: tuple[int, ...] = (), *extra: Any) -> Any:
        """Rows of later field `name` at `positions` as `to_nullable` delivers them (null where absent); `shape` is
        the batch shape ([B] or [B, T] windows); `extra` goes to `take` (a tiered store's read record)."""
        spec = self.schema.fields[name]
        if name in self.ragged:  # a ragged column carries its nulls itself
            if len(shape) > 1:
                raise SchemaError(f"ragged field {name!r} cannot be sampled as sequences")
            if name in self.tier_ragged:  # rows updated in place: read under the presence seqlock
                return self.presence.read(name, positions, self.tier_ragged[name].take)[0]
            return self.take_ragged(name, positions)
        values, present = self.presence.read(name, positions, lambda p: self.take(name, p, *extra))
        return to_nullable(spec, values, present, shape)

    def snapshot_later(self, name: str, p0: int, p1: int) -> pa.Array:
        """Rows [p0, p1) of one chunk of later field `name`: a copy, null where absent (`to_table`)."""
        spec = self.schema.fields[name]
        values, present = self.presence.read(name, np.arange(p0, p1), lambda p: np.array(self.view(name, p0, p1)))
        return nullable_array(spec, values, present)

    # ------------------------------------------------------------------ reads
    def take(self, name: str, positions: np.ndarray) -> Any:
        """Rows at ring `positions` of column `name` (one gather)."""
        return np.take(self.arrays[name], positions, axis=0)

    def take_next(self, name: str, positions: np.ndarray) -> Any:
        """Rows at `positions` that are ring positions or final-observation slots (`arena_rows + slot`)."""
        return np.take(self.arrays[name], positions, axis=0)

    def take_ragged(self, name: str, positions: np.ndarray) -> pa.Array:
        """Rows at ring `positions` of ragged column `name`: ranged copies, or a zero-copy slice of one chunk."""
        if name in self.tier_ragged:
            return self.tier_ragged[name].take(positions)
        return _ragged.take_chunked(self.ragged[name], self.chunk_rows, positions)

    def use_outputs(self, pool: Any) -> None:
        """Gathers of the ragged arenas put large values into `pool` (an `arrowbuf.ring.outpool.OutputPool`: the
        store reader's), so their pages stay warm between gathers, pauses included."""
        for arena in self.tier_ragged.values():
            arena.outputs = pool

    def count_access(self, key: Any, rows: int, resolve: Any, *args: Any) -> None:
        """Placement input (tiered stores): rows read per column. Nothing to count with one tier."""

    def column(self, name: str) -> Any:
        """Something indexable by a position array (`col[pos]`) giving host rows: n-step returns read through it."""
        return self.arrays[name]

    def view(self, name: str, p0: int, p1: int) -> np.ndarray:
        """Rows [p0, p1) of one chunk: a zero-copy view of the arena."""
        return self.arrays[name][p0:p1]

    def ragged_snapshot(self) -> dict[str, list[pa.Array]]:
        """The per-slot arrays of the ragged fields (take under the store's lock: writers replace them)."""
        # shared ragged fields: a view that copies a slot when asked (the snapshot's seq check follows the copy)
        return {k: v if k in self.tier_ragged else list(v) for k, v in self.ragged.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.arrays

    def initial_placement(self) -> None:
        """Place the columns' chunks in their tiers at construction: one tier has nothing to place."""

    def placement_counters(self) -> dict[str, int] | None:
        """Migrations and their bytes so far (`stats()["placement"]`); None for one tier."""
        return None

    def close(self) -> None:
        if self.pages is not None:
            self.pages.close()
        self.arrays.clear()
        self.ragged.clear()
        self.tier_ragged.clear()
