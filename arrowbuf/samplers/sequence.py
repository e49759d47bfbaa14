"""Sequences: windows of T consecutive rows within one episode, drawn uniformly or by priority."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidArgument
from .base import Sampler
from .prioritized import PrioritizedSampler
from .uniform import UniformSampler


class SequenceSampler(Sampler):
    """Windows of consecutive steps inside one episode, never crossing an episode boundary.

    A window is `burn_in + length` steps starting at a row whose step index is a multiple of `stride`; batches come
    back shaped [B, burn_in + length, ...] (the first `burn_in` steps warm up a recurrent state). Steps follow each
    row's successor in its episode, so interleaved actors are fine. Start rows are drawn uniformly, or by priority
    with `priority=Prioritized(...)` (a window's priority is its start row's priority); draws whose window is not
    (yet) complete are redrawn, so the distribution is the one over complete windows.

    The item is the window, named by its start row: `batch.indices` are start ids, `max_times_sampled` counts
    deliveries of each window (rows inside a delivered window stay available to the windows that start elsewhere),
    and with `max_times_sampled` a batch holds distinct windows. `mass` is the start distribution's.
    """

    spec_name = "sequence"

    def __init__(self, length: int, stride: int = 1, burn_in: int = 0,
                 priority: PrioritizedSampler | None = None) -> None:
        if length < 1 or stride < 1 or burn_in < 0:
            raise InvalidArgument(f"need length >= 1, stride >= 1, burn_in >= 0; got {length}, {stride}, {burn_in}")
        self.length, self.stride, self.burn_in = int(length), int(stride), int(burn_in)
        self.window = self.length + self.burn_in
        self.priority = priority

    def _on_bind(self) -> None:
        self.starts: Sampler = self.priority if self.priority is not None else UniformSampler()
        self.starts.bind(self.index, self.rng, has_next=self.has_next)

    def on_valid(self, positions: np.ndarray) -> None:
        self.starts.on_valid(positions)

    def on_invalid(self, positions: np.ndarray) -> None:
        self.starts.on_invalid(positions)

    def update_priorities(self, positions: np.ndarray, priorities: np.ndarray) -> None:
        self.starts.update_priorities(positions, priorities)

    def mass(self, positions: np.ndarray) -> np.ndarray:
        return self.starts.mass(positions)

    def total_mass(self) -> float:
        return self.starts.total_mass()

    def min_mass(self) -> float:
        return self.starts.min_mass()

    def state(self, positions: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta, arrays = self.starts.state(positions)
        return {"starts": meta}, arrays

    def load_state(self, positions: np.ndarray, meta: dict[str, Any], arrays: dict[str, np.ndarray],
                   dropped_valid: int = 0) -> None:
        self.starts.load_state(positions, meta["starts"], arrays, dropped_valid)

    def windows(self, start_pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions [B, window] following each start's successors, and a mask of complete windows."""
        idx = self.index
        pos = np.empty((len(start_pos), self.window), dtype=np.int64)
        pos[:, 0] = start_pos
        ok = idx.step[start_pos] % self.stride == 0
        cur = start_pos
        for j in range(1, self.window):
            nxt = idx.next_pos[cur]
            inside = (nxt >= 0) & (nxt < idx.arena_rows)
            cur = np.where(inside, nxt, cur)
            ok &= inside
            pos[:, j] = cur
        ok &= self.has_next(cur)  # the last step's next observation is known (it may itself be a used-up start)
        return pos, ok

    def select(self, n: int, *, distinct: bool = False) -> tuple[np.ndarray, np.ndarray | None] | None:
        idx = self.index
        out_pos = np.empty((n, self.window), dtype=np.int64)
        out_w = np.ones(n, dtype=np.float32) if self.priority is not None else None
        need = np.arange(n)
        taken = np.empty(0, dtype=np.int64)
        for _ in range(64):
            got = self.starts.select(len(need), distinct=distinct)
            if got is None:
                return None
            seqs, w = got
            start_pos = seqs % idx.arena_rows
            pos, ok = self.windows(start_pos)
            if distinct and len(taken):
                ok &= ~np.isin(start_pos, taken)
            k = int(ok.sum())
            out_pos[need[:k]] = pos[ok]
            if out_w is not None and w is not None:
                out_w[need[:k]] = w[ok]
            if distinct:
                taken = np.concatenate([taken, start_pos[ok]])
            need = need[k:]
            if len(need) == 0:
                break
        else:
            # complete windows are rare among the start draws (e.g. most episodes shorter than a window): draw
            # the rest from the explicit list of complete windows, by the same start distribution
            if not self._select_listed(need, out_pos, out_w, taken if distinct else None):
                return None
        lo_pos = idx.lo % idx.arena_rows
        return idx.lo + (out_pos - lo_pos) % idx.arena_rows, out_w

    def _select_listed(self, need: np.ndarray, out_pos: np.ndarray, out_w: np.ndarray | None,
                       taken: np.ndarray | None) -> bool:
        """Fill rows `need` of `out_pos` (and `out_w`) from every complete window, drawn by start mass (O(capacity);
        fallback path only). With `taken` (distinct windows) no start repeats; False when too few windows exist."""
        start_pos = self.index.live_positions()
        m = self.starts.mass(start_pos)
        start_pos, m = start_pos[m > 0], m[m > 0]
        pos, ok = self.windows(start_pos)
        if taken is not None:
            ok &= ~np.isin(start_pos, taken)
        pos, m = pos[ok], m[ok]
        if len(pos) == 0 or (taken is not None and len(pos) < len(need)):
            return False
        pick = self.rng.choice(len(pos), size=len(need), replace=taken is None, p=m / m.sum())
        out_pos[need] = pos[pick]
        if out_w is not None and self.priority is not None:
            out_w[need] = self.priority.weights(pos[pick, 0])
        return True

    def describe(self) -> dict[str, Any]:
        return {"sampler": "SequenceSampler", "length": self.length, "stride": self.stride,
                "burn_in": self.burn_in, **({"priority": self.priority.describe()} if self.priority else {})}


