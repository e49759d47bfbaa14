"""StoreWriter: the write path of a store (append, extend, flush) and its one commit routine.

A batch is written in three steps, and commits once (`arrowbuf.tiers.reservations` has the protocol):

1. Reserve (`_reserve`, holding the store's write lock, briefly): the batch takes seqs `[base, base + n)` from the
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
in the same commit, never visible. The per-step `append` fast path and `flush` run reserve, copy and commit in one
go under the write lock for their one row (the fast path only when no reservation is open).

A rate-limited writer waits for the limiter before it takes the write lock (other writers go on meanwhile) and
re-checks the limiter under it.

Usage (what `ExperienceStore` does)::

    writer = StoreWriter(core)
    ids = writer.extend(batch)          # np.ndarray[int64] of the new rows' ids (their seqs)
    seq = writer.append(step)           # int
    writer.flush("actor-3", next_obs=obs)
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Hashable

import numpy as np

from .core import StoreCore
from .errors import ArrowbufError, FinalObsWarning, InsertTimeout, SchemaError
from .index import ENDED, HEADER, PENDING
from .samplers import Sampler
from .tiers.reservations import CHECK_S, HOLE, waited

_MISSING = object()
_LO, _HI, _INSERTS = HEADER["lo"], HEADER["hi"], HEADER["inserts"]
_RES, _WAITERS, _HOLES = HEADER["reserve_head"], HEADER["commit_waiters"], HEADER["holes"]
_FLOATISH = frozenset({float, int, np.float16, np.float32, np.float64})


class StoreWriter:
    """append, extend and flush over a store's `StoreCore` (see the module docstring for the protocol)."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core
        self._fast = self._fast_plan()
        # skip no-op sampler calls on the append path
        self._notify = type(core.sampler).on_valid is not Sampler.on_valid
        self._notify_invalid = type(core.sampler).on_invalid is not Sampler.on_invalid
        self._warned_final = False
        # this process's episode streams: planned outside the write lock (other processes plan meanwhile), so the
        # threads of one process take turns from plan to apply. Lock order: _streams, write_lock, lock.
        self._streams = threading.Lock()
        # consume (issue 16): the store's ConsumeTracker when tasks or admission control are on, else None. A write
        # waits (`hold.wait`, outside the write lock) and re-checks (`hold.ready`, under it) that the rows it evicts
        # were consumed by every task and its rows' policy versions are admitted. See arrowbuf/consume.py.
        self.hold: Any = None

    # ------------------------------------------------------------------ public surface
    def append(self, step: dict[str, Any], *, timeout: float | None = None) -> int:
        """Add one step (a dict of scalars and arrays). Returns its id (its seq).

        Steps that already have the schema's dtypes and shapes take a scalar fast path; anything else goes through
        the full validation of `extend` (same errors, same result).
        """
        c = self.core
        if c.rate_limiter is None and self.hold is None and type(step) is dict and self._fast is not None:
            seq = self._append_fast(step)
            if seq >= 0:
                return seq
        cols, n = c.schema.validate_batch(step, single=True)
        return int(self._ingest(cols, n, timeout)[0])

    def extend(self, batch: Any, *, timeout: float | None = None) -> np.ndarray:
        """Add many steps; returns the new rows' ids (`np.ndarray[int64]`, their seqs). See `ExperienceStore.extend`."""
        cols, n = self.core.schema.validate_batch(batch)
        return self._ingest(cols, n, timeout)

    def flush(self, actor: Hashable = None, final: dict[str, Any] | None = None) -> bool:
        """End stream `actor`'s open episode at its last stored step (see `ExperienceStore.flush`).

        Returns True when a waiting row became sampleable.
        """
        c = self.core
        c.check_open()
        final = dict(final or {})
        unknown = sorted(set(final) - {d.name for d in c.derived})
        if unknown:
            raise SchemaError(f"flush() takes the derived fields {[d.name for d in c.derived]}; got {unknown}")
        with self._streams, c.write_lock:
            c.check_open()
            st = c.episodes.streams.get(actor)
            prev = -1 if st is None else st.pending_seq
            idx = c.index
            waiting = c.final_sources and prev >= idx.lo and int(idx.seq[prev % c.arena_rows]) == prev
            if not waiting:
                c.episodes.close(actor)
                return False
            values = {}
            for d in c.derived:
                spec = c.schema.fields[d.next_of]
                if d.name not in final:
                    raise SchemaError(f"flush({actor!r}): the stream's last step waits for its {d.name!r}; pass it "
                                      f"(flush(actor, {d.name}=<its next {d.next_of}>)) so the step becomes sampleable")
                v = np.asarray(final[d.name])
                if v.shape != spec.shape:
                    raise SchemaError(f"flush({actor!r}): {d.name!r} must have shape {spec.shape}, got {v.shape}")
                values[d.next_of] = v.astype(spec.dtype, copy=False)
            slots = self._claim_final_slots(1)
            for src, v in values.items():
                c.cols.write_final(src, slots, v[None])
            self._commit(idx.hi, 0, slots[:0], slots[:0], None, [(prev, c.arena_rows + int(slots[0]))],
                         slots, np.array([prev], dtype=np.int64))
            c.episodes.close(actor)
        return True

    # ------------------------------------------------------------------ the append fast path
    def _fast_plan(self) -> list[tuple[str, Any, tuple[int, ...] | None, bool]] | None:
        """Per-field checks for the append fast path, or None when the schema needs the general path."""
        plan = []
        for f in self.core.schema.fields.values():
            if f.ragged or f.later:  # later fields (fields helper): the general path records their presence
                return None
            plan.append((f.name, f.dtype, f.shape if f.shape else None, not f.allow_nan))
        return plan

    def _append_fast(self, step: dict[str, Any]) -> int:
        """One already well-typed step; returns -1 (nothing done) when the general path must handle it."""
        c = self.core
        values = []
        for name, dtype, shape, no_nan in self._fast:  # type: ignore[union-attr]
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
            for d in c.derived:
                allowed += d.name in step
            if extra != allowed or "episode_id" in step:
                return -1
            if actor is _MISSING:
                actor = None
            elif actor.__class__ is not int and actor.__class__ is not str:
                return -1
        end = False
        for e in c.end_fields:
            end = end or bool(step[e])
        finals = []
        if end and c.derived:
            for d in c.derived:
                v = step.get(d.name, _MISSING)
                spec = c.schema.fields[d.next_of]
                if v.__class__ is not np.ndarray or v.dtype != spec.dtype or v.shape != spec.shape:
                    return -1
                finals.append((d.next_of, v))
        if c.closed:
            c.check_open()
        idx = c.index
        arena_rows = c.arena_rows
        cols = c.cols
        with self._streams, c.write_lock:
            if c.closed:
                c.check_open()
            seq = int(idx.header[_HI])
            if idx.header[_RES] > seq:  # other writers' reservations are open: take the reserving path
                return -1
            pos = seq % arena_rows  # one row always fits in the spare chunk: a free position
            ep, st, prev = c.episodes.advance_one(actor, end, seq)
            # phase 1: write the row
            idx.seq[pos] = -1
            if c.max_times_sampled:
                c.times_sampled[pos] = 0
            if cols.direct:
                arrays = cols.arrays
                for (name, _, _, _), v in zip(self._fast, values):  # type: ignore[arg-type]
                    arrays[name][pos] = v
            else:
                for (name, _, _, _), v in zip(self._fast, values):  # type: ignore[arg-type]
                    cols.write_row(name, pos, v)
            idx.episode_id[pos] = ep
            idx.step[pos] = st
            slots = None
            if finals:
                slots = self._claim_final_slots(1)
                for src, v in finals:
                    cols.write_final(src, slots, v[None])
                idx.next_pos[pos] = arena_rows + slots[0]
            else:
                idx.next_pos[pos] = ENDED if end and not c.final_sources else PENDING
            # phase 2: commit
            self._commit(seq, 1, pos, seq, pos if not c.final_sources or slots is not None else None,
                         ((prev, pos),) if prev >= 0 else (), slots, seq if slots is not None else None)
        return seq

    # ------------------------------------------------------------------ batches
    def _ingest(self, cols: dict[str, Any], n: int, timeout: float | None) -> np.ndarray:
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
            if self.hold is not None:  # consume (issue 16): eviction hold and admission by policy version
                self.hold.wait(cols, n, timeout, deadline)
            with self._streams:
                plan = first_id = None
                if "episode_id" not in cols:  # plan the episodes before the write lock, ids provisional
                    first_id = c.episodes.next_episode_id
                    plan = c.episodes.plan(n, ends, actor=cols.get("actor"))
                with c.write_lock:
                    c.check_open()
                    if not (self._may_insert(n) and (self.hold is None or self.hold.ready(cols, n))):
                        continue  # another writer used the room the limiter gave: wait again (outside the lock)
                    r = self._reserve(cols, n, ends, plan, first_id)
                    if serial:
                        return self._copy_and_commit(r, cols, ends)
            break
        return self._copy_and_commit(r, cols, ends)

    def _copy_and_commit(self, r: "_Reservation", cols: dict[str, Any], ends: np.ndarray) -> np.ndarray:
        try:
            self._copy_rows(r, cols, ends)
        except BaseException:
            self.core.reservations.abort(r.slot)  # the next waiter skips these rows (a hole)
            raise
        self._commit_reserved(r)
        return np.arange(r.base, r.base + r.n, dtype=np.int64)

    def _reserve(self, cols: dict[str, Any], n: int, ends: np.ndarray, plan: Any = None,
                 first_id: int | None = None) -> "_Reservation":
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
        elif first_id is not None and c.episodes.next_episode_id != first_id:
            _shift_new_episodes(plan, first_id, c.episodes.next_episode_id - first_id)
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
        c.episodes.apply(plan, base)
        return r

    def _copy_rows(self, r: "_Reservation", cols: dict[str, Any], ends: np.ndarray) -> None:
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

    def _commit_reserved(self, r: "_Reservation") -> None:
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
                            self._commit_hole(seen, gone)
                    since = time.monotonic()
                    continue
                c.check_open()
                res.wait_hi(seen, CHECK_S)
        finally:
            with c.cond:
                h[_WAITERS] -= 1

    def _commit_hole(self, base: int, n: int) -> None:
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
        """Phase 2 for every write (append, extend, flush), under the state lock: make the written rows live.

        Args:
            base, n: the write covers seqs [base, base + n); the live range becomes [.., base + n).
            pos, seqs: positions and seqs of the rows written (an int each for one row).
            ready: positions (an array, or an int for one row) that became sampleable by this write alone, or None.
            links: (seq, next position) of earlier rows whose successor (a row or a final slot) this write supplies.
            final_slots, final_seqs: final-observation slots written and the seqs of the rows owning them.
        """
        with self.core.cond:
            self._commit_locked(base, n, pos, seqs, ready, links, final_slots, final_seqs)

    def _commit_locked(self, base: int, n: int, pos: Any, seqs: Any, ready: Any, links: Any,
                       final_slots: np.ndarray | None, final_seqs: Any) -> None:
        """`_commit`'s work, with the state lock held."""
        c = self.core
        idx = c.index
        h = idx.header
        lo = int(h[_LO])
        if n:
            idx.seq[pos] = seqs  # their generation: ids name these rows from now on
            if base + n - c.capacity > lo:  # the ring is full: the oldest rows go
                lo = base + n - c.capacity
                self._evict_below(lo)
            h[_HI] = base + n  # the commit point (the watermark): the rows are visible
            if h[_RES] < base + n:  # the append fast path commits without a reservation
                h[_RES] = base + n
        if final_slots is not None:
            c.final_owner[final_slots] = final_seqs
        for prev, nxt in links:
            if prev >= lo:  # still live, so still at its position (a live row's position is never rewritten)
                ppos = prev % c.arena_rows
                idx.next_pos[ppos] = nxt
                if c.final_sources:  # its next observation is known now
                    ready = ppos if ready is None else np.append(ready, ppos)
        if ready is not None:
            idx.valid[ready] = True
            if self._notify:
                c.sampler.on_valid(np.atleast_1d(np.asarray(ready, dtype=np.int64)))
        h[_INSERTS] += n
        c.cond.notify_all()
        if n and h[_WAITERS]:  # writers of later reservations wait for the watermark (in any process)
            c.reservations.wake()

    def _evict_below(self, new_lo: int) -> None:
        """Under the state lock: rows older than `new_lo` stop being live."""
        c = self.core
        idx = c.index
        h = idx.header
        lo = int(h[_LO])
        if new_lo <= lo:
            return
        stop = min(new_lo, int(h[_HI]))
        if h[_HOLES] and stop > lo:  # skipped reservations leave the live range too
            h[_HOLES] -= int(np.count_nonzero(idx.seq[np.arange(lo, stop, dtype=np.int64) % c.arena_rows] == HOLE))
        if stop - lo == 1:  # the append path's common case
            p = lo % c.arena_rows
            if idx.valid[p]:
                idx.valid[p] = False
                if self._notify_invalid:
                    c.sampler.on_invalid(np.array([p]))
        elif stop > lo:
            gone = np.arange(lo, stop, dtype=np.int64) % c.arena_rows
            was = gone[idx.valid[gone]]
            if len(was):
                idx.valid[was] = False
                c.sampler.on_invalid(was)
        h[_LO] = new_lo

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
        warnings.warn(
            f"store {c.name!r}: {count} terminal transition(s) stopped being sampleable because their final "
            f"observation's slot was reused (final_obs_capacity={c.final_capacity}; episodes here average "
            f"{mean_len:.1f} steps, so the ring holds about {int(c.capacity / mean_len)} episode ends). Pass "
            f"final_obs_capacity={want} (or more) to keep every terminal transition; stats()['final_obs_dropped'] "
            "counts the losses", FinalObsWarning, stacklevel=4)

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


