"""Where consumption per task lives: the store's tier (shared memory for `tier="shm"`) or this process's heap.

`ConsumeTracker` (`arrowbuf.engine.consume`) keeps its state in the objects made here, so that the processes of one
node that open a shared store (`ExperienceStore(..., tier="shm", tasks=[...])`, `ExperienceStore.attach(name)`)
consume from one store with the semantics of one process. Every read and write of this state happens under the
store's state lock (a cross-process robust mutex for a shared store, `arrowbuf.tiers.shm.locks`).

Layout in a shared tier (arenas of the store's directory, recorded in its manifest and checked on attach)::

    arena.consume.header     int64 [8]: policy_version, stale_dropped, insert_waits, the lease counter, the store's
                             lease token, ended leases, the 128-bit key of lease ids (`shared_leases`)
    arena.consume.task.<i>   int64 [arena_rows]: per ring position, the seq of the row task i consumed there (-1: none)
    arena.consume.task.<i>.ints  int64 [10]: task i's cursor, rows delivered, rows dropped as stale, rows
                             redelivered, leases expired, rows admitted oldest-first, the window of its last
                             oldest-first consume (`arrowbuf.samplers.admission.encode_window`), and the consumption
                             being made final: its lease number or -(its first seq + 1) (0: none), rows, and rows
                             delivered before it (`begin_final`)
    arena.consume.task.<i>.lease  int64 [arena_rows]: the lease holding task i's row there (`shared_leases`)
    arena.consume.pins       int64 [PIN_SLOTS, 4]: gathers in progress: pid, its start time, pin id, oldest seq
    arena.consume.leases, arena.consume.ended: the open and recently ended leases (`arrowbuf.engine.shared_leases`)

Tasks are numbered in declaration order; their names are in the manifest (`consume.tasks`). A shared store's tasks
are declared when it is created (its arenas are made once, before it is sealed).

Pins (a consume's rows being gathered outside the lock hold eviction) are slots holding the pid and start time of
the process that gathers: a process killed mid-gather leaves its slot, which the next reader that finds its process
gone (or its pid reused: another start time) clears, when every process with the store open is visible here (one
pid namespace; otherwise the pin is kept: eviction waits rather than tear a row). So a SIGKILL never holds eviction for
good within one pid namespace.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, MutableMapping

import numpy as np

from ..errors import InvalidArgument
from ..tiers.base import Tier
from ..tiers.shm.paths import start_time as _start_time
from .leases import LeaseTable
from .shared_leases import ENDED_SLOTS, LEASE_SLOTS, SLOT_INTS, SharedLeaseTable

#: Header slots of `consume.header`.
HEADER = {"policy_version": 0, "stale_dropped": 1, "insert_waits": 2}  # 3-7: the lease table's (shared_leases)
HEADER_LEN = 8
#: Per-task ints of `consume.task.<i>.ints`.
TASK_INTS = {"cursor": 0, "delivered": 1, "stale": 2, "redelivered": 3, "leases_expired": 4, "admitted": 5,
             "window": 6,
             "final": 7, "final_rows": 8, "final_base": 9}
#: Concurrent gathers a shared store tracks (consumers in all processes together, one each while gathering).
PIN_SLOTS = 256
#: Seconds a liveness check of another process's pin is trusted.
_ALIVE_TTL_S = 0.05


class NamedInts(MutableMapping[str, int]):
    """A dict of ints over fixed slots of an int64 array (a store's counters in its tier)."""

    def __init__(self, arr: np.ndarray, slots: dict[str, int]) -> None:
        self._arr = arr
        self._slots = slots

    def __getitem__(self, key: str) -> int:
        return int(self._arr[self._slots[key]])

    def __setitem__(self, key: str, value: int) -> None:
        self._arr[self._slots[key]] = int(value)

    def __delitem__(self, key: str) -> None:
        raise InvalidArgument(f"counter {key!r} cannot be removed")

    def __iter__(self) -> Iterator[str]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)


class TaskInts(MutableMapping[str, int]):
    """One int per task (slot `slot` of each task's ints array): cursors, delivered rows, stale drops."""

    def __init__(self, ints: dict[str, np.ndarray], slot: int) -> None:
        self._ints = ints
        self._slot = slot

    def __getitem__(self, task: str) -> int:
        return int(self._ints[task][self._slot])

    def __setitem__(self, task: str, value: int) -> None:
        self._ints[task][self._slot] = int(value)

    def __delitem__(self, task: str) -> None:
        raise InvalidArgument(f"task {task!r} cannot be removed")

    def __iter__(self) -> Iterator[str]:
        return iter(self._ints)

    def __len__(self) -> int:
        return len(self._ints)


