"""Leases: rows a task consumed but has not acknowledged yet (in flight), and what happens to them.

`store.consume(task, n, lease=seconds)` hands the rows out in flight for that task under a lease id
(`batch.lease`). Until the lease ends the rows go to no other consumer of the task and are never evicted. Then:
- `store.ack(lease)` (or `batch.ack()`): final. The rows count as consumed by the task and are never delivered to
  it again; the store's final-consumption hooks are called (`ConsumeTracker.final_hooks`, the journal's).
- `store.nack(lease)`: the rows go back to the task's queue at once.
- the lease expires (its consumer died, the reply was lost, it forgot): at its deadline the rows go back to the
  task's queue. Expiry is checked whenever the store looks at consumption (every consume, ack, nack, stats, a held
  writer), and waits are bounded by the next deadline, so an expired lease's rows reach a waiting consumer on time.
Rows that go back keep their place: a task's queue is in id (seq) order, so they are delivered again before any
newer row (in their original order). Delivery is at least once before an ack, exactly once after it.

A lease ends once. Acking or nacking it again, or after it expired, raises `LeaseError` naming what ended it (the
table remembers the last `ENDED_KEPT` ended leases; an older or never issued id is "unknown"). Ids are
`<store token>.<n>.<secret>`: a random token per store object, so an id of another store (or of this store before a
restart) is never taken for one of its own, and 64 random bits per lease, so that a client holding one lease cannot
guess another client's (and ack or nack it). This module keeps the table only; `arrowbuf.engine.consume.ConsumeTracker`
decides what the rows do, under the store's state lock (every method here is called holding it).

Who holds a lease: its owner is whoever acts when it opens (`arrowbuf.observe.identity`: the Flight server acts as
the calling client). A server bounds the leases one client holds open with `client_cap(n)` around the store calls it
makes for that client (`ServerLimits.max_leases_per_client`); past it, a consume with `lease=` is refused with
`ResourceExhausted` and takes nothing. In-process callers are not capped (their own process).
"""

from __future__ import annotations

import collections
import itertools
import math
import re
import secrets
import time
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument, LeaseError, ResourceExhausted
from ..observe import identity
from ..serving.limits import current_client_cap

#: Longest lease a consume may ask for (seconds): a day.
MAX_LEASE_S = 86400.0
#: Ended leases remembered for a clear error on a second ack/nack.
ENDED_KEPT = 1 << 16
#: Longest lease id (characters); ids are short, but a remote one is hostile input.
MAX_LEASE_ID_CHARS = 128
_ID = re.compile(r"[A-Za-z0-9._:/+-]{1,128}")
def cap_refusal(held: int, limit: int) -> ResourceExhausted:
    return ResourceExhausted(f"consume: this client holds {held} open leases, the server's max_leases_per_client "
                             f"({limit}); ack or nack some before consuming with lease= again")


def check_lease_seconds(value: object, what: str = "consume: lease") -> float | None:
    """`value` as a lease duration in seconds (None: no lease).

    Raises:
        InvalidArgument: not a finite number in (0, MAX_LEASE_S].
    """
    if value is None:
        return None
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool) or \
            not 0 < float(value) <= MAX_LEASE_S or math.isnan(float(value)):
        raise InvalidArgument(f"{what} must be a number of seconds in (0, {MAX_LEASE_S:.0f}], got {value!r}")
    return float(value)


def check_lease_id(value: object, what: str = "lease") -> str:
    """`value` as a lease id (what `batch.lease` holds).

    Raises:
        LeaseError: not a string of at most `MAX_LEASE_ID_CHARS` characters of `[A-Za-z0-9._:/+-]`.
    """
    if not isinstance(value, str) or not _ID.fullmatch(value):
        shown = repr(value)[:80]
        raise LeaseError(f"{what}: {shown} is not a lease id; pass batch.lease of a batch consumed with lease=")
    return value


@dataclass
class Lease:
    """One open lease: the rows (`seqs`, oldest first) `task` holds in flight until `deadline` (monotonic), opened
    by `owner` (an `identity` code)."""

    id: str
    task: str
    seqs: np.ndarray
    deadline: float
    owner: int = 0


