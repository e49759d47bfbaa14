"""Row reservations of a store's ring: parallel writers, commits in seq order, and recovery from dead writers.

A batch is written in three steps (`arrowbuf.engine.writer` drives them):

1. **Reserve** (under the store's write lock, short): the batch takes seqs `[base, base + n)` from the reservation
   head, and `add(base, n)` records who holds them (pid and process start time) in a table in the tier's memory, so
   every process of a shared store sees it.
2. **Copy** (no lock): the rows are written to their ring positions. Writers of several processes (or threads) copy at
   the same time, each into its own rows.
3. **Commit** (under the state lock), in seq order: a batch commits only when every row before it has committed (the
   live range's end `hi`, the commit watermark, equals its `base`), so a row is sampleable only when every row before
   it is whole. A writer whose turn has not come waits for `hi` to move (`wait_hi`: a futex on the header word on
   Linux, so a commit in any process wakes it; short sleeps elsewhere), then `done(slot)`.

A writer that dies between reserve and commit (SIGKILL included) would leave a gap that holds back every later commit.
A waiter whose wait made no progress for a while asks `stale(hi)`: when the reservation at the watermark belongs to a
process that no longer exists (pid gone, or reused by a later process), or was abandoned (`abort`: an exception while
copying), the waiter commits it as a *hole*: its positions get seq `HOLE`, never sampleable, skipped by snapshots, and
the watermark moves past it. Its rows were never acknowledged to anyone (`extend` had not returned), so nothing
acknowledged is lost, and no torn row is ever visible.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from ..tiers.base import Tier
from ..tiers.futex import FUTEX as _FUTEX

#: Seq of a ring position whose reservation was skipped (its writer died): not a row.
HOLE = -3
#: Reservations that can be open at once (a writer waits for a free entry beyond that).
SLOTS = 64
_BASE, _N, _PID, _START = range(4)
#: Seconds a waiter waits without progress before it checks the reservation it waits for.
CHECK_S = 0.05

_ME: list[tuple[int, int]] = []  # (pid, start time) of this process, after a fork too


def _me() -> tuple[int, int]:
    pid = os.getpid()
    if not _ME or _ME[0][0] != pid:
        from ..tiers.shm.paths import start_time

        _ME[:] = [(pid, start_time(pid))]
    return _ME[0]


class Reservations:
    """The table of open reservations of one store (see the module docstring).

    Args:
        tier: where the table lives (the store's index tier: shared memory for `tier="shm"`).
        header: the ring index's header array; `hi_slot` is the slot of the commit watermark `hi` in it.
    """

    def __init__(self, tier: Tier, header: np.ndarray, hi_slot: int) -> None:
        self.table = tier.allocate("index.reservations", np.dtype(np.int64), SLOTS, (4,))
        if tier.fresh:
            self.table[:, _BASE] = -1
        self.shared = tier.shared
        self._store_dir = getattr(tier, "path", None) if tier.shared else None  # its leases: who has it open
        self._header = header
        self._hi_slot = hi_slot
        self._hi_addr = header.ctypes.data + hi_slot * header.itemsize

    # ------------------------------------------------------------------ table (under the write lock)
    def add(self, base: int, n: int, hi: int) -> int:
        """Record the reservation `[base, base + n)`; returns its entry, or -1 when every entry is in use (entries
        of reservations below the watermark `hi` are free: committed or skipped)."""
        t = self.table
        free = np.flatnonzero((t[:, _BASE] < 0) | (t[:, _BASE] < hi))
        if not len(free):
            return -1
        i = int(free[0])
        pid, start = _me()
        t[i, _N], t[i, _PID], t[i, _START] = n, pid, start
        t[i, _BASE] = base
        return i

    def done(self, slot: int) -> None:
        """The reservation committed (or was skipped): its entry is free."""
        self.table[slot, _BASE] = -1

    def abort(self, slot: int) -> None:
        """This writer gives its reservation up (an exception while copying): the next waiter skips it."""
        self.table[slot, _PID] = 0

    # ------------------------------------------------------------------ recovery (under the state lock)
    def stale(self, hi: int) -> int:
        """Rows of the reservation that starts at the watermark `hi` when its writer is dead or gave it up (the
        caller then commits them as a hole); 0 when it may still commit, or when no reservation starts there."""
        t = self.table
        at = np.flatnonzero(t[:, _BASE] == hi)
        if not len(at):
            return 0
        i = int(at[0])
        pid, start = int(t[i, _PID]), int(t[i, _START])
        if pid != 0 and (_alive(pid, start) or not self._all_visible()):
            return 0
        n = int(t[i, _N])
        t[i, _BASE] = -1
        return n

    # ------------------------------------------------------------------ waiting for the watermark
    def wait_hi(self, seen: int, seconds: float) -> None:
        """Sleep until the watermark differs from `seen` (a commit in any process wakes this), or `seconds` pass.
        Returns early now and then (spurious wake-ups): callers re-check."""
        if _FUTEX is not None:
            _FUTEX.wait(self._hi_addr, seen, seconds)
        else:
            time.sleep(min(seconds, 0.0005))

    def wake(self) -> None:
        """Wake every writer waiting for the watermark (after it moved)."""
        if _FUTEX is not None:
            _FUTEX.wake(self._hi_addr)


    def _all_visible(self) -> bool:
        """Whether every process with the store open is visible in this process's /proc (one pid namespace): only
        then does a missing pid mean a dead writer (as for the locks' stuck-holder check)."""
        if self._store_dir is None:
            return True
        from ..tiers.shm.janitor import lease_holders
        from ..tiers.shm.paths import start_time

        return all(start_time(pid) == started for pid, started in lease_holders(self._store_dir))


def _alive(pid: int, start: int) -> bool:
    """Whether process `pid` started at `start` still exists (a reused pid is another process)."""
    if pid == os.getpid():
        return True
    from ..tiers.shm.paths import start_time

    now = start_time(pid)
    return now != 0 and (start == 0 or now == start)


def waited(since: float) -> bool:
    """True once a wait that began at `since` (time.monotonic) ran `CHECK_S` without progress."""
    return time.monotonic() - since >= CHECK_S


__all__: list[Any] = ["HOLE", "Reservations", "SLOTS", "waited"]