class SharedPins(MutableMapping[int, int]):
    """Gathers in progress ({pin id: oldest seq}) of every process of a shared store, in a slot table.

    This process's pins are set and removed by id; `values()` (what eviction checks) also holds the pins of other
    live processes. Slots of a process that died are cleared when seen (see the module docstring).
    """

    def __init__(self, table: np.ndarray, store_dir: str | None = None) -> None:
        self._t = table  # [PIN_SLOTS, 4]: pid, start time, pin id, oldest seq (pid 0: free)
        self._store_dir = store_dir  # its leases say who has the store open (`_all_visible`)
        self._mine: dict[int, int] = {}  # pin id -> slot
        self._pid = os.getpid()
        self._start = _start_time(self._pid)
        self._alive: dict[tuple[int, int], float] = {}  # (pid, start time) -> when it was last seen alive

    def _me(self) -> None:
        if os.getpid() != self._pid:  # a forked child: its pins are its own
            self._pid, self._start, self._mine = os.getpid(), _start_time(os.getpid()), {}

    def __setitem__(self, pin: int, seq: int) -> None:
        self._me()
        free = np.flatnonzero(self._t[:, 0] == 0)
        if not len(free):
            self._prune()
            free = np.flatnonzero(self._t[:, 0] == 0)
            if not len(free):
                raise InvalidArgument(f"more than {PIN_SLOTS} consumes gather rows of this shared store at once; "
                                      "use fewer concurrent consumers")
        s = int(free[0])
        self._t[s, 1:] = (self._start, pin, seq)
        self._t[s, 0] = self._pid
        self._mine[pin] = s

    def __getitem__(self, pin: int) -> int:
        return int(self._t[self._mine[pin], 3])

    def __delitem__(self, pin: int) -> None:
        self._me()
        s = self._mine.pop(pin)
        self._t[s] = 0

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._mine))

    def __len__(self) -> int:
        return len(self._mine)

    def __bool__(self) -> bool:
        return bool((self._t[:, 0] != 0).any())

    def values(self) -> list[int]:  # type: ignore[override]
        """The oldest seq of every gather in progress, in any live process."""
        self._me()
        used = np.flatnonzero(self._t[:, 0] != 0)
        out = []
        for s in used.tolist():
            pid, start, _, seq = (int(v) for v in self._t[s])
            if pid != self._pid and not self._is_alive(pid, start) and self._all_visible():
                self._t[s] = 0  # its process died mid-gather
                continue
            out.append(seq)
        return out

    def _prune(self) -> None:
        self.values()

    def _all_visible(self) -> bool:
        """Whether every process with the store open is visible in this process's /proc (one pid namespace): only
        then does a missing pid mean a dead process (as for the writers' reservations, `arrowbuf.ring.reservations`);
        otherwise a pin is kept (eviction waits) rather than a row torn under another namespace's gather."""
        if self._store_dir is None:
            return True
        from ..tiers.shm.janitor import lease_holders

        return all(_start_time(pid) == started for pid, started in lease_holders(self._store_dir))

    def _is_alive(self, pid: int, start: int) -> bool:
        now = time.monotonic()
        seen = self._alive.get((pid, start))
        if seen is not None and now - seen < _ALIVE_TTL_S:
            return True
        alive = _start_time(pid) == start and start != 0
        if alive:
            if len(self._alive) > 4 * PIN_SLOTS:
                self._alive.clear()
            self._alive[(pid, start)] = now
        return alive


