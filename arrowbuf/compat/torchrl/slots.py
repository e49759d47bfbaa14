"""Where each stored element sits in TorchRL's index space: a `SlotMap` between element positions and store seqs.

TorchRL addresses elements by position (0 .. max_size - 1, flat over the storage dims); arrowbuf addresses rows by
seq (insert order; the ring keeps the newest `capacity`). Two maps, one Protocol:

- `SlotColumn` (stores ArrowbufStorage creates): every row records its position in the column `slot`. Each process
  keeps `position -> seq` in memory and catches up from the rows written since it last looked (by any process:
  a shared store's writers are other processes), so any write order works: round robin, a writer whose cursor
  starts elsewhere, workers whose writes land out of order. Positions travel with the rows into checkpoints,
  state_dicts and served stores.
- `SeqModulo` (a store made elsewhere, without that column): position = seq % max_size; writes must then come in
  ring order.

    slots.refresh(store)                   # catch up with rows written since (cheap when nothing was)
    seqs, live = slots.seqs(positions, lo, hi)
    slots.record(positions, new_seqs)      # after this process appended rows
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from .rows import gather

SLOT_COLUMN = "slot"


class SlotMap(Protocol):
    """Element positions <-> store seqs (see the module doc)."""

    #: whether rows carry their position in `SLOT_COLUMN` (so any write order works)
    recorded: bool

    def refresh(self, store: Any, lo: int, hi: int) -> None:
        """Catch up with rows committed below `hi` that this process has not seen."""

    def seqs(self, positions: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """The seqs at `positions` and whether each is a live row (in [lo, hi))."""

    def positions(self, seqs: np.ndarray, store: Any) -> np.ndarray:
        """The positions of live rows `seqs`."""

    def record(self, positions: np.ndarray, seqs: np.ndarray) -> None:
        """Rows `seqs` were appended at `positions` by this process."""


class SlotColumn:
    """Positions recorded per row (the column `slot`); see the module doc."""

    recorded = True

    def __init__(self, size: int) -> None:
        self.size = int(size)
        self._seq = np.full(self.size, -1, dtype=np.int64)  # position -> seq (-1: never written)
        self._seen = 0  # rows below this seq have been read into _seq

    def refresh(self, store: Any, lo: int, hi: int) -> None:
        if hi <= self._seen:
            return
        start = max(self._seen, lo)
        if start < hi:
            new = np.arange(start, hi, dtype=np.int64)
            pos = np.asarray(gather(store, new, [SLOT_COLUMN])[SLOT_COLUMN], dtype=np.int64)
            self._seq[pos] = new
        self._seen = hi

    def seqs(self, positions: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        s = self._seq[positions]
        return s, (s >= lo) & (s < hi)

    def positions(self, seqs: np.ndarray, store: Any) -> np.ndarray:
        if len(seqs) == 0:
            return np.zeros(0, dtype=np.int64)
        return np.asarray(gather(store, np.asarray(seqs, dtype=np.int64), [SLOT_COLUMN])[SLOT_COLUMN], dtype=np.int64)

    def record(self, positions: np.ndarray, seqs: np.ndarray) -> None:
        seqs = np.asarray(seqs, dtype=np.int64)
        if len(seqs) and int(seqs[0]) == self._seen:  # nobody else wrote in between: no need to read them back
            self._seq[np.asarray(positions, dtype=np.int64)[-len(seqs):]] = seqs
            self._seen = int(seqs[-1]) + 1


class SeqModulo:
    """position = seq % size (a store made without the `slot` column)."""

    recorded = False

    def __init__(self, size: int) -> None:
        self.size = int(size)

    def refresh(self, store: Any, lo: int, hi: int) -> None:
        return None

    def seqs(self, positions: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        if hi == lo:
            s = np.full(len(positions), -1, dtype=np.int64)
            return s, np.zeros(len(positions), dtype=bool)
        s = lo + (positions - lo) % self.size
        return s, s < hi

    def positions(self, seqs: np.ndarray, store: Any) -> np.ndarray:
        return np.asarray(seqs, dtype=np.int64) % self.size

    def record(self, positions: np.ndarray, seqs: np.ndarray) -> None:
        return None


def plan_write(slots: SlotMap, positions: np.ndarray, lo: int, hi: int, capacity: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """How to write elements at `positions` (a position written twice: the last write wins, as on
    LazyTensorStorage).

    Returns (keep, update_seqs, append_mask): `keep` indexes the rows of the write that are written (in write
    order); of those, rows with `append_mask` are appended, the others overwrite the live rows `update_seqs` in
    place. Appending is chosen whenever the rows the ring then evicts are exactly the rows being overwritten (a
    round-robin writer on a full ring), so seqs keep following the writer; otherwise stored elements are
    overwritten in place and new positions appended.

    Raises:
        NotImplementedError: the write cannot be expressed on the ring without losing or misplacing data (the
            message says which positions and why).
    """
    n = len(positions)
    size = hi - lo
    if not slots.recorded:  # positions follow seqs: appends only in the ring's own order
        expected = (hi + np.arange(n)) % capacity
        if np.array_equal(positions, expected):
            return np.arange(n), np.zeros(0, dtype=np.int64), np.ones(n, dtype=bool)
    _, last = np.unique(positions[::-1], return_index=True)
    keep = np.sort(n - 1 - last)
    pos = positions[keep]
    seqs, live = slots.seqs(pos, lo, hi)
    k = len(pos)
    if not slots.recorded:
        if live.all():
            return keep, seqs, np.zeros(k, dtype=bool)
        raise NotImplementedError(
            f"ArrowbufStorage over a store without a `{SLOT_COLUMN}` column appends in ring order: the next "
            f"positions are {expected[:4].tolist()}..., the write asked for {positions[:4].tolist()}... (use a "
            "store ArrowbufStorage created, or a RoundRobinWriter)")
    n_live = int(live.sum())
    evicted = size + k - capacity  # rows the ring evicts if every row is appended
    if evicted <= 0 and n_live == 0:
        return keep, np.zeros(0, dtype=np.int64), np.ones(k, dtype=bool)
    if evicted == n_live and np.array_equal(np.sort(seqs[live]), lo + np.arange(evicted)):
        return keep, np.zeros(0, dtype=np.int64), np.ones(k, dtype=bool)  # the ring evicts what is overwritten
    fresh = ~live
    if size + (k - n_live) > capacity:
        raise NotImplementedError(
            f"ArrowbufStorage: writing positions {pos[fresh][:4].tolist()}... that hold no element into a full "
            f"storage would evict other elements of the ring (its oldest); write elements in the writer's "
            "round-robin order, or overwrite elements that are stored")
    return keep, seqs[live], fresh
