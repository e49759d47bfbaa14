"""Ragged (list) columns in flat tier memory: token ids and log-probs in one arena per column, on every tier.

Every store keeps a ragged column here (host memory, shared memory, the bottom tier of a tiered store), so that a
gather of any rows, in any order, is one ranged copy per row into the output (`take`: Arrow ListView over the
arena, flattened). `RaggedArena` keeps the rows in tier arrays:

- `values`: the elements, one ring of `capacity` elements for the whole column. A write or an update appends its
  rows' elements at the head (`HEAD`, a logical offset that only grows; physical offset `(L - BASE) % capacity`); a
  row's elements are contiguous (a row that would cross the ring's end starts at 0 instead, the skipped tail being
  padding);
- `start`, `length` per ring position: where a row's elements are (length -1: null, a later field not written);
  `lstart` the same start as a logical offset, `origin` the logical offset the row's first write allocated at;
- `meta`: the head, the base, the capacity, the ring position after the last row written, and the very first
  allocation.

What may be overwritten: rows are written in seq order (under the store's write lock), so the elements that rows
still in the ring (written and not yet overwritten, live or evicted) may point at all lie at or after the `origin`
of the oldest of them: the row at the ring position after the rows being written (or, before the ring has wrapped
once, the first allocation). An append must keep `HEAD - tail <= capacity`. Updates of later fields append and
re-point (a row's `origin` stays): their old elements become garbage that the head reuses once the row leaves the
ring. So the arena holds the elements of the rows in the ring plus updated-away elements and at most one row of
padding: close to the payload, where two regions per chunk slot held up to twice it.

Sizing: a shared tier (and a tiered store's bottom tier) cannot grow: `capacity = arena_rows * mean_length`
(`FieldSpec.mean_length`, default 256) and rows that do not fit raise `OutOfSpace` before anything is written (the
arena holds `mean_length` elements per ring row on average, whatever any one chunk holds). On a growable tier (the
process heap, `Tier.growable`) the arena starts at `mean_length` (default 64) per row and grows to what the rows need
plus a quarter (at most `MAX_SLACK_BYTES`): new arrays, the live elements copied, rows re-pointed; readers holding
the old arrays keep reading them (a reader takes the arrays once per gather, `_view`), and the rows it must not
trust are caught by the same seq and presence checks as any concurrent write.

Readers gather rows with one ranged copy (Arrow ListView over the mapped `values`, flattened), clamped to the arena
so a row being rewritten meanwhile can never point outside it; the store's seq check (eviction) and the presence
seqlock (updates, `arrowbuf.ring.presence`) then discard any row read while it changed: the head only overwrites
elements of rows that left the ring (their seqs were invalidated first) or garbage. All writes happen under the
store's write lock, which is cross-process for a shared tier.

Usage (what `arrowbuf.ring.columns.ColumnArenas` does)::

    arena = RaggedArena(spec, tier, chunk_rows, num_slots, arena_rows)
    arena.write(first_pos, list_array)      # rows [first_pos, first_pos + n) of the ring, in seq order
    arena.update(positions, list_array)     # later fields: new elements for live rows
    arena.take(positions)                   # pa.ListArray (a copy)
    arena.held_bytes()                      # bytes of elements the arena holds (its memory)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import OutOfSpace
from ..schema import FieldSpec
from ..schema.convert import arrow_to_numpy, numpy_to_arrow
from ..tiers.base import Tier
from .outpool import OutputPool
from .ragged_gather import own as _own

#: Mean elements per row a ragged field is sized for when its schema does not say (`mean_length`).
DEFAULT_MEAN_LENGTH = 256
#: The same for an arena on a growable tier (host memory): it starts small and grows to what the rows need.
GROWABLE_MEAN_LENGTH = 64
#: A growing arena takes a quarter more than it needs, at most this many bytes more.
MAX_SLACK_BYTES = 1 << 30

# meta slots
_HEAD, _BASE, _CAP, _NEXT, _FIRST = range(5)


def arena_capacity(spec: FieldSpec, arena_rows: int) -> int:
    """Elements a fixed (shared or disk) arena of ragged field `spec` holds: `mean_length` per ring row."""
    return int(arena_rows) * int(spec.mean_length or DEFAULT_MEAN_LENGTH)


def planned_bytes(spec: FieldSpec, chunk_rows: int, num_slots: int, arena_rows: int) -> int:
    """Bytes a `RaggedArena` of `spec` takes (a shared tier checks its free space before anything is made)."""
    return arena_capacity(spec, arena_rows) * spec.dtype.itemsize + 32 * arena_rows + 64


def grown_capacity(needed: int, itemsize: int) -> int:
    """Elements a growable arena takes when it needs `needed`: a quarter more, the slack at most `MAX_SLACK_BYTES`."""
    return int(needed) + min(int(needed) // 4, MAX_SLACK_BYTES // max(1, int(itemsize)))


class RaggedArena:
    """One ragged column in tier memory (see the module docstring).

    Args:
        spec: the ragged field.
        tier: where the arrays live (shared memory: every process of the store maps them).
        chunk_rows, num_slots, arena_rows: the ring geometry (`arrowbuf.ring.chunks.ChunkDirectory`).
    """

    def __init__(self, spec: FieldSpec, tier: Tier, chunk_rows: int, num_slots: int, arena_rows: int) -> None:
        self.spec = spec
        self.type = spec.physical_type()  # json: the bytes of its text (the store gives it its Arrow type)
        self.chunk_rows = int(chunk_rows)
        self.num_slots = int(num_slots)
        self.arena_rows = int(arena_rows)
        self.tier = tier
        self.growable = bool(getattr(tier, "growable", False)) and not tier.shared
        cap = (int(arena_rows) * int(spec.mean_length or GROWABLE_MEAN_LENGTH) if self.growable
               else arena_capacity(spec, arena_rows))
        self.key = key = f"ragged.{spec.name}"
        i64 = np.dtype(np.int64)
        self.start = tier.allocate(f"{key}.start", i64, arena_rows)
        self.length = tier.allocate(f"{key}.length", i64, arena_rows)
        self.lstart = tier.allocate(f"{key}.lstart", i64, arena_rows)
        self.origin = tier.allocate(f"{key}.origin", i64, arena_rows)
        self.meta = tier.allocate(f"{key}.meta", i64, 8)
        self.values = tier.allocate(f"{key}.values", spec.dtype, max(1, cap))
        self.grown = 0  # times the arena grew (a growable tier)
        #: where large gathers put their values (the store reader's pool, `ColumnArenas.use_outputs`), or None
        self.outputs: OutputPool | None = None
        if tier.fresh:
            self.start.fill(0)
            self.length.fill(-1)
            self.lstart.fill(0)
            self.origin.fill(-1)  # never written
            self.meta.fill(0)
            self.meta[_CAP] = len(self.values)
            self.meta[_FIRST] = -1
        # the elements as one Arrow array over the mapped memory (zero-copy for numbers; bools are bit-packed in
        # Arrow, so they are gathered with numpy instead)
        self._flat = None if spec.dtype == np.bool_ else numpy_to_arrow(self.values, self.type.value_type)
        self._view = (self.values, self._flat, self.start, self.length)  # what a reader reads, taken once

    @property
    def capacity(self) -> int:
        """Elements the arena holds."""
        return int(self.meta[_CAP])

    def held_bytes(self) -> int:
        """Bytes of element memory the arena keeps (what it costs beyond 32 bytes of bookkeeping per ring row)."""
        return self.capacity * self.spec.dtype.itemsize

    # ------------------------------------------------------------------ writes (under the store's write lock)
    def write(self, first_pos: int, values: pa.Array) -> None:
        """Rows [first_pos, first_pos + len(values)) of the ring (wrapping at its end), the next rows in seq order.

        Raises:
            OutOfSpace: the arena cannot hold the rows' elements; nothing written.
        """
        n = len(values)
        if not n:
            return
        offs = arrow_to_numpy(values.offsets).astype(np.int64)
        lens = np.diff(offs)
        nxt = (int(first_pos) + n) % self.arena_rows
        tail = self._tail(nxt)
        starts = self._place(lens, tail, f"{n} rows at ring position {first_pos}")
        pos = (int(first_pos) + np.arange(n, dtype=np.int64)) % self.arena_rows
        self._copy(starts, values, offs)
        self._point(pos, starts, lens, values)
        self.origin[pos] = starts
        if int(self.meta[_FIRST]) < 0:
            self.meta[_FIRST] = int(starts[0])
        self.meta[_NEXT] = nxt

    def update(self, positions: np.ndarray, values: pa.Array) -> None:
        """New elements for the rows at `positions` (distinct, live): appended at the head, then the rows point at
        them. The caller brackets this with the presence seqlock.

        Raises:
            OutOfSpace: the arena cannot hold the new elements; nothing written.
        """
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if not pos.size:
            return
        offs = arrow_to_numpy(values.offsets).astype(np.int64)
        lens = np.diff(offs)
        starts = self._place(lens, self._tail(int(self.meta[_NEXT])), f"an update of {pos.size} rows")
        self._copy(starts, values, offs)
        self._point(pos, starts, lens, values)

    def _tail(self, nxt: int) -> int:
        """The lowest logical offset rows still in the ring may point at, once the rows up to ring position `nxt`
        are (re)written: the first allocation of the row at `nxt` (the oldest left), or of the very first row
        while the ring has not wrapped (conservative: only ever too low)."""
        first = int(self.meta[_FIRST])
        o = int(self.origin[nxt])
        if first < 0:
            return int(self.meta[_HEAD])
        return o if o >= 0 else first

    def _place(self, lens: np.ndarray, tail: int, what: str) -> np.ndarray:
        """Logical starts for rows of `lens` elements (nulls: -1, no elements) appended at the head, growing the
        arena or raising `OutOfSpace` when `HEAD - tail` would pass its capacity; advances the head."""
        sizes = np.maximum(lens, 0)
        need = int(sizes.sum())
        if int(sizes.max(initial=0)) > (1 << 62):
            raise OutOfSpace(f"ragged field {self.spec.name!r}: a row too long")
        for attempt in range(2):
            cap = self.capacity
            head, base = int(self.meta[_HEAD]), int(self.meta[_BASE])
            starts, end = _layout(sizes, head, (head - base) % cap if cap else 0, cap)
            if end - tail <= cap:
                break
            if attempt or not self.growable:
                mean = self.spec.mean_length or DEFAULT_MEAN_LENGTH
                raise OutOfSpace(
                    f"ragged field {self.spec.name!r}: {what} need {need} elements; the arena of {cap} elements "
                    f"({self.arena_rows} ring rows x mean_length {mean}) has {max(0, cap - (head - tail))} free "
                    f"(the rows still in the ring hold the rest); declare a larger mean_length for it in the "
                    f"schema (e.g. {2 * mean})")
            self._grow(tail, end - tail + int(sizes.max(initial=0)))
        self.meta[_HEAD] = end
        return starts

    def _copy(self, starts: np.ndarray, values: pa.Array, offs: np.ndarray) -> None:
        """The elements of `values`' rows to logical `starts` (consecutive rows in one piece each side of a wrap)."""
        first, last = int(offs[0]), int(offs[-1])
        if last <= first:
            return
        flat = arrow_to_numpy(values.values.slice(first, last - first))
        rel = offs - first
        cap, base = self.capacity, int(self.meta[_BASE])
        phys = (starts - base) % cap
        # rows laid out back to back except at the one wrap (if any): copy in at most two ranges
        cut = np.flatnonzero(np.diff(phys) != np.diff(offs)[:-1]) + 1
        bounds = [0, *cut.tolist(), len(starts)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            lo, hi = int(rel[a]), int(rel[b])
            if hi > lo:
                p = int(phys[a])
                self.values[p:p + hi - lo] = flat[lo:hi]

    def _point(self, pos: np.ndarray, starts: np.ndarray, lens: np.ndarray, values: pa.Array) -> None:
        if values.null_count:
            lens = np.where(np.asarray(values.is_valid(), dtype=bool), lens, -1)
        self.lstart[pos] = starts
        self.start[pos] = (starts - int(self.meta[_BASE])) % self.capacity
        self.length[pos] = lens

    def _grow(self, tail: int, needed: int) -> None:
        """A new ring of `grown_capacity(needed)` elements holding logical [tail, HEAD) from its start: new arrays,
        the used part copied, rows re-pointed; then readers are switched to them (under the store's write lock)."""
        old_cap, head, base = self.capacity, int(self.meta[_HEAD]), int(self.meta[_BASE])
        new_cap = max(grown_capacity(needed, self.spec.dtype.itemsize), old_cap + 1)
        values = self.tier.allocate(f"{self.key}.values", self.spec.dtype, new_cap)
        used = head - tail
        if used > 0:
            p = (tail - base) % old_cap
            first = min(used, old_cap - p)
            values[:first] = self.values[p:p + first]
            if used > first:
                values[first:used] = self.values[:used - first]
        rows = self.arena_rows
        start = self.tier.allocate(f"{self.key}.start", np.dtype(np.int64), rows)
        length = self.tier.allocate(f"{self.key}.length", np.dtype(np.int64), rows)
        kept = self.lstart >= tail  # every row still in the ring (rows below are being rewritten now)
        start[:] = np.where(kept, self.lstart - tail, 0)
        length[:] = np.where(kept, self.length, -1)
        flat = None if self.spec.dtype == np.bool_ else numpy_to_arrow(values, self.type.value_type)
        self.values, self.start, self.length, self._flat = values, start, length, flat
        self.meta[_BASE], self.meta[_CAP] = tail, new_cap
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
        starts = np.clip(starts, 0, total)  # a row rewritten while read may hold anything: stay inside the arena
        lens = np.clip(np.where(valid, lens, 0), 0, total - starts)
        offsets = np.zeros(len(pos) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        if offsets[-1] >= 2**31:
            raise OutOfSpace(f"ragged field {self.spec.name!r}: {int(offsets[-1])} elements in one gather are more "
                             "than a list column's int32 offsets address; gather fewer rows")
        flat: pa.Array
        outputs = self.outputs
        count = int(offsets[-1])
        if flat_values is not None and outputs is not None and count and count * values.itemsize >= outputs.min_bytes:
            # into a pooled array: warm pages, kept through pauses (Arrow's allocator hands freed memory back to
            # the kernel after a short delay, so a gather after a pause faulted its output in again)
            out = outputs.at_least(count, values.dtype, tag=self.key)
            ends = starts + lens
            cut = np.flatnonzero(starts[1:] != ends[:-1]) + 1  # rows side by side in the arena: one run (FIFO)
            lo = starts[np.concatenate(([0], cut))].tolist()
            hi = ends[np.concatenate((cut - 1, [len(ends) - 1]))].tolist()
            np.concatenate([values[a:b] for a, b in zip(lo, hi)], out=out)
            mask = None if valid.all() else numpy_to_arrow(~valid)
            res = pa.ListArray.from_arrays(numpy_to_arrow(offsets.astype(np.int32)),
                                           numpy_to_arrow(out, self.type.value_type), type=self.type, mask=mask)
            return _own(res, out)
        if flat_values is not None and total < 2**31:
            view = pa.ListViewArray.from_arrays(numpy_to_arrow(starts.astype(np.int32)),
                                                numpy_to_arrow(lens.astype(np.int32)), flat_values)
            flat = pc.list_flatten(view)
        elif flat_values is not None:
            flat = pc.list_flatten(pa.LargeListViewArray.from_arrays(numpy_to_arrow(starts), numpy_to_arrow(lens),
                                                                     flat_values))
        else:
            idx = np.repeat(starts - offsets[:-1], lens) + np.arange(int(offsets[-1]), dtype=np.int64)
            flat = numpy_to_arrow(values[idx], self.type.value_type)
        mask = None if valid.all() else numpy_to_arrow(~valid)
        out = pa.ListArray.from_arrays(numpy_to_arrow(offsets.astype(np.int32)), flat, type=self.type, mask=mask)
        return _own(out) if _outside(flat, values) else out

    def slot(self, s: int) -> pa.Array:
        """The rows of chunk slot `s` (a copy)."""
        return self.take(np.arange(s * self.chunk_rows, (s + 1) * self.chunk_rows, dtype=np.int64))


def _layout(sizes: np.ndarray, head: int, phead: int, cap: int) -> tuple[np.ndarray, int]:
    """Logical starts of rows of `sizes` elements appended at logical `head` (physical `phead`) of a ring of `cap`
    elements, each row contiguous: the first row that would cross the ring's end starts at its beginning (the rest
    of the ring is padding). Returns (starts, the new head)."""
    ends = np.cumsum(sizes)
    rel = ends - sizes  # starts relative to the head, no wrap
    room = cap - phead
    cross = np.flatnonzero(ends > room)
    if cross.size and cap:
        k = int(cross[0])
        rel[k:] += room - int(rel[k])  # row k and after start at the ring's beginning
    end = head + (int(rel[-1] + sizes[-1]) if sizes.size else 0)
    return head + rel, end
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

    def __init__(self, arena: RaggedArena, read: Callable[[np.ndarray], pa.Array] | None = None) -> None:
        self.arena = arena
        self.read = read

    def __len__(self) -> int:
        return self.arena.num_slots

    def __getitem__(self, s: int) -> pa.Array:
        if self.read is None:
            return self.arena.slot(int(s))
        pos = np.arange(int(s) * self.arena.chunk_rows, (int(s) + 1) * self.arena.chunk_rows, dtype=np.int64)
        return self.read(pos)

    def __iter__(self) -> Iterator[pa.Array]:
        return (self[s] for s in range(len(self)))
