"""Ragged (list) columns in flat tier memory: token ids and log-probs in one arena per column, on every tier.

Every store keeps a ragged column here (host memory, shared memory, the bottom tier of a tiered store), so that a
gather of any rows, in any order, is one ranged copy per row into the output (`take`: Arrow ListView over the
arena, flattened), where one Arrow array per chunk slot needed two or three (one per slot touched, a concatenation,
one back into the order asked). `RaggedArena` keeps the rows in four arrays allocated from the tier:

- `values`: the elements, two regions of `slot_cap = chunk_rows * mean_length` elements per chunk slot
  (`FieldSpec.mean_length`, default 256), used by the slot's generations in turn;
- `start`, `length` per ring position: where a row's elements are (length -1: null, a later field not written);
- `fill` per region: elements used (a bump pointer); `half` and `last` per slot: the region the slot's current
  generation writes, and the highest row offset it wrote.

Why two regions: the ring evicts a slot's old rows piece by piece as new rows replace them, so while a new generation
fills a slot, rows of the old one further along are still live; their elements stay untouched in the other region.
A write at a row offset at or below `last` starts a new generation (offsets only grow within one), which switches
to the other region and empties it (every row pointing there is two generations old: evicted). Rows are appended;
`update` of a later field appends the new elements to the region the row's generation uses and then points the row
at them, so a reader never sees elements overwritten under it. Rows that need more than a region raise
`OutOfSpace` before anything is written (raise `mean_length` in the schema), except on a growable tier (the process
heap, `Tier.growable`): there the arena grows (regions at least doubled, the used part of each copied, rows
re-pointed) and readers holding the old arrays keep reading them: a reader takes the arrays once per gather
(`_view`), and the rows it must not trust are caught by the same seq and presence checks as any concurrent write.
Host arenas start at `mean_length` (default 64 elements per row) and grow to what the rows need; the two regions
per slot make an arena up to about twice the live elements.

Readers gather rows with one ranged copy (Arrow ListView over the mapped `values`, flattened), clamped to the region
so a row being rewritten meanwhile can never point outside it; the store's seq check (eviction) and the presence
seqlock (updates, `arrowbuf.ring.presence`) then discard any row read while it changed. All writes happen under the
store's write lock, which is cross-process for a shared tier.

Usage (what `arrowbuf.ring.columns.ColumnArenas` does for a shared tier)::

    arena = RaggedArena(spec, tier, chunk_rows, num_slots, arena_rows)
    arena.write(first_pos, list_array)      # rows [first_pos, first_pos + n) of the ring
    arena.update(positions, list_array)     # later fields: new elements for live rows
    arena.take(positions)                   # pa.ListArray (a copy)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import OutOfSpace
from ..schema import FieldSpec
from ..tiers.base import Tier
from .ragged_gather import own as _own
from .ragged_gather import take as _ragged_take

#: Mean elements per row a ragged field is sized for when its schema does not say (`mean_length`).
DEFAULT_MEAN_LENGTH = 256
#: The same for an arena on a growable tier (host memory): it starts small and grows to what the rows need.
GROWABLE_MEAN_LENGTH = 64


def slot_capacity(spec: FieldSpec, chunk_rows: int) -> int:
    """Elements one chunk slot of ragged field `spec` holds."""
    return int(chunk_rows) * int(spec.mean_length or DEFAULT_MEAN_LENGTH)


def planned_bytes(spec: FieldSpec, chunk_rows: int, num_slots: int, arena_rows: int) -> int:
    """Bytes a `RaggedArena` of `spec` takes (a shared tier checks its free space before anything is made)."""
    return 2 * num_slots * slot_capacity(spec, chunk_rows) * spec.dtype.itemsize + 16 * arena_rows + 32 * num_slots


class RaggedArena:
    """One ragged column in tier memory (see the module docstring).

    Args:
        spec: the ragged field.
        tier: where the arrays live (shared memory: every process of the store maps them).
        chunk_rows, num_slots, arena_rows: the ring geometry (`arrowbuf.ring.chunks.ChunkDirectory`).
    """

    def __init__(self, spec: FieldSpec, tier: Tier, chunk_rows: int, num_slots: int, arena_rows: int) -> None:
        self.spec = spec
        self.type = spec.arrow_type()
        self.chunk_rows = int(chunk_rows)
        self.num_slots = int(num_slots)
        self.tier = tier
        self.growable = bool(getattr(tier, "growable", False)) and not tier.shared
        self.slot_cap = (int(chunk_rows) * int(spec.mean_length or GROWABLE_MEAN_LENGTH) if self.growable
                         else slot_capacity(spec, chunk_rows))
        self.key = key = f"ragged.{spec.name}"
        self.start = tier.allocate(f"{key}.start", np.dtype(np.int64), arena_rows)
        self.length = tier.allocate(f"{key}.length", np.dtype(np.int64), arena_rows)
        self.fill = tier.allocate(f"{key}.fill", np.dtype(np.int64), 2 * num_slots)
        self.half = tier.allocate(f"{key}.half", np.dtype(np.int64), num_slots)
        self.last = tier.allocate(f"{key}.last", np.dtype(np.int64), num_slots)
        self.values = tier.allocate(f"{key}.values", spec.dtype, 2 * num_slots * self.slot_cap)
        self.grown = 0  # times the arena grew (a growable tier)
        if tier.fresh:
            self.start.fill(0)
            self.length.fill(-1)
            self.fill.fill(0)
            self.half.fill(0)
            self.last.fill(-1)
        # the elements as one Arrow array over the mapped memory (zero-copy for numbers; bools are bit-packed in
        # Arrow, so they are gathered with numpy instead)
        self._flat = None if spec.dtype == np.bool_ else pa.array(self.values, type=self.type.value_type)
        self._view = (self.values, self._flat, self.start, self.length)  # what a reader reads, taken once

    # ------------------------------------------------------------------ writes (under the store's write lock)
    def write(self, first_pos: int, values: pa.Array) -> None:
        """Rows [first_pos, first_pos + len(values)) of the ring (wrapping at its end).

        Raises:
            OutOfSpace: a region cannot hold the rows' elements; nothing written.
        """
        pieces = []
        pos, done, n = int(first_pos), 0, len(values)
        arena_rows = len(self.start)
        while done < n:
            slot, off = divmod(pos, self.chunk_rows)
            take = min(n - done, self.chunk_rows - off)
            pieces.append((slot, off, pos, values.slice(done, take)))
            done += take
            pos = (pos + take) % arena_rows
        plan = []
        used: dict[int, int] = {}
        for slot, off, p, part in pieces:  # room first: a batch that does not fit writes nothing
            fresh = off <= int(self.last[slot])  # a new generation of the slot: the other region, emptied
            region = 2 * slot + (1 - int(self.half[slot]) if fresh else int(self.half[slot]))
            used[region] = (0 if fresh else used.get(region, int(self.fill[region]))) + self._count(part)
            self._check_room(slot, used[region])
            plan.append((slot, off, p, part, fresh, region))
        for slot, off, p, part, fresh, region in plan:
            if fresh:
                self.half[slot] = region - 2 * slot
                self.fill[region] = 0
            self.last[slot] = off + len(part) - 1
            self._append(region, np.arange(p, p + len(part), dtype=np.int64), part)

    def update(self, positions: np.ndarray, values: pa.Array) -> None:
        """New elements for the rows at `positions` (distinct, live): appended to the regions their generations
        use, then the rows point at them. The caller brackets this with the presence seqlock.

        Raises:
            OutOfSpace: a region cannot hold the new elements; nothing written.
        """
        regions = self.regions(positions)
        lens = np.diff(np.asarray(values.offsets, dtype=np.int64))
        todo = []
        for r in np.unique(regions).tolist():
            sel = np.flatnonzero(regions == r)
            self._check_room(r // 2, int(self.fill[r]) + int(lens[sel].sum()))
            todo.append((r, sel))
        for r, sel in todo:
            self._append(r, positions[sel], _ragged_take(values, sel))

    def regions(self, positions: np.ndarray) -> np.ndarray:
        """The region each row at `positions` belongs to: its slot's current one for offsets its generation wrote
        (up to `last`), the other one for the older rows further along (exact, even for an empty row at a region's
        end, whose start alone would name the next region)."""
        pos = np.asarray(positions, dtype=np.int64)
        slot, off = np.divmod(pos, self.chunk_rows)
        half = self.half[slot]
        return 2 * slot + np.where(off <= self.last[slot], half, 1 - half)

    def _append(self, region: int, positions: np.ndarray, part: pa.Array) -> None:
        """Elements of `part`'s rows at the end of `region`; rows `positions` point at them."""
        offs = np.asarray(part.offsets, dtype=np.int64)
        first, last = int(offs[0]), int(offs[-1])
        base = region * self.slot_cap + int(self.fill[region])
        if last > first:
            child = part.values.slice(first, last - first)
            self.values[base:base + last - first] = child.to_numpy(zero_copy_only=False)
        lens = np.diff(offs)
        if part.null_count:
            lens = np.where(np.asarray(part.is_valid(), dtype=bool), lens, -1)
        self.start[positions] = base + offs[:-1] - first
        self.length[positions] = lens
        self.fill[region] += last - first

    def _count(self, part: pa.Array) -> int:
        offs = part.offsets
        return int(offs[len(offs) - 1].as_py()) - int(offs[0].as_py()) if len(part) else 0

    def _check_room(self, slot: int, elements: int) -> None:
        if elements > self.slot_cap and self.growable:
            self._grow(elements)
        if elements > self.slot_cap:
            mean = self.spec.mean_length or DEFAULT_MEAN_LENGTH
            raise OutOfSpace(f"ragged field {self.spec.name!r}: chunk slot {slot} needs {elements} elements, more "
                             f"than its region of {self.slot_cap} ({self.chunk_rows} rows x mean_length {mean}); "
                             f"declare a larger mean_length for it in the schema (e.g. {2 * mean})")

    def _grow(self, elements: int) -> None:
        """Regions of at least `elements` (and at least twice the old size): new arrays, the used part of every
        region copied, rows re-pointed; then readers are switched to them (under the store's write lock)."""
        old, new = self.slot_cap, max(2 * self.slot_cap, int(elements))
        n_regions = 2 * self.num_slots
        values = self.tier.allocate(f"{self.key}.values", self.spec.dtype, n_regions * new)
        for r in range(n_regions):
            used = int(self.fill[r])
            if used:
                values[r * new:r * new + used] = self.values[r * old:r * old + used]
        arena_rows = len(self.start)
        rows = np.arange(arena_rows, dtype=np.int64)
        regions = self.regions(rows)
        start = self.tier.allocate(f"{self.key}.start", np.dtype(np.int64), arena_rows)
        length = self.tier.allocate(f"{self.key}.length", np.dtype(np.int64), arena_rows)
        start[:] = self.start + regions * (new - old)
        length[:] = self.length
        flat = None if self.spec.dtype == np.bool_ else pa.array(values, type=self.type.value_type)
        self.values, self.start, self.length, self._flat, self.slot_cap = values, start, length, flat, new
        self._view = (values, flat, start, length)
        self.grown += 1

    # ------------------------------------------------------------------ reads
    def take(self, positions: np.ndarray) -> pa.Array:
        """Rows at ring `positions` as a list array of their own (one ranged copy)."""
        values, flat_values, start, length = self._view  # once: a growing arena swaps all four together
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        lens = length[pos].copy()
        starts = start[pos].copy()
        valid = lens >= 0
        total = len(values)
        starts = np.clip(starts, 0, total)  # a row rewritten while read may hold anything: stay inside the region
        lens = np.clip(np.where(valid, lens, 0), 0, total - starts)
        offsets = np.zeros(len(pos) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        if offsets[-1] >= 2**31:
            raise OutOfSpace(f"ragged field {self.spec.name!r}: {int(offsets[-1])} elements in one gather are more "
                             "than a list column's int32 offsets address; gather fewer rows")
        flat: Any
        if flat_values is not None and total < 2**31:
            view = pa.ListViewArray.from_arrays(pa.array(starts.astype(np.int32)), pa.array(lens.astype(np.int32)),
                                                flat_values)
            flat = pc.list_flatten(view)
        elif flat_values is not None:
            flat = pc.list_flatten(pa.LargeListViewArray.from_arrays(pa.array(starts), pa.array(lens), flat_values))
        else:
            idx = np.repeat(starts - offsets[:-1], lens) + np.arange(int(offsets[-1]), dtype=np.int64)
            flat = pa.array(values[idx], type=self.type.value_type)
        mask = None if valid.all() else pa.array(~valid)
        out = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), flat, type=self.type, mask=mask)
        return _own(out) if _outside(flat, values) else out

    def slot(self, s: int) -> pa.Array:
        """The rows of chunk slot `s` (a copy)."""
        return self.take(np.arange(s * self.chunk_rows, (s + 1) * self.chunk_rows, dtype=np.int64))


