"""A batch's rows between reservation and commit in a store's writer (`arrowbuf.engine.writer`): the record the
writer keeps per batch, and the two small computations on it (the ring segments a run of rows occupies, and moving the
episode ids a plan handed out)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from .episodes import IngestPlan


class Deferred(enum.Enum):
    """`StoreWriter.reserve`'s plan argument `DEFER`: the episode plan is made at commit (a batch in pieces whose
    episode ends come later)."""

    PLAN = "plan"


DEFER = Deferred.PLAN


@dataclass
class Reservation:
    """One batch between reserve and commit (see `arrowbuf.engine.writer.StoreWriter`)."""

    base: int
    n: int
    skip: int                      # leading rows of a batch longer than the ring: counted, never stored
    slot: int                      # its entry in the reservation table
    segs: list[tuple[int, int, int]]
    plan: IngestPlan | Deferred
    seqs: np.ndarray
    pos: np.ndarray
    final_slots: np.ndarray | None = None
    owners: np.ndarray | None = None  # the seqs owning `final_slots`
    ending: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    ready: np.ndarray | None = None  # positions this batch alone made sampleable
    links: list[tuple[int, int]] = field(default_factory=list)
    ends: np.ndarray | None = None  # a batch in pieces whose episode plan waits for these (`PiecesWriter.begin`)
    locked: bool = False  # a batch in pieces of a ragged store: it holds the write lock until commit or abort

    def planned(self) -> IngestPlan:
        """The batch's episode plan, made by now (a deferred one at `PiecesWriter.finish`, before its index entries).

        Raises:
            RuntimeError: the plan was deferred and is not made yet (a bug in the caller's order of steps).
        """
        plan = self.plan
        if isinstance(plan, Deferred):
            raise RuntimeError("the episode plan of a batch in pieces is made at its commit; it was read before")
        return plan


def shift_new_episodes(plan: IngestPlan, first_id: int, delta: int) -> None:
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
