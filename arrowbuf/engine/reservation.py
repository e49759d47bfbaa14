"""A batch's rows between reservation and commit in a store's writer (`arrowbuf.engine.writer`): the record the
writer keeps per batch, and the two small computations on it (the ring segments a run of rows occupies, and moving the
episode ids a plan handed out)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: `StoreWriter.reserve`'s plan argument: the episode plan is made at commit (a batch in pieces whose episode ends
#: come later).
DEFER = object()


@dataclass
class Reservation:
    """One batch between reserve and commit (see `arrowbuf.engine.writer.StoreWriter`)."""

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
    ends: np.ndarray | None = None  # a batch in pieces whose episode plan waits for these (`PiecesWriter.begin`)
    locked: bool = False  # a batch in pieces of a ragged store: it holds the write lock until commit or abort


def shift_new_episodes(plan: Any, first_id: int, delta: int) -> None:
    """Move the episode ids a plan handed out (those >= `first_id`; older ones continue open episodes) by `delta`."""
    fresh = plan.episode_id >= first_id
    plan.episode_id[fresh] += delta
    for st in plan.streams.values():
        if st is not None and st.episode_id >= first_id:
            st.episode_id += delta
    plan.next_episode_id += delta


def segments(first_pos: int, count: int, arena_rows: int) -> list[tuple[int, int, int]]:
    """Contiguous (arena_start, arena_stop, offset) pieces of `count` rows starting at `first_pos`."""
    end = first_pos + count
    if end <= arena_rows:
        return [(first_pos, end, 0)]
    head = arena_rows - first_pos
    return [(first_pos, arena_rows, 0), (0, count - head, head)]