class ConsumeState:
    """The arrays and counters of one store's `ConsumeTracker`, in its tier when the tier is shared.

    Attributes:
        consumed: {task: int64 [arena_rows]} the seq consumed at each ring position (-1: none).
        cursor, delivered, stale_by_task: {task: int} mappings.
        counters: {"stale_dropped", "insert_waits"} mapping.
        pins: {pin id: oldest seq} of gathers in progress (every process's, for a shared store).
    """

    def __init__(self, tier: Tier, arena_rows: int) -> None:
        self.tier = tier
        self.shared = bool(tier.shared)
        self.arena_rows = int(arena_rows)
        self.consumed: dict[str, np.ndarray] = {}
        self._ints: dict[str, np.ndarray] = {}
        self.header = self._alloc("consume.header", HEADER_LEN, 0)
        self.counters = NamedInts(self.header, {k: v for k, v in HEADER.items() if k != "policy_version"})
        self.cursor = TaskInts(self._ints, TASK_INTS["cursor"])
        self.delivered = TaskInts(self._ints, TASK_INTS["delivered"])
        self.stale_by_task = TaskInts(self._ints, TASK_INTS["stale"])
        self.admitted = TaskInts(self._ints, TASK_INTS["admitted"])  # rows delivered oldest-first (store.admission)
        self.window = TaskInts(self._ints, TASK_INTS["window"])  # the window of its last oldest-first consume
        self.pins: MutableMapping[int, int]
        self._marks: dict[str, np.ndarray] = {}  # per task: the lease holding each row (shared leases)
        self.leases: LeaseTable
        if self.shared:
            table = tier.allocate("consume.pins", np.dtype(np.int64), PIN_SLOTS, (4,))
            if tier.fresh:
                table.fill(0)
            self.pins = SharedPins(table, getattr(tier, "path", None))
            self.leases = SharedLeaseTable(
                self.header, tier.allocate("consume.leases", np.dtype(np.int64), LEASE_SLOTS, (SLOT_INTS,)),
                tier.allocate("consume.ended", np.dtype(np.int64), ENDED_SLOTS, (2,)), self._marks, self.consumed,
                TaskInts(self._ints, TASK_INTS["redelivered"]), TaskInts(self._ints, TASK_INTS["leases_expired"]),
                fresh=bool(tier.fresh))
        else:
            self.pins = {}
            self.leases = LeaseTable()

    def _alloc(self, key: str, rows: int, fill: int) -> np.ndarray:
        if not self.shared:
            return np.full(rows, fill, dtype=np.int64)
        arr = self.tier.allocate(key, np.dtype(np.int64), rows)
        if self.tier.fresh:  # a process attaching must not reset what the others wrote
            arr.fill(fill)
        return arr

    @property
    def policy_version(self) -> int:
        return int(self.header[HEADER["policy_version"]])

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self.header[HEADER["policy_version"]] = int(value)

    def version_view(self) -> memoryview:
        """A live one-element view of the policy version: `view[0]` reads the current version without a call
        (lineage's per-row hook)."""
        i = HEADER["policy_version"]
        return self.header[i:i + 1].data

    def can_add(self) -> str:
        """'' when a task may be declared now, else why not (a shared store past its creation)."""
        if self.shared and (not self.tier.fresh or getattr(self.tier, "sealed", False)):
            return ("a shared-memory store's tasks are declared when it is created: pass "
                    "ExperienceStore(..., tier='shm', tasks=[...]) (its other processes see them on attach)")
        return ""

    # a consumption being made final (an ack, a consume without a lease), so that one cut short by a SIGKILL is
    # finished by the next holder of the state lock: its rows' marks or lease and their count are separate writes,
    # and a count lost between them never comes back
    def begin_final(self, task: str, key: int, rows: int) -> None:
        """Record, before they start, the writes that make `rows` rows of `task` final: `key` is the acked lease's
        number (> 0) or -(the first seq a consume without a lease marks + 1)."""
        ints = self._ints[task]
        ints[TASK_INTS["final_rows"]] = rows
        ints[TASK_INTS["final_base"]] = ints[TASK_INTS["delivered"]]
        ints[TASK_INTS["final"]] = key  # last: a record without its key is none

    def end_final(self, task: str) -> None:
        self._ints[task][TASK_INTS["final"]] = 0

    def final_in_progress(self, task: str) -> tuple[int, int, int] | None:
        """(key, rows, rows delivered before it) of a consumption of `task` that began to be made final and did not
        end (`begin_final`), or None."""
        ints = self._ints[task]
        key = int(ints[TASK_INTS["final"]])
        if key == 0:
            return None
        return key, int(ints[TASK_INTS["final_rows"]]), int(ints[TASK_INTS["final_base"]])

    def add(self, task: str) -> None:
        """Make (or, attaching, map) task `task`'s arrays; the next task number is its position."""
        i = len(self.consumed)
        self.consumed[task] = self._alloc(f"consume.task.{i}", self.arena_rows, -1)
        self._ints[task] = self._alloc(f"consume.task.{i}.ints", len(TASK_INTS), 0)
        if self.shared:
            self._marks[task] = self._alloc(f"consume.task.{i}.lease", self.arena_rows, 0)


#: Most tasks a shared store's manifest may declare (a real one has a handful).
MAX_SHARED_TASKS = 256


__all__ = ["HEADER", "MAX_SHARED_TASKS", "PIN_SLOTS", "ConsumeState", "NamedInts", "SharedPins", "TaskInts"]
