"""Consumption per task: each task sees every row once; rows wait for their fields, groups, versions and budgets.

The LLM post-training path: rollout workers write rows, later stages fill fields (`store.update`), and
each stage ("ref", "train") consumes every row exactly once, independently of the others. A store owns one
`ConsumeTracker` (composition: the store delegates `consume`, `add_task` and `policy_version` to it).

Usage::

    store = ab.ExperienceStore(schema, capacity=4096, tasks=["ref", "train"], max_staleness=1)
    ids = store.extend(rollouts)
    ref = store.consume("ref", 256, timeout=5.0)                      # each row once for "ref"
    store.update(ref.indices, {"ref_logprobs": ...})
    store.policy_version = 7
    b = store.consume("train", 256, require=["reward", "ref_logprobs"], max_staleness=1,
                      where="reward IS NOT NULL AND policy_version >= 6", max_tokens=65536, timeout=5.0)

Mechanism:
- Per task, one int64 per ring position holding the seq of the row the task consumed there (-1: none). A row is
  consumed by a task iff `consumed[pos] == seq`: a new row in a recycled slot is unconsumed with no reset needed
  (the same generation check as priority updates). A cursor per task skips the consumed prefix of the ring.
- `consume` selects and marks rows under the store's state lock, so two consumers of one task never get the same
  row, then gathers them outside the lock through the reader's gather (every column, ragged included). While it
  gathers, the rows are pinned: the writer's eviction hold (below) keeps them in place, so no row is torn.
- Leases (`consume(..., lease=s)`, `arrowbuf.engine.leases`): the rows are marked as above (no other consumer of the
  task gets them) but are not final: an `ack` makes them so, a `nack` or the lease's expiry unmarks them and moves
  the task's cursor back, so they are delivered again before newer rows. Leased rows hold eviction. Whatever makes
  a consumption final (a consume without a lease, an ack, a stale or zero-variance drop) goes through `_final`,
  which calls `final_hooks` (the journal's hook point).
- Blocking: `consume` waits on the store's condition variable, which commits, updates (`notify`), consumption and
  `policy_version` changes notify; at the deadline it returns what is ready (possibly nothing).
- Eviction hold: with tasks declared, the writer (`StoreWriter.hold`) may evict a row only once every declared task
  consumed it, or it is stale under the store's `max_staleness`, and it is not being gathered. A writer that would
  evict a held row waits (without the write lock, so `update` and other stages go on) up to its `timeout`, then
  raises `InsertTimeout`; nothing is written.
- Staleness: `consume(max_staleness=k)` drops (marks consumed for the task, counts `stale_dropped`) rows whose
  `policy_version` is below `store.policy_version - k`. With `ExperienceStore(max_staleness=k)` writers are also
  admitted by version: rows older than the window raise `InvalidArgument`, rows ahead of it wait for the version.
- Groups (`ab.samplers.Group` as the store's sampler): only complete groups whose rows are all ready are delivered,
  never split; `n` counts rows (at most `n // size` groups); staleness and `where` judge whole groups; zero-variance
  groups are dropped for every task (`arrowbuf.samplers.group`).
- `where=`: a SQL predicate run in `arrowbuf.query.sql`'s sandbox over the candidate rows' scalar columns only (scalar
  fields, `episode_id`, `step`, `seq`; a later field not yet written is NULL); ragged and tensor columns are never
  read for it. Rows that fail the filter stay unconsumed for the task (a later call may take them).
- Shared memory (`tier="shm"`): the state above (consumed seqs, cursors, counters, `policy_version`, pins, leases)
  lives in the store's shared memory (`arrowbuf.engine.consume_state`, `arrowbuf.engine.shared_leases`) under its
  cross-process state lock, so consumers, updaters and writers in every process that attached it share it; a wait
  for rows polls there (another process's commit cannot notify this condition).
- `max_tokens=`: a token budget over the store's `token_field` (a ragged field; default `response_tokens` when the
  schema has it, else its only ragged field): rows (groups) in order while their token count fits; always at least
  one, so a row longer than the budget is delivered alone rather than never.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any, cast

import numpy as np

from ..delivery.batch import SampleBatch
from ..errors import InsertTimeout, InvalidArgument, SchemaError
from ..query.filters import MAX_WHERE_CHARS, RowFilters
from ..query.sql import caller_cancelled
from ..samplers.admission import admit, check_admission, encode_window, waiting
from ..samplers.base import Sampler
from ..samplers.group import GroupSampler
from ..surface import StoreSurface
from ..tiers.base import Tier
from .consume_state import ConsumeState
from .core import StoreCore
from .leases import LeaseTable, check_lease_seconds
from .reader import StoreReader
from .shared_leases import SharedLeaseTable
from .tokens import check_token_field, token_counts, token_field_of

#: Seconds between checks that a server's caller is still there, while a consume waits for rows.
_CANCEL_POLL_S = 0.2
#: First and longest pause between looks for rows while a consume of a shared store waits (other processes write).
_SHARED_POLL_S = 0.0002
_SHARED_POLL_MAX_S = 0.005

#: Consumption per task is part of the store surface now (`arrowbuf.surface.StoreSurface`); the old name stays.
ConsumeSurface = StoreSurface



def check_policy_version(value: object) -> None:
    """Refuse a policy version that is not a non-negative integer.

    Raises:
        InvalidArgument: naming the value.
    """
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"policy_version must be a non-negative integer, got {value!r}")

class ConsumeTracker:
    """Per-task consumption, staleness, groups and the writer's eviction/admission hold of one store.

    Args:
        core: the store's `StoreCore` (its index, columns, lock and condition).
        reader: the store's `StoreReader` (its `gather` delivers the rows).
        tasks: task names declared now (more with `add_task`).
        max_staleness: store-level staleness window (admission control and stale eviction), or None.
        token_field: the ragged field `max_tokens` counts, or None for the default (module docstring).
    """

    def __init__(self, core: StoreCore, reader: StoreReader, tasks: Iterable[str] | None = None,
                 max_staleness: int | None = None,
                 token_field: str | None = None) -> None:
        self.core = core
        self.reader = reader
        # the state lives in the store's tier: shared memory for tier="shm" (arrowbuf.engine.consume_state)
        self._state = ConsumeState(core.tier, core.arena_rows)
        self._consumed: dict[str, np.ndarray] = self._state.consumed
        self._cursor: MutableMapping[str, int] = self._state.cursor
        self._pins: MutableMapping[int, int] = self._state.pins  # every process's gathers, for a shared store
        self._gathering: dict[int, tuple[str, np.ndarray]] = {}  # pin -> (task, seqs) of a batch not handed out yet
        # (without a lease: a leased batch is not final until acked, the lease table has it; this process's only)
        self._pin_ids = itertools.count()
        self.counters: MutableMapping[str, int] = self._state.counters  # stale_dropped, insert_waits
        self._delivered: MutableMapping[str, int] = self._state.delivered
        self._stale_by_task: MutableMapping[str, int] = self._state.stale_by_task  # rows dropped as stale per task:
        # at consume, or evicted unconsumed
        self._admitted, self._window = self._state.admitted, self._state.window  # oldest-first (store.admission)
        # rows in flight per task (consume with lease=), see arrowbuf.engine.leases; a shared store's in shared memory
        # (arrowbuf.engine.shared_leases): any process acks or nacks, any process returns an expired lease's rows
        self.leases: LeaseTable = self._state.leases
        #: Called as `hook(task, seqs, how)` under the state lock whenever `task`'s consumption of rows `seqs` becomes
        #: final: `how` "consumed" (a consume without a lease), "acked" (a lease acked), "dropped" (stale or
        #: zero-variance rows, never delivered). Rows in flight under a lease are not final (they may come back).
        #: The one hook point where a durable store records consumption (the journal). A hook must not block (it
        #: holds the store's lock); it may return a callable, which `consume` (for "consumed") and `ack` run after
        #: releasing the lock and before returning: e.g. a wait for the journal's group commit, so that an ack
        #: returns only once it is durable. Drops return nothing to wait for (their caller is not waiting on them).
        self.final_hooks: list[Callable[[str, np.ndarray, str], Callable[[], None] | None]] = []
        schema = core.schema
        self.max_staleness = _check_staleness(max_staleness, "max_staleness")
        if self.max_staleness is not None:
            self._check_version_field()
        self.token_field = check_token_field(schema, token_field)
        self.filters = RowFilters(core, self)
        self.group: GroupSampler | None = cast(GroupSampler, core.sampler) if core.sampler.whole_groups else None
        if self.group is not None:
            self.group.attach(self, schema)
        if tasks is not None:
            if isinstance(tasks, str) or not all(isinstance(t, str) for t in tasks):
                raise InvalidArgument(f"tasks= takes a list of task names, got {tasks!r}")
            names = list(tasks)
            for t in names:
                self._check_new_task(t, names)
            for t in names:
                self._add(t)

    # ------------------------------------------------------------------ tasks and versions
    @property
    def tasks(self) -> list[str]:
        """The declared tasks, in declaration order."""
        return list(self._consumed)

    @property
    def holds(self) -> bool:
        """Whether writers must ask this tracker before evicting or admitting rows."""
        return bool(self._consumed) or self.max_staleness is not None

    def add_task(self, name: str) -> None:
        """Declare task `name`: from now on it consumes every live row once, and rows wait for it before eviction.

        Raises:
            InvalidArgument: the name is not a non-empty string, or the task exists.
        """
        self.check_task(name)
        with self.core.cond:
            if name in self._consumed:
                raise InvalidArgument(f"task {name!r} is already declared; tasks are {self.tasks}")
            self._add(name)

    def check_task(self, name: object) -> None:
        """Refuse a task `add_task` would refuse (a bad or duplicate name, no room), changing nothing.

        Raises:
            InvalidArgument: naming the reason.
        """
        self._check_new_task(name, [])
        why = self._state.can_add()
        if why:
            raise InvalidArgument(f"cannot declare task {name!r}: {why}")

    def _check_new_task(self, name: object, others: list[str]) -> None:
        if not isinstance(name, str) or not name or len(name) > 256:
            raise InvalidArgument(f"a task name is a non-empty string of at most 256 characters, got {name!r}")
        if name in self._consumed or others.count(name) > 1:
            raise InvalidArgument(f"task {name!r} is declared twice; task names are unique")

    def _add(self, name: str) -> None:
        self._state.add(name)  # fresh arrays (cursor, counts 0), or a shared store's, as the other processes left them

    @property
    def _policy_version(self) -> int:
        return self._state.policy_version

    @_policy_version.setter
    def _policy_version(self, value: int) -> None:
        self._state.policy_version = value

    def version_view(self) -> memoryview:
        """A live one-element view of `policy_version` (`view[0]`, read without a call: lineage's per-row hook)."""
        return self._state.version_view()

    @property
    def shared(self) -> bool:
        """Whether the state is in shared memory (other processes of the node consume from the same store)."""
        return self._state.shared

    @property
    def policy_version(self) -> int:
        """The current policy version (default 0; a shared store's, set by any of its processes)."""
        return self._policy_version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        check_policy_version(value)
        with self.core.cond:
            self._policy_version = int(value)
            self.core.cond.notify_all()  # admission waits on the version

    def notify(self) -> None:
        """Wake consumers and held writers after rows changed outside the commit path (commits and `store.update`
        notify the store's condition themselves)."""
        with self.core.cond:
            self.core.cond.notify_all()

    # ------------------------------------------------------------------ what a Group sampler reads (groups.RowView)
    def values(self, name: str, positions: np.ndarray) -> np.ndarray:
        """Values of scalar field or system column `name` at ring `positions` (host numpy)."""
        idx = self.core.index
        if name in ("episode_id", "step"):
            return np.asarray(getattr(idx, name)[positions])
        if name == "seq":
            return np.asarray(idx.seq[positions])
        return np.asarray(self.core.cols.column(name)[positions])

    def present(self, fields: list[str], positions: np.ndarray) -> np.ndarray:
        """Mask: every field in `fields` is written at each of `positions` (`StoreCore.present`)."""
        if not fields:
            return np.ones(len(positions), dtype=bool)
        return np.asarray(self.core.present(list(fields), positions), dtype=bool)

    # ------------------------------------------------------------------ consume
    def consume(self, task: str, n: int, *, require: Iterable[str] | None = None, timeout: float | None = 0.0,
                max_staleness: int | None = None, where: str | None = None,
                max_tokens: int | None = None, lease: float | None = None,
                admission: str | None = None) -> SampleBatch:
        """Up to `n` rows (whole groups with a Group sampler) that `task` has not consumed, marked consumed for it.

        Args:
            task: a declared task.
            n: most rows to deliver (with a Group: at most `n // size` groups; `n` must be at least the size).
            require: fields every delivered row must have written (fields filled later by `update`).
            timeout: seconds to wait for `n` ready rows (or the token budget); at the deadline, what is ready.
            max_staleness: drop rows (groups) whose `policy_version` < `policy_version - max_staleness`.
            where: a SQL predicate over the scalar columns (module docstring).
            max_tokens: token budget of the batch, counted over the store's token field.
            lease: seconds the rows stay in flight for `task` (`arrowbuf.engine.leases`): final on `ack`, back in the
                task's queue on `nack` or at expiry. None: final now (delivered at most once).
            admission: None (rows in id order; `max_staleness` drops stale rows) or "oldest": the oldest eligible
                rows first, by `policy_version` then id, rows outside the version window held back, not dropped
                (`arrowbuf.samplers.admission`).

        Returns:
            A `SampleBatch` of every column (ragged included); `indices` are the rows' ids, oldest first;
            `info` holds the task; `lease` the lease id (None without `lease=`, or for an empty batch). Possibly
            empty.

        Raises:
            InvalidArgument: an unknown task or field, or a bad option; nothing is consumed.
            StoreClosed: the store was closed.
        """
        c = self.core
        c.check_open()
        plan = self._plan(task, n, require, timeout, max_staleness, where, max_tokens)
        plan["admission"] = check_admission(admission)
        if plan["admission"] is not None:  # under the store's window unless the call names its own
            self._check_version_field()
            plan["k"] = self.max_staleness if plan["k"] is None else plan["k"]
        seconds = check_lease_seconds(lease)
        poll = _SHARED_POLL_S  # a shared store: other processes' commits and updates cannot notify this condition
        deadline = time.monotonic() + plan["timeout"]
        lease_id = None
        durable: list[Callable[[], None]] = []  # what the final hooks ask to wait for, outside the lock
        cancelled = caller_cancelled()  # a server's call: its client may go away while it waits
        with c.cond:
            if plan["admission"] is not None:
                self._window[task] = encode_window(plan["k"])  # what `stats` counts as waiting for this task
            evaluated = False
            while True:  # commits, updates, consumption and version changes notify the condition
                c.check_open()
                self.expire()
                seqs, full, pending = self._pick(plan)
                left = deadline - time.monotonic()
                if len(pending) and (left > 0 or not evaluated):  # rows `where` has not judged yet
                    self.filters.evaluate(plan["where"], pending)  # releases the lock while the query runs
                    evaluated = True
                    continue
                if full or left <= 0:
                    break
                if cancelled is not None and cancelled():
                    break
                c.waiters += 1  # commits notify the condition only when someone waits (StoreCore.notify)
                try:
                    wait = self._bounded(left)
                    if cancelled is not None:
                        wait = min(wait or _CANCEL_POLL_S, _CANCEL_POLL_S)
                    if self.shared:  # poll, backing off: a write in another process notifies nobody here
                        wait = min(wait or poll, poll)
                        poll = min(2 * poll, _SHARED_POLL_MAX_S)
                    c.cond.wait(wait)
                finally:
                    c.waiters -= 1
            if len(seqs) and cancelled is not None and cancelled():
                seqs = seqs[:0]  # nobody will read the reply: nothing is consumed
            pin = next(self._pin_ids)
            if len(seqs):
                self._pins[pin] = int(seqs.min())  # first: a shared store's pin table may be full (then: nothing done)
                opened = None
                try:
                    # the lease before the consumed marks: a process killed between the two (a shared store) leaves
                    # a lease that finds its rows and returns them at expiry, never rows consumed that no lease holds
                    if seconds is not None:  # a shared store's lease table may be full: nothing was taken
                        opened = self.leases.open(task, seqs, seconds)
                        lease_id = opened.id
                    else:  # final at once: marked, then counted (`_finish_finals` if a process dies in between)
                        self._state.begin_final(task, -(int(seqs[0]) + 1), len(seqs))
                    self._consumed[task][seqs % c.arena_rows] = seqs
                    if plan["admission"] is not None:
                        self._admitted[task] += len(seqs)
                except BaseException:
                    self._return(task, seqs)
                    if opened is not None:
                        self.leases.remove(opened)
                    else:
                        self._state.end_final(task)
                    self._pins.pop(pin, None)
                    raise
                if seconds is None:
                    try:
                        self._final(task, seqs, "consumed", durable)
                    finally:
                        self._state.end_final(task)
                    self._gathering[pin] = (task, seqs)  # a leased batch is in the lease table (not final) already
        try:
            arrays = self.reader.gather(seqs, None)
        except BaseException:
            if lease_id is not None:  # nothing was handed out: the rows go back now rather than at expiry
                self.nack(lease_id)
            raise
        finally:
            with c.cond:
                self._pins.pop(pin, None)
                self._gathering.pop(pin, None)
                c.cond.notify_all()  # held writers: rows were consumed and unpinned
        for until_durable in durable:
            until_durable()
        batch = SampleBatch(arrays, seqs, None, info={"task": task})
        if lease_id is not None:
            batch.lease, batch.owner = lease_id, self
        return batch

    # ------------------------------------------------------------------ leases (arrowbuf.engine.leases)
    def ack(self, lease: str) -> int:
        """Make the consumption of a lease's rows final for its task; returns the rows.

        Raises:
            LeaseError: not an open lease of this store (already acked or nacked, expired, unknown).
        """
        durable: list[Callable[[], None]] = []
        with self.core.cond:
            self.expire()
            held = self.leases.find(lease, "ack")
            # counted, then ended: in a shared store the intent is recorded first, so that a process killed
            # between the writes leaves an ack the next holder of the state lock finishes (`_finish_finals`)
            number = self.leases.number_of(held) if isinstance(self.leases, SharedLeaseTable) else 1
            self._state.begin_final(held.task, number, len(held.seqs))
            try:
                self._final(held.task, held.seqs, "acked", durable)
            except BaseException:  # a final hook refused it (the lease stays open): no ack to finish
                self._state.end_final(held.task)
                raise
            self.leases.remove(held)
            self.leases.ended(held, "acked")
            self._state.end_final(held.task)
            self.core.cond.notify_all()  # held writers: the rows may be evicted now
        for until_durable in durable:  # e.g. the journal's commit of this ack
            until_durable()
        return len(held.seqs)

    def nack(self, lease: str) -> int:
        """Put a lease's rows back in its task's queue now (delivered again, before newer rows); returns the rows.

        Raises:
            LeaseError: not an open lease of this store (already acked or nacked, expired, unknown).
        """
        with self.core.cond:
            self.expire()
            held = self.leases.find(lease, "nack")
            self._return(held.task, held.seqs)  # before the lease ends (`LeaseTable.remove`)
            self.leases.remove(held)
            self.leases.ended(held, "nacked")
            self.core.cond.notify_all()
        return len(held.seqs)

    def expire(self) -> int:
        """Under the state lock: finish what a killed process left half made final (`_finish_finals`); put the
        rows of leases past their deadline back in their tasks' queues; returns how many leases expired."""
        self._finish_finals()
        due = self.leases.expiring()
        for held in due:
            self._return(held.task, held.seqs)  # before the lease ends (`LeaseTable.remove`)
            self.leases.remove(held)
            self.leases.ended(held, "expired")
        if due:
            self.core.cond.notify_all()
        return len(due)

    def _finish_finals(self) -> None:
        """Under the state lock: a consumption that began to be made final and did not end (its process was killed
        holding the lock: a live one ends it before it lets go) is finished: an ack's rows counted if they were not
        and its lease closed; a consume without a lease counted if it had marked its rows (else it never happened)."""
        if not isinstance(self.leases, SharedLeaseTable):
            return  # in this process's memory it runs whole or the process is gone with the store
        for task in self._consumed:
            cut = self._state.final_in_progress(task)
            if cut is None:
                continue
            key, rows, base = cut
            if self._delivered[task] == base:
                first = -key - 1
                if key > 0 or self._consumed[task][first % self.core.arena_rows] == first:
                    self._delivered[task] = base + rows
            if key > 0:
                self.leases.close_number(task, key)
            self._state.end_final(task)

    def _return(self, task: str, seqs: np.ndarray) -> None:
        """Rows of `task` in flight become unconsumed again (the row's seq check: a row is never recycled while in
        flight, since leased rows hold eviction); the cursor moves back so the next consume finds them first."""
        arr = self._consumed[task]
        pos = seqs % self.core.arena_rows
        back = arr[pos] == seqs
        arr[pos[back]] = -1
        if len(seqs):
            self._cursor[task] = min(self._cursor[task], int(seqs.min()))

    def _final(self, task: str, seqs: np.ndarray, how: str, durable: list[Callable[[], None]] | None = None) -> None:
        """Under the state lock: `task`'s consumption of `seqs` is final (module docstring of leases); counted
        (delivered rows) and passed to the final hooks; what they return to wait for goes to `durable`."""
        if how != "dropped":
            self._delivered[task] += len(seqs)
            if self.core.lineage is not None:  # who consumed them, when, at which staleness (arrowbuf.observe.lineage)
                self.core.lineage.consumed(task, seqs, 1 if how == "consumed" else 3)  # lineage DELIVERED / ACKED
        for hook in self.final_hooks:
            until_durable = hook(task, seqs, how)
            if until_durable is not None and durable is not None:
                durable.append(until_durable)

    def _bounded(self, left: float | None) -> float | None:
        """A wait of `left` seconds cut at the next lease deadline (an expiry must wake waiters: nothing notifies)."""
        nxt = self.leases.next_deadline()
        if nxt is None:
            return left
        until = max(0.0, nxt - time.monotonic()) + 1e-3
        return until if left is None else min(left, until)

    def _plan(self, task: object, n: object, require: str | Iterable[str] | None, timeout: object,
              max_staleness: object, where: object,
              max_tokens: object) -> dict[str, Any]:
        """Validate a consume request before anything is touched."""
        schema = self.core.schema
        if not isinstance(task, str) or task not in self._consumed:
            raise InvalidArgument(f"unknown task {task!r}; declared tasks are {self.tasks}: declare it with "
                                  "ExperienceStore(..., tasks=[...]) or store.add_task(name)")
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise InvalidArgument(f"consume: n must be a positive number of rows, got {n!r}")
        if self.group is not None and n < self.group.size:
            raise InvalidArgument(f"consume: n={n} is less than one group ({self.group.size} rows, Group sampler); "
                                  "groups are never split: pass n >= the group size")
        if require is None:
            fields: list[str] = []
        else:
            if isinstance(require, str):
                require = [require]
            fields = list(dict.fromkeys(require))
            unknown = [f for f in fields if not isinstance(f, str) or f not in schema.fields]
            if unknown:
                raise InvalidArgument(f"consume: require names unknown fields {unknown}; fields are "
                                      f"{list(schema.fields)}")
        if timeout is None:
            timeout = 0.0
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 <= timeout < math.inf:
            raise InvalidArgument(f"consume: timeout must be a finite number of seconds >= 0, got {timeout!r}")
        k = _check_staleness(max_staleness, "consume: max_staleness")
        if k is not None:
            self._check_version_field()
        if where is not None:
            self.filters.check(where)
        token_field = None
        if max_tokens is not None:
            if not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise InvalidArgument(f"consume: max_tokens must be a positive integer, got {max_tokens!r}")
            token_field = token_field_of(schema, self.token_field)
        return {"task": task, "n": int(n), "require": fields, "timeout": float(timeout), "k": k, "where": where,
                "max_tokens": None if max_tokens is None else int(max_tokens), "token_field": token_field}

    def _pick(self, plan: dict[str, Any]) -> tuple[np.ndarray, bool, np.ndarray]:
        """Under the lock: the rows to deliver now, whether the request is satisfied (else wait), and the rows the
        `where` predicate has not judged yet. Stale and zero-variance rows found on the way are dropped (marked
        consumed, counted)."""
        candidates = self._candidates(plan["task"])
        window = max(4 * plan["n"], 1024) if plan.get("admission") is None else len(candidates)  # oldest: all
        while True:  # the oldest candidates first: a batch rarely needs to look at the whole ring
            seqs, full, pending = self._pick_from(candidates[:window], plan)
            if len(pending) and window < len(candidates):  # one query judges every candidate (a query costs ~0.1 s)
                ready = candidates[self.present(plan["require"], candidates % self.core.arena_rows)]
                pending = self.filters.mask(plan["where"], ready)[1]
            if full or len(pending) or window >= len(candidates):
                return seqs, full, pending
            window *= 4

    def _pick_from(self, seqs: np.ndarray, plan: dict[str, Any]) -> tuple[np.ndarray, bool, np.ndarray]:
        """`_pick` over the candidate rows `seqs` (oldest first; a prefix of them groups as all of them would)."""
        task = plan["task"]
        pending = seqs[:0]
        oldest = plan.get("admission") is not None  # holds rows outside its window back, drops none
        if self.group is None:
            if plan["k"] is not None and len(seqs) and not oldest:
                stale = self._stale(seqs, plan["k"])
                if stale.any():
                    self._drop(task, seqs[stale])
                    seqs = seqs[~stale]
            seqs = seqs[self.present(plan["require"], seqs % self.core.arena_rows)]
            if plan["where"] is not None and len(seqs):
                ok, pending = self.filters.mask(plan["where"], seqs)
                seqs = seqs[ok]
            units = seqs[:, None]
            want = plan["n"]
        else:
            units, pending = self._ready_groups(task, seqs, plan)
            want = plan["n"] // self.group.size
        if oldest and len(units):
            versions = self.values("policy_version", units.reshape(-1) % self.core.arena_rows)
            units = admit(units, versions, self._policy_version, plan["k"])
        if plan["max_tokens"] is not None and len(units):
            tokens = token_counts(self.core, plan["token_field"], units.reshape(-1)).reshape(units.shape).sum(axis=1)
            fits = max(1, int(np.searchsorted(np.cumsum(tokens), plan["max_tokens"], side="right")))
            if fits < min(want, len(units)):
                return units[:fits].reshape(-1), True, pending
        return units[:want].reshape(-1), len(units) >= want, pending

    def _ready_groups(self, task: str, seqs: np.ndarray, plan: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """Complete groups among `task`'s candidate rows that may be delivered now ([groups, size] seqs)."""
        assert self.group is not None
        members = self.group.groups(seqs)
        pending = seqs[:0]
        if not len(members):
            return members, pending
        keep = self.group.screen(members)
        if not keep.all():  # zero variance: dropped for every task (they never hold eviction)
            gone = members[~keep].reshape(-1)
            for t, arr in self._consumed.items():
                fresh = gone[arr[gone % self.core.arena_rows] != gone]
                arr[fresh % self.core.arena_rows] = fresh
                if len(fresh):
                    self._final(t, fresh, "dropped")
            members = members[keep]
        if plan["k"] is not None and len(members) and plan.get("admission") is None:
            stale = self._stale(members.reshape(-1), plan["k"]).reshape(members.shape).any(axis=1)
            if stale.any():
                self._drop(task, members[stale].reshape(-1))
                members = members[~stale]
        flat = members.reshape(-1)
        ok = self.present(plan["require"], flat % self.core.arena_rows)
        if plan["where"] is not None and len(flat):
            passed, pending = self.filters.mask(plan["where"], flat[ok])
            ok[ok] = passed
        return members[ok.reshape(members.shape).all(axis=1)], pending

    def _candidates(self, task: str) -> np.ndarray:
        """Under the lock: live, sampleable rows `task` has not consumed, oldest first."""
        idx = self.core.index
        lo, hi = idx.lo, idx.hi
        start = max(lo, self._cursor[task])
        seqs = np.arange(start, hi, dtype=np.int64)
        pos = seqs % self.core.arena_rows
        done = self._consumed[task][pos] == seqs
        self._cursor[task] = hi if done.all() else start + int(np.argmin(done))
        return seqs[~done & idx.valid[pos] & (idx.seq[pos] == seqs)]

    def _drop(self, task: str, seqs: np.ndarray) -> None:
        self._consumed[task][seqs % self.core.arena_rows] = seqs
        self.counters["stale_dropped"] += len(seqs)
        self._stale_by_task[task] += len(seqs)
        self._final(task, seqs, "dropped")
        if self.core.lineage is not None:
            self.core.lineage.consumed(task, seqs, outcome=2)  # arrowbuf.observe.lineage.STALE

    def _count_evicted(self, n: int) -> None:
        """Under the write lock and the state lock, right before a write of `n` rows evicts the oldest rows: those
        a task has not consumed (only stale rows may go so, `_held`) are dropped as stale for it and counted."""
        c = self.core
        idx = c.index
        lo, hi = idx.lo, idx.hi
        stop = min(hi, hi + n - c.capacity)
        if stop <= lo or not self._consumed:
            return
        seqs = np.arange(lo, stop, dtype=np.int64)
        pos = seqs % c.arena_rows
        live = idx.valid[pos] & (idx.seq[pos] == seqs)
        for task, arr in self._consumed.items():
            gone = live & (arr[pos] != seqs)
            if gone.any():
                self._drop(task, seqs[gone])

    def _stale(self, seqs: np.ndarray, k: int) -> np.ndarray:
        return self.values("policy_version", seqs % self.core.arena_rows) < self._policy_version - k

    def _check_version_field(self) -> None:
        spec = self.core.schema.fields.get("policy_version")
        if spec is None or spec.shape or spec.ragged or not spec.plain or spec.dtype.kind not in "iu":
            raise SchemaError(f"staleness needs an integer scalar field 'policy_version' in schema "
                              f"{self.core.schema.name!r}; add `policy_version: {{dtype: int64}}`")

    # ------------------------------------------------------------------ the writer's hold (StoreWriter.hold)
    def wait(self, cols: dict[str, Any], n: int, timeout: float | None, deadline: float | None) -> None:
        """Before a writer takes its write lock: wait until `n` new rows may be admitted and the rows they evict
        are released (consumed by every task, stale, not being gathered).

        Raises:
            InvalidArgument: the batch holds rows older than the staleness window (nothing is written).
            InsertTimeout: not admitted within `timeout` (None: no wait).
            StoreClosed: the store was closed meanwhile.
        """
        c = self.core
        versions = self._versions(cols)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        with c.cond:
            self._check_not_too_old(versions)
            if self._admissible(versions, n):
                return
            self.counters["insert_waits"] += 1

            def ok() -> bool:
                c.check_open()
                return self._admissible(versions, n)

            if left is not None and left > 0:
                end = time.monotonic() + left
                while (rem := end - time.monotonic()) > 0:  # cut at lease deadlines: an expiry may release rows
                    if c.wait_for(ok, self._bounded(rem)):
                        return
            c.check_open()
            raise InsertTimeout(self._blocked_reason(versions, n) + (
                "; did not wait (timeout=None)" if timeout is None else f"; waited {timeout}s")
                + ": consume the rows, or pass a longer timeout=")

    def ready(self, cols: dict[str, Any], n: int) -> bool:
        """Under the writer's write lock: whether `n` rows may be written now (`wait` first). When it says so, the
        writer evicts next: unconsumed stale rows it evicts are counted as dropped for their tasks."""
        versions = self._versions(cols)
        with self.core.cond:
            self._check_not_too_old(versions)
            if not self._admissible(versions, n):
                return False
            self._count_evicted(n)  # the writer reserves (and evicts) next, still under its write lock
            return True

    def _versions(self, cols: dict[str, Any]) -> np.ndarray | None:
        if self.max_staleness is None:
            return None
        return np.asarray(cols["policy_version"])

    def _check_not_too_old(self, versions: np.ndarray | None) -> None:
        if versions is None or not len(versions) or self.max_staleness is None:
            return
        floor = self._policy_version - self.max_staleness
        if versions.min() < floor:
            raise InvalidArgument(f"rows of policy_version {int(versions.min())} are older than the store's "
                                  f"staleness window (policy_version {self._policy_version}, max_staleness "
                                  f"{self.max_staleness}: at least {floor}); nothing was written: drop them or "
                                  "regenerate with the current policy")

    def _admissible(self, versions: np.ndarray | None, n: int) -> bool:
        if versions is not None and len(versions) and self.max_staleness is not None and \
                versions.max() > self._policy_version + self.max_staleness:
            return False
        return self._evictable(n)

    def _evictable(self, n: int) -> bool:
        """Whether the rows a write of `n` rows evicts (the oldest `hi + n - capacity`) are all released."""
        held = self._held(n)
        return held is None or not len(held)

    def _held(self, n: int) -> np.ndarray | None:
        """Seqs of the rows a write of `n` rows would evict that are not released yet (None: nothing evicted)."""
        c = self.core
        idx = c.index
        lo, hi = idx.lo, idx.hi
        stop = min(hi, hi + n - c.capacity)
        if stop <= lo:
            return None
        seqs = np.arange(lo, stop, dtype=np.int64)
        pos = seqs % c.arena_rows
        if len(self.leases):  # first: an expiry puts rows back, unconsumed, and ends their lease (then not held)
            self.expire()
        done = np.ones(len(seqs), dtype=bool)
        for arr in self._consumed.values():
            done &= arr[pos] == seqs
        pinned = min(self._pins.values(), default=hi) if self._pins else hi  # a shared store's: live processes' only
        done &= seqs < pinned
        if not done.all() and self.max_staleness is not None:
            stale = self.values("policy_version", pos) < self._policy_version - self.max_staleness
            stale &= seqs < pinned
            done |= stale
        if len(self.leases):
            done &= ~np.isin(seqs, self.leases.held())  # in flight: it may come back, so it stays
        return seqs[~done]

    def _blocked_reason(self, versions: np.ndarray | None, n: int) -> str:
        if versions is not None and len(versions) and self.max_staleness is not None and \
                versions.max() > self._policy_version + self.max_staleness:
            return (f"rows of policy_version {int(versions.max())} are ahead of the store's window (policy_version "
                    f"{self._policy_version}, max_staleness {self.max_staleness}); they wait for "
                    "store.policy_version to advance")
        held = self._held(n)
        oldest = int(held[0]) if held is not None and len(held) else -1
        waiting = [t for t, arr in self._consumed.items() if oldest >= 0 and
                   arr[oldest % self.core.arena_rows] != oldest]
        return (f"the ring is full and {0 if held is None else len(held)} of the rows this write would evict are "
                f"not yet consumed by every task (oldest id {oldest} waits for {waiting or 'a consume in progress'})")

    # ------------------------------------------------------------------ checkpoints (arrowbuf.persist)
    def state(self, seqs: np.ndarray, journaled: bool = False) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """What a checkpoint keeps of this tracker, for the live rows `seqs` (call under the store's state lock,
        as the checkpoint's snapshot does): per task a bool per row (consumed by it), and JSON-able metadata (tasks,
        `policy_version`, `max_staleness`, `token_field`, counters, rows delivered per task).

        A batch marked consumed but still being gathered (not handed out yet) is recorded as not consumed, so a
        store restored from this checkpoint delivers it again rather than never (at least once over a restart).
        `journaled` (a durable store's own checkpoint): recorded as consumed instead. Its consumption record is
        in the journal already (`final_hooks` run when the rows are marked) and the checkpoint cuts the journal
        below it: the snapshot must say what the record says, or a consume that returned would be delivered again.
        """
        pos = seqs % self.core.arena_rows
        delivered = dict(self._delivered)
        arrays: dict[str, np.ndarray] = {}
        for task, arr in self._consumed.items():
            done = arr[pos] == seqs
            out = [] if journaled else [inflight for t, inflight in self._gathering.values() if t == task]
            delivered[task] -= sum(len(inflight) for inflight in out)
            out.append(self.leases.task_seqs(task))  # in flight, not acked: delivered again after a restore
            back = np.concatenate(out)
            if len(back):  # one pass per task, whatever the number of leases and gathers
                done &= ~np.isin(seqs, back)
            arrays[task] = done
        meta = {"tasks": self.tasks, "policy_version": self._policy_version, "max_staleness": self.max_staleness,
                "token_field": self.token_field, "counters": dict(self.counters), "delivered": delivered,
                "stale_dropped_by_task": dict(self._stale_by_task),
                "admission": {t: [self._admitted[t], self._window[t]] for t in self.tasks}}
        return meta, arrays

    def progress_state(self, segments: list[tuple[int, int]]) -> dict[str, Any]:
        """What per-task progress (`arrowbuf.observe.progress`) needs, copied under the store's state lock so that
        the counting runs outside it, with no work per lease or per gather: per task the seq it marked consumed at
        each ring position of `segments` (the live rows' positions, as [start, stop) slices; leased and
        still-gathered rows are marked too), the rows it holds in flight (leased, and taken but still being
        gathered) and the rows delivered to it."""
        self.expire()
        leased = self.leases.in_flight(self.tasks)
        out: dict[str, Any] = {}
        for task, arr in self._consumed.items():
            gathering = sum(len(inflight) for t, inflight in self._gathering.values() if t == task)
            marks = [arr[a:b] for a, b in segments]
            out[task] = {"consumed_at": np.concatenate(marks) if marks else np.zeros(0, np.int64),
                         "leased": int(leased.get(task, 0)), "gathering": gathering,
                         "delivered": int(self._delivered.get(task, 0))}
        return out

    def load_state(self, seqs: np.ndarray, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Put back what `state` recorded, for the rows now at `seqs` (a fresh store built with the recorded tasks,
        `max_staleness` and `token_field`; call under the store's state lock, as restore does).

        Raises:
            InvalidArgument: a recorded task is not declared here, or an array does not match `seqs`.
        """
        pos = seqs % self.core.arena_rows
        for task in meta.get("tasks", []):
            if task not in self._consumed:
                raise InvalidArgument(f"checkpointed task {task!r} is not declared in the restored store "
                                      f"(tasks {self.tasks}); declare it before loading its state")
            done = np.asarray(arrays[task], dtype=bool)
            if len(done) != len(seqs):
                raise InvalidArgument(f"consumption record of task {task!r} has {len(done)} rows for "
                                      f"{len(seqs)} rows")
            self._consumed[task][pos[done]] = seqs[done]
            self._cursor[task] = 0
            self._delivered[task] = int(meta.get("delivered", {}).get(task, 0))
            self._stale_by_task[task] = int(meta.get("stale_dropped_by_task", {}).get(task, 0))
            self._admitted[task], self._window[task] = (int(v) for v in meta.get("admission", {}).get(task, (0, 0)))
        self._policy_version = int(meta.get("policy_version", 0))
        for k, v in meta.get("counters", {}).items():
            if k in self.counters:
                self.counters[k] = int(v)

    def mark_consumed(self, task: str, seqs: np.ndarray) -> int:
        """Mark the live rows among `seqs` consumed by `task` (a durable store's journal replay); returns how many.

        Raises:
            InvalidArgument: an unknown task.
        """
        if task not in self._consumed:
            raise InvalidArgument(f"unknown task {task!r}; declared tasks: {self.tasks}")
        seqs = np.asarray(seqs, dtype=np.int64)
        with self.core.cond:
            live = seqs[self.core.index.live(seqs)]
            self._consumed[task][live % self.core.arena_rows] = live
            self._delivered[task] += len(live)
        return len(live)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """Counters for `store.stats()` (call under the store's lock)."""
        self.expire()
        out: dict[str, Any] = {"policy_version": self._policy_version, "tasks": self.tasks,
                               "consumed": dict(self._delivered), **self.counters,
                               "stale_dropped_by_task": dict(self._stale_by_task),
                               "in_flight": self.leases.in_flight(self.tasks), "leases": len(self.leases),
                               "redelivered": {t: self.leases.redelivered.get(t, 0) for t in self.tasks},
                               "leases_expired": {t: self.leases.expired.get(t, 0) for t in self.tasks}}
        out["admission"] = {t: {"admitted": self._admitted[t], **self._waiting(t),
                                "dropped": self._stale_by_task[t]} for t in self.tasks}
        out["groups_dropped_zero_variance"] = self.group.dropped_groups if self.group is not None else 0
        return out


    def _waiting(self, task: str) -> dict[str, int]:
        """Rows `task`'s oldest-first window holds back now (`arrowbuf.samplers.admission.waiting`)."""
        if not self._window[task]:
            return waiting(np.zeros(0, np.int64), 0, 0)
        seqs = self._candidates(task)
        versions = self.values("policy_version", seqs % self.core.arena_rows)
        return waiting(versions, self._policy_version, self._window[task])


def check_store_options(tier: str | Tier, sampler: object, tasks: object) -> None:
    """Before a store allocates anything: a sampler whose state lives in this process's heap (`process_local`)
    cannot serve a shared-memory store. Tasks and arrowbuf's `Group` sampler can: their state lives in the store's
    tier (`arrowbuf.engine.consume_state`, `arrowbuf.samplers.group`).

    Raises:
        InvalidArgument: `tier="shm"` with a process-local sampler.
    """
    if tier != "shm" and not getattr(tier, "shared", False):
        return
    if isinstance(sampler, Sampler) and sampler.process_local:
        raise InvalidArgument(f"a {type(sampler).__name__} sampler keeps its state in one process, so a "
                              "shared-memory store (tier='shm') cannot use it; serve a host store over Flight to "
                              "share it between processes")


def _check_staleness(value: object, what: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"{what} must be a non-negative integer number of policy versions, got {value!r}")
    return int(value)


__all__ = ["MAX_WHERE_CHARS", "ConsumeSurface", "ConsumeTracker", "check_store_options"]
