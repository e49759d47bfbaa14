"""A durable store (`ExperienceStore(..., durable=DIR, durability="group")`): checkpoints plus a journal under DIR.

`DurableWrites` is the store's `Writes` (`arrowbuf.store.writes`): every change a caller is acknowledged for is
journaled (`arrowbuf.persist.journal`) and durable under the policy before the call returns:

- `extend`/`append`: the batch is validated and its record encoded first (outside every lock), then the writer
  reserves its seqs and calls back (`StoreWriter.extend_columns(on_reserve=)`, under its write lock, so records are
  in seq order): the record is appended there, before the rows are copied, and made durable while they are;
  an `aborted` record follows if the copy fails (its seqs become holes, as in the live store);
- `update`, `update_priorities`, `add_task`, `policy_version`: validated in full, then journaled, then applied, in
  one order (`_mutate`): whoever sees a change sees it after its record; `end_episode`: journaled by the writer's
  callback once the call is known to be valid, before it changes anything;
- consumption: `ConsumeTracker.final_hooks` (the rows a consume marks without a lease, an acked lease), recorded
  under the store's state lock when they become final, durable before they are handed out.

`DurableWrites.checkpoint()` checkpoints into DIR in the background (writers go on) through `_Cut`, the handshake of
docs/durability.md: the journal is cut only below records whose effect the snapshot holds, and once the manifest is
committed the segments before the cut go. `resume` (from `ExperienceStore.restore`) replays the journal after the
last checkpoint (`arrowbuf.persist.replay`), cuts a torn tail off, and journals on.

Layout: DIR is a checkpoint directory (docs/format.md) with `_durable.json` (the policy) and `_journal/` (segments).
Without `durable=` none of this exists and the store pays nothing (`DirectWrites`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Literal, overload

import numpy as np
import pyarrow as pa

from ..engine.consume import check_policy_version
from ..engine.core import StoreCore
from ..errors import InvalidArgument, StoreCorrupt
from ..observe import identity
from ..observe.lineage import ACKED, DELIVERED
from ..observe.meter import ProgressSink
from ..persist import faults
from ..persist import journal as jr
from ..persist import manifest as mf
from ..persist.checkpoint import CheckpointHandle
from ..persist.checkpoint import checkpoint as write_checkpoint
from ..persist.crc import IMPLEMENTATION as CRC_IMPLEMENTATION
from ..persist.replay import columns_table, replay
from ..persist.snapshot import Snapshot, capture, capture_held
from ..samplers.base import validate_priorities
from ..schema.inputs import BatchLike, IdsLike, StepLike, ValuesLike
from ..schema.update import update_ids, validate_update
from .pending import PendingWrite
from .writes import StoreParts

DURABLE = "_durable.json"
#: Kept checkpoints of a durable directory when the caller does not say.
DEFAULT_KEEP = 2


def check_new(root: str) -> None:
    """Refuse to start a new durable store over one that exists (it would be lost): restore it instead."""
    if os.path.exists(os.path.join(root, mf.MANIFEST)) or jr.segments(root):
        raise InvalidArgument(f"{root} already holds a durable store (a checkpoint or a journal): reopen it with "
                              f"ExperienceStore.restore({root!r}), or pass an empty directory")


def read_policy(root: str) -> str | None:
    """The durability policy recorded in durable directory `root` (None: not a durable directory)."""
    p = os.path.join(root, DURABLE)
    if not os.path.exists(p):
        return None
    try:
        with open(p) as f:
            policy = json.load(f).get("durability")
    except (OSError, ValueError, AttributeError):
        raise StoreCorrupt(f"{p} is malformed") from None
    if policy not in jr.POLICIES:
        raise StoreCorrupt(f"{p}: unknown durability {policy!r}")
    return str(policy)


def _now_us() -> int:
    return int(time.time() * 1e6)


def _batch_meta(first: int, n: int, who: str, at_us: int | None = None) -> dict[str, Any]:
    """A batch record's meta: its first seq and rows, and for the lineage its writer and the time (Unix
    microseconds) it was recorded, at its reservation (microseconds before its commit)."""
    return {"first": int(first), "n": int(n), "w": who, "t": _now_us() if at_us is None else int(at_us)}


_WIDTHS: dict[tuple[int, str], int] = {}


def _meta_width(n: int, who: str) -> int:
    """The widest meta a batch record of `n` rows by `who` can have (`_batch_meta`: its first seq is known only at
    the reservation); cached."""
    key = (n, who)
    w = _WIDTHS.get(key)
    if w is None:
        if len(_WIDTHS) > 1024:
            _WIDTHS.clear()
        w = _WIDTHS[key] = len(json.dumps(_batch_meta(2 ** 63 - 1, n, who, 2 ** 63 - 1), separators=(",", ":")))
    return w


class DurableWrites:
    """The `Writes` of a durable store (module docstring). Built by the facade over its parts."""

    accepts_pieces = False  # a batch is journaled whole, before its rows are copied

    def __init__(self, root: str, journal: jr.Journal, parts: StoreParts) -> None:
        self.root, self.journal, self.parts = root, journal, parts
        self.core = parts.core
        # updates, priorities, tasks, versions, episode ends: journaled and applied in one order; a checkpoint's cut
        # holds it (`_Cut`)
        self._mutate = threading.RLock()
        self.replayed: dict[str, int] = {}
        parts.consume.final_hooks.append(self._consumed)

    @classmethod
    def create(cls, root: str, policy: str, parts: StoreParts, direct: bool | None = None) -> DurableWrites:
        """Start a new durable directory: an initial checkpoint (the store's geometry), then the journal."""
        if policy not in jr.POLICIES:
            raise InvalidArgument(f"durability must be one of {list(jr.POLICIES)}, got {policy!r}")
        core = parts.core
        if core.tier.shared:
            raise InvalidArgument("durable= is not supported on a shared-memory store (tier='shm'): writes of "
                                  "attached processes would not be journaled; serve a host store over Flight")
        mf.make_dirs(root)
        jr.check_journal_dir(root)  # before anything is written into it
        check_new(root)
        mf.write_json_atomic(os.path.join(root, DURABLE), {"durability": policy, "journal": jr.JOURNAL})
        write_checkpoint(core, root, keep=DEFAULT_KEEP, cut=_Start())
        return cls(root, jr.Journal(root, policy, first_lsn=0, direct=direct), parts)

    # ------------------------------------------------------------------ rows
    def append(self, step: dict[str, Any], timeout: float | None) -> int:
        return int(self._extend(step, timeout, True, True)[0])

    def extend(self, batch: BatchLike, timeout: float | None, wait: bool) -> np.ndarray | PendingWrite:
        return self._extend(batch, timeout, False, wait)

    @overload
    def _extend(self, batch: BatchLike | StepLike, timeout: float | None, single: bool,
                wait: Literal[True]) -> np.ndarray: ...

    @overload
    def _extend(self, batch: BatchLike | StepLike, timeout: float | None, single: bool,
                wait: bool) -> np.ndarray | PendingWrite: ...

    def _extend(self, batch: BatchLike | StepLike, timeout: float | None, single: bool,
                wait: bool) -> np.ndarray | PendingWrite:
        """Journal and store `batch`; returns its ids once durable, or with `wait=False` a `PendingWrite` at once
        (the rows stored and their record written; durable later: `arrowbuf.store.pending`)."""
        journal = self.journal
        journal.expect()  # a group commit that starts while this batch is validated and encoded waits for its record
        expected = True
        reserved: list[int] = []  # first seq and ticket, once the writer reserved the rows
        try:
            cols, n = self.core.schema.validate_batch(batch, single=single)
            if n == 0:
                return np.zeros(0, dtype=np.int64)
            who = identity.current()
            # encoded here, outside every lock (an IPC stream in pieces, no joined copy; checksummed); its meta
            # (the first seq, known at the reservation) fits the width reserved for it
            record = jr.prepare("batch", {"first": 0, "n": n}, jr.table_pieces(columns_table(cols)),
                                meta_width=_meta_width(n, who))
            # a caller that waits makes its record durable on its own thread (the write, the disk's write started,
            # the copy, then fdatasync); under "os" and for `wait=False` the journal's thread syncs it
            own = wait and journal.policy != "os"

            def on_reserve(first: int, rows: int) -> None:  # the writer's callback, under its write lock
                nonlocal expected
                faults.reached("before_batch_record")
                expected = False
                ticket = journal.append_prepared(record, _batch_meta(first, rows, who), expected=True,
                                                 writeback=own)
                reserved.extend((first, ticket))
                if not own and journal.policy != "os":
                    journal.sync_soon(ticket, lazy=not wait)

            ids = self.parts.writer.extend_columns(cols, n, timeout=timeout, on_reserve=on_reserve)
        except BaseException:
            if reserved:  # recorded, then not stored: its seqs are holes, in the live store and after a replay
                journal.append("aborted", {"first": reserved[0], "n": n})
            raise
        finally:
            if expected:
                journal.unexpect()  # the announced record never came (failed or empty)
        ticket = reserved[1]
        if not wait:
            journal.flush(ticket, help_=False)  # written (a kill of the process loses nothing returned)
            return PendingWrite(ids, journal, ticket)
        journal.wait(ticket)
        return ids

    def end_episode(self, actor: Hashable, final: dict[str, Any]) -> bool:
        if actor is not None and not isinstance(actor, (str, int)):
            raise InvalidArgument(f"a durable store journals end_episode's actor: pass a str or int, got "
                                  f"{type(actor).__name__}")
        payload = jr.table_bytes(columns_table({k: np.asarray(v)[None] for k, v in final.items()})) if final else b""
        tickets: list[int] = []

        def record() -> None:  # the writer's callback once the call is valid, before it changes anything
            tickets.append(self.journal.append("end_episode", {"actor": actor}, payload))

        with self._mutate:
            out = self.parts.writer.end_episode(actor, final, before=record)
        if tickets:
            self.journal.wait(tickets[0])
        return bool(out)

    # ------------------------------------------------------------------ changes to rows and state
    # Journaled before they are applied, both under `_mutate` (so the journal's order is the order they apply in):
    # whoever sees a value (a consumer that then journals its consumption) sees it after its record, so a consumption
    # that survives a crash never delivered a change that did not. Each is validated in full first: a record is
    # appended only for a change that will apply.
    def update(self, ids: IdsLike, values: Mapping[str, object]) -> int:
        seqs = update_ids(ids)
        single = isinstance(ids, (int, np.integer)) and not isinstance(ids, bool)
        cols = validate_update(self.core.schema, seqs, values, single)
        updater = self.parts.updater
        updater.check_issued(seqs)  # ids only grow: an id issued now stays issued
        payload = jr.table_bytes(columns_table({"seq": seqs, **cols}))
        with self._mutate:
            ticket = self.journal.append("update", {}, payload)
            n = updater.apply(seqs, cols)
        self.journal.wait(ticket)
        return int(n)

    def update_priorities(self, indices: IdsLike, priorities: ValuesLike) -> int:
        seqs, pri = validate_priorities(indices, priorities)
        table = pa.table({"seq": pa.array(seqs, pa.int64()), "priority": pa.array(np.asarray(pri, np.float64))})
        payload = jr.table_bytes(table)
        with self._mutate:
            ticket = self.journal.append("priorities", {}, payload)
            n = self.parts.reader.update_priorities(seqs, pri)
        self.journal.wait(ticket)
        return int(n)

    def add_task(self, name: str) -> None:
        consume = self.parts.consume
        with self._mutate:
            consume.check_task(name)
            ticket = self.journal.append("task", {"name": name})
            consume.add_task(name)
        self.journal.wait(ticket)

    def set_policy_version(self, value: int) -> None:
        check_policy_version(value)
        with self._mutate:
            ticket = self.journal.append("policy_version", {"value": int(value)})
            self.parts.consume.policy_version = value
        self.journal.wait(ticket)

    def _consumed(self, task: str, seqs: np.ndarray, how: str) -> Callable[[], None] | None:
        """`ConsumeTracker.final_hooks`: `task`'s consumption of `seqs` became final (`how`: "consumed" without a
        lease, "acked" for an acked lease; "dropped" stale rows are not journaled), under the store's state lock.
        The record names the consumer, the time (Unix microseconds) and the lineage outcome, so a restore keeps the
        lineage; the consume or ack waits for it (the returned call) before it returns."""
        if how == "dropped":
            return None
        ticket = self.journal.record_consumed(task, seqs, {"c": identity.current(), "t": _now_us(),
                                                           "o": ACKED if how == "acked" else DELIVERED})
        journal = self.journal

        def until_durable() -> None:
            journal.wait(ticket)

        return until_durable

    # ------------------------------------------------------------------ checkpoints and lifetime
    def checkpoint(self, path: str | None, keep: int | None, background: bool,
                   compression: str | None) -> dict[str, Any] | CheckpointHandle:
        """Checkpoint into the durable directory (`path` None or that directory): the journal it covers goes once
        its manifest is committed (`_Cut`: where the journal is cut, and when); any other `path` is a plain
        checkpoint there."""
        self.parts.reader.settle()  # the device path's queued priority updates: in the sampler state copied
        if path is not None and os.path.realpath(path) != os.path.realpath(self.root):
            out: dict[str, Any] | CheckpointHandle = write_checkpoint(
                self.core, path, keep=keep, background=background, compression=compression)
            return out
        handle = write_checkpoint(self.core, self.root, keep=DEFAULT_KEEP if keep is None else keep,
                                  background=True, compression=compression, cut=_Cut(self))
        return handle if background else handle.wait()

    def stats(self) -> dict[str, Any]:
        """For `store.stats()["journal"]`: policy, whether large records are written with direct I/O
        (`arrowbuf.persist.appender`), records, bytes and fsyncs since this store opened its journal, the next
        record's lsn and the last durable one's, and what its restore replayed (records per kind, torn bytes)."""
        return {"durability": self.journal.policy, "path": self.root, "crc32": CRC_IMPLEMENTATION,
                "direct_io": self.journal.direct_io, **self.journal.stats,
                "next_lsn": self.journal.next_lsn, "durable_lsn": self.journal.durable_lsn,
                "replayed": dict(self.replayed)}

    def close(self) -> None:
        hooks = self.parts.consume.final_hooks
        if self._consumed in hooks:
            hooks.remove(self._consumed)
        self.journal.close()


class _Cut:
    """`persist.checkpoint.JournalCut` of a durable store: the snapshot and the journal's cut point are taken with
    no change between a record and its effect (the rule of docs/durability.md: the journal may be cut only below the
    oldest record whose effect the snapshot is sure to hold).

    Under `_mutate` (no update, priority, task, version or episode end between its record and its effect) and the
    write lock (no new reservation), the batches reserved before are waited for (`StoreWriter.wait_reserved`: each
    commits, or becomes a hole); then every record before the cut point is in the snapshot, and no record after it
    is but consumption (recorded and marked under the state lock: replaying one the snapshot holds marks it again,
    harmless). The locks are held for the snapshot's copy of the small state only; the old segment is synced after."""

    def __init__(self, log: DurableWrites) -> None:
        self.log = log
        self.lsn = -1

    def capture(self, core: StoreCore) -> tuple[Snapshot, dict[str, Any]]:
        log = self.log
        with log._mutate, core.write_lock:
            log.parts.writer.wait_reserved()
            self.lsn = log.journal.cut()
            snap = capture_held(core, journaled=True)
        log.journal.flush(self.lsn - 1)
        return snap, {"from_lsn": self.lsn}

    def before_commit(self) -> None:
        """The records after the cut point that the checkpoint relies on are durable: a batch that overwrote rows of a
        chunk while it was copied evicted them, and the checkpoint leaves them out (`persist.checkpoint`)."""
        j = self.log.journal
        j.wait(j.next_lsn - 1)

    def after_commit(self) -> None:
        self.log.journal.truncate_before(self.lsn)


class _Start:
    """The `JournalCut` of a new durable directory's first checkpoint: the journal starts after it, at lsn 0."""

    def capture(self, core: StoreCore) -> tuple[Snapshot, dict[str, Any]]:
        return capture(core), {"from_lsn": 0}

    def before_commit(self) -> None:
        pass

    def after_commit(self) -> None:
        pass


class _Target:
    """`persist.replay.ReplayTarget` over a restored store's parts (no journal, no eviction hold)."""

    def __init__(self, parts: StoreParts) -> None:
        self.parts = parts
        self.core = parts.core

    def next_seq(self) -> int:
        return int(self.core.index.hi)

    def apply_batch(self, table: pa.Table) -> np.ndarray:
        return np.asarray(self.parts.writer.extend(table, timeout=None))

    def skip(self, n: int) -> None:
        self.parts.writer.skip(n)

    def apply_update(self, seqs: np.ndarray, values: dict[str, Any]) -> None:
        self.parts.updater.update(seqs, values)

    def apply_priorities(self, seqs: np.ndarray, priorities: np.ndarray) -> None:
        self.parts.reader.update_priorities(seqs, priorities)

    def apply_task(self, name: str) -> None:
        if name not in self.parts.consume.tasks:
            self.parts.consume.add_task(name)

    def apply_policy_version(self, value: int) -> None:
        self.parts.consume.policy_version = value

    def apply_consumed(self, task: str, seqs: np.ndarray) -> None:
        if task in self.parts.consume.tasks:
            self.parts.consume.mark_consumed(task, seqs)

    def restamp_written(self, first: int, n: int, writer: str, at: float) -> None:
        lineage = self.core.lineage
        if lineage is not None and n > 0:
            with self.core.cond:
                lineage.restamp_written(np.arange(first, first + n, dtype=np.int64) % self.core.arena_rows, writer,
                                        at)

    def restamp_consumed(self, task: str, seqs: np.ndarray, consumer: str, at: float, outcome: int) -> None:
        lineage = self.core.lineage
        if lineage is not None and task in self.parts.consume.tasks:
            with self.core.cond:
                live = seqs[self.core.index.live(seqs)]
                lineage.consumed(task, live, outcome)  # staleness against the replayed policy_version, as then
                lineage.restamp_consumed(task, live, consumer, at)

    def apply_end_episode(self, actor: Hashable, final: dict[str, Any]) -> None:
        self.parts.writer.end_episode(actor, final)


def resume(root: str, manifest: dict[str, Any], policy: str | None, parts: StoreParts,
           progress: ProgressSink | None = None) -> DurableWrites:
    """After a durable directory's last checkpoint was loaded into a fresh store: replay the journal after it (the
    writer's eviction hold off: the journal holds the evictions as they happened), cut a torn tail off, journal on.
    `progress` hears the journal's bytes read and its records replayed.

    Raises:
        StoreCorrupt: a damaged journal record (other than a torn tail), naming the segment.
    """
    policy = policy or read_policy(root) or "group"
    from_lsn = int((manifest.get("journal") or {}).get("from_lsn", 0))
    core, writer = parts.core, parts.writer
    owner = jr.lock_journal(root)  # no live store writes it while it is read, cut and continued
    try:
        records, torn, next_lsn, last_crc = jr.read_journal(root, from_lsn, progress)
        # the journal holds the inserts as they happened: no eviction hold, no rate limiter may refuse them again
        hold, writer.hold = writer.hold, None
        limiter, core.rate_limiter = core.rate_limiter, None
        try:
            counts = replay(records, _Target(parts), f"journal of {root}", capacity=int(core.capacity),
                            progress=progress)
        finally:
            writer.hold, core.rate_limiter = hold, limiter
        first = jr.seal_last(root, next_lsn, torn, prev=last_crc)
        journal = jr.Journal(root, policy, first_lsn=first, lock_fd=owner,
                             direct=None if core.options is None else core.options.journal_direct)
    except BaseException:
        os.close(owner)
        raise
    log = DurableWrites(root, journal, parts)
    log.replayed = {**counts, "torn_bytes": 0 if torn is None else torn.size - torn.offset}
    return log
