"""The steps of one batch written in pieces (what `arrowbuf.engine.pieces.ExtendInPieces` drives): which stores take
a batch in pieces, reserving its rows on the first piece, copying each piece into them, and committing or giving the
reservation up, through the reservation and commit steps of the store's `arrowbuf.engine.writer.StoreWriter` (see
that module's docstring for the commit protocol).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ring.index import ENDED, PENDING
from .reservation import DEFER, Reservation
from .writer import StoreWriter


class PiecesWriter:
    """Batches in pieces over a store's `StoreWriter` (its reservation and commit steps): `ok`, `begin`, `write`,
    `finish`, `abort`."""

    def __init__(self, writer: StoreWriter) -> None:
        self.writer = writer
        self.core = writer.core

    def ok(self, n: int, names: Any) -> bool:
        """Whether a batch of `n` rows with columns `names` may be written in pieces (`begin`): arena columns
        of one process (no tiered slot table; ragged fields only outside shared memory), no consume hold, rate
        limiter, no derived fields (final observations), no actor or episode_id column, and no more rows
        than the capacity. Episode-end fields are taken in one process's store (their plan is made at commit, under
        the write lock; in a shared store another process's writer may hold that lock while it waits for these
        rows). A store with ragged fields writes their values in ring order under the write lock, so its batch in
        pieces holds that lock from `begin` to its commit or abort (`hold_lock`)."""
        c = self.core
        return (c.cols.direct and not (c.cols.ragged and c.tier.shared) and self.writer.hold is None
                and c.rate_limiter is None and not c.final_sources and 0 < n <= c.capacity
                and not (c.end_fields and c.tier.shared)
                and "actor" not in names and "episode_id" not in names)

    @property
    def hold_lock(self) -> bool:
        """Whether a batch in pieces holds the store's write lock from its first piece to its commit or abort (a
        store with ragged fields: their values are appended to each chunk's region in ring order, so no other
        writer may reserve rows after them, nor update, nor checkpoint, until they are all written)."""
        return bool(self.core.cols.ragged)

    def begin(self, n: int) -> Reservation:
        """Step 1 for a batch of `n` rows whose columns come later, in pieces (`ok` must hold): reserve seqs
        [base, base + n) and their ring positions. Each `write` copies rows straight into the ring;
        `finish` commits them as ONE extend, `abort` gives the reservation up (nothing stored).
        With `hold_lock` the write lock stays held until then."""
        c = self.core
        c.check_open()
        hold = self.hold_lock
        if c.end_fields:  # the episode plan needs every row's end flag: made at commit, this process's other
            self.writer.streams.acquire()  # writers waiting meanwhile (their rows must follow these in every stream)
            try:
                c.write_lock.acquire()
                try:
                    c.check_open()
                    r = self.writer.reserve({}, n, np.zeros(n, dtype=bool), DEFER)
                except BaseException:
                    c.write_lock.release()
                    raise
                if not hold:
                    c.write_lock.release()
            except BaseException:
                self.writer.streams.release()
                raise
            r.ends = np.zeros(n, dtype=bool)
            r.locked = hold
            return r
        with self.writer.streams:
            first_id = c.episodes.next_episode_id
            plan = c.episodes.plan(n, np.zeros(n, dtype=bool), actor=None)
            c.write_lock.acquire()
            try:
                c.check_open()
                r = self.writer.reserve({}, n, np.zeros(n, dtype=bool), plan, first_id)
            except BaseException:
                c.write_lock.release()
                raise
            if not hold:
                c.write_lock.release()
            r.locked = hold
            return r

    def write(self, r: Reservation, offset: int, cols: dict[str, Any], m: int) -> None:
        """Step 2 for rows [offset, offset + m) of a batch begun with `begin` (validated columns; no lock
        taken: ragged values are written under the write lock the batch holds, in ring order as pieces come)."""
        self.core.check_open()  # the store may have closed while the previous piece came
        arenas = self.core.cols
        if r.ends is not None:
            for name in self.core.end_fields:
                r.ends[offset:offset + m] |= np.asarray(cols[name], dtype=bool)
        for s0, s1, off in r.segs:
            lo, hi = max(off, offset), min(off + (s1 - s0), offset + m)
            if lo >= hi:
                continue
            for name in arenas.arrays:
                arenas.write(name, s0 + lo - off, cols[name][lo - offset:hi - offset])
        for name in arenas.ragged:  # (r.skip is 0: `ok` takes no more rows than the capacity)
            arenas.write_ragged(name, cols[name], (r.base + offset) % self.core.arena_rows)

    def finish(self, r: Reservation) -> np.ndarray:
        """Step 3: the index entries, then the commit (every row visible at once); returns the rows' ids."""
        c = self.core
        idx = c.index
        if r.ends is not None:  # the deferred episode plan, under `_streams` (held since `begin`)
            if not r.locked:
                c.write_lock.acquire()
            try:
                r.plan = c.episodes.plan(r.n, r.ends, actor=None)
                c.episodes.next_episode_id = r.plan.next_episode_id
                c.episodes.apply(r.plan, r.base)
            finally:
                if not r.locked:
                    c.write_lock.release()
        plan = r.plan
        succ = plan.succ
        nxt = np.where(succ >= 0, (r.base + succ) % self.core.arena_rows, np.where(succ == -2, ENDED, PENDING))
        for s0, s1, off in r.segs:
            k = s1 - s0
            idx.episode_id[s0:s1] = plan.episode_id[off:off + k]
            idx.step[s0:s1] = plan.step[off:off + k]
            idx.next_pos[s0:s1] = nxt[off:off + k]
        r.ready = r.pos
        r.links = [(prev, (r.base + j) % self.core.arena_rows) for prev, j in plan.patches]
        try:
            self.writer.commit_reserved(r)
        finally:
            self._release_lock(r)
        self._release_streams(r)
        return np.arange(r.base, r.base + r.n, dtype=np.int64)

    def _release_lock(self, r: Reservation) -> None:
        if r.locked:
            r.locked = False
            self.core.write_lock.release()

    def _release_streams(self, r: Reservation) -> None:
        if r.ends is not None:
            r.ends = None
            self.writer.streams.release()

    def abort(self, r: Reservation) -> None:
        """Give a pieces reservation up: none of its rows is stored; its seqs become a hole (now when it is at the
        watermark, else when the writer before it commits and a later one waits)."""
        c = self.core
        try:
            c.reservations.abort(r.slot)
            with c.cond:
                if c.index.hi == r.base:
                    gone = c.reservations.stale(r.base)
                    if gone:
                        self.writer.commit_hole(r.base, gone)
        finally:
            self._release_lock(r)
            self._release_streams(r)


__all__ = ["PiecesWriter"]