def _outside(flat: pa.Array, values: np.ndarray) -> bool:
    """Whether `flat`'s buffer is memory of its own, not a view into the arena `values` (only such a gather result
    may be handed to a trainer as writable memory)."""
    buf = flat.buffers()[1] if flat.type != pa.bool_() else None
    if buf is None or not len(flat):
        return False
    lo, hi = values.ctypes.data, values.ctypes.data + values.nbytes
    return not (lo <= buf.address < hi or lo < buf.address + buf.size <= hi)


class SlotView:
    """A `RaggedArena` as the per-slot list arrays a host store keeps (`ColumnArenas.ragged[name]`): `view[s]` is
    slot `s`'s rows, copied when asked (snapshots copy a slot, then check its rows' seqs). `read` is the presence
    seqlock of a later field, or None."""

    def __init__(self, arena: RaggedArena, read: Any = None) -> None:
        self.arena = arena
        self.read = read

    def __len__(self) -> int:
        return self.arena.num_slots

    def __getitem__(self, s: int) -> pa.Array:
        if self.read is None:
            return self.arena.slot(int(s))
        pos = np.arange(int(s) * self.arena.chunk_rows, (int(s) + 1) * self.arena.chunk_rows, dtype=np.int64)
        return self.read(pos)

    def __iter__(self) -> Any:
        return (self[s] for s in range(len(self)))