class LeaseTable:
    """The open leases of one store, the recently ended ones, and per-task counts (see the module docstring)."""

    def __init__(self) -> None:
        self._open: dict[str, Lease] = {}
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._token = secrets.token_hex(6)
        self._ids = itertools.count(1)
        self._owners: dict[int, int] = {}  # open leases per owner (client_cap)
        self._rows: dict[str, int] = {}  # rows in flight per task (counted as leases open and end)
        self.redelivered: dict[str, int] = {}  # rows returned to a task's queue (expired or nacked)
        self.expired: dict[str, int] = {}  # leases that expired, per task

    def __len__(self) -> int:
        return len(self._open)

    def open(self, task: str, seqs: np.ndarray, seconds: float) -> Lease:
        """A new lease on `seqs` for `task`, ending `seconds` from now.

        Raises:
            ResourceExhausted: the caller holds `client_cap` open leases already.
        """
        owner = identity.current_code()
        cap = current_client_cap()
        if cap is not None:
            held = self._owners.get(owner, 0)
            if held >= cap:
                raise cap_refusal(held, cap)
        lease = Lease(f"{self._token}.{next(self._ids)}.{secrets.token_hex(8)}", task, seqs,
                      time.monotonic() + seconds, owner)
        self._open[lease.id] = lease
        self._owners[owner] = self._owners.get(owner, 0) + 1
        self._rows[task] = self._rows.get(task, 0) + len(seqs)
        return lease

    def _closed(self, lease: Lease) -> None:
        left = self._owners.get(lease.owner, 0) - 1
        if left > 0:
            self._owners[lease.owner] = left
        else:
            self._owners.pop(lease.owner, None)
        self._rows[lease.task] = self._rows.get(lease.task, 0) - len(lease.seqs)

    def take(self, lease_id: object, verb: str) -> Lease:
        """Remove and return the open lease `lease_id` (to ack it: `find`, then `remove`).

        Raises:
            LeaseError: not an id, or no open lease has it (already acked or nacked, expired, unknown).
        """
        lease = self.find(lease_id, verb)
        self.remove(lease)
        return lease

    def remove(self, lease: Lease) -> None:
        """Close `lease` (its rows are no longer in flight under it); nothing if it is not open. A caller that puts
        the rows back does so first: a process killed in between (a shared table) leaves a lease whose rows are
        back already, never rows marked consumed that no lease returns."""
        if self._open.pop(lease.id, None) is not None:
            self._closed(lease)

    def find(self, lease_id: object, verb: str) -> Lease:
        """The open lease `lease_id`, left open (to nack it: its rows go back before `remove`).

        Raises:
            LeaseError: not an id, or no open lease has it (already acked or nacked, expired, unknown).
        """
        lid = check_lease_id(lease_id, verb)
        lease = self._open.get(lid)
        if lease is not None:
            return lease
        how = self._ended.get(lid)
        if how == "expired":
            raise LeaseError(f"{verb}: lease {lid!r} expired before it was acknowledged; its rows went back to the "
                             "task's queue (they are or will be delivered again): consume again, and ack within the "
                             "lease (pass a longer lease=)")
        if how is not None:
            raise LeaseError(f"{verb}: lease {lid!r} was already {how}; a lease ends once")
        raise LeaseError(f"{verb}: unknown lease {lid!r} (never issued by this store, or ended long ago); pass the "
                         "batch.lease of a batch this store delivered")

    def ended(self, lease: Lease, how: str) -> None:
        """Remember that `lease` ended (`how`: "acked", "nacked", "expired")."""
        self._ended[lease.id] = how
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        if how != "acked":
            self.redelivered[lease.task] = self.redelivered.get(lease.task, 0) + len(lease.seqs)
        if how == "expired":
            self.expired[lease.task] = self.expired.get(lease.task, 0) + 1

    def expiring(self, now: float | None = None) -> list[Lease]:
        """The open leases whose deadline passed, left open (their rows go back before each is `remove`d)."""
        if not self._open:
            return []
        now = time.monotonic() if now is None else now
        return [lease for lease in self._open.values() if lease.deadline <= now]

    def next_deadline(self) -> float | None:
        """The earliest deadline of an open lease (monotonic), or None."""
        return min((lease.deadline for lease in self._open.values()), default=None)

    def held(self) -> np.ndarray:
        """Seqs of every row in flight (any task)."""
        if not self._open:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([lease.seqs for lease in self._open.values()])

    def of_task(self, task: str) -> list[Lease]:
        """The open leases of `task`."""
        return [lease for lease in self._open.values() if lease.task == task]

    def task_seqs(self, task: str) -> np.ndarray:
        """Seqs of every row `task` holds in flight, in one array (no work per lease beyond joining their seqs)."""
        held = [lease.seqs for lease in self._open.values() if lease.task == task]
        return np.concatenate(held) if held else np.zeros(0, dtype=np.int64)

    def in_flight(self, tasks: list[str]) -> dict[str, int]:
        """Rows in flight per task (counted as leases open and end: no work per lease)."""
        out = dict.fromkeys(tasks, 0)
        out.update({task: n for task, n in self._rows.items() if n})
        return out


__all__ = ["ENDED_KEPT", "MAX_LEASE_ID_CHARS", "MAX_LEASE_S", "Lease", "LeaseTable", "cap_refusal",
           "check_lease_id", "check_lease_seconds"]
