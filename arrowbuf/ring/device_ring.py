"""The device ring: a store's ring mirrored in device memory, for sampling without the host.

A store whose GPU tier can hold the whole ring of the columns it samples keeps, beside the host arenas (which stay
the source of truth: writers of every process, the index, Flight, the journal and checkpoints work on them):

- one device arena per mirrored column spanning the whole ring, plus, for a `next_of` source (`obs` for a derived
  `next_obs`), the final observations of ended episodes at rows `arena_rows + slot`: the encoding the index's
  `next_pos` already uses, so a derived column is one `index_select` through the mirrored `next_pos`;
- mirrors of the index's `seq`, `next_pos`, `episode_id`, `step` and `valid`, and the storage of a device sum tree
  whose leaves mirror the sampler's mass (`arrowbuf.samplers.device`).

The mirror is pulled, not pushed: `sync` runs in the sampling process under the store's state lock and copies what
changed since the last sync, found from the index alone (so writers in other processes of a shared store feed it
too, and a writer never touches device memory):

1. rows committed since (`[synced hi, hi)`): their columns (contiguous ranges of the ring) and index entries;
2. rows evicted since (`[synced lo, lo)`): their index entries (no longer sampleable);
3. rows whose successor was pending (`next_pos == PENDING` when last copied): their `next_pos` and validity, once
   a later commit linked them (a successor or a final observation);
4. final observations: the slot a copied sampleable row points at (`next_pos >= arena_rows`), unless the device
   holds it for that row already; and the rows whose slot was claimed again since (the writer made them
   unsampleable: the `final_count` counter says which slots, the slot's owner says when it was released);
5. positions the caller names (a priority update given on the host).

Each upload goes through pinned host memory and is queued on the sampling stream without waiting
(`arrowbuf.tiers.gpu.Staging`); the device reads that follow (draws, gathers) are queued after it on the same
stream, so stream order replaces the host path's seqlock: the mirror holds a consistent state of the ring as of
the sync (taken under the lock), and nothing changes it until the next sync, which is queued after this sample's
gathers. A sample thus never re-draws a torn row. Memory on the device: the mirrored columns' rows
(`planned_bytes`), 33 bytes per ring position for the index mirrors, and 16 per position for the tree.

A restore (or any jump of more than a ring) is a full rebuild: every live row copied, one bulk copy per column.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np

from ..errors import OutOfSpace
from ..schema import ExperienceSchema, FieldSpec
from ..tiers.base import format_bytes
from ..tiers.gpu import GpuTier, as_signed
from .index import PENDING, RingIndex

#: Bytes per ring position of the index mirrors (seq, next_pos, episode_id, step: int64; valid: bool) and the tree.
INDEX_BYTES = 4 * 8 + 1


def tree_nodes(rows: int) -> int:
    """float64 elements of a sum tree over `rows` leaves (`arrowbuf.samplers.sumtree` layout)."""
    return 2 << (int(rows) - 1).bit_length()


def mirrorable(schema: ExperienceSchema) -> list[FieldSpec]:
    """The fields a device ring can hold: fixed-width, of a numpy dtype, written with their row (not filled later)."""
    return [f for f in schema.fields.values() if not f.ragged and f.plain and not f.later]


def planned_bytes(fields: list[FieldSpec], arena_rows: int, final_capacity: int, final_sources: list[str]) -> int:
    """Device bytes of a ring of `fields` (columns, final rows, index mirrors, tree)."""
    cols = sum(f.row_bytes * (arena_rows + (final_capacity if f.name in final_sources else 0)) for f in fields)
    return cols + INDEX_BYTES * arena_rows + 8 * tree_nodes(arena_rows)


class DeviceRing:
    """A store's ring mirrored on a device (see the module docstring).

    Args:
        tier: the GPU tier the arenas are allocated in (counted in its budget).
        fields: the mirrored fields (a subset of `mirrorable(schema)`); a derived field is mirrored when its source is.
        arena_rows, final_capacity, final_sources: the ring's geometry (`ColumnArenas`).

    Attributes:
        arenas: per mirrored field, its device arena (`arena_rows` rows, plus `final_capacity` for a `next_of`
            source). seq, next_pos, episode_id, step, valid: the index mirrors. tree: the sum-tree storage.
        lock: held for a whole device sample (sync, draws, gathers) so that no other sync's copies land between a
            draw and its gathers.
        stats: syncs, rows copied, full rebuilds.
    """

    def __init__(self, tier: GpuTier, fields: list[FieldSpec], arena_rows: int, final_capacity: int,
                 final_sources: list[str]) -> None:
        torch = tier.torch
        self.tier = tier
        self.torch = torch
        self.device = tier.device
        self.arena_rows = int(arena_rows)
        self.final_capacity = int(final_capacity)
        self.fields = {f.name: f for f in fields}
        self.final_sources = [s for s in final_sources if s in self.fields]
        need = planned_bytes(fields, self.arena_rows, self.final_capacity, self.final_sources)
        if not tier.fits(need):
            raise OutOfSpace(f"gpu tier: a device ring of {sorted(self.fields)} needs {format_bytes(need)}, "
                             f"{format_bytes(tier.nbytes())} of the {format_bytes(tier.budget or 0)} budget are in "
                             "use; raise the budget, ring fewer columns (GpuTier(ring=[...])) or ring=False")
        self._keys: list[str] = []
        self.arenas: dict[str, Any] = {}
        for f in fields:
            extra = self.final_capacity if f.name in self.final_sources else 0
            self.arenas[f.name] = self._alloc(f"ring.{f.name}", f.dtype, self.arena_rows + extra, f.shape)
        i64 = np.dtype(np.int64)
        self.seq = self._alloc("ring.index.seq", i64, self.arena_rows)
        self.next_pos = self._alloc("ring.index.next_pos", i64, self.arena_rows)
        self.episode_id = self._alloc("ring.index.episode_id", i64, self.arena_rows)
        self.step = self._alloc("ring.index.step", i64, self.arena_rows)
        self.valid = self._alloc("ring.index.valid", np.dtype(np.bool_), self.arena_rows)
        self.tree = self._alloc("ring.mass", np.dtype(np.float64), tree_nodes(self.arena_rows))
        self.seq.fill_(-1)
        self.next_pos.fill_(PENDING)
        self.valid.fill_(False)
        self.tree.zero_()
        self.episode_id.zero_()
        self.step.zero_()
        self.staging = tier.staging
        self.stream = torch.cuda.Stream(device=self.device) if tier.cuda else None
        self.lock = threading.RLock()
        self.caller: Any = None  # the stream of the sample in progress (`on_stream`)
        # what was copied, as of the last sync (host memory only: reading it never waits for the device)
        self.lo = self.hi = 0
        self.fin_mark = 0  # final-observation slots claimed before this count are settled on the device
        self.fresh = True
        self.pending = np.empty(0, dtype=np.int64)  # positions whose successor was pending when copied
        self.valid_shadow = np.zeros(self.arena_rows, dtype=bool)
        self.valid_count = 0
        self.owner_shadow = np.full(max(1, self.final_capacity), -1, dtype=np.int64)
        self.extra: list[np.ndarray] = []
        self.stats = {"syncs": 0, "rows_copied": 0, "index_copied": 0, "final_copied": 0, "rebuilds": 0}

    def _alloc(self, key: str, dtype: np.dtype, rows: int, shape: tuple[int, ...] = ()) -> Any:
        self._keys.append(key)
        return self.tier.allocate(key, dtype, rows, shape)

    def nbytes(self) -> int:
        """Device bytes the ring holds."""
        return sum(int(t.numel() * t.element_size()) for t in (*self.arenas.values(), self.seq, self.next_pos,
                                                               self.episode_id, self.step, self.valid, self.tree))

    def close(self) -> None:
        """Give the ring's device memory back to the tier (the store then samples on the host path)."""
        for key in self._keys:
            self.tier.free(key)
        self._keys.clear()
        self.arenas.clear()

    @contextmanager
    def on_stream(self) -> Iterator[None]:
        """Run the block's device work on the ring's stream, ordered after the caller's stream and before it: the
        caller's earlier work on outputs it handed back finishes first, and its later work sees the batch. (The CPU
        has no streams: a plain block.)"""
        if self.stream is None:
            with nullcontext():
                yield
            return
        torch = self.torch
        caller = torch.cuda.current_stream(self.device)
        self.caller = caller
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            yield
        caller.wait_stream(self.stream)

    def hand_over(self, tensors: Any) -> None:
        """Tensors made on the ring's stream that the caller gets to keep (and may free): tell the caching allocator
        the caller's stream uses them, so their memory is not reused before its work on them is done."""
        if self.stream is not None:
            for t in tensors:
                t.record_stream(self.caller)

    def mark(self, positions: np.ndarray) -> None:
        """Positions whose index entry or mass changed outside a commit (a priority update given on the host): copied
        at the next sync."""
        self.extra.append(np.asarray(positions, dtype=np.int64).reshape(-1))

    # ------------------------------------------------------------------ the pull
    def sync(self, index: RingIndex, final_owner: np.ndarray, rows: Callable[[str, int, int], np.ndarray],
             finals: Callable[[str, np.ndarray], np.ndarray],
             mass: Callable[[np.ndarray], np.ndarray]) -> tuple[Any, Any] | None:
        """Under the store's state lock, on the ring's stream: copy what changed since the last sync (see the module
        docstring). `rows(name, p0, p1)` reads host rows `[p0, p1)` of a column, `finals(name, slots)` its final
        rows, `mass(positions)` the sampler's mass. Returns (positions, their mass) as device tensors, for the
        device tree's leaves, or None when nothing changed."""
        lo, hi = index.lo, index.hi
        fc = index.counter("final_count")
        if not self.fresh and hi == self.hi and lo == self.lo and fc == self.fin_mark and not self.extra:
            return None
        self.stats["syncs"] += 1
        ar = self.arena_rows
        full = self.fresh or hi - self.hi >= ar  # a jump of a ring or more: every position changed
        parts: list[np.ndarray] = []
        if full:
            self.stats["rebuilds"] += 1
            parts.append(np.arange(ar, dtype=np.int64))
            new0 = lo
        else:
            new0 = max(self.hi, lo)
            parts.append(np.arange(new0, hi, dtype=np.int64) % ar)        # committed since
            parts.append(np.arange(self.lo, min(lo, self.hi), dtype=np.int64) % ar)  # evicted since
            if len(self.pending):  # linked since: a successor or a final slot arrived
                parts.append(self.pending[index.next_pos[self.pending] != PENDING])
        parts.extend(self.extra)
        self.extra = []
        lost = self._released(final_owner, fc, full)
        if len(lost):
            parts.append(lost)
        dirty = np.unique(np.concatenate(parts)) if len(parts) > 1 else parts[0]
        # columns of the rows committed since: contiguous ranges of the ring
        for p0, p1 in _ranges(new0, hi, ar):
            for name, arena in self.arenas.items():
                self.staging.copy_into(arena[p0:p1], as_signed(np.asarray(rows(name, p0, p1))))
            self.stats["rows_copied"] += p1 - p0
        self.lo, self.hi, self.fresh = lo, hi, False
        if not len(dirty):
            return None
        # index entries and mass of the dirty positions: one upload of one packed int64 array
        valid = index.valid[dirty]
        pack = np.empty((7, len(dirty)), dtype=np.int64)
        pack[0] = dirty
        pack[1] = index.seq[dirty]
        pack[2] = index.next_pos[dirty]
        pack[3] = index.episode_id[dirty]
        pack[4] = index.step[dirty]
        pack[5] = valid
        pack[6] = mass(dirty).view(np.int64)
        self._final_rows(pack, valid, finals)
        dev = self.staging.to_device(pack)
        pos = dev[0]
        self.seq.index_copy_(0, pos, dev[1])
        self.next_pos.index_copy_(0, pos, dev[2])
        self.episode_id.index_copy_(0, pos, dev[3])
        self.step.index_copy_(0, pos, dev[4])
        self.valid.index_copy_(0, pos, dev[5] != 0)
        self.valid_count += int(np.count_nonzero(valid)) - int(np.count_nonzero(self.valid_shadow[dirty]))
        self.valid_shadow[dirty] = valid
        self.stats["index_copied"] += len(dirty)
        # the pending set: copied positions (and those still pending) whose successor has not arrived
        cand = dirty if full else np.union1d(self.pending, dirty)
        seq = index.seq[cand]
        self.pending = cand[(index.next_pos[cand] == PENDING) & (seq >= lo) & (seq < hi)]
        return pos, dev[6].view(self.torch.float64)

    def _released(self, final_owner: np.ndarray, fc: int, full: bool) -> np.ndarray:
        """Positions of rows whose final-observation slot was claimed again since the last sync (the writer made them
        unsampleable, or is about to: a slot is counted as claimed before its old owner is released, so a slot still
        held by the owner the device knows is looked at again next time)."""
        cap = self.final_capacity
        if not self.final_sources or cap < 1:
            self.fin_mark = fc
            return np.empty(0, np.int64)
        if full:
            self.owner_shadow.fill(-1)
            self.fin_mark = fc
            return np.empty(0, np.int64)
        counts = np.arange(max(self.fin_mark, fc - cap), fc, dtype=np.int64)
        if not len(counts):
            return np.empty(0, np.int64)
        slots = counts % cap
        old = self.owner_shadow[slots]
        held = (old >= 0) & (final_owner[slots] == old)  # not released yet
        stop = int(np.flatnonzero(held)[0]) if held.any() else len(counts)
        gone = old[:stop][old[:stop] >= 0]
        self.owner_shadow[slots[:stop]] = -1
        self.fin_mark = int(counts[stop]) if stop < len(counts) else fc
        return gone % self.arena_rows

    def _final_rows(self, pack: np.ndarray, valid: np.ndarray, finals: Callable[[str, np.ndarray], np.ndarray]
                    ) -> None:
        """The final observations the dirty rows of `pack` point at (sampleable rows whose successor is a final
        slot, which they own while sampleable), copied unless the device has them for that owner already."""
        if not self.final_sources:
            return
        ar = self.arena_rows
        fin = valid & (pack[2] >= ar)
        if not fin.any():
            return
        slots = pack[2][fin] - ar
        owners = pack[1][fin]
        new = self.owner_shadow[slots] != owners
        slots, owners = slots[new], owners[new]
        if not len(slots):
            return
        dst = self.staging.to_device(ar + slots)
        for name in self.final_sources:
            self.arenas[name].index_copy_(0, dst, self.staging.to_device(as_signed(np.asarray(finals(name, slots)))))
        self.owner_shadow[slots] = owners
        self.stats["final_copied"] += len(slots)


def _ranges(s0: int, s1: int, ar: int) -> list[tuple[int, int]]:
    """Ring position ranges of seqs [s0, s1) (at most two: the ring wraps once)."""
    if s1 <= s0:
        return []
    p0, n = s0 % ar, s1 - s0
    if p0 + n <= ar:
        return [(p0, p0 + n)]
    return [(p0, ar), (0, n - (ar - p0))]
