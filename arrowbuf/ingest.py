"""Ingest: the write path of `ExperienceStore` (append, extend), a mixin over the store's state.

Ingest is two-phase. A writer (holding the store's write lock, not its state lock) fills free arena rows: the ring
keeps one spare chunk, so the rows written are ones the ring already evicted and no live row is touched. It first
sets each row's seq to -1 (a sampler still gathering an evicted row then sees its seq check fail), writes the columns
(`ColumnArenas.write`) and the index, then commits under the state lock: seqs, the live range, sampleability,
final-observation owners, counters, and a notify for waiting samplers. A batch longer than what the spare chunk
holds is written and committed in pieces; a batch longer than the ring keeps its newest rows.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .episodes import IngestPlan
from .errors import InsertTimeout, SchemaError
from .index import ENDED, HEADER, PENDING

_MISSING = object()
_INSERTS = HEADER["inserts"]
_FINAL_COUNT = HEADER["final_count"]
_FLOATISH = frozenset({float, int, np.float16, np.float32, np.float64})


class IngestMixin:
    """append and extend for `ExperienceStore` (see the module docstring for the protocol)."""

    # provided by ExperienceStore
    _cols: Any
    _lock: Any
    _cond: Any
    _write_lock: Any
    _episodes: Any
    _fast: Any
    _end_fields: list[str]
    _derived_list: list[Any]
    _final_sources: list[str]
    _final_owner: np.ndarray
    _max_times_sampled: int
    _times_sampled: np.ndarray
    _notify: bool
    schema: Any
    index: Any
    directory: Any
    sampler: Any
    rate_limiter: Any
    capacity: int
    arena_rows: int
    final_capacity: int
    _check_open: Callable[[], None]
    _wait_for: Callable[[Any, float | None], bool]
    _counters: Callable[[], Any]

    def append(self, step: dict[str, Any], *, timeout: float | None = None) -> int:
        """Add one step (a dict of scalars and arrays). Returns its seq.

        Steps that already have the schema's dtypes and shapes take a scalar fast path; anything else goes through
        the full validation of `extend` (same errors, same result).
        """
        if self.rate_limiter is None and type(step) is dict and self._fast is not None:
            seq = self._append_fast(step)
            if seq >= 0:
                return seq
        cols, n = self.schema.validate_batch(step, single=True)
        return self._ingest(cols, n, timeout)

    def _fast_plan(self) -> list[tuple[str, Any, tuple[int, ...] | None, bool]] | None:
        """Per-field checks for the append fast path, or None when the schema needs the general path."""
        plan = []
        for f in self.schema.fields.values():
            if f.ragged:
                return None
            if f.shape:
                plan.append((f.name, f.dtype, f.shape, not f.allow_nan))
            else:
                plan.append((f.name, f.dtype, None, not f.allow_nan))
        return plan

    def _append_fast(self, step: dict[str, Any]) -> int:
        """One already well-typed step; returns -1 (nothing done) when the general path must handle it."""
        values = []
        for name, dtype, shape, no_nan in self._fast:
            v = step.get(name, _MISSING)
            if shape is None:
                kind = dtype.kind
                if kind == "b":
                    if v.__class__ is not bool and v.__class__ is not np.bool_:
                        return -1
                elif kind == "f":
                    if v.__class__ not in _FLOATISH or (no_nan and v != v):
                        return -1
                elif v.__class__ is not int and v.__class__ is not dtype.type or dtype.itemsize < 8:
                    return -1
            elif v.__class__ is not np.ndarray or v.dtype != dtype or v.shape != shape or (
                    no_nan and np.isnan(v).any()):
                return -1
            values.append(v)
        extra = len(step) - len(values)
        actor = None
        if extra:
            actor = step.get("actor", _MISSING)
            allowed = 1 if actor is not _MISSING else 0
            for d in self._derived_list:
                allowed += d.name in step
            if extra != allowed or "episode_id" in step:
                return -1
            if actor is _MISSING:
                actor = None
            elif actor.__class__ is not int and actor.__class__ is not str:
                return -1
        end = False
        for e in self._end_fields:
            end = end or bool(step[e])
        finals = []
        if end and self._derived_list:
            for d in self._derived_list:
                v = step.get(d.name, _MISSING)
                spec = self.schema.fields[d.next_of]
                if v.__class__ is not np.ndarray or v.dtype != spec.dtype or v.shape != spec.shape:
                    return -1
                finals.append((d.next_of, v))
        self._check_open()
        idx = self.index
        h = idx.header
        arena_rows = self.arena_rows
        cols = self._cols
        with self._write_lock:
            self._check_open()
            seq = int(h[1])
            pos = seq % arena_rows
            ep, st, prev = self._episodes.advance_one(actor, end, seq)
            idx.seq[pos] = -1
            if self._max_times_sampled:
                self._times_sampled[pos] = 0
            if cols.direct:
                arrays = cols.arrays
                for (name, _, _, _), v in zip(self._fast, values):
                    arrays[name][pos] = v
            else:
                for (name, _, _, _), v in zip(self._fast, values):
                    cols.write_row(name, pos, v)
            idx.episode_id[pos] = ep
            idx.step[pos] = st
            nxt = ENDED if end and not self._final_sources else PENDING
            slot = -1
            if finals:
                slot = int(h[_FINAL_COUNT]) % self.final_capacity
                h[_FINAL_COUNT] += 1
                self._release_final_slots(np.array([slot]))
                for src, v in finals:
                    cols.write_final(src, slot, v)
                nxt = arena_rows + slot
            idx.next_pos[pos] = nxt
            with self._cond:
                idx.seq[pos] = seq
                lo = int(h[0])
                if seq - lo >= self.capacity:  # the ring is full: the oldest row goes
                    opos = lo % arena_rows
                    if idx.valid[opos]:
                        idx.valid[opos] = False
                        if self._notify:
                            self.sampler.on_invalid(np.array([opos]))
                    lo += 1
                    h[0] = lo
                h[1] = seq + 1
                if slot >= 0:
                    self._final_owner[slot] = seq
                if not self._final_sources or slot >= 0:
                    idx.valid[pos] = True
                    if self._notify:
                        self.sampler.on_valid(np.array([pos]))
                if prev >= lo:
                    ppos = prev % arena_rows
                    idx.next_pos[ppos] = pos
                    if self._final_sources:
                        idx.valid[ppos] = True
                        if self._notify:
                            self.sampler.on_valid(np.array([ppos]))
                h[_INSERTS] += 1
                self._cond.notify_all()
        return seq

    def extend(self, batch: Any, *, timeout: float | None = None) -> int:
        """Add many steps: a dict of arrays with a leading dim, a `pa.RecordBatch` or a `pa.Table`.

        Rows are visible to `sample`, `len` and `to_table` when this returns. A batch longer than the capacity keeps
        its newest rows. Returns the seq of the first row of the batch.

        Raises:
            SchemaError: the batch does not match the schema; nothing is stored.
            InsertTimeout: the rate limiter held the insert back past `timeout` seconds.
        """
        cols, n = self.schema.validate_batch(batch)
        return self._ingest(cols, n, timeout)

    def _ends(self, cols: dict[str, Any], n: int) -> np.ndarray:
        ends = np.zeros(n, dtype=bool)
        for name in self._end_fields:
            ends |= cols[name]
        return ends

    def _ingest(self, cols: dict[str, Any], n: int, timeout: float | None) -> int:
        self._check_open()
        if n == 0:
            return self.index.hi
        ends = self._ends(cols, n)
        if self.schema.derived and ends.any():
            for d in self.schema.derived.values():
                if d.name not in cols:
                    raise SchemaError(
                        f"field {d.name!r} (derived from {d.next_of!r}) is needed on the steps that end an episode: "
                        f"pass {d.name!r} with the batch (it is read only on those steps)"
                    )
        with self._write_lock:
            self._check_open()
            self._wait_insert(n, timeout)
            plan = self._episodes.plan(n, ends, actor=cols.get("actor"), episode_id=cols.get("episode_id"))
            self._episodes.next_episode_id = plan.next_episode_id  # claim the ids now: a writer killed mid-batch
            base = self.index.hi                                   # must not leave them to the next writer
            skip = max(0, n - self.capacity)
            if skip:  # a batch longer than the ring: its oldest rows are evicted as soon as they are counted
                with self._cond:  # the batch alone fills the ring: every stored row goes
                    self._evict_to(base + skip + self.capacity)
                    self.index.hi = self.index.lo = base + skip
                    self.index.count("inserts", skip)
            step = self.directory.spare_rows
            for a in range(skip, n, step):
                b = min(n, a + step)
                final_slots = self._write_piece(cols, plan, ends, base, a, b)
                self._commit_piece(plan, ends, base, a, b, skip, final_slots)
            self._episodes.apply(plan, base)
        return base

    def _segments(self, first_pos: int, count: int) -> list[tuple[int, int, int]]:
        """Contiguous (arena_start, arena_stop, offset) pieces of `count` rows starting at `first_pos`."""
        end = first_pos + count
        if end <= self.arena_rows:
            return [(first_pos, end, 0)]
        head = self.arena_rows - first_pos
        return [(first_pos, self.arena_rows, 0), (0, count - head, head)]

    def _write_piece(self, cols: dict[str, Any], plan: IngestPlan, ends: np.ndarray, base: int, a: int,
                     b: int) -> np.ndarray | None:
        """Fill arena rows of batch rows [a, b); they lie in free (already evicted) positions. No lock held."""
        idx = self.index
        first_pos = (base + a) % self.arena_rows
        segs = self._segments(first_pos, b - a)
        for s0, s1, _off in segs:  # invalidate first: a reader still gathering these rows sees its seq fail
            idx.seq[s0:s1] = -1
            if self._max_times_sampled:
                self._times_sampled[s0:s1] = 0
        arenas = self._cols
        for name in arenas.arrays:
            src = cols[name]
            for s0, s1, off in segs:
                arenas.write(name, s0, src[a + off:a + off + (s1 - s0)])
        for name in arenas.ragged:
            arenas.write_ragged(name, cols[name].slice(a, b - a), first_pos)
        succ = plan.succ[a:b]
        nxt = np.where(succ >= 0, (base + succ) % self.arena_rows, np.where(succ == -2, ENDED, PENDING))
        for s0, s1, off in segs:
            n_seg = s1 - s0
            idx.episode_id[s0:s1] = plan.episode_id[a + off:a + off + n_seg]
            idx.step[s0:s1] = plan.step[a + off:a + off + n_seg]
            idx.next_pos[s0:s1] = nxt[off:off + n_seg]
        if not self._final_sources:
            return None
        end_local = np.flatnonzero(ends[a:b]) + a
        if len(end_local) == 0:
            return None
        slots = (idx.counter("final_count") + np.arange(len(end_local))) % self.final_capacity
        idx.count("final_count", len(end_local))
        self._release_final_slots(slots)
        for d in self.schema.derived.values():
            arenas.write_final(d.next_of, slots, cols[d.name][end_local])
        idx.next_pos[(base + end_local) % self.arena_rows] = self.arena_rows + slots
        return slots

    def _release_final_slots(self, slots: np.ndarray) -> None:
        """Free final-observation slots for reuse: rows still relying on them stop being sampleable."""
        idx = self.index
        owners = self._final_owner[slots]
        with self._lock:
            live = owners[(owners >= idx.lo) & (owners >= 0)]
            if len(live):
                pos = live % self.arena_rows
                still = pos[idx.valid[pos] & (idx.seq[pos] == live)]
                if len(still):
                    idx.valid[still] = False
                    self.sampler.on_invalid(still)
                    idx.count("final_obs_dropped", len(still))
            self._final_owner[slots] = -1  # seqlock: a reader still gathering a slot sees its owner change

    def _commit_piece(self, plan: IngestPlan, ends: np.ndarray, base: int, a: int, b: int, skip: int,
                      final_slots: np.ndarray | None) -> None:
        idx = self.index
        seqs = base + np.arange(a, b, dtype=np.int64)
        pos = seqs % self.arena_rows
        with self._cond:
            idx.seq[pos] = seqs
            self._evict_to(base + b)
            idx.hi = base + b
            if final_slots is not None:
                self._final_owner[final_slots] = base + np.flatnonzero(ends[a:b]) + a
            # rows that became sampleable with this piece
            if not self.schema.derived:
                newly = pos
            else:
                preds = plan.pred[a:b]
                preds = preds[preds >= skip]  # predecessors written by this batch
                parts = [(base + preds) % self.arena_rows, pos[ends[a:b]]]
                newly = np.concatenate(parts)
            for prev_seq, j in plan.patches:
                if a <= j < b and prev_seq >= idx.lo:
                    ppos = prev_seq % self.arena_rows
                    if idx.seq[ppos] == prev_seq:
                        idx.next_pos[ppos] = (base + j) % self.arena_rows
                        if self.schema.derived:
                            newly = np.append(newly, ppos)
            if len(newly):
                newly = newly[idx.seq[newly] >= idx.lo]
                idx.valid[newly] = True
                self.sampler.on_valid(newly)
            idx.count("inserts", b - a)
            self._cond.notify_all()

    def _evict_to(self, new_hi: int) -> None:
        """Under the lock: rows older than `new_hi - capacity` stop being live."""
        idx = self.index
        new_lo = max(idx.lo, new_hi - self.capacity)
        if new_lo > idx.lo:
            gone = np.arange(idx.lo, min(new_lo, idx.hi), dtype=np.int64) % self.arena_rows
            if len(gone):
                was = gone[idx.valid[gone]]
                idx.valid[gone] = False
                if len(was):
                    self.sampler.on_invalid(was)
            idx.lo = new_lo

    def _wait_insert(self, n: int, timeout: float | None) -> None:
        limiter = self.rate_limiter
        if limiter is None:
            return
        with self._cond:
            if not self._wait_for(lambda: limiter.can_insert(n, self._counters()), timeout):
                c = self._counters()
                raise InsertTimeout(
                    f"insert of {n} rows held back by {limiter!r} "
                    f"(inserts={c.inserts}, samples={c.samples}, size={c.size}); "
                    + ("did not wait (timeout=None)" if timeout is None else f"waited {timeout}s")
                    + ": sample more, or pass a longer timeout="
                )
