"""The chunk directory: which rows each chunk slot holds, whether it is sealed, and where each column of it lives.

The store's ring is `num_slots` chunk slots of `chunk_rows` rows. Global insert sequence number `seq` maps to arena
position `seq % arena_rows`; slot `position // chunk_rows`. One slot more than the capacity needs is kept spare, so
a writer fills free memory while every live row stays readable. Residency is recorded per (column, chunk) as a
tier code; a gather groups positions by tier and does one `take` per column per tier.

Usage::

    d = ChunkDirectory(capacity=1000, chunk_rows=128, columns=["obs", "reward"], tiers=["host"])
    d.live_chunks(lo=0, hi=200)             # [(slot, start_pos, stop_pos, first_seq), ...] in seq order
    d.table()                               # pa.Table: slot, first_seq, rows, sealed, tier per column
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from ..errors import InvalidArgument
from ..tiers.base import Tier


def default_chunk_rows(row_bytes: int, capacity: int, target_bytes: int = 2 << 20) -> int:
    """Rows per chunk: about `target_bytes` (2 MiB) per chunk and at least 16 rows, but at most an eighth of the
    capacity, so the spare chunk the ring keeps costs little memory."""
    rows = max(16, target_bytes // max(1, row_bytes))
    rows = 1 << int(math.floor(math.log2(rows)))
    return int(max(1, min(rows, -(-capacity // 8))))


class ChunkDirectory:
    """Ring geometry and per-(column, chunk) residency of a store.

    Args:
        capacity: rows the ring holds (exact).
        chunk_rows: rows per chunk.
        columns: stored column names (fields and system columns).
        tiers: tier names; codes are indexes into this list.
    """

    def __init__(self, capacity: int, chunk_rows: int, columns: list[str], tiers: list[str],
                 tier: Tier | None = None) -> None:
        if capacity < 1:
            raise InvalidArgument(f"capacity must be >= 1 row, got {capacity}")
        self.capacity = int(capacity)
        self.chunk_rows = int(chunk_rows)
        self.num_slots = -(-self.capacity // self.chunk_rows) + 1
        self.arena_rows = self.num_slots * self.chunk_rows
        self.columns = list(columns)
        self.tiers = list(tiers)
        if tier is None:
            self.residency = np.zeros((len(self.columns), self.num_slots), dtype=np.int8)
        else:  # in tier memory, so every process of a shared store sees the same residency
            self.residency = tier.allocate("chunks.residency", np.dtype(np.int8), len(self.columns), (self.num_slots,))
            if tier.fresh:
                self.residency.fill(0)

    @property
    def spare_rows(self) -> int:
        """Rows a writer may fill without evicting a live row first."""
        return self.arena_rows - self.capacity

    def positions(self, seqs: np.ndarray) -> np.ndarray:
        return seqs % self.arena_rows

    def sealed_chunks(self, lo: int, hi: int) -> int:
        """Chunks of the live range [lo, hi) whose every row is written (sealed: immutable until evicted)."""
        return sum(1 for c in self.live_chunks(lo, hi) if self.is_sealed(c, hi))

    def is_sealed(self, chunk: tuple[int, int, int, int], hi: int) -> bool:
        """A chunk is sealed once the writer has moved past its last row."""
        slot, p0, p1, first = chunk
        return first - (p0 - slot * self.chunk_rows) + self.chunk_rows <= hi

    def live_chunks(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """(slot, start_pos, stop_pos, first_seq) for the live seq range [lo, hi), oldest first."""
        out = []
        seq = int(lo)
        while seq < hi:
            pos = seq % self.arena_rows
            slot, off = divmod(pos, self.chunk_rows)
            take = min(int(hi) - seq, self.chunk_rows - off)
            out.append((slot, pos, pos + take, seq))
            seq += take
        return out

    def table(self, lo: int, hi: int) -> pa.Table:
        """One row per live chunk: slot, first_seq, rows, sealed, and the tier of each column."""
        chunks = self.live_chunks(lo, hi)
        slots = np.array([c[0] for c in chunks], dtype=np.int64)
        cols = {
            "slot": slots,
            "first_seq": np.array([c[3] for c in chunks], dtype=np.int64),
            "rows": np.array([c[2] - c[1] for c in chunks], dtype=np.int64),
            "sealed": np.array([self.is_sealed(c, hi) for c in chunks], dtype=bool),
        }
        for i, name in enumerate(self.columns):
            cols[f"tier:{name}"] = np.array([self.tiers[t] for t in self.residency[i, slots]], dtype=object)
        return pa.table(cols)
