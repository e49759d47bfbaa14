"""StoreWriter: the write path of a store (append, extend, end_episode) and its one commit routine.

A batch is written in three steps, and commits once (`arrowbuf.ring.reservations` has the protocol):

1. Reserve (`reserve`, holding the store's write lock, briefly): the batch takes seqs `[base, base + n)` from the
   reservation head and records them in the reservation table. Its ring positions are free: the ring keeps one spare
   chunk, so a batch that fits in it touches no live row; a longer batch first evicts, under the state lock, the
   oldest rows whose positions it reuses (while it is written the store holds fewer than `capacity` rows). Each
   position first gets seq -1 (a reader still copying the evicted row there sees its seq check fail). Episode ids and
   final-observation slots are claimed here too.
2. Copy (`_copy_rows`, no lock): columns, index entries, final observations. Writers of other processes and threads
   copy their own rows at the same time. (A tiered store and ragged fields copy under the write lock.)
3. Commit (`_commit`, under the state lock), in seq order: a batch waits until every earlier row committed (the
   watermark `hi` reaches its base), then sets the rows' seqs, the live range (the new rows become visible all at
   once, and the ring evicts down to `capacity`), final-observation owners, successors of earlier rows, which rows
   became sampleable, the insert counter, and notifies waiting samplers and writers.

So a batch is atomic: a reader (`len`, `sample`, `to_table`, `sql`) sees all of its rows or none, and a row is
sampleable only when every row before it committed. A writer killed before its commit leaves none of its rows (only
the rows it evicted to make room are gone); the writer after it skips its seqs as a hole once it sees it is dead. A
batch longer than the capacity keeps its newest `capacity` rows: its older rows are counted as inserted and evicted
in the same commit, never visible. The per-step `append` fast path and `end_episode` run reserve, copy and commit in one
go under the write lock for their one row (the fast path only when no reservation is open).

A rate-limited writer waits for the limiter before it takes the write lock (other writers go on meanwhile) and
re-checks the limiter under it.

Usage (what `ExperienceStore` does)::

    writer = StoreWriter(core)
    ids = writer.extend(batch)          # np.ndarray[int64] of the new rows' ids (their seqs)
    seq = writer.append(step)           # int
    writer.end_episode("actor-3", {"next_obs": obs})
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Hashable
from math import isfinite
from typing import Any

import numpy as np

from ..errors import AppendSlowPathWarning, ArrowbufError, FinalObsWarning, InsertTimeout, SchemaError
from ..observe.lineage import STAMP_CLOCK as _now
from ..observe.lineage import STAMP_WRITER as _who
from ..options import final_obs_advice
from ..rate_limiters import RateLimiter
from ..ring.index import ENDED, HEADER, PENDING
from ..ring.reservations import CHECK_S, HOLE, waited
from ..samplers import Sampler
from . import stepcheck
from .core import StoreCore
from .reservation import DEFER as _DEFER
from .reservation import Reservation as _Reservation
from .reservation import segments as _segments
from .reservation import shift_new_episodes as _shift_new_episodes

_MISSING = object()
_LO, _HI, _INSERTS = HEADER["lo"], HEADER["hi"], HEADER["inserts"]
_RES, _WAITERS, _HOLES = HEADER["reserve_head"], HEADER["commit_waiters"], HEADER["holes"]


class StoreWriter:
    """append, extend and end_episode over a store's `StoreCore` (see the module docstring for the protocol)."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core
        self._fast = self._fast_plan()
        self._fast_names = tuple(p[0] for p in self._fast or ())
        # per-store constants of the per-step path (read once here, not per call)
        self._index = core.index
        self._capacity = core.capacity
        self._arena_rows = core.arena_rows
        self._has_final = bool(core.final_sources)
        self._end_fields = tuple(core.end_fields)
        self._finals = tuple((d.name, d.next_of, core.schema.fields[d.next_of]) for d in core.derived)
        self._derived_names = tuple(d.name for d in core.derived)
        # memoryviews of the index for one-row reads and writes: about 3x cheaper per scalar than numpy indexing
        # (same memory; a shared tier's header and index are shared by these views too)
        self._hv = core.index.header.data
        self._seqv = core.index.seq.data
        self._validv = core.index.valid.data
        self._nextv = core.index.next_pos.data
        self._epv = core.index.episode_id.data
        self._stepv = core.index.step.data
        # skip no-op sampler calls on the append path
        self._notify = type(core.sampler).on_valid is not Sampler.on_valid
        self._notify_invalid = type(core.sampler).on_invalid is not Sampler.on_invalid
        self._warned_final = False
        # this process's episode streams: planned outside the write lock (other processes plan meanwhile), so the
        # threads of one process take turns from plan to apply. Lock order: streams, write_lock, lock.
        self.streams = threading.Lock()
        # the store's ConsumeTracker when tasks or admission control are on, else None. A write
        # waits (`hold.wait`, outside the write lock) and re-checks (`hold.ready`, under it) that the rows it evicts
        # were consumed by every task and its rows' policy versions are admitted. See arrowbuf/consume.py.
        self.hold: Any = None
        limiter = core.rate_limiter
        self._limit_inserts = limiter is not None and getattr(type(limiter), "can_insert",
                                                               None) is not RateLimiter.can_insert
        self.slow_counts: dict[str, int] = {}  # reason -> steps the general path stored (`_count_slow`)
        self._warned_slow = False

    # ------------------------------------------------------------------ public surface
    def _count_slow(self, step: Any) -> None:
        """Count a step stored by the general path (`stats()["append_slow_path"]`); warn the first time."""
        if self.hold is not None:
            reason = "the store has consume tasks or admission control (its writes wait for them)"
        else:
            reason = stepcheck.slow_reason(self.core.schema, step, self._derived_names)
        self.slow_counts[reason] = self.slow_counts.get(reason, 0) + 1
        if self._warned_slow:
            return
        self._warned_slow = True
        if self._fast is None or self.hold is not None:  # the store's configuration, not the values
            advice = "collect steps and call extend for speed"
        else:
            advice = ("pass values of the schema's dtypes (or ones that convert safely: int32 into int64, float64 "
                      "into float32, numpy scalars), or collect steps and call extend")
        warnings.warn(
            f"store {self.core.name!r}: append took the general (batch) path, about 10x slower per step: {reason}; "
            f"{advice}. stats()['append_slow_path'] counts these steps", AppendSlowPathWarning, stacklevel=6)

    def extend(self, batch: Any, *, timeout: float | None = None) -> np.ndarray:
        """Add many steps; returns the new rows' ids (`np.ndarray[int64]`, their seqs). See `ExperienceStore.extend`."""
        cols, n = self.core.schema.validate_batch(batch)
        return self._ingest(cols, n, timeout)

    def extend_columns(self, cols: dict[str, Any], n: int, *, timeout: float | None = None,
                       on_reserve: Callable[[int, int], None] | None = None) -> np.ndarray:
        """`extend` of a batch `ExperienceSchema.validate_batch` already checked and converted. `on_reserve(first,
        n)` is called once its seqs `[first, first + n)` are reserved, under the write lock (so calls come in seq
        order), before its rows are copied: a durable store appends the batch's journal record there. If it raises,
        nothing of the batch is written (its seqs become a hole)."""
        return self._ingest(cols, n, timeout, on_reserve)

    def skip(self, n: int) -> None:
        """Leave the next `n` seqs without rows (holes, as a dead writer's reservation): a restored durable store
        skips the seqs issued before a crash that no journal record holds, so they never name another row."""
        c = self.core
        if n <= 0:
            return
        with c.write_lock, c.cond:
            base = c.index.hi
            self.commit_hole(base, n)
            h = c.index.header
            h[_RES] = max(int(h[_RES]), base + n)

    def end_episode(self, actor: Hashable = None, final: dict[str, Any] | None = None,
                    before: Callable[[], None] | None = None) -> bool:
        """End stream `actor`'s open episode at its last stored step (see `ExperienceStore.end_episode`).

        `before()` is called once the call is known to be valid, under the writer's locks, before anything changes
        (a durable store journals the call there).

        Returns True when a waiting row became sampleable.
        """
        c = self.core
        c.check_open()
        final = dict(final or {})
        unknown = sorted(set(final) - {d.name for d in c.derived})
        if unknown:
            raise SchemaError(f"end_episode() takes the derived fields {[d.name for d in c.derived]}; got {unknown}")
        with self.streams, c.write_lock:
            c.check_open()
            st = c.episodes.streams.get(actor)
            prev = -1 if st is None else st.pending_seq
            idx = c.index
            waiting = c.final_sources and prev >= idx.lo and int(idx.seq[prev % c.arena_rows]) == prev
            if not waiting:
                if before is not None:
                    before()
                c.episodes.close(actor)
                return False
            values = {}
            for d in c.derived:
                spec = c.schema.fields[d.next_of]
                if d.name not in final:
                    raise SchemaError(f"end_episode({actor!r}): the stream's last step waits for its {d.name!r}; pass "
                                      f"it (end_episode(actor, {d.name}=<its next {d.next_of}>)) so the step becomes "
                                      "sampleable")
                v = np.asarray(final[d.name])
                if v.shape != spec.shape:
                    raise SchemaError(f"end_episode({actor!r}): {d.name!r} must have shape {spec.shape}, got {v.shape}")
                values[d.next_of] = v.astype(spec.dtype, copy=False)
            if before is not None:
                before()
            slots = self._claim_final_slots(1)
            for src, v in values.items():
                c.cols.write_final(src, slots, v[None])
            self._commit(idx.hi, 0, slots[:0], slots[:0], None, [(prev, c.arena_rows + int(slots[0]))],
                         slots, np.array([prev], dtype=np.int64))
            c.episodes.close(actor)
        return True

    # ------------------------------------------------------------------ the append fast path
    def _fast_plan(self) -> list[tuple] | None:
        """Per-field checks for the append fast path (`arrowbuf.engine.stepcheck`), or None when the schema needs the
        general path (ragged fields; fields filled later, whose presence the general path records; dtypes numpy lacks,
        `FieldSpec.plain`)."""
        plan: list[tuple] = []
        for f in self.core.schema.fields.values():
            if f.ragged or f.later or not f.plain:  # not plain: bfloat16/float8 bits, complex, json convert first
                return None
            if f.shape:
                plan.append((f.name, f.shape, f.dtype, not f.allow_nan, None, 0, 0, f))
            else:
                plan.append((f.name, None, *stepcheck.scalar_rule(f), f))
        return plan

    def append(self, step: dict[str, Any], *, timeout: float | None = None) -> int:
        """Add one step (a dict of scalars and arrays). Returns its id (its seq).

        A step whose values need no batch conversion (`arrowbuf.engine.stepcheck`: the schema's dtypes, numpy scalars,
        safely castable arrays) is written and committed here, in one go under the write lock, with scalar stores
        (the per-step fast path, also with a rate limiter or a prioritized sampler). Anything else goes through
        the full validation of `extend` (same errors, same result) in `_append_general`, as does a step that must
        wait (other writers' open reservations, a rate limiter holding inserts back).
        """
        if self.hold is not None or type(step) is not dict or self._fast is None:
            return self._append_general(step, timeout, True)
        values = []
        # (a tensor field: exact = its dtype, finite = it forbids NaN; see `_fast_plan`)
        for _name, shape, exact, finite, ranged, lo, hi, spec in self._fast:
            v = step.get(_name, _MISSING)
            if shape is None:  # scalars: see `stepcheck.scalar_rule` (Python floats and numpy scalars cost no call)
                cls = v.__class__
                if cls in exact:
                    pass
                elif cls in finite and isfinite(v) or cls in ranged and lo <= v <= hi:
                    pass
                else:
                    v = stepcheck.scalar_ok(spec, v)
                    if v is None:
                        return self._append_general(step, timeout, True)
            elif v.__class__ is not np.ndarray or v.dtype is not exact or v.shape != shape or (
                    finite and not np.isfinite(v).all()):
                v = stepcheck.array_ok(spec, v)  # converts a safely castable dtype (int32 -> int64, f64 -> f32)
                if v is None:
                    return self._append_general(step, timeout, True)
            values.append(v)
        extra = len(step) - len(values)
        actor = None
        if extra:
            actor = step.get("actor", _MISSING)
            allowed = 1 if actor is not _MISSING else 0
            for d in self._derived_names:
                allowed += d in step
            if extra != allowed or "episode_id" in step:
                return self._append_general(step, timeout, True)
            if actor is _MISSING:
                actor = None
            elif actor.__class__ is not int and actor.__class__ is not str:
                return self._append_general(step, timeout, True)
        end = False
        for e in self._end_fields:
            if step[e]:
                end = True
                break
        finals = None
        if end and self._finals:
            finals = []
            for dname, src, spec in self._finals:
                v = step.get(dname, _MISSING)
                if v.__class__ is not np.ndarray or v.dtype is not spec.dtype or v.shape != spec.shape or (
                        not spec.allow_nan):
                    v = stepcheck.array_ok(spec, v)
                    if v is None:
                        return self._append_general(step, timeout, True)
                finals.append((src, v))
        c = self.core
        if c.closed:
            c.check_open()
        hv = self._hv
        arena_rows = self._arena_rows
        cols = c.cols
        with self.streams, c.write_lock:
            if c.closed:
                c.check_open()
            seq = hv[_HI]
            free = hv[_RES] <= seq  # else other writers' reservations are open: take the reserving path
            if free and self._limit_inserts:  # a limiter that can hold inserts back (SampleToInsertRatio)
                with c.lock:
                    free = c.rate_limiter.can_insert(1, c.counters())
            if free:
                pos = seq % arena_rows  # one row always fits in the spare chunk: a free position
                if cols.pages is not None:
                    cols.pages.advance(seq + 1)
                ep, st, prev = c.episodes.advance_one(actor, end, seq)
                # write the row (reserve and copy in one go: the write lock keeps other writers out)
                self._seqv[pos] = -1
                if c.max_times_sampled:
                    c.times_sampled[pos] = 0
                if cols.direct:
                    arrays = cols.arrays
                    for name, v in zip(self._fast_names, values):
                        arrays[name][pos] = v
                else:
                    for name, v in zip(self._fast_names, values):
                        cols.write_row(name, pos, v)
                self._epv[pos] = ep
                self._stepv[pos] = st
                links = ((prev, pos),) if prev >= 0 else ()
                if finals is None:
                    self._nextv[pos] = ENDED if end and not self._has_final else PENDING
                    with c.lock:  # commit
                        self._commit_locked(seq, 1, pos, seq, None if self._has_final else pos, links, None, None)
                else:
                    slots = self._claim_final_slots(1)
                    for src, v in finals:
                        cols.write_final(src, slots, v[None])
                    self._nextv[pos] = arena_rows + int(slots[0])
                    with c.lock:  # commit
                        self._commit_locked(seq, 1, pos, seq, pos, links, slots, seq)
        if not free:  # wait (outside the write lock) in the general path
            return self._append_general(step, timeout, False)
        return seq

    def _append_general(self, step: Any, timeout: float | None, slow: bool) -> int:
        """`append` through `extend`'s validation and write path; `slow`: count the step as a slow-path one (not
        when it only had to wait)."""
        cols, n = self.core.schema.validate_batch(step, single=True)
        seq = int(self._ingest(cols, n, timeout)[0])
        if slow:  # stored, but the slow way: count it, and say so once
            self._count_slow(step)
        return seq

    # ------------------------------------------------------------------ batches
    def _ingest(self, cols: dict[str, Any], n: int, timeout: float | None,
                on_reserve: Callable[[int, int], None] | None = None) -> np.ndarray:
        c = self.core
        c.check_open()
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        ends = np.zeros(n, dtype=bool)
        for name in c.end_fields:
            ends |= cols[name]
        if c.derived and ends.any():
            for d in c.derived:
                if d.name not in cols:
                    raise SchemaError(
                        f"field {d.name!r} (derived from {d.next_of!r}) is needed on the steps that end an episode: "
                        f"pass {d.name!r} with the batch (it is read only on those steps)"
                    )
        deadline = None if timeout is None else time.monotonic() + timeout
        # copy outside the write lock where rows are plain arena rows; a tiered store (slot table), ragged fields
        # (per-chunk arrays of this process) and a consume hold (it decides on the rows a write evicts) write the
        # whole batch under it
        serial = not c.cols.direct or bool(c.cols.ragged) or self.hold is not None
        while True:
            self._wait_insert(n, timeout, deadline)  # outside the write lock: other writers go on meanwhile
            if self.hold is not None:  # eviction hold and admission by policy version
                self.hold.wait(cols, n, timeout, deadline)
            with self.streams:
                plan = first_id = None
                if "episode_id" not in cols:  # plan the episodes before the write lock, ids provisional
                    first_id = c.episodes.next_episode_id
                    plan = c.episodes.plan(n, ends, actor=cols.get("actor"))
                with c.write_lock:
                    c.check_open()
                    if not (self._may_insert(n) and (self.hold is None or self.hold.ready(cols, n))):
                        continue  # another writer used the room the limiter gave: wait again (outside the lock)
                    r = self.reserve(cols, n, ends, plan, first_id)
                    if on_reserve is not None:
                        try:
                            on_reserve(r.base, n)
                        except BaseException:
                            c.reservations.abort(r.slot)  # the next waiter skips these rows (a hole)
                            raise
                    if serial:
                        return self._copy_and_commit(r, cols, ends)
            break
        return self._copy_and_commit(r, cols, ends)

    def _copy_and_commit(self, r: _Reservation, cols: dict[str, Any], ends: np.ndarray) -> np.ndarray:
        try:
            self._copy_rows(r, cols, ends)
        except BaseException:
            self.core.reservations.abort(r.slot)  # the next waiter skips these rows (a hole)
            raise
        self.commit_reserved(r)
        return np.arange(r.base, r.base + r.n, dtype=np.int64)

    def reserve(self, cols: dict[str, Any], n: int, ends: np.ndarray, plan: Any = None,
                 first_id: int | None = None) -> _Reservation:
        """Step 1, under the write lock: take seqs [base, base + n) from the reservation head, free their ring
        positions (evicting the rows there), claim episode ids and final-observation slots.

        `plan`: the batch's episode plan made before the lock with new episode ids from `first_id` on; they move
        to the ids free now (writers of other processes may have taken some meanwhile). None: plan here.
        """
        c = self.core
        idx = c.index
        h = idx.header
        arena_rows = c.arena_rows
        if plan is None:
            plan = c.episodes.plan(n, ends, actor=cols.get("actor"), episode_id=cols.get("episode_id"))
        elif plan is _DEFER:  # planned at commit (`finish_pieces`, the caller holding `streams` until then)
            pass
        elif first_id is not None and c.episodes.next_episode_id != first_id:
            _shift_new_episodes(plan, first_id, c.episodes.next_episode_id - first_id)
        if plan is not _DEFER:
            c.episodes.next_episode_id = plan.next_episode_id  # claim the ids now: a writer killed mid-batch
        base = max(int(h[_RES]), idx.hi)                   # must not leave them to the next writer
        skip = max(0, n - c.capacity)  # a batch longer than the ring keeps its newest rows
        m = n - skip
        need = base + n - arena_rows   # rows older than this sit where the batch goes
        if need > idx.hi and base > idx.hi:  # they are reserved by other writers, not yet committed: wait for them
            self._wait_hi(min(need, base))
        while True:
            slot = c.reservations.add(base, n, idx.hi)
            if slot >= 0:
                break
            self._wait_hi(idx.hi + 1)  # every entry is in use: wait for a commit
        h[_RES] = base + n
        if c.cols.pages is not None:  # pages ahead of the new head are prepared meanwhile (tiers/prefault.py)
            c.cols.pages.advance(base + n)
        if need > idx.lo:
            with c.cond:
                self._evict_below(min(need, idx.hi))
        first_pos = (base + skip) % arena_rows
        segs = _segments(first_pos, m, arena_rows)
        for s0, s1, _off in segs:  # invalidate first: a reader still copying these rows sees its seq fail
            idx.seq[s0:s1] = -1
            if c.max_times_sampled:
                c.times_sampled[s0:s1] = 0
        seqs = base + np.arange(skip, n, dtype=np.int64)
        r = _Reservation(base, n, skip, slot, segs, plan, seqs, seqs % arena_rows)
        if c.final_sources:
            ending = np.flatnonzero(ends[skip:]) + skip
            if len(ending) > c.final_capacity:  # more episode ends than final-observation slots: the oldest lose
                lost = ending[:-c.final_capacity]
                self._dropped(len(lost))
                ending = ending[-c.final_capacity:]
            if len(ending):
                r.final_slots = self._claim_final_slots(len(ending))
                r.owners = base + ending
            r.ending = ending
        if plan is not _DEFER:
            c.episodes.apply(plan, base)
        return r

    def _copy_rows(self, r: _Reservation, cols: dict[str, Any], ends: np.ndarray) -> None:
        """Step 2 (no lock needed: the rows are this writer's alone): columns, index entries, final observations."""
        c = self.core
        idx = c.index
        arena_rows = c.arena_rows
        skip, base, segs, plan = r.skip, r.base, r.segs, r.plan
        m = r.n - skip
        arenas = c.cols
        for name in arenas.arrays:
            src = cols[name]
            for s0, s1, off in segs:
                arenas.write(name, s0, src[skip + off:skip + off + (s1 - s0)])
        for name in arenas.ragged:
            arenas.write_ragged(name, cols[name].slice(skip, m), (base + skip) % arena_rows)
        succ = plan.succ[skip:]
        nxt = np.where(succ >= 0, (base + succ) % arena_rows, np.where(succ == -2, ENDED, PENDING))
        for s0, s1, off in segs:
            k = s1 - s0
            idx.episode_id[s0:s1] = plan.episode_id[skip + off:skip + off + k]
            idx.step[s0:s1] = plan.step[skip + off:skip + off + k]
            idx.next_pos[s0:s1] = nxt[off:off + k]
        if not c.final_sources:
            r.ready = r.pos
        else:
            preds = plan.pred[skip:]
            preds = preds[preds >= skip]  # predecessors written by this batch
            ending = r.ending
            if r.final_slots is not None:
                for d in c.derived:
                    arenas.write_final(d.next_of, r.final_slots, cols[d.name][ending])
                idx.next_pos[(base + ending) % arena_rows] = arena_rows + r.final_slots
            r.ready = np.concatenate([(base + preds) % arena_rows, (base + ending) % arena_rows])
        r.links = [(prev, (base + j) % arena_rows) for prev, j in plan.patches if j >= skip]

    def commit_reserved(self, r: _Reservation) -> None:
        """Step 3: wait until every earlier row committed (the watermark reaches this batch), then commit."""
        c = self.core
        if c.index.hi != r.base:
            self._wait_hi(r.base)
        with c.cond:
            if c.index.hi != r.base:  # another writer took this one for dead and skipped its rows (never expected)
                raise ArrowbufError(f"store {c.name!r}: the rows this writer reserved (seqs {r.base}.."
                                    f"{r.base + r.n - 1}) were skipped as a dead writer's while it copied them; they "
                                    "were not stored. Are writers of this store in several pid namespaces? Write again")
            self._commit_locked(r.base, r.n, r.pos, r.seqs, r.ready, r.links, r.final_slots, r.owners)
            c.reservations.done(r.slot)

    def wait_reserved(self) -> None:
        """With the write lock held (no new reservation starts): wait until every batch reserved so far committed,
        or became a hole (its writer died or failed). A durable store's checkpoint cuts its journal here."""
        target = int(self.core.index.header[_RES])
        if self.core.index.hi < target:
            self._wait_hi(target)

    def _wait_hi(self, target: int) -> None:
        """Wait (holding at most the write lock) until the watermark reaches `target`; a reservation at the watermark
        whose writer died or gave up is committed as a hole meanwhile."""
        c = self.core
        idx = c.index
        h = idx.header
        res = c.reservations
        with c.cond:
            h[_WAITERS] += 1
        try:
            since = time.monotonic()
            while True:
                seen = idx.hi
                if seen >= target:
                    return
                if waited(since):  # no progress for a while: is the writer we wait for still there?
                    with c.cond:
                        seen = idx.hi
                        gone = res.stale(seen)
                        if gone:
                            self.commit_hole(seen, gone)
                    since = time.monotonic()
                    continue
                c.check_open()
                res.wait_hi(seen, CHECK_S)
        finally:
            with c.cond:
                h[_WAITERS] -= 1

    def commit_hole(self, base: int, n: int) -> None:
        """Under the state lock: skip the reservation [base, base + n) of a dead writer (see tiers/reservations)."""
        c = self.core
        idx = c.index
        skip = max(0, n - c.capacity)
        pos = np.arange(base + skip, base + n, dtype=np.int64) % c.arena_rows
        idx.seq[pos] = HOLE
        idx.valid[pos] = False
        idx.header[_HOLES] += len(pos)
        if base + n - c.capacity > int(idx.header[_LO]):
            self._evict_below(base + n - c.capacity)
        idx.header[_HI] = base + n
        c.reservations.wake()
        c.cond.notify_all()

    # ------------------------------------------------------------------ the commit routine
    def _commit(self, base: int, n: int, pos: Any, seqs: Any, ready: Any, links: Any,
                final_slots: np.ndarray | None, final_seqs: Any) -> None:
        """The commit routine for every write (append, extend, end_episode): `_commit_locked` under the state lock."""
        with self.core.lock:
            self._commit_locked(base, n, pos, seqs, ready, links, final_slots, final_seqs)

    def _commit_locked(self, base: int, n: int, pos: Any, seqs: Any, ready: Any, links: Any,
                       final_slots: np.ndarray | None, final_seqs: Any) -> None:
        """The one commit routine (append, extend, flush, reserved batches), with the state lock held: make the
        written rows live.

        Args:
            base, n: the write covers seqs [base, base + n); the live range becomes [.., base + n).
            pos, seqs: positions and seqs of the rows written (an int each for one row).
            ready: positions (an array, or an int for one row) that became sampleable by this write alone, or None.
            links: (seq, next position) of earlier rows whose successor (a row or a final slot) this write supplies.
            final_slots, final_seqs: final-observation slots written and the seqs of the rows owning them.

        One row (the append path) costs a few scalar stores: constants are the writer's, and nothing is allocated
        unless a sampler wants to hear about the rows.
        """
        c = self.core
        idx = self._index
        hv = self._hv
        lo = hv[_LO]
        one = pos.__class__ is int  # one row (the append path): scalar stores through the memoryviews
        if n:
            if one:
                self._seqv[pos] = seqs
            else:
                idx.seq[pos] = seqs  # their generation: ids name these rows from now on
            end = base + n
            if end - self._capacity > lo:  # the ring is full: the oldest rows go
                self._evict_below(end - self._capacity, lo, base)
                lo = end - self._capacity
            hv[_HI] = end  # the commit point (the watermark): the rows are visible
            lineage = c.lineage
            if lineage is not None:  # who wrote the rows, when, under which version (arrowbuf.observe.lineage)
                if one:
                    st = lineage.stamp
                    if st is None:
                        lineage.one(pos)
                    else:  # the record is two scalars: store them here (no call: ~1% of an append)
                        st[0][pos] = _who()
                        st[1][pos] = _now()
                else:
                    lineage.wrote(pos, base + n - len(pos))  # a batch (seqs from base + skip on): a run record
            if hv[_RES] < end:  # the append fast path commits without a reservation
                hv[_RES] = end
        if final_slots is not None:
            c.final_owner[final_slots] = final_seqs
        more = None
        for prev, nxt in links:
            if prev >= lo:  # still live, so still at its position (a live row's position is never rewritten)
                ppos = prev % self._arena_rows
                self._nextv[ppos] = nxt
                if self._has_final:  # its next observation is known now
                    if ready is None:
                        ready = ppos
                    else:
                        more = [ppos] if more is None else [*more, ppos]
        if ready is not None:
            if ready.__class__ is int:
                self._validv[ready] = True
            else:
                idx.valid[ready] = True
            if more is not None:
                idx.valid[more] = True
            if self._notify:
                ready = (np.array([ready], dtype=np.int64) if ready.__class__ is int
                         else np.atleast_1d(np.asarray(ready, dtype=np.int64)))
                c.sampler.on_valid(ready if more is None else np.append(ready, more))
        hv[_INSERTS] += n
        c.notify()
        if n and hv[_WAITERS]:  # writers of later reservations wait for the watermark (in any process)
            c.reservations.wake()

    def _evict_below(self, new_lo: int, lo: int | None = None, hi: int | None = None) -> None:
        """Under the state lock: rows older than `new_lo` stop being live (`lo`, `hi`: the live range, when the
        caller just read it)."""
        c = self.core
        idx = self._index
        hv = self._hv
        if lo is None:
            lo = hv[_LO]
        if new_lo <= lo:
            return
        stop = min(new_lo, hv[_HI] if hi is None else hi)  # a commit evicts only rows that were live
        if hv[_HOLES] and stop > lo:  # skipped reservations leave the live range too
            hv[_HOLES] -= int(np.count_nonzero(idx.seq[np.arange(lo, stop, dtype=np.int64) % self._arena_rows]
                                               == HOLE))
        if stop - lo == 1:  # the append path's common case
            p = lo % self._arena_rows
            if self._validv[p]:
                self._validv[p] = False
                if self._notify_invalid:
                    c.sampler.on_invalid(np.array([p]))
        elif stop > lo:
            gone = np.arange(lo, stop, dtype=np.int64) % self._arena_rows
            was = gone[idx.valid[gone]]
            if len(was):
                idx.valid[was] = False
                c.sampler.on_invalid(was)
        hv[_LO] = new_lo

    # ------------------------------------------------------------------ final observations
    def _claim_final_slots(self, k: int) -> np.ndarray:
        """`k` final-observation slots for the rows being written: the oldest are reused (`_release_final_slots`)."""
        idx = self.core.index
        slots = (idx.counter("final_count") + np.arange(k, dtype=np.int64)) % self.core.final_capacity
        idx.count("final_count", k)
        self._release_final_slots(slots)
        return slots

    def _release_final_slots(self, slots: np.ndarray) -> None:
        """Free final-observation slots for reuse: rows still relying on them stop being sampleable."""
        c = self.core
        idx = c.index
        owners = c.final_owner[slots]
        with c.lock:
            live = owners[(owners >= idx.lo) & (owners >= 0)]
            if len(live):
                pos = live % c.arena_rows
                still = pos[idx.valid[pos] & (idx.seq[pos] == live)]
                if len(still):
                    idx.valid[still] = False
                    c.sampler.on_invalid(still)
                    self._dropped(len(still))
            c.final_owner[slots] = -1  # seqlock: a reader still gathering a slot sees its owner change

    def _dropped(self, count: int) -> None:
        """Count terminal transitions that lost their final observation, and say so once (they matter most)."""
        c = self.core
        idx = c.index
        idx.count("final_obs_dropped", count)
        if self._warned_final:
            return
        self._warned_final = True
        episodes = max(1, idx.counter("final_count"))
        mean_len = max(1.0, idx.counter("inserts") / episodes)
        want = int(np.ceil(c.capacity / mean_len * 1.25))
        have, advice = final_obs_advice(c.final_capacity, want)
        warnings.warn(
            f"store {c.name!r}: {count} terminal transition(s) stopped being sampleable because their final "
            f"observation's slot was reused ({have}; episodes here average "
            f"{mean_len:.1f} steps, so the ring holds about {int(c.capacity / mean_len)} episode ends). {advice} "
            "to keep every terminal transition; stats()['final_obs_dropped'] counts the losses", FinalObsWarning,
            stacklevel=4)

    # ------------------------------------------------------------------ rate limiting
    def _may_insert(self, n: int) -> bool:
        """Under the write lock: whether the rate limiter lets `n` rows in now."""
        c = self.core
        if c.rate_limiter is None:
            return True
        with c.cond:
            return bool(c.rate_limiter.can_insert(n, c.counters()))

    def _wait_insert(self, n: int, timeout: float | None, deadline: float | None) -> None:
        """Wait (holding only the state condition) until the rate limiter lets `n` rows in; raise InsertTimeout."""
        c = self.core
        limiter = c.rate_limiter
        if limiter is None:
            return
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        with c.cond:
            if not limiter.can_insert(n, c.counters()):
                c.limiter_waits["insert"] += 1  # held back (StoreCore.limiter_waits: /metrics)
            ok = c.wait_for(lambda: limiter.can_insert(n, c.counters()), left)
            if ok and (left is None or left > 0 or limiter.can_insert(n, c.counters())):
                return
            if ok:
                return
            cnt = c.counters()
            raise InsertTimeout(
                f"insert of {n} rows held back by {limiter!r} "
                f"(inserts={cnt.inserts}, samples={cnt.samples}, size={cnt.size}); "
                + ("did not wait (timeout=None)" if timeout is None else f"waited {timeout}s")
                + ": sample more, or pass a longer timeout="
            )
