"""The arenas of a tiered store (`ExperienceStore(..., tiers=...)`): one arena per (column, tier), residency per
(column, chunk slot), moves between tiers (`migrate`, what `arrowbuf.placement` calls) and a gather that takes from
each tier a row lives in. Same surface as `ColumnArenas` (arrowbuf/columns.py), whose write and gather rules it
extends; see that module's docstring for why host and disk arenas span the whole ring.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from ..schema import ExperienceSchema
from ..tiers.base import Tier
from ..tiers.gpu import GpuTier
from .chunks import ChunkDirectory
from .columns import ColumnArenas
from .device_ring import DeviceRing, mirrorable, planned_bytes
from .presence import Presence
from .ragged_arena import RaggedArena, SlotView

# A numpy call costs about this many seconds; an extra copy of a row this many bytes/s: the mixed-tier gather takes
# straight into the output run by run when the calls cost less than copying every row twice.
_RUN_COST = 3e-6
_COPY_BW = 4e9
_PAGE = 4096
_COLD_BW = 1e9  # a gather slower than this (bytes/s) read from a disk, not from memory


class _TrackedColumn:
    """`col[positions]` over a tiered column: host rows, and the read is recorded for the moved-chunk check."""

    def __init__(self, arenas: TieredColumnArenas, name: str, reads: list | None) -> None:
        self.arenas, self.name, self.reads = arenas, name, reads

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        return self.arenas.take(self.name, positions, self.reads, host=True)


class TieredColumnArenas(ColumnArenas):
    """Columns whose chunks live in several tiers; residency per (column, chunk slot).

    Addressing: in a non-slotted tier (host, disk) a column's arena spans the whole ring and a row keeps its ring
    position, so moving a chunk copies `[p0, p1)` of one arena to the same rows of another; the host tier's arenas
    are sparse (memory is held only for resident chunks). A slotted tier (GPU) holds a fixed number of chunk slots
    per column, found through `local[column, slot]`. A gather groups positions by tier: one take per column per tier.

    Consistency: a chunk is copied while it stays readable where it was, then the slot table flips under the store's
    lock (only if the chunk is still the same sealed, live generation), then the old copy is released. Each flip bumps
    the column's `epoch` and stamps the chunk (`stamp[column, slot] = epoch`); a sampler notes the epochs before a
    gather and afterwards re-gathers the rows whose chunk was stamped meanwhile, so it never returns a row read from
    a released or reused copy. A writer starting a new generation of a slot may move it (to where new chunks should
    go, `write_tier`), and waits for a migration of that slot in flight rather than race its copy.
    """

    tiered = True


    direct = False

    def __init__(self, schema: ExperienceSchema, directory: ChunkDirectory, meta: Tier, tiers: list[Tier],
                 final_capacity: int, final_sources: list[str], index: Any) -> None:
        import threading

        self.index = index
        self.schema = schema
        self.directory = directory
        self.chunk_rows = cr = directory.chunk_rows
        self.arena_rows = directory.arena_rows
        self.num_slots = directory.num_slots
        self.final_capacity = int(final_capacity)
        self.final_sources = list(final_sources)
        self.tiers = list(tiers)
        self.meta = meta
        self.slotted = [bool(t.slotted) for t in self.tiers]
        self.bottom = len(self.tiers) - 1
        self.fields = [f for f in schema.fields.values() if not f.ragged]  # ragged fields stay in the bottom tier
        self.names = [f.name for f in self.fields]
        self.ci = {n: directory.columns.index(n) for n in self.names}
        self.spec = {f.name: f for f in self.fields}
        self.row_bytes = {f.name: f.row_bytes for f in self.fields}
        self.chunk_bytes = {f.name: f.row_bytes * cr for f in self.fields}
        ncols = len(directory.columns)
        self.res = directory.residency
        self.local = np.zeros((ncols, self.num_slots), dtype=np.int64)
        self.epoch = np.zeros(ncols, dtype=np.int64)
        self.flips = 0  # every flip of any column: a sampler's fast check that nothing moved
        self.stamp = np.zeros((ncols, self.num_slots), dtype=np.int64)
        self.moving = np.zeros((ncols, self.num_slots), dtype=bool)
        self.holds = 0  # readers/updaters holding migrations off (`moves_held`): no new one starts while > 0
        self.write_tier = np.full(ncols, self.bottom, dtype=np.int8)
        self.access = [0] * ncols   # rows read per column (sample, Loader); plain ints: the sample path adds to it
        self._access_idx: dict[Any, list[int]] = {}
        # per column: slots in each tier, and the tier holding all of them (-1: several), for the direct take path
        self.counts = np.zeros((ncols, len(self.tiers)), dtype=np.int64)
        self.single = [-1] * ncols
        self.counters = {"migrations": 0, "migrated_bytes": 0, "aborted": 0, "regathers": 0, "held_gathers": 0,
                         "write_moves": 0}
        self.cond = threading.Condition(threading.Lock())
        self.arenas: list[dict[str, Any]] = [{} for _ in self.tiers]
        self.free: list[dict[str, list[int]]] = [{} for _ in self.tiers]
        for code, t in enumerate(self.tiers):
            if not t.slotted:
                for f in self.fields:
                    self.arenas[code][f.name] = t.allocate_sparse(f.name, f.dtype, self.arena_rows, f.shape)
        top = next(c for c in range(len(self.tiers)) if not self.slotted[c])
        self.arrays = dict(self.arenas[top])  # membership and `store._arenas`: the top non-slotted arenas
        self.presence = Presence(schema, meta, self.arena_rows)  # validity stays on the host (meta tier)
        # ragged fields (token ids, log-probs): flat arenas in the bottom tier (the disk, when there is one: a spill
        # for token data; the OS page cache keeps what is read often). Placement does not move them.
        self.ragged = {}
        self.tier_ragged = {}
        for f in schema.fields.values():
            if f.ragged:
                arena = RaggedArena(f, self.tiers[self.bottom], cr, self.num_slots, self.arena_rows)
                self.tier_ragged[f.name] = arena
                self.ragged[f.name] = SlotView(arena, self._consistent(f.name, arena.take) if f.later else None)
        self.later = self.presence.valid
        self._final_code = len(self.tiers)  # a pseudo tier code for final-observation rows in a gather
        self._prefetch = [hasattr(t, "prefetch") for t in self.tiers]  # tiers whose reads may wait for a disk
        self._cold = [True] * ncols  # per column: its last gather waited for a disk (prefetch the next one)
        self.final = {src: meta.allocate(f"final.{src}", self.spec[src].dtype, max(1, self.final_capacity),
                                         self.spec[src].shape) for src in self.final_sources}
        #: the ring mirrored in a GPU tier (`arrowbuf.ring.device_ring`), or None: see `_device_ring`
        self.device_ring: DeviceRing | None = self._device_ring()

    def _device_ring(self) -> DeviceRing | None:
        """The device ring a GPU tier asks for (`GpuTier(ring=...)`): None (auto) mirrors every mirrorable field when
        the tier is on a CUDA device and the whole ring of them fits its budget; True insists (`OutOfSpace`); a list
        names the fields. With a ring the tier holds no chunk slots: placement moves chunks between the other tiers."""
        for t in self.tiers:
            if not isinstance(t, GpuTier) or t.ring is False:
                continue
            fields = mirrorable(self.schema)
            if isinstance(t.ring, list):
                bad = [c for c in t.ring if c not in {f.name for f in fields}]
                if bad:
                    raise InvalidArgument(f"GpuTier(ring={t.ring!r}): {bad} cannot be mirrored on the device; "
                                          f"expected fields among {[f.name for f in fields]} (fixed-width, of a numpy "
                                          "dtype, not filled later)")
                fields = [f for f in fields if f.name in t.ring]
            if not fields:
                return None
            if t.ring is None and not (t.cuda and t.fits(planned_bytes(fields, self.arena_rows, self.final_capacity,
                                                                         self.final_sources))):
                return None
            return DeviceRing(t, fields, self.arena_rows, self.final_capacity, self.final_sources)
        return None

    def rows(self, name: str, p0: int, p1: int) -> np.ndarray:
        """Host rows [p0, p1) of column `name` (a view where they lie in one non-slotted tier, else a gather): what
        the device ring copies."""
        ci = self.ci[name]
        s0, s1 = p0 // self.chunk_rows, (p1 - 1) // self.chunk_rows
        codes = self.res[ci, s0:s1 + 1]
        code = int(codes[0])
        if not self.slotted[code] and (codes == code).all():
            return self.arenas[code][name][p0:p1]
        return self.take(name, np.arange(p0, p1, dtype=np.int64), host=True)

    def final_rows(self, name: str, slots: np.ndarray) -> np.ndarray:
        """Final observations in `slots` of column `name` (on the host: they never move)."""
        return self.final[name][slots]

    # ------------------------------------------------------------------ placement at start
    def placement_counters(self) -> dict[str, int]:
        """Migrations, their bytes, aborted moves and re-gathers so far (`stats()["placement"]`)."""
        return dict(self.counters)

    def initial_placement(self) -> None:
        """Every slot of every column starts in a non-slotted tier: the first slots of each column (the same number
        for every column) fill the upper tiers' budgets, the bottom tier takes the rest."""
        cr = self.chunk_rows
        per_slot = sum(self.chunk_bytes.values())
        first = 0
        for code, t in enumerate(self.tiers):
            if self.slotted[code]:
                continue
            if code == self.bottom or t.budget is None:
                n = self.num_slots - first
            else:
                room = t.budget - t.nbytes()
                n = max(0, min(self.num_slots - first, room // max(1, per_slot + 2 * mmap_page() * len(self.names))))
            for name in self.names:
                self.res[self.ci[name], first:first + n] = code
                t.hold(name, first * cr, (first + n) * cr, chunk=cr)
            first += n
            if first >= self.num_slots:
                break
        top = next(c for c in range(len(self.tiers)) if not self.slotted[c])
        self.write_tier[:] = top
        for name in self.names:
            ci = self.ci[name]
            self.counts[ci] = np.bincount(self.res[ci], minlength=len(self.tiers))
            full = np.flatnonzero(self.counts[ci] == self.num_slots)
            self.single[ci] = int(full[0]) if len(full) else -1

    # ------------------------------------------------------------------ writes
    def write(self, name: str, first_pos: int, values: Any) -> None:
        if self.later and name in self.later:
            values = self.presence.mark(name, first_pos, values)
        ci = self.ci[name]
        cr = self.chunk_rows
        p, end, off = int(first_pos), int(first_pos) + len(values), 0
        while p < end:
            s = p // cr
            q = min(end, (s + 1) * cr)
            if p == s * cr or self.slotted[self.res[ci, s]]:
                self._recycle(ci, name, s)
            self.arenas[self.res[ci, s]][name][p:q] = values[off:off + q - p]
            off += q - p
            p = q

    def write_row(self, name: str, pos: int, value: Any) -> None:
        if self.later and name in self.later:
            self.presence.mark_row(name, pos)
        ci = self.ci[name]
        s = pos // self.chunk_rows
        if pos == s * self.chunk_rows or self.slotted[self.res[ci, s]]:
            self._recycle(ci, name, s)
        self.arenas[self.res[ci, s]][name][pos] = value

    def write_final(self, name: str, slots: np.ndarray | int, values: Any) -> None:
        self.final[name][slots] = values

    def _put_rows(self, name: str, positions: np.ndarray, values: np.ndarray) -> None:
        """`update_rows` of a tiered column: rows written where their chunk lives. A migration copies a chunk without
        the write lock, so an update during its copy would be lost at its flip: the update holds new migrations off
        (`holds`), waits for those in flight on its chunks (bounded, however busy placement is), writes under `cond`."""
        ci = self.ci[name]
        cr = self.chunk_rows
        slots = positions // cr
        touched = np.unique(slots)
        with self.cond:
            self.holds += 1  # no new migration starts meanwhile: the wait is for those in flight only (bounded)
            try:
                while self.moving[ci, touched].any():
                    self.cond.wait()
                for s in touched.tolist():
                    sel = np.flatnonzero(slots == s)
                    code = int(self.res[ci, s])
                    if self.slotted[code]:  # device memory: read the chunk, change its rows, write it back
                        tier: Any = self.tiers[code]
                        arena = self.arenas[code][name]
                        off = int(self.local[ci, s]) * cr
                        chunk = np.array(tier.get(arena, off, off + cr, self.spec[name].dtype))
                        chunk[positions[sel] - s * cr] = values[sel]
                        tier.put(arena, off, chunk)
                    else:
                        self.arenas[code][name][positions[sel]] = values[sel]
            finally:
                self.holds -= 1

    @contextlib.contextmanager
    def moves_held(self) -> Iterator[None]:
        """Hold migrations off for the block (none starts; those in flight finish first): no copy a reader uses is
        released or reused meanwhile. For a reader whose optimistic seqlock keeps losing to placement. Writers may
        still move a slot whose old rows are all evicted (`_recycle`); a sample's torn-row check covers those."""
        with self.cond:
            self.holds += 1
        try:
            with self.cond:
                while self.moving.any():
                    self.cond.wait()
            yield
        finally:
            with self.cond:
                self.holds -= 1

    def _recycle(self, ci: int, name: str, s: int) -> None:
        """A writer starts a new generation of slot `s`. Rows of the old generation past the piece being written may
        still be live (eviction follows the writer piece by piece), so the slot moves without a copy only once all
        of them are evicted: then to where new chunks of this column should go, if that is higher and has room.
        Appends never go to device memory: a slot in a slotted tier is copied out first. Waits for a migration of
        the slot in flight."""
        cur, want = int(self.res[ci, s]), int(self.write_tier[ci])
        if not self.moving[ci, s] and not self.slotted[cur] and want >= cur:
            return
        cr = self.chunk_rows
        p0, p1 = s * cr, (s + 1) * cr
        with self.cond:
            while self.moving[ci, s]:
                self.cond.wait()
            cur = int(self.res[ci, s])
            if not self.slotted[cur] and want >= cur:
                return
            old_last = int(self.index.seq[p1 - 1])
            if not self.slotted[cur] and old_last >= self.index.lo:
                return  # live rows of the old generation stay readable where they are
            for target in range(min(want, cur) if not self.slotted[cur] else want, self.bottom + 1):
                if self.slotted[target] or target == cur:
                    continue
                t = self.tiers[target]
                if target != self.bottom and not t.fits(t.hold_cost(name, p0, p1)):
                    if not self.slotted[cur]:
                        return  # no room above: stay
                    continue
                t.hold(name, p0, p1)
                if self.slotted[cur]:  # copy what may still be read (a rare path: the oldest chunk on the device)
                    self.arenas[target][name][p0:p1] = self._read_chunk(cur, name, ci, s)
                else:  # a sampler may have drawn an old row just before its eviction: its seq check must fail
                    self.index.seq[p0:p1] = -1  # now, as the data it would read is not moved along
                self._flip(ci, s, target, -1)
                self._release(cur, name, ci, s)
                self.counters["write_moves"] += 1
                return

    # ------------------------------------------------------------------ reads
    def take(self, name: str, positions: np.ndarray, reads: list | None = None, host: bool = False) -> Any:
        """Rows at ring `positions`: one take per tier the rows live in (straight into the output). A device tensor
        when some rows are in a slotted (GPU) tier, unless `host`."""
        ci = self.ci[name]
        if reads is not None:
            reads.append((ci, positions))
        single = self.single[ci]
        if single >= 0 and not self.slotted[single]:  # the whole column in one tier: the direct path
            if not self._prefetch[single]:
                return self.arenas[single][name].take(positions, axis=0)
            started = self._prefetch_rows(name, ci, positions, None, [single])
            out = self.arenas[single][name].take(positions, axis=0)
            self._note_speed(ci, started, out.nbytes)
            return out
        slots = positions // self.chunk_rows
        return self._gather(name, ci, positions, slots, self.res[ci, slots], host)

    def take_next(self, name: str, positions: np.ndarray, reads: list | None = None, host: bool = False) -> Any:
        """Rows at ring positions or final-observation slots (`arena_rows + slot`, on the host: they never move)."""
        ci = self.ci[name]
        if reads is not None:  # `moved` skips final-observation slots
            reads.append((ci, positions))
        fin = positions >= self.arena_rows
        if not fin.any():
            return self.take(name, positions, None, host)
        slots = np.where(fin, 0, positions) // self.chunk_rows
        codes = self.res[ci, slots]
        codes[fin] = self._final_code
        return self._gather(name, ci, positions, slots, codes, host)

    def _gather(self, name: str, ci: int, positions: np.ndarray, slots: np.ndarray, codes: np.ndarray,
                host: bool) -> Any:
        """Rows of one column from the tiers `codes` name per row (`_final_code`: final-observation rows)."""
        if len(codes) == 0 or (codes == codes[0]).all():
            code = int(codes[0]) if len(codes) else self.bottom
            return self._take_from(code, name, ci, positions, slots, host)
        spec = self.spec[name]
        present = np.flatnonzero(np.bincount(codes, minlength=self._final_code + 1)).tolist()
        slotted = [c for c in present if self._is_slotted(c)]
        started = self._prefetch_rows(name, ci, positions, codes, present)
        device: Any = None if host or not slotted else self.tiers[slotted[0]]
        if device is None:
            out = np.empty((len(positions), *spec.shape), dtype=spec.dtype)
            cuts = np.flatnonzero(codes[1:] != codes[:-1]) + 1
            if len(cuts) * _RUN_COST < len(positions) * self.row_bytes[name] / _COPY_BW:
                # few runs of one tier (sorted positions, chunk-granular residency): take straight into the output
                starts = [0, *cuts.tolist()]
                stops = [*starts[1:], len(positions)]
                if slotted:
                    for a, b in zip(starts, stops):
                        out[a:b] = self._take_from(int(codes[a]), name, ci, positions[a:b], slots[a:b], True)
                else:
                    arenas = [*(self.arenas[c].get(name) for c in range(len(self.tiers))), self.final.get(name)]
                    pos = positions
                    if self._final_code in present:
                        pos = np.where(codes == self._final_code, positions - self.arena_rows, positions)
                    for a, b, c in zip(starts, stops, codes[starts].tolist()):
                        # mode="clip": with out=, the default mode="raise" gathers into a buffer and copies it again
                        np.take(arenas[c], pos[a:b], axis=0, out=out[a:b], mode="clip")
            else:
                for c in present:  # many short runs: one take per tier, then scatter
                    idx = np.flatnonzero(codes == c)
                    out[idx] = self._take_from(c, name, ci, positions[idx], slots[idx], True)
            self._note_speed(ci, started, out.nbytes)
            return out
        out = device.empty((len(positions), *spec.shape), spec.dtype)
        for c in present:
            idx = np.flatnonzero(codes == c)
            part = self._take_from(c, name, ci, positions[idx], slots[idx], False)
            if isinstance(part, np.ndarray):
                part = device.to_device(part)
            device.scatter(out, idx, part)
        return out

    def _prefetch_rows(self, name: str, ci: int, positions: np.ndarray, codes: np.ndarray | None,
                       present: list[int]) -> float:
        """Before a gather: when this column's recent gathers waited for a disk, start every disk read of the batch
        at once (rows of a page or more; smaller rows are read ahead with their neighbours anyway). Returns the
        start time, for `_note_speed`."""
        if self._cold[ci] and self.row_bytes[name] >= _PAGE:
            for c in present:
                if c < len(self.tiers) and self._prefetch[c]:
                    rows = positions if codes is None else positions[codes == c]
                    self.tiers[c].prefetch(name, np.sort(rows))  # type: ignore[attr-defined]
        return time.perf_counter()

    def _note_speed(self, ci: int, started: float, nbytes: int) -> None:
        """A gather slower than memory speed means pages came from the disk: prefetch the next batches."""
        if any(self._prefetch):
            self._cold[ci] = nbytes > _COLD_BW * (time.perf_counter() - started)

    def _device(self, code: int) -> Any:
        """The slotted tier `code` (its data-movement helpers: take, put, get)."""
        return self.tiers[code]

    def _is_slotted(self, code: int) -> bool:
        return code < len(self.tiers) and self.slotted[code]

    def _arena_of(self, code: int, name: str) -> tuple[np.ndarray, int]:
        """A non-slotted arena and the position its row 0 has."""
        if code == self._final_code:
            return self.final[name], self.arena_rows
        return self.arenas[code][name], 0

    def _take_from(self, code: int, name: str, ci: int, positions: np.ndarray, slots: np.ndarray, host: bool) -> Any:
        if not self._is_slotted(code):
            arena, offset = self._arena_of(code, name)
            return arena.take(positions - offset if offset else positions, axis=0)
        device_arena = self.arenas[code].get(name)
        if device_arena is None:  # a stale slot table read (the stamp check re-gathers): any valid rows will do
            return np.zeros((len(positions), *self.spec[name].shape), dtype=self.spec[name].dtype)
        local = np.clip(self.local[ci, slots], 0, len(device_arena) // self.chunk_rows - 1) * self.chunk_rows
        local += positions % self.chunk_rows
        tier: Any = self.tiers[code]
        out = tier.take(device_arena, local, self.spec[name].dtype)
        if host:
            out = out.cpu().numpy()
            dtype = self.spec[name].dtype
            return out.view(dtype) if out.dtype != dtype and out.dtype.itemsize == dtype.itemsize else out
        return out

    def column(self, name: str, reads: list | None = None) -> Any:
        return _TrackedColumn(self, name, reads)

    def view(self, name: str, p0: int, p1: int) -> np.ndarray:
        """Rows [p0, p1) of one chunk: zero-copy from the disk tier (its copy stays valid until the ring overwrites
        the rows); a copy from host (a later move gives those pages back) and device memory."""
        ci = self.ci[name]
        s = p0 // self.chunk_rows
        for _ in range(100):
            e0 = int(self.epoch[ci])
            code = int(self.res[ci, s])
            if self.slotted[code]:
                arena = self.arenas[code].get(name)
                if arena is None:
                    continue
                off = int(self.local[ci, s]) * self.chunk_rows + p0 - s * self.chunk_rows
                out = self._device(code).get(arena, off, off + p1 - p0, self.spec[name].dtype)
            elif code == self.bottom and self.tiers[code].name == "disk":
                out = self.arenas[code][name][p0:p1]
            else:
                out = np.array(self.arenas[code][name][p0:p1])
            if self.epoch[ci] == e0 or self.stamp[ci, s] <= e0:
                return out
        raise RuntimeError(f"could not read a stable copy of column {name!r} rows [{p0}, {p1})")

    def moved(self, e0: np.ndarray, reads: list, items: int) -> np.ndarray | None:
        """Per item (of `items`), whether a chunk it read was moved since the epochs `e0`; None: nothing moved."""
        changed = self.epoch != e0
        if not changed.any():
            return None
        bad: np.ndarray | None = None
        for ci, positions in reads:
            if not changed[ci]:
                continue
            ring = positions < self.arena_rows
            slots = np.where(ring, positions, 0) // self.chunk_rows
            hit = (self.stamp[ci, slots] > e0[ci]) & ring
            bad = hit if bad is None else bad | hit
        if bad is None:
            return None
        return np.asarray(bad.reshape(items, -1).any(axis=1))

    def count_access(self, key: Any, rows: int, resolve: Any, *args: Any) -> None:
        """Count `rows` read from the columns `resolve(*args)` names (cached under `key`: the sample path)."""
        idx = self._access_idx.get(key)
        if idx is None:
            names = resolve(*args)
            idx = self._access_idx[key] = sorted({self.ci[n] for n in names if n in self.ci})
        access = self.access
        for ci in idx:
            access[ci] += rows

    # ------------------------------------------------------------------ moves
    def ensure_arena(self, code: int, name: str, slots: int) -> bool:
        """Allocate column `name`'s arena of `slots` chunk slots in slotted tier `code` (once). False if it does not
        fit the budget."""
        with self.cond:
            if name in self.arenas[code]:
                return True
            if self.device_ring is not None and self.device_ring.tier is self.tiers[code]:
                return False  # that tier holds the device ring: no chunk slots besides
            t = self.tiers[code]
            nbytes = slots * self.chunk_bytes[name]
            if slots < 1 or not t.fits(nbytes):
                return False
            spec = self.spec[name]
            self.arenas[code][name] = t.allocate(name, spec.dtype, slots * self.chunk_rows, spec.shape)
            self.free[code][name] = list(range(slots - 1, -1, -1))
            return True

    def slots_total(self, code: int, name: str) -> int:
        arena = self.arenas[code].get(name)
        return 0 if arena is None else len(arena) // self.chunk_rows

    def migrate(self, name: str, s: int, target: int, gen: int | None, index: Any, state_lock: Any,
                write_lock: Any = None) -> bool:
        """Copy chunk slot `s` of column `name` to tier `target` and flip the slot table; False (and nothing changed)
        if there is no room, the slot is already moving, or the chunk changed meanwhile.

        A sealed chunk (`gen`: its first seq) is copied while writers go on: it stays that generation, unwritten,
        as long as it is live, which the flip checks. A slot that is not sealed (being written, partly evicted or
        empty; `gen=None`) moves only while `write_lock` is free, held for the move, so no writer touches it.
        """
        if gen is None:
            if write_lock is None or self.slotted[target] or not write_lock.acquire(blocking=False):
                return False
            try:
                return self._migrate(name, s, target, None, index, state_lock)
            finally:
                write_lock.release()
        return self._migrate(name, s, target, gen, index, state_lock)

    def _migrate(self, name: str, s: int, target: int, gen: int | None, index: Any, state_lock: Any) -> bool:
        ci = self.ci[name]
        cr = self.chunk_rows
        p0, p1 = s * cr, (s + 1) * cr
        t = self.tiers[target]
        local = -1
        seq = index.seq

        def unchanged() -> bool:  # under the state lock
            return gen is None or bool(seq[p0] == gen and gen >= index.lo and seq[p1 - 1] == gen + cr - 1)

        with state_lock:  # copy only a sealed chunk: every row committed, so nobody writes it while it stays live
            if not unchanged():
                return False
        with self.cond:
            cur = int(self.res[ci, s])
            if cur == target or self.moving[ci, s] or self.holds:
                return False
            if self.slotted[target]:
                free = self.free[target].get(name)
                if not free:
                    return False
                local = free.pop()
            else:
                if not t.fits(t.hold_cost(name, p0, p1)):
                    return False
                t.hold(name, p0, p1)
            self.moving[ci, s] = True
        ok = False
        try:
            with state_lock:  # an unsealed slot with no live row (writers are held off): nothing to copy
                empty = gen is None and seq[p0] < index.lo and seq[p1 - 1] < index.lo
            if empty:
                pass
            elif self.slotted[target]:
                t.put(self.arenas[target][name], local * cr, self._read_chunk(cur, name, ci, s))  # type: ignore
            else:
                self.arenas[target][name][p0:p1] = self._read_chunk(cur, name, ci, s)
            with state_lock:  # still that generation, none of its rows evicted: the copy is exact
                if unchanged():
                    with self.cond:
                        self._flip(ci, s, target, local)
                        ok = True
        finally:
            with self.cond:
                if ok:
                    self._release(cur, name, ci, s)
                    self.counters["migrations"] += 1
                    self.counters["migrated_bytes"] += 0 if empty else self.chunk_bytes[name]
                else:
                    if self.slotted[target]:
                        self.free[target][name].append(local)
                    else:
                        t.release(name, p0, p1)
                    self.counters["aborted"] += 1
                self.moving[ci, s] = False
                self.cond.notify_all()
        return ok

    def _read_chunk(self, code: int, name: str, ci: int, s: int) -> np.ndarray:
        cr = self.chunk_rows
        if self.slotted[code]:
            off = int(self.local[ci, s]) * cr
            return self.tiers[code].get(self.arenas[code][name], off, off + cr, self.spec[name].dtype)  # type: ignore
        return self.arenas[code][name][s * cr:(s + 1) * cr]

    def _flip(self, ci: int, s: int, target: int, local: int) -> None:
        """Under `cond`: point slot `s` of column `ci` at `target` (and its local slot), stamp it."""
        if local >= 0:
            self.local[ci, s] = local
        self.counts[ci, self.res[ci, s]] -= 1
        self.counts[ci, target] += 1
        self.single[ci] = -1
        self.res[ci, s] = target
        if self.counts[ci, target] == self.num_slots:
            self.single[ci] = target
        self.epoch[ci] += 1
        self.stamp[ci, s] = self.epoch[ci]
        self.flips += 1

    def _release(self, code: int, name: str, ci: int, s: int) -> None:
        """Under `cond`, after a flip: give back the copy of slot `s` in tier `code` (a slotted source keeps its
        local slot number in `local` until the slot moves there again)."""
        if self.slotted[code]:
            self.free[code][name].append(int(self.local[ci, s]))
        else:
            self.tiers[code].release(name, s * self.chunk_rows, (s + 1) * self.chunk_rows)

    def drop_device_ring(self) -> None:
        """Give the device ring's memory back (its store samples on the host path): placement may use the tier."""
        if self.device_ring is not None:
            self.device_ring.close()
            self.device_ring = None

    def close(self) -> None:
        self.drop_device_ring()
        for d in self.arenas:
            d.clear()
        self.arrays.clear()
        self.final.clear()


def mmap_page() -> int:
    import mmap

    return mmap.PAGESIZE
