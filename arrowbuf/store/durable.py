"""A durable store (`ExperienceStore(..., durable=DIR, durability="group")`): checkpoints plus a journal under DIR.

Every change a caller is acknowledged for is journaled (`arrowbuf.persist.journal`) and durable under the policy
before the call returns: `extend`/`append` (the batch, recorded at its reservation, in seq order, before its rows
are copied: the journal's sync thread runs the fdatasync meanwhile; `aborted` if the copy fails), `update`,
`update_priorities`, `add_task`, `policy_version`, `end_episode`, and consumption (`consume` records the rows it
marks before it hands them out: `StoreCore.journal.record_consumed`). The writer notes each reservation's seqs
(`note_issued`), so ids issued before a crash are never given to another row after it.

`DurableLog.checkpoint()` rotates the journal, checkpoints into DIR (in the background: writers go on) and, once the
manifest is committed, deletes the journal segments the checkpoint covers. `resume` (from `ExperienceStore.restore`)
replays the journal after the last checkpoint (`arrowbuf.persist.replay`), cuts a torn tail off, and journals on.

Layout: DIR is a checkpoint directory (docs/format.md) with `_durable.json` (the policy) and `_journal/` (segments).
Without `durable=` none of this exists and the store pays nothing (`StoreCore.journal` is None).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import InvalidArgument, StoreCorrupt
from ..observe import identity
from ..observe.lineage import ACKED, DELIVERED
from ..persist import journal as jr
from ..persist import manifest as mf
from ..persist.checkpoint import checkpoint as write_checkpoint
from ..persist.crc import IMPLEMENTATION as CRC_IMPLEMENTATION
from ..persist.replay import columns_table, replay
from ..persist.snapshot import Snapshot, capture, capture_held
from ..ring.reservations import HOLE
from ..samplers.base import validate_priorities
from .consume import check_policy_version
from .pending import PendingWrite
from .update import update_ids, validate_update

DURABLE = "_durable.json"
#: Crash tests: SIGKILL the process at a named point (as `arrowbuf.persist.checkpoint`'s kill points).
_KILL_AT: str | None = "ARROWBUF_PERSIST_KILL_AT" if "ARROWBUF_PERSIST_KILL_AT" in os.environ else None
#: Kept checkpoints of a durable directory when the caller does not say.
DEFAULT_KEEP = 2
#: Whether a batch's record is encoded and written on the journal's thread while the writer copies its rows (True:
#: the writer's thread pays ~half the journal's CPU, the hand-off costs CPU and wakeups), or encoded by the writer
#: before its reservation and written at it (False, the default: one thread, no hand-off; the faster of the two on
#: the 2-core machine it was measured on, docs/durability.md). `ARROWBUF_JOURNAL_OFFLOAD=1` turns it on; a store
#: reads it when it opens its journal (`DurableLog.offload`). The journal's bytes are the same either way.
OFFLOAD = os.environ.get("ARROWBUF_JOURNAL_OFFLOAD", "0") == "1"
#: Whether a batch's record, encoded by the writer (cheap: ~40 us for 186 KB of GRPO rows, mostly GIL-free
#: serialize and CRC), is written by the journal's sync thread together with its fdatasync (True), instead of by the
#: writer at its reservation (False). True takes the `writev` (~55 us of kernel copy into the page cache per 186 KB)
#: off the writer's critical path; the record's place (lsn: commit order) is still taken at the reservation, and
#: `extend(wait=False)` still returns only once the record is written. `ARROWBUF_JOURNAL_DEFER_WRITE=0|1` sets it;
#: a store reads it when it opens its journal (`DurableLog.defer_write`). The journal's bytes are the same.
DEFER_WRITE = os.environ.get("ARROWBUF_JOURNAL_DEFER_WRITE", "0") == "1"
#: Whether an `extend` that acknowledges synchronously (`wait=True`; the Flight server's too) under "group" or
#: "batch" makes its record durable on its own thread (True): it writes the record at its reservation, starts the
#: disk's write at once (`sync_file_range`, no wait), copies its rows meanwhile, then `fdatasync`s (writers waiting
#: at the same time share one, as always), with no hand-off to the journal's sync thread; False: the sync thread
#: `fdatasync`s while the writer copies (a wake-up and interpreter-lock hand-offs per batch).
#: `ARROWBUF_JOURNAL_WRITER_SYNC=0|1`; read when a store opens its journal (`DurableLog.writer_sync`).
WRITER_SYNC = os.environ.get("ARROWBUF_JOURNAL_WRITER_SYNC", "1") == "1"


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


class _Pending:
    """A batch being extended: its validated columns, its record (encoded when the journal writes it), and once its
    seqs are reserved its first seq and journal ticket."""

    __slots__ = ("payload", "n", "record", "first", "ticket", "expected", "who", "lazy")

    def __init__(self, payload: Any, n: int, record: jr.Prepared | jr.Deferred, expected: bool = False,
                 who: str = "") -> None:
        self.payload, self.n, self.record, self.who = payload, n, record, who
        self.first = -1
        self.ticket: int | None = None
        self.expected = expected  # announced to the journal (`Journal.expect`), not appended yet
        self.lazy = False  # `extend(wait=False)`: nobody waits for its fdatasync yet (`Journal.sync_soon(lazy=)`)


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


def _cols_bytes(cols: dict[str, Any]) -> int:
    """About the bytes of a batch record of validated columns `cols` (a segment rotates once past its size)."""
    total = 1024
    for c in cols.values():  # an Arrow array's `nbytes` walks its buffers in Python-visible cost: the C++ total
        total += int(c.get_total_buffer_size()) if isinstance(c, pa.Array) else int(getattr(c, "nbytes", 0) or 0)
    return total


class DurableLog:
    """The journaling side of one durable store (module docstring). Built by the facade, with its parts."""

    def __init__(self, root: str, journal: jr.Journal, core: Any, writer: Any, reader: Any, updater: Any,
                 consume: Any) -> None:
        self.root, self.journal = root, journal
        self.core, self.writer, self.reader, self.updater, self.consume = core, writer, reader, updater, consume
        self._order = threading.Condition()
        self._recorded = int(core.index.hi)  # batch records go in seq order: the next seq to record
        self._mutate = threading.RLock()      # updates, priorities, tasks, versions: applied and logged in one order
        self._local = threading.local()       # the batch this thread is extending (`note_issued` records it)
        self.replayed: dict[str, int] = {}
        self.offload = OFFLOAD
        self.defer_write = DEFER_WRITE
        self.writer_sync = WRITER_SYNC

    @classmethod
    def create(cls, root: str, policy: str, core: Any, writer: Any, reader: Any, updater: Any,
               consume: Any) -> DurableLog:
        """Start a new durable directory: an initial checkpoint (the store's geometry), then the journal."""
        if policy not in jr.POLICIES:
            raise InvalidArgument(f"durability must be one of {list(jr.POLICIES)}, got {policy!r}")
        if core.tier.shared:
            raise InvalidArgument("durable= is not supported on a shared-memory store (tier='shm'): writes of "
                                  "attached processes would not be journaled; serve a host store over Flight")
        mf.make_dirs(root)
        jr.check_journal_dir(root)  # before anything is written into it
        check_new(root)
        mf.write_json_atomic(os.path.join(root, DURABLE), {"durability": policy, "journal": jr.JOURNAL})
        write_checkpoint(core, root, keep=DEFAULT_KEEP, cut=_Start())
        log = cls(root, jr.Journal(root, policy, first_lsn=0), core, writer, reader, updater, consume)
        core.journal = log
        return log

    # ------------------------------------------------------------------ hooks (StoreCore.journal)
    def note_issued(self, next_seq: int) -> None:
        """The writer reserved seqs up to `next_seq` (called under its write lock). For the batch this thread is
        extending (`extend`), this is where its record is appended (in seq order, before its rows are copied: the
        fdatasync runs on the journal's sync thread while they are); otherwise an `issued` record."""
        pending = getattr(self._local, "pending", None)
        if pending is not None and pending.ticket is None:
            first = int(next_seq) - pending.n
            if _KILL_AT is not None and os.environ.get(_KILL_AT) == "before_batch_record":  # crash tests
                self.journal.append("issued", {"next": int(next_seq)})
                os.kill(os.getpid(), signal.SIGKILL)
            pending.first = first
            expected, pending.expected = pending.expected, False
            # its place in commit order is taken here, and it is written here (with `offload`: by the journal's
            # thread while this writer copies the rows); under "group" and "batch" the sync thread syncs it meanwhile
            defer = self.offload or self.defer_write
            own = self.writer_sync and not (defer or pending.lazy) and self.journal.policy != "os"
            pending.ticket = self.journal.append_prepared(pending.record, _batch_meta(first, pending.n, pending.who),
                                                          expected=expected, defer=defer, writeback=own)
            with self._order:
                self._recorded = max(self._recorded, first + pending.n)
            if not own and (defer or self.journal.policy != "os"):
                self.journal.sync_soon(pending.ticket, lazy=pending.lazy)
            return
        self.journal.append("issued", {"next": int(next_seq)})

    def record_consumed(self, task: str, seqs: np.ndarray, how: str = "consumed") -> int:
        """`task` consumed `seqs` (`how`: "consumed" without a lease, "acked" for an acked lease); returns the ticket
        for `wait`. The record names the consumer, the time (Unix microseconds) and the lineage outcome, so a
        restore keeps the lineage."""
        return self.journal.record_consumed(task, seqs, {"c": identity.current(), "t": _now_us(),
                                                         "o": ACKED if how == "acked" else DELIVERED})

    def wait(self, ticket: int) -> None:
        """Return once record `ticket` is durable under the store's policy."""
        self.journal.wait(ticket)

    # ------------------------------------------------------------------ journaled writes
    def extend(self, batch: Any, timeout: float | None, single: bool = False, wait: bool = True) -> Any:
        """Journal and store `batch`; returns its ids once durable, or with `wait=False` a `PendingWrite` at once
        (the rows stored and their record written; durable later: `arrowbuf.store.pending`)."""
        # announced first: a group commit that starts while this batch is validated and encoded waits for its record
        self.journal.expect()
        pending: _Pending | None = None
        try:
            cols, n = self.core.schema.validate_batch(batch, single=single)
            if n == 0:
                return np.zeros(0, dtype=np.int64)
            # the record (IPC stream in pieces, no joined copy; checksummed) is encoded here, outside every lock, or
            # with `offload` on the journal's thread when it writes it; the reservation (`note_issued`) takes its
            # place in commit order and gives its seqs (a fixed-width meta). `extend` returns once it is written
            who = identity.current()
            width = _meta_width(n, who)
            def encode() -> jr.Prepared:
                return jr.prepare("batch", {"first": 0, "n": n}, jr.table_pieces(columns_table(cols)),
                                  meta_width=width)

            pending = _Pending(cols, n, jr.Deferred(encode, _cols_bytes(cols), width) if self.offload else encode(),
                               True, who)
            pending.lazy = not wait
            self._local.pending = pending  # `note_issued` appends the batch record at the reservation
            ids = self.writer.extend_columns(cols, n, timeout=timeout)
        except BaseException:
            if pending is not None and pending.ticket is not None:  # recorded, then not stored: its seqs are holes
                self.journal.append("aborted", {"first": pending.first, "n": n})
            raise
        finally:
            self._local.pending = None
            if pending is None or pending.expected:
                self.journal.unexpect()  # the announced record never came (failed, empty, or recorded late)
                if pending is not None:
                    pending.expected = False
        assert pending is not None
        if pending.ticket is None:  # not reserved through the writer's hook (never expected): record it now
            pending.ticket = self._record_batch(int(ids[0]), n, jr.prepare(
                "batch", _batch_meta(int(ids[0]), n, pending.who), jr.table_pieces(columns_table(pending.payload))))
            self.journal.sync_soon(pending.ticket)
        if not wait:
            self.journal.flush(pending.ticket, help_=False)  # written (a kill of the process loses nothing returned)
            return PendingWrite(ids, self.journal, pending.ticket)
        self.journal.wait(pending.ticket)
        return ids

    def _record_batch(self, first: int, n: int, record: jr.Prepared) -> int:
        """Append a committed batch's record once every earlier batch's is appended (batches commit in seq order;
        an earlier one that never commits is an aborted reservation: holes)."""
        with self._order:
            since = time.monotonic()
            while self._recorded < first:
                self._order.wait(0.05)
                if self._recorded < first and (self._holes(self._recorded, first) or time.monotonic() - since > 5):
                    break
            ticket = self.journal.append_prepared(record)
            self._recorded = max(self._recorded, first + n)
            self._order.notify_all()
        return ticket

    def _holes(self, lo: int, hi: int) -> bool:
        idx = self.core.index
        seqs = np.arange(lo, hi, dtype=np.int64)
        return bool((idx.seq[seqs % self.core.arena_rows] == HOLE).all())

    # Updates, priorities, tasks and policy versions are journaled before they are applied, both under `_mutate`
    # (so the journal's order is the order they apply in): whoever sees a value (a consumer that then journals its
    # consumption) sees it after its record, so a consumption that survives a crash never delivered a change that
    # did not. Each is validated in full first: a record is appended only for a change that will apply.
    def update(self, ids: Any, values: dict[str, Any]) -> int:
        seqs = update_ids(ids)
        single = isinstance(ids, (int, np.integer)) and not isinstance(ids, bool)
        cols = validate_update(self.core.schema, seqs, values, single)
        self.updater.check_issued(seqs)  # ids only grow: an id issued now stays issued
        payload = jr.table_bytes(columns_table({"seq": seqs, **cols}))
        with self._mutate:
            ticket = self.journal.append("update", {}, payload)
            n = self.updater.apply(seqs, cols)
        self.journal.wait(ticket)
        return int(n)

    def update_priorities(self, indices: Any, priorities: Any) -> int:
        seqs, pri = validate_priorities(indices, priorities)
        table = pa.table({"seq": pa.array(seqs, pa.int64()), "priority": pa.array(np.asarray(pri, np.float64))})
        payload = jr.table_bytes(table)
        with self._mutate:
            ticket = self.journal.append("priorities", {}, payload)
            n = self.reader.update_priorities(seqs, pri)
        self.journal.wait(ticket)
        return int(n)

    def add_task(self, name: str) -> None:
        with self._mutate:
            self.consume.check_task(name)
            ticket = self.journal.append("task", {"name": name})
            self.consume.add_task(name)
        self.journal.wait(ticket)

    def set_policy_version(self, value: int) -> None:
        check_policy_version(value)
        with self._mutate:
            ticket = self.journal.append("policy_version", {"value": int(value)})
            self.consume.policy_version = value
        self.journal.wait(ticket)

    def end_episode(self, actor: Any, final: dict[str, Any]) -> bool:
        if actor is not None and not isinstance(actor, (str, int)):
            raise InvalidArgument(f"a durable store journals end_episode's actor: pass a str or int, got "
                                  f"{type(actor).__name__}")
        payload = jr.table_bytes(columns_table({k: np.asarray(v)[None] for k, v in final.items()})) if final else b""
        tickets: list[int] = []

        def record() -> None:  # called by the writer once the call is valid, before it changes anything
            tickets.append(self.journal.append("end_episode", {"actor": actor}, payload))

        with self._mutate:
            out = self.writer.end_episode(actor, final, before=record)
        if tickets:
            self.journal.wait(tickets[0])
        return bool(out)

    def stats(self) -> dict[str, Any]:
        """For `store.stats()["journal"]`: policy, whether records are written on the journal's thread (`OFFLOAD`),
        whether large records are written with direct I/O (`arrowbuf.persist.appender`),
        records, bytes and fsyncs since this store opened its journal,
        the next record's lsn and the last durable one's, and what its restore replayed (records per kind, torn
        bytes dropped)."""
        return {"durability": self.journal.policy, "path": self.root, "crc32": CRC_IMPLEMENTATION,
                "offload": self.offload, "defer_write": self.defer_write, "writer_sync": self.writer_sync,
                "direct_io": self.journal.direct_io,
                **self.journal.stats,
                "next_lsn": self.journal.next_lsn, "durable_lsn": self.journal.durable_lsn,
                "replayed": dict(self.replayed)}

    # ------------------------------------------------------------------ checkpoints and lifetime
    def checkpoint(self, keep: int | None, background: bool, compression: str | None) -> Any:
        """Checkpoint into the durable directory; the journal it covers goes once its manifest is committed
        (`_Cut`: where the journal is cut, and when)."""
        handle = write_checkpoint(self.core, self.root, keep=DEFAULT_KEEP if keep is None else keep,
                                  background=True, compression=compression, cut=_Cut(self))
        return handle if background else handle.wait()

    def close(self) -> None:
        self.core.journal = None
        self.journal.close()


class _Cut:
    """`persist.checkpoint.JournalCut` of a durable store: the snapshot and the journal's cut point are taken with
    no change between a record and its effect (the rule of docs/durability.md: the journal may be cut only below the
    oldest record whose effect the snapshot is sure to hold).

    Under `_mutate` (no update, priority, task or version between its record and its effect) and the write lock (no
    new reservation), the batches reserved before are waited for (`StoreWriter.wait_reserved`: each commits, or
    becomes a hole); then every record before the cut point is in the snapshot and no record after it is, but
    consumption (recorded and marked under the state lock: replaying one the snapshot holds marks it again, harmless).
    The lock is held for the snapshot's copy of the small state only; the old segment is synced after it."""

    def __init__(self, log: DurableLog) -> None:
        self.log = log
        self.lsn = -1

    def capture(self, core: Any) -> tuple[Snapshot, dict[str, Any]]:
        log = self.log
        with log._mutate, core.write_lock:
            log.writer.wait_reserved()
            self.lsn = log.journal.cut()
            snap = capture_held(core)
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

    def capture(self, core: Any) -> tuple[Snapshot, dict[str, Any]]:
        return capture(core), {"from_lsn": 0}

    def before_commit(self) -> None:
        pass

    def after_commit(self) -> None:
        pass


class _Target:
    """`persist.replay.ReplayTarget` over a restored store's parts (no journal, no eviction hold)."""

    def __init__(self, core: Any, writer: Any, reader: Any, updater: Any, consume: Any) -> None:
        self.core, self.writer, self.reader, self.updater, self.consume = core, writer, reader, updater, consume

    def next_seq(self) -> int:
        return int(self.core.index.hi)

    def apply_batch(self, table: pa.Table) -> np.ndarray:
        return np.asarray(self.writer.extend(table, timeout=None))

    def skip(self, n: int) -> None:
        self.writer.skip(n)

    def apply_update(self, seqs: np.ndarray, values: dict[str, Any]) -> None:
        self.updater.update(seqs, values)

    def apply_priorities(self, seqs: np.ndarray, priorities: np.ndarray) -> None:
        self.reader.update_priorities(seqs, priorities)

    def apply_task(self, name: str) -> None:
        if name not in self.consume.tasks:
            self.consume.add_task(name)

    def apply_policy_version(self, value: int) -> None:
        self.consume.policy_version = value

    def apply_consumed(self, task: str, seqs: np.ndarray) -> None:
        if task in self.consume.tasks:
            self.consume.mark_consumed(task, seqs)

    def restamp_written(self, first: int, n: int, writer: str, at: float) -> None:
        lineage = self.core.lineage
        if lineage is not None and n > 0:
            with self.core.cond:
                lineage.restamp_written(np.arange(first, first + n, dtype=np.int64) % self.core.arena_rows, writer,
                                        at)

    def restamp_consumed(self, task: str, seqs: np.ndarray, consumer: str, at: float, outcome: int) -> None:
        lineage = self.core.lineage
        if lineage is not None and task in self.consume.tasks:
            with self.core.cond:
                live = seqs[self.core.index.live(seqs)]
                lineage.consumed(task, live, outcome)  # staleness against the replayed policy_version, as then
                lineage.restamp_consumed(task, live, consumer, at)

    def apply_end_episode(self, actor: Any, final: dict[str, Any]) -> None:
        self.writer.end_episode(actor, final)


def resume(root: str, manifest: dict[str, Any], policy: str | None, core: Any, writer: Any, reader: Any,
           updater: Any, consume: Any) -> DurableLog:
    """After a durable directory's last checkpoint was loaded into a fresh store: replay the journal after it (the
    writer's eviction hold off: the journal holds the evictions as they happened), cut a torn tail off, journal on.

    Raises:
        StoreCorrupt: a damaged journal record (other than a torn tail), naming the segment.
    """
    policy = policy or read_policy(root) or "group"
    from_lsn = int((manifest.get("journal") or {}).get("from_lsn", 0))
    owner = jr.lock_journal(root)  # no live store writes it while it is read, cut and continued
    try:
        records, torn, next_lsn, last_crc = jr.read_journal(root, from_lsn)
        # the journal holds the inserts as they happened: no eviction hold, no rate limiter may refuse them again
        hold, writer.hold = writer.hold, None
        limiter, core.rate_limiter = core.rate_limiter, None
        try:
            counts = replay(records, _Target(core, writer, reader, updater, consume), f"journal of {root}",
                            capacity=int(core.capacity))
        finally:
            writer.hold, core.rate_limiter = hold, limiter
        first = jr.seal_last(root, next_lsn, torn, prev=last_crc)
        journal = jr.Journal(root, policy, first_lsn=first, lock_fd=owner)
    except BaseException:
        os.close(owner)
        raise
    log = DurableLog(root, journal, core, writer, reader, updater, consume)
    log.replayed = {**counts, "torn_bytes": 0 if torn is None else torn.size - torn.offset}
    core.journal = log
    return log
