"""Leases of a shared-memory store: the lease table of `arrowbuf.engine.leases` in the store's shared memory.

Every process that opens a shared store (`tier="shm"`) sees the same open leases, so a batch consumed with
`lease=` in one process may be acked or nacked in any other (the id names the store, not the process), and the
rows of a consumer process that dies come back to its task when the lease expires: whichever process looks at
consumption next (a consume, an ack, a held writer) returns them. Deadlines are CLOCK_MONOTONIC instants, one clock
for every process of the node.

Layout (arenas of the store's directory; every access under the store's state lock, a robust mutex)::

    arena.consume.leases         int64 [LEASE_SLOTS, 7]: lease number (0: free), task number, deadline (ns),
                                 rows, oldest seq, newest seq, owner (pid << 32 | the opener's identity code)
    arena.consume.ended          int64 [ENDED_SLOTS, 2]: the last ended leases (a ring): lease number, how it ended
    arena.consume.task.<i>.lease int64 [arena_rows]: per ring position, the lease number holding task i's row there

A row is in a lease's flight for its task while the task's consumed mark holds the row's seq and its lease mark holds
the lease's number; a lease's rows are found again by scanning its [oldest, newest] seq range. Lease numbers come from
a counter in the store's header, so an id is never reused; ids are `<store token>.<n>.<mac>` with the token and a
128-bit key drawn once when the store is created (`consume.header`), and the mac a keyed BLAKE2b of the number: a
process of the node can rebuild any id (it maps the store), a remote client holding one id cannot guess another.

Shares: one process holds at most `process_share(LEASE_SLOTS)` open leases (3,072 of 4,096), so that no process
takes every slot; a server also caps each of its clients (`arrowbuf.serving.limits.client_cap`). A header or slot
table that shared memory corrupted (a counter out of range or already in use, a token out of range) is
`StoreCorrupt` naming `arena.consume.header` or `arena.consume.leases`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Iterator, MutableMapping

import numpy as np

from ..errors import InvalidArgument, ResourceExhausted, StoreCorrupt
from ..observe import identity
from ..serving.limits import current_client_cap
from .leases import ENDED_KEPT, Lease, LeaseTable, cap_refusal

#: Open leases a shared store holds at once (every process together).
LEASE_SLOTS = 4096
#: Ended leases a shared store remembers (for a clear error on a second ack or nack).
ENDED_SLOTS = min(4096, ENDED_KEPT)
_HOW = {"acked": 1, "nacked": 2, "expired": 3}
_HOW_NAME = {v: k for k, v in _HOW.items()}
#: Slots of `consume.header` this module uses (see `arrowbuf.engine.consume_state.HEADER`).
NEXT_LEASE, TOKEN, ENDED_COUNT, KEY = 3, 4, 5, 6
#: Ints per slot of `consume.leases`.
SLOT_INTS = 7
_MAX_TOKEN = 1 << 47
_MAX_NUMBER = 1 << 62
_HEADER = "arena.consume.header"


def process_share(slots: int) -> int:
    """Open leases one process may hold in a table of `slots`: three quarters of it (at least one), so that a
    quarter stays for the other processes of the node."""
    return max(1, slots - slots // 4)


def _number(lease_id: str, table: SharedLeaseTable) -> int:
    """The lease number of id `lease_id` of the store with `table` (KeyError: not one of its ids)."""
    token, n, mac = (lease_id.split(".") + ["", "", ""])[:3]
    if token != table.token or not n.isdigit() or len(n) > 18 or lease_id.count(".") != 2 \
            or not hmac.compare_digest(mac.encode(), table.mac(int(n)).encode()):
        raise KeyError(lease_id)
    return int(n)


class _OpenLeases(MutableMapping[str, Lease]):
    """The open leases as `LeaseTable` keeps them ({id: Lease}), over the shared slot table."""

    def __init__(self, table: SharedLeaseTable) -> None:
        self._t = table

    def _slot(self, lease_id: str) -> int:
        n = _number(lease_id, self._t)
        hit = np.flatnonzero(self._t.slots[:, 0] == n)
        if not len(hit):
            raise KeyError(lease_id)
        return int(hit[0])

    def __getitem__(self, lease_id: str) -> Lease:
        return self._t.lease_at(self._slot(lease_id))

    def __setitem__(self, lease_id: str, lease: Lease) -> None:
        self._t.store(_number(lease_id, self._t), lease)

    def __delitem__(self, lease_id: str) -> None:
        self._t.free(self._slot(lease_id))

    def __iter__(self) -> Iterator[str]:
        return iter([self._t.lease_id(int(n)) for n in self._t.slots[self._t.used(), 0]])

    def __len__(self) -> int:
        return len(self._t.used())


class _Ended(MutableMapping[str, str]):
    """The recently ended leases ({id: how}), a ring in shared memory (the oldest are forgotten first)."""

    def __init__(self, table: SharedLeaseTable) -> None:
        self._t = table

    def __getitem__(self, lease_id: str) -> str:
        n = _number(lease_id, self._t)
        hit = np.flatnonzero(self._t.ended_ring[:, 0] == n)
        if not len(hit):
            raise KeyError(lease_id)
        return _HOW_NAME.get(int(self._t.ended_ring[int(hit[-1]), 1]), "ended")

    def __setitem__(self, lease_id: str, how: str) -> None:
        h = self._t.header
        at = int(h[ENDED_COUNT]) % ENDED_SLOTS
        self._t.ended_ring[at] = (_number(lease_id, self._t), _HOW.get(how, 0))
        h[ENDED_COUNT] = int(h[ENDED_COUNT]) + 1

    def __delitem__(self, lease_id: str) -> None:
        raise InvalidArgument("ended leases are forgotten oldest first, never one by one")

    def __iter__(self) -> Iterator[str]:
        return iter([self._t.lease_id(int(n)) for n in self._t.ended_ring[:, 0] if n])

    def __len__(self) -> int:
        return min(int(self._t.header[ENDED_COUNT]), ENDED_SLOTS)  # never above ENDED_KEPT: nothing is popped


class SharedLeaseTable(LeaseTable):
    """`LeaseTable` over shared memory (see the module docstring): the same methods and errors, every process's
    leases.

    Args:
        header: the store's `consume.header` (lease counter, token, ended count).
        slots, ended: the `consume.leases` and `consume.ended` arenas.
        marks: {task: its `consume.task.<i>.lease` array}; consumed: {task: its consumed array} (same order).
        redelivered, expired: per-task counters ({task: int} mappings in shared memory).
        fresh: the store is being created here (draw its token).
    """

    def __init__(self, header: np.ndarray, slots: np.ndarray, ended: np.ndarray, marks: dict[str, np.ndarray],
                 consumed: dict[str, np.ndarray], redelivered: MutableMapping[str, int],
                 expired: MutableMapping[str, int], fresh: bool) -> None:
        super().__init__()
        self.header, self.slots, self.ended_ring = header, slots, ended
        self.marks, self.consumed = marks, consumed
        if fresh:
            slots.fill(0)
            ended.fill(0)
            header[NEXT_LEASE] = 1
            header[TOKEN] = secrets.randbits(47) + 1
            header[ENDED_COUNT] = 0
            header[KEY] = secrets.randbits(63)
            header[KEY + 1] = secrets.randbits(63)
        token = int(header[TOKEN])
        if not 0 < token <= _MAX_TOKEN:
            raise StoreCorrupt(f"the lease token in {_HEADER} is {token}, outside 1..2**47: its memory was "
                               "overwritten. Recreate the store")
        if slots.ndim != 2 or slots.shape[1] != SLOT_INTS:
            raise StoreCorrupt(f"arena.consume.leases has shape {slots.shape}, not (slots, {SLOT_INTS}): it was "
                               "made by another arrowbuf version or overwritten. Recreate the store")
        self.token = f"{token:012x}"
        self._key = b"".join(int(v).to_bytes(8, "little", signed=True) for v in header[KEY:KEY + 2])
        self._open = _OpenLeases(self)  # type: ignore[assignment]
        self._ended = _Ended(self)  # type: ignore[assignment]
        self.redelivered = redelivered  # type: ignore[assignment]
        self.expired = expired  # type: ignore[assignment]

    # ------------------------------------------------------------------ ids
    def mac(self, n: int) -> str:
        """The secret part of lease number `n`'s id (a keyed BLAKE2b of the number)."""
        return hashlib.blake2b(n.to_bytes(8, "little", signed=True), key=self._key, digest_size=8).hexdigest()

    def lease_id(self, n: int) -> str:
        return f"{self.token}.{n}.{self.mac(n)}"

    # ------------------------------------------------------------------ the slot table
    def used(self) -> np.ndarray:
        """Slots of open leases."""
        return np.flatnonzero(self.slots[:, 0] != 0)

    def _task(self, i: int) -> str:
        names = list(self.consumed)
        if not 0 <= i < len(names):
            raise StoreCorrupt(f"the shared lease table (arena.consume.leases) names task number {i} of "
                               f"{len(names)}: its memory was overwritten. Recreate the store")
        return names[i]

    def _range(self, task: str, lo: int, hi: int) -> np.ndarray:
        """The seqs [lo, hi] of a lease slot (at most a ring's worth: anything else is overwritten memory)."""
        if hi < lo:
            return np.zeros(0, dtype=np.int64)
        if lo < 0 or hi - lo >= len(self.marks[task]):
            raise StoreCorrupt(f"the shared lease table (arena.consume.leases) holds seqs [{lo}, {hi}]: more than "
                               "the ring: its memory was overwritten. Recreate the store")
        return np.arange(lo, hi + 1, dtype=np.int64)

    def _seqs(self, task: str, n: int, lo: int, hi: int) -> np.ndarray:
        seqs = self._range(task, lo, hi)
        pos = seqs % len(self.marks[task])
        return seqs[(self.marks[task][pos] == n) & (self.consumed[task][pos] == seqs)]

    def lease_at(self, s: int) -> Lease:
        """The open lease in slot `s` (its rows found again from the marks)."""
        n, ti, deadline_ns, _, lo, hi, owner = (int(v) for v in self.slots[s])
        task = self._task(ti)
        return Lease(self.lease_id(n), task, self._seqs(task, n, lo, hi), deadline_ns / 1e9, owner)

    def store(self, n: int, lease: Lease) -> None:
        """Record open lease number `n` (its rows are marked consumed for its task by the caller, afterwards).

        The order makes any prefix of these writes safe for a process killed in the middle (the state lock then
        passes on, `tiers.shm.locks`): the slot first, then the rows' lease marks, then (the caller) the rows'
        consumed marks. A slot without marks is a lease of no rows; marks without consumed marks find no rows
        (`_seqs`); at the lease's expiry its slot and marks are cleared and the rows it found go back. Never a row
        marked consumed that no lease returns."""
        free = np.flatnonzero(self.slots[:, 0] == 0)
        if not len(free):  # (expired ones were ended by the consume that opens this one: `ConsumeTracker.expire`)
            raise InvalidArgument(f"this shared store has {len(self.slots)} open leases; ack or nack some before "
                                  "consuming with lease= again")
        used = self.slots[self.slots[:, 0] != 0]
        share = process_share(len(self.slots))
        mine = int((used[:, 6] >> 32 == os.getpid()).sum())
        if mine >= share:
            raise ResourceExhausted(f"this process holds {mine} of the shared store's {len(self.slots)} lease slots, "
                                    "its share; ack or nack some before consuming with lease= again")
        cap = current_client_cap()
        if cap is not None:
            held = int((used[:, 6] == lease.owner).sum())
            if held >= cap:
                raise cap_refusal(held, cap)
        seqs = np.asarray(lease.seqs, dtype=np.int64)
        ti = list(self.consumed).index(lease.task)
        lo, hi = (int(seqs.min()), int(seqs.max())) if len(seqs) else (0, -1)
        s = int(free[0])
        self.slots[s, 1:] = (ti, int(lease.deadline * 1e9), len(seqs), lo, hi, lease.owner)
        self.slots[s, 0] = n
        self.marks[lease.task][seqs % len(self.marks[lease.task])] = n

    def free(self, s: int) -> None:
        """Close slot `s`: its rows' lease marks are cleared (their consumed marks are the tracker's)."""
        n, ti, _, _, lo, hi, _ = (int(v) for v in self.slots[s])
        self.slots[s] = 0  # first: a slot that fails the checks below is gone all the same
        task = self._task(ti)
        seqs = self._range(task, lo, hi)
        pos = seqs % len(self.marks[task])
        mine = self.marks[task][pos] == n
        self.marks[task][pos[mine]] = 0

    def number_of(self, lease: Lease) -> int:
        """The number of an open lease (its slot's key)."""
        return _number(lease.id, self)

    def close_number(self, task: str, n: int) -> None:
        """Close lease number `n` of `task` whatever of its closing already ran (an ack cut short): its slot if it is
        still open, and every lease mark of it."""
        for s in np.flatnonzero(self.slots[:, 0] == n):
            self.free(int(s))
        marks = self.marks[task]
        marks[marks == n] = 0

    # ------------------------------------------------------------------ LeaseTable, shared
    def open(self, task: str, seqs: np.ndarray, seconds: float) -> Lease:
        n = int(self.header[NEXT_LEASE])
        if not 0 < n < _MAX_NUMBER or (self.slots[:, 0] == n).any():
            raise StoreCorrupt(f"the lease counter in {_HEADER} is {n}: out of range or a number an open lease "
                               "holds; its memory was overwritten. Recreate the store")
        owner = (os.getpid() << 32) | identity.current_code()
        lease = Lease(self.lease_id(n), task, seqs, time.monotonic() + seconds, owner)
        # the counter first: a process killed after `store` must not leave the next lease the number of an open one
        # (a refused `store` skips a number, nothing else)
        self.header[NEXT_LEASE] = n + 1
        self.store(n, lease)  # refused (full, over a share): nothing was taken
        return lease

    def task_seqs(self, task: str) -> np.ndarray:
        """Seqs of every row `task` holds in flight: its rows whose lease mark is set (one pass, no work per lease)."""
        marks = self.marks.get(task)
        if marks is None:
            return np.zeros(0, dtype=np.int64)
        return np.asarray(self.consumed[task][marks != 0], dtype=np.int64)

    def expiring(self, now: float | None = None) -> list[Lease]:
        used = self.used()
        if not len(used):
            return []
        now_ns = int((time.monotonic() if now is None else now) * 1e9)
        gone = []
        for s in used[self.slots[used, 2] <= now_ns].tolist():
            try:
                gone.append(self.lease_at(s))
            except StoreCorrupt:
                self.slots[s] = 0  # said once; its rows stay consumed for the task
                raise
        return gone

    def held(self) -> np.ndarray:
        """Seqs of every row in flight (any task): one pass over the lease marks, no work per lease."""
        held = [self.task_seqs(task) for task in self.consumed]
        return np.concatenate(held) if held else np.zeros(0, dtype=np.int64)

    def next_deadline(self) -> float | None:
        used = self.used()
        return None if not len(used) else float(self.slots[used, 2].min()) / 1e9

    def in_flight(self, tasks: list[str]) -> dict[str, int]:
        out = dict.fromkeys(tasks, 0)
        for s in self.used().tolist():
            task = self._task(int(self.slots[s, 1]))
            out[task] = out.get(task, 0) + int(self.slots[s, 3])
        return out


__all__ = ["ENDED_SLOTS", "LEASE_SLOTS", "SLOT_INTS", "SharedLeaseTable", "process_share"]
