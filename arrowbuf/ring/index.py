"""The ring index: per-row metadata of a store and the live range of sequence numbers.

Rows are named by their global insert sequence number `seq`. The ring keeps the newest `capacity` committed rows,
`lo <= seq < hi`; row `seq` lives at arena position `seq % arena_rows`. Per position the index keeps the row's seq
(a generation check: a stale id never matches a recycled slot), its episode id and step, the position of its successor
in the same episode (`next_pos`), and whether it can be sampled (`valid`: live, and its next observation is known).

`next_pos` codes: >= 0 a position (>= arena_rows: a final-observation slot), PENDING: the successor has not arrived,
ENDED: the episode ended here and the schema derives nothing from the next step.

Writers reserve seqs from `reserve_head` (>= hi) and commit them in seq order (`arrowbuf.ring.reservations`); a
reservation whose writer died is committed as a hole: its positions get seq `HOLE` (never a row).
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import StoreCorrupt
from ..tiers.base import Tier

PENDING = -1
ENDED = -2

#: Slots of the index header: the live range, then counters every process of a shared store sees.
HEADER = {name: i for i, name in enumerate([
    "lo", "hi", "inserts", "samples", "final_count", "next_episode_id", "final_obs_dropped", "torn_retries",
    "priority_updates_ignored", "removed", "update_skipped", "reserve_head", "holes", "commit_waiters",
])}


class RingIndex:
    """Row metadata arrays and the live range; samplers read it under the store's lock."""

    def __init__(self, tier: Tier, capacity: int, arena_rows: int) -> None:
        self.capacity = int(capacity)
        self.arena_rows = int(arena_rows)
        self.tier = tier  # samplers keep their state here too (shared by every process of a shared store)
        self.seq = tier.allocate("index.seq", np.dtype(np.int64), arena_rows)
        self.episode_id = tier.allocate("index.episode_id", np.dtype(np.int64), arena_rows)
        self.step = tier.allocate("index.step", np.dtype(np.int64), arena_rows)
        self.next_pos = tier.allocate("index.next_pos", np.dtype(np.int64), arena_rows)
        self.valid = tier.allocate("index.valid", np.dtype(np.bool_), arena_rows)
        # counters shared by every user of the tier (another process, for shared memory): see HEADER
        self.header = tier.allocate("index.header", np.dtype(np.int64), len(HEADER))
        if tier.fresh:  # a process attaching to shared memory must not reset it
            self.seq.fill(-1)
            self.valid.fill(False)
            self.header.fill(0)
        else:
            self._check_header()

    def _check_header(self) -> None:
        """Refuse an attached header whose live range cannot be (its memory was overwritten): `StoreCorrupt`
        naming the file, instead of a store whose `len` and `sample` disagree forever."""
        lo, hi, holes = self.lo, self.hi, int(self.header[HEADER["holes"]])
        why = None
        if not 0 <= lo <= hi:
            why = f"the live range lo={lo}, hi={hi} is not 0 <= lo <= hi"
        elif hi - lo > self.arena_rows:
            why = f"the live range lo={lo}, hi={hi} holds {hi - lo} rows, more than the ring's {self.arena_rows}"
        elif not 0 <= holes <= hi - lo:
            why = f"{holes} skipped rows in a live range of {hi - lo}"
        elif hi - lo > holes and int(self.seq.max()) < lo:
            why = f"the live range lo={lo}, hi={hi} names rows that no slot holds (newest seq {int(self.seq.max())})"
        if why is not None:
            path = getattr(self.tier, "path", None)
            file = os.path.join(path, "arena.index.header") if path else "its index header"
            raise StoreCorrupt(f"shared store: {file}: {why}; its memory was overwritten and the store cannot be "
                               "attached. Recreate it (or remove it with `arrowbuf shm gc` once its owner exited)")

    @property
    def lo(self) -> int:
        """Oldest live seq."""
        return int(self.header[0])

    @lo.setter
    def lo(self, value: int) -> None:
        self.header[0] = value

    @property
    def hi(self) -> int:
        """One past the newest committed seq."""
        return int(self.header[1])

    @hi.setter
    def hi(self, value: int) -> None:
        self.header[1] = value

    def count(self, name: str, delta: int = 1) -> None:
        """Add `delta` to the named header counter."""
        self.header[HEADER[name]] += delta

    def counter(self, name: str) -> int:
        return int(self.header[HEADER[name]])

    def __len__(self) -> int:
        return self.hi - self.lo - int(self.header[HEADER["holes"]])  # holes: seqs of skipped reservations

    def positions(self, seqs: np.ndarray) -> np.ndarray:
        return seqs % self.arena_rows

    def seqs_of(self, positions: np.ndarray) -> np.ndarray:
        """The live seqs at `positions` (positions of live rows only)."""
        lo_pos = self.lo % self.arena_rows
        return self.lo + (positions - lo_pos) % self.arena_rows

    def live(self, seqs: np.ndarray) -> np.ndarray:
        """Mask of ids that still name their row: in the live range and not recycled."""
        seqs = np.asarray(seqs, dtype=np.int64)
        ok = (seqs >= self.lo) & (seqs < self.hi)
        pos = seqs % self.arena_rows
        ok &= self.seq[pos] == seqs
        return ok

    def live_positions(self) -> np.ndarray:
        """Positions of all live rows in seq order (O(capacity); not for the sample path)."""
        return np.arange(self.lo, self.hi, dtype=np.int64) % self.arena_rows

    def valid_seqs(self) -> np.ndarray:
        """Seqs of every sampleable row, oldest first (O(capacity); fallback path only)."""
        seqs = np.arange(self.lo, self.hi, dtype=np.int64)
        return seqs[self.valid[seqs % self.arena_rows]]