@dataclass
class _Reservation:
    """One batch between reserve and commit (see `StoreWriter._reserve`)."""

    base: int
    n: int
    skip: int                      # leading rows of a batch longer than the ring: counted, never stored
    slot: int                      # its entry in the reservation table
    segs: list[tuple[int, int, int]]
    plan: Any
    seqs: np.ndarray
    pos: np.ndarray
    final_slots: np.ndarray | None = None
    owners: Any = None
    ending: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    ready: Any = None
    links: list[tuple[int, int]] = field(default_factory=list)


def _shift_new_episodes(plan: Any, first_id: int, delta: int) -> None:
    """Move the episode ids a plan handed out (those >= `first_id`; older ones continue open episodes) by `delta`."""
    fresh = plan.episode_id >= first_id
    plan.episode_id[fresh] += delta
    for st in plan.streams.values():
        if st is not None and st.episode_id >= first_id:
            st.episode_id += delta
    plan.next_episode_id += delta


def _segments(first_pos: int, count: int, arena_rows: int) -> list[tuple[int, int, int]]:
    """Contiguous (arena_start, arena_stop, offset) pieces of `count` rows starting at `first_pos`."""
    end = first_pos + count
    if end <= arena_rows:
        return [(first_pos, end, 0)]
    head = arena_rows - first_pos
    return [(first_pos, arena_rows, 0), (0, count - head, head)]
