"""Queues: FIFO (each item delivered once, oldest first) and LIFO (the newest sampleable rows)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import Sampler, StatelessSampler


class FifoSampler(Sampler):
    """A queue: each item delivered once, in insert order. Items evicted before delivery are skipped (counted).

    A row becomes sampleable once its next observation is known (the episode's next step arrived, or it ended). In
    the default strict order a row that is not yet sampleable holds back every later row: an idle actor's open step
    stalls the queue until that actor writes again or the ring evicts the row (`describe()["blocked_at"]` names the
    row). With `skip_pending=True` the queue delivers the oldest rows that are sampleable now and comes back for a
    skipped row once it becomes sampleable (if the ring has not evicted it): each row still once, in insert order
    among the rows ready at each sample, and no actor can stall the others.

    Args:
        skip_pending: serve around rows whose next observation has not arrived instead of waiting for them.
    """

    spec_name = "fifo"

    queue = True

    def __init__(self, skip_pending: bool = False) -> None:
        self.skip_pending = bool(skip_pending)

    def _on_bind(self) -> None:
        # [cursor, skipped, frontier] in tier memory: the processes sharing a store share one queue. With
        # skip_pending, `frontier` is one past the newest row delivered, every row below `cursor` is delivered or
        # evicted, and `_delivered[pos] == seq` marks the rows delivered between them.
        tier = self.index.tier
        self._state = tier.allocate("sampler.fifo", np.dtype(np.int64), 3)
        self._delivered = (tier.allocate("sampler.fifo.delivered", np.dtype(np.int64), self.index.arena_rows)
                           if self.skip_pending else np.zeros(0, np.int64))
        if tier.fresh:
            self._state[:] = 0
            self._delivered.fill(-1)

    @property
    def cursor(self) -> int:
        return int(self._state[0])

    @cursor.setter
    def cursor(self, value: int) -> None:
        self._state[0] = value

    @property
    def skipped(self) -> int:
        return int(self._state[1])

    @skipped.setter
    def skipped(self, value: int) -> None:
        self._state[1] = value

    @property
    def frontier(self) -> int:
        return max(int(self._state[2]), self.cursor)

    @frontier.setter
    def frontier(self, value: int) -> None:
        self._state[2] = value

    def _advance_past_evicted(self) -> None:
        lo = self.index.lo
        if self.cursor >= lo:
            return
        if self.skip_pending:  # rows behind the frontier may have been delivered out of order
            gone = np.arange(self.cursor, min(lo, self.frontier), dtype=np.int64)
            self.skipped += int(np.count_nonzero(self._delivered[gone % self.index.arena_rows] != gone))
            self.skipped += max(0, lo - self.frontier)
            self.frontier = max(self.frontier, lo)
        else:
            self.skipped += lo - self.cursor
        self.cursor = lo

    def _ready(self, limit: int) -> int:
        """Rows from the cursor that are sampleable, contiguous, up to `limit`."""
        idx = self.index
        stop = min(idx.hi, self.cursor + limit)
        if stop <= self.cursor:
            return 0
        valid = idx.valid[np.arange(self.cursor, stop, dtype=np.int64) % idx.arena_rows]
        if valid.all():
            return stop - self.cursor
        return int(np.argmin(valid))

    def _late(self) -> np.ndarray:
        """skip_pending: rows behind the frontier, skipped while pending, that are sampleable now (oldest first)."""
        idx = self.index
        back = np.arange(self.cursor, self.frontier, dtype=np.int64)
        bp = back % idx.arena_rows
        return back[idx.valid[bp] & (self._delivered[bp] != back)]

    def _fresh(self, n: int) -> np.ndarray:
        """skip_pending: up to `n` sampleable rows from the frontier on (oldest first)."""
        idx = self.index
        start, hi, window = self.frontier, idx.hi, max(n, 64)
        while True:
            seqs = np.arange(start, min(hi, start + window), dtype=np.int64)
            seqs = seqs[idx.valid[seqs % idx.arena_rows]]
            if len(seqs) >= n or start + window >= hi:
                return seqs[:n]
            window *= 2

    def select(self, n: int, *, distinct: bool = False) -> tuple[np.ndarray, None] | None:
        self._advance_past_evicted()
        if not self.skip_pending:
            if self._ready(n) < n:
                return None
            seqs = np.arange(self.cursor, self.cursor + n, dtype=np.int64)
            self.cursor += n
            return seqs, None
        late = self._late()[:n]
        fresh = self._fresh(n - len(late)) if len(late) < n else late[:0]
        if len(late) + len(fresh) < n:
            return None
        idx = self.index
        seqs = np.concatenate([late, fresh])
        self._delivered[seqs % idx.arena_rows] = seqs
        if len(fresh):
            self.frontier = int(fresh[-1]) + 1
        back = np.arange(self.cursor, self.frontier, dtype=np.int64)  # move the cursor over the delivered prefix
        open_ = self._delivered[back % idx.arena_rows] != back
        self.cursor = int(back[np.argmax(open_)]) if open_.any() else self.frontier
        return np.sort(seqs), None

    def _undelivered(self, seqs: np.ndarray) -> np.ndarray:
        """Mask: the rows `seqs` are sampleable and not yet delivered."""
        idx = self.index
        pos = seqs % idx.arena_rows
        ok = idx.valid[pos] & (seqs >= self.cursor)
        if self.skip_pending:
            ok &= self._delivered[pos] != seqs
        return ok

    def available(self) -> int:
        self._advance_past_evicted()
        if self.skip_pending:
            return int(np.count_nonzero(self._undelivered(np.arange(self.cursor, self.index.hi, dtype=np.int64))))
        return self._ready(self.index.hi - self.cursor)

    def mass(self, positions: np.ndarray) -> np.ndarray:
        """1 per sampleable row not yet delivered, else 0."""
        pos = np.asarray(positions, dtype=np.int64)
        return self._undelivered(self.index.seq[pos]).astype(np.float64)

    def total_mass(self) -> float:
        idx = self.index
        return float(np.count_nonzero(self._undelivered(np.arange(max(self.cursor, idx.lo), idx.hi, dtype=np.int64))))

    def state(self, positions: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta = {"cursor": self.cursor, "skipped": self.skipped}
        if not self.skip_pending:
            return meta, {}
        seqs = self.index.seq[positions]
        return {**meta, "frontier": self.frontier}, {"fifo_delivered": self._delivered[positions] == seqs}

    def load_state(self, positions: np.ndarray, meta: dict[str, Any], arrays: dict[str, np.ndarray],
                   dropped_valid: int = 0) -> None:
        self.cursor = int(meta["cursor"])
        self.skipped = int(meta["skipped"])
        if self.skip_pending:
            self.frontier = int(meta.get("frontier", self.cursor))
            done = positions[np.asarray(arrays.get("fifo_delivered", np.zeros(len(positions), bool)), bool)]
            self._delivered[done] = self.index.seq[done]

    def describe(self) -> dict[str, Any]:
        out = {"sampler": "FifoSampler", "cursor": self.cursor, "skipped_evicted": self.skipped}
        if self.skip_pending:
            out["skip_pending"] = True
        elif self.cursor < self.index.hi and not self.index.valid[self.cursor % self.index.arena_rows]:
            out["blocked_at"] = self.cursor  # the queue waits for this row's next observation
        return out


class LifoSampler(StatelessSampler):
    """The newest `n` sampleable rows (a stack when combined with `max_times_sampled=1`)."""

    spec_name = "lifo"

    def select(self, n: int, *, distinct: bool = False) -> tuple[np.ndarray, None] | None:
        idx = self.index  # the newest n rows are always distinct
        hi, lo = idx.hi, idx.lo
        window = n
        while True:  # look back far enough to find n sampleable rows (pending rows are skipped)
            start = max(lo, hi - window)
            seqs = np.arange(start, hi, dtype=np.int64)
            seqs = seqs[idx.valid[seqs % idx.arena_rows]]
            if len(seqs) >= n:
                return seqs[-n:], None
            if start == lo:
                return None
            window *= 2
