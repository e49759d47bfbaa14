"""The journal (write-ahead log) of a durable store: checksummed records in commit order, in Arrow IPC segments.

Layout (docs/format.md): `DIR/_journal/<first lsn, 20 digits>.arrows`, each segment an Arrow IPC *stream* of
one-row record batches with the columns

    lsn      int64    the record's log sequence number (consecutive over the whole journal)
    kind     string   batch | aborted | update | priorities | task | policy_version | consumed | end_episode |
                      issued | end
    meta     string   JSON: the record's small arguments (a batch's first seq and rows, a task's name ...); may end
                      in spaces (room reserved before the seqs were known)
    payload  binary   the record's bulk data as an Arrow IPC stream (a batch's rows, an update's values ...)
    prev     uint32   the previous record's crc32 in the segment (the schema message's CRC-32 for the first)
    crc32    uint32   CRC-32 of the payload's bytes (its data buffer and padding), continued over every byte of the
                      encapsulated IPC message before them (framing, flatbuffer metadata, lsn, kind, meta, payload
                      offsets), then prev and its padding: every byte of a record but the last 8 (this value and 4
                      zero bytes of padding: the crc32 column is the body's last buffer) is checked by the record
                      itself, in one pass, and the payload's part is computed before the record's place is known

The schema carries the journal format version in its metadata (`arrowbuf.journal`: "2"); a segment of another
version is refused with `StoreCorrupt` saying so. `pyarrow.ipc.open_stream`, Polars' `read_ipc_stream` and DuckDB
(through pyarrow) read a segment like any Arrow stream. A closed segment ends with an `end` record; the last (open)
one may end with a torn record (a process killed in the middle of a write, or a machine that lost the page cache):
`read_segments` drops it, never applies it, and says where to cut the file. Any other damage (a flipped byte
anywhere, a record missing) raises `StoreCorrupt` naming the segment.

Durability policies (`Journal(policy=)`), what `wait(ticket)` guarantees on return:

- "batch": the record is on disk (fdatasync of the segment before the ack; callers waiting at the same time share
  one fdatasync).
- "group": group commit: as "batch", and the fdatasync waits (at most a window of `window_s`, 2 ms) for the writers
  that announced a record (`expect`) and have not appended it yet, so that their records share it; it never waits
  when no other writer is on its way (a lone writer, or writers that all wait already: their records are in the
  file, one fdatasync covers them), and it stops waiting as soon as the last announced record is appended.
- `sync_soon(ticket)` starts the fdatasync on the journal's sync thread and returns at once: a writer that records
  its batch before copying its rows overlaps the two, then `wait`s.
- Records are written in lsn order (commit order) whoever writes them: `append` writes the queue up to its record.
  A failed write fails every later record (`wait` and `append` raise the OSError): nothing is ever written after a
  partial record.
- "os": the record is in the operating system's page cache (a `write` returned): it survives the process being
  killed, not the machine crashing or losing power.

Usage::

    j = Journal(dir, "group", first_lsn=0)
    t = j.append("batch", {"first": 0, "n": 10}, ipc_bytes)   # in commit order; cheap (buffered in the kernel)
    j.wait(t)                                                 # durable under the policy: now acknowledge
    j.rotate()                                                # a checkpoint starts here; truncate_before() later
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from .. import config
from ..errors import InvalidArgument, StoreCorrupt
from ..observe.meter import ProgressSink
from .appender import SegmentFile
from .loader import SegmentLoader as _Loader
from .loader import open_segment
from .manifest import FILE_MODE, check_private, make_dirs
from .manifest import fsync_dir as _fsync_dir
from .record import (
    FORMAT_VERSION,
    RECORD_SCHEMA,
    Prepared,
    encode,
    meta_bytes,
    payload_table,
    prepare,
    record_crc,
    seal,
    table_bytes,
    table_pieces,
)
from .record import SCHEMA_BYTES as _SCHEMA_BYTES
from .record import SCHEMA_CRC as _SCHEMA_CRC
from .record import U32 as _U32
from .record import V1_SCHEMA_BYTES as _V1_SCHEMA_BYTES
from .record import ZERO4 as _ZERO4

__all__ = ["FORMAT_VERSION", "RECORD_SCHEMA", "Prepared", "encode", "payload_table", "prepare",
           "record_crc", "seal", "table_bytes", "table_pieces", "Journal", "Record", "read_segments", "read_journal",
           "seal_last", "segments", "lock_journal", "TornTail"]

JOURNAL = "_journal"
OWNER = "_owner.lock"
SEGMENT = re.compile(r"^(\d{20})\.arrows$")
POLICIES = ("batch", "group", "os")
#: Segments are rotated once they pass this size (also at every checkpoint).
SEGMENT_BYTES = 256 << 20
#: Group commit window.
GROUP_WINDOW_S = 0.002


def segment_name(first_lsn: int) -> str:
    return f"{first_lsn:020d}.arrows"


@dataclass
class Record:
    lsn: int
    kind: str
    meta: dict[str, Any]
    payload: Any  # bytes-like (a zero-copy `pa.Buffer` when read back)


class Journal:
    """An open journal: appends records to the newest segment and makes them durable under `policy` (module
    docstring). Thread-safe. `append` queues a record (its lsn is its place in commit order) and writes the queue
    up to it; `wait` is where a caller pays for durability."""

    def __init__(self, directory: str, policy: str = "group", first_lsn: int = 0,
                 window_s: float = GROUP_WINDOW_S, lock_fd: int | None = None, direct: bool | None = None) -> None:
        if policy not in POLICIES:
            raise InvalidArgument(f"durability must be one of {list(POLICIES)}, got {policy!r}")
        self.dir = os.path.join(os.fspath(directory), JOURNAL)
        self._owner = lock_journal(directory) if lock_fd is None else lock_fd
        self.policy = policy
        self.window_s = window_s
        # lock order: _sync_lock, then _io, then _lock. _lock (brief): the next lsn and the queue of records not
        # written yet; _io: the file (one writer at a time, records written in lsn order); _sync_lock: one
        # fdatasync at a time, and no fd is closed while one runs (a rotation retires the old fd: closed later)
        self._lock = threading.Lock()
        self._io = threading.Lock()
        self._sync_lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())  # the durable lsn and the count of waiting callers
        self._next = int(first_lsn)
        self._queue: collections.deque[tuple[int, Prepared | None, bytes | None]] = collections.deque()
        self._queued_bytes = len(_SCHEMA_BYTES)  # the newest segment's bytes, with the queued records
        self._written = int(first_lsn) - 1  # the last record written (in the page cache)
        self._durable = int(first_lsn) - 1
        self._coming = 0  # records announced (`expect`) and not appended yet: what a group commit waits for
        # large records with direct I/O (asked for; `direct_io` says whether the filesystem took it); None: the
        # registered ARROWBUF_JOURNAL_DIRECT (`arrowbuf.config`), read now
        self.direct = bool(config.get("ARROWBUF_JOURNAL_DIRECT")) if direct is None else bool(direct)
        self._file: SegmentFile | None = None
        self._retired: list[SegmentFile] = []  # rotated segments, closed by the next fdatasync's caller
        self._size = 0
        self._closed = False
        self._error: OSError | None = None  # a write failed: the file may end in a partial record; no more writes
        #: records, bytes and fsyncs since the journal opened, and the CPU time (user and system, of whichever thread)
        #: spent in its write, sync_file_range and fdatasync calls: what the journal's own CPU cost excludes
        #: (benchmarks/bench_journal.py)
        self.stats: dict[str, Any] = {"records": 0, "bytes": 0, "fsyncs": 0, "syscall_cpu_s": 0.0}
        self._kick = threading.Condition(threading.Lock())  # `sync_soon` requests for the sync thread
        self._kick_upto = -1
        self._kick_at = 0.0  # when the sync thread starts on `_kick_upto` (later than now: a lazy `sync_soon`)
        self._taken = -1  # the request the sync thread is working on
        self._syncer: threading.Thread | None = None
        self._open_segment()

    # ------------------------------------------------------------------ writing
    def _open_segment(self) -> None:
        path = os.path.join(self.dir, segment_name(self._written + 1))
        f = SegmentFile(path, direct=self.direct)
        try:
            f.write([_SCHEMA_BYTES], len(_SCHEMA_BYTES))
            os.fsync(f.fd)
        except BaseException:
            f.close()
            raise
        _fsync_dir(self.dir)
        self._file, self._size, self._prev = f, len(_SCHEMA_BYTES), _SCHEMA_CRC

    @property
    def direct_io(self) -> bool:
        """Whether the open segment is written with direct I/O (`DIRECT`, and the filesystem allows it)."""
        f = self._file
        return f is not None and f.direct

    @property
    def _fd(self) -> int:
        assert self._file is not None
        return self._file.fd

    def append(self, kind: str, meta: dict[str, Any], payload: Any = b"") -> int:
        """Append one record (in the order of the calls) and write it; returns its ticket for `wait`."""
        return self.append_prepared(prepare(kind, meta, payload))

    def expect(self) -> None:
        """Announce a record this caller will append soon (a writer about to encode its batch): a group commit
        that starts meanwhile waits for it (at most its window) instead of syncing without it. Pair with one
        `append_prepared(..., expected=True)` or `unexpect()`."""
        with self._cond:
            self._coming += 1

    def unexpect(self) -> None:
        """Withdraw an `expect` whose record will not come (the caller failed before appending it)."""
        with self._cond:
            self._coming = max(0, self._coming - 1)
            self._cond.notify_all()

    def append_prepared(self, record: Prepared, meta: dict[str, Any] | None = None, expected: bool = False,
                        writeback: bool = False) -> int:
        """Append a record `prepare`d before (outside this journal's locks: the payload's checksum is done by
        then), with `meta` if given (within the width prepared); returns its ticket (its lsn) for `wait`.
        The record's place (its lsn: commit order) is taken here, and it is written here (in the operating system's
        page cache, or at the device with direct I/O). `expected`: the record announced by this caller's `expect`
        (counted as arrived, even if this raises). `writeback`: start the disk's write of it now
        (`start_writeback`), for a caller that `wait`s later."""
        try:
            meta_b = None if meta is None else meta_bytes(record, meta)  # a meta too wide fails here, not later
            with self._lock:
                if self._closed or self._error is not None:
                    raise self._error or InvalidArgument("the journal is closed")
                lsn = self._next
                self._next += 1
                self._queue.append((lsn, record, meta_b))
                self._queued_bytes += record.size
                if self._queued_bytes >= SEGMENT_BYTES:  # the segment is full: the next record starts a new one
                    self._queue.append((self._next, None, None))
                    self._next += 1
                    self._queued_bytes = len(_SCHEMA_BYTES)
        finally:
            if expected:
                self.unexpect()
        self.flush(lsn)
        if writeback:
            with self._io:
                if self._error is None and not self._closed:
                    assert self._file is not None
                    c0 = time.thread_time()
                    self._file.start_writeback()
                    self.stats["syscall_cpu_s"] += time.thread_time() - c0
        return lsn

    def flush(self, ticket: int, help_: bool = True) -> None:
        """Return once record `ticket` (and every one before it) is written to the segment (in the operating
        system's page cache): writes the queued records itself if no other thread is writing them (with
        `help_=False`, waits instead while the sync thread has the record in hand).

        Raises:
            OSError: a write failed (the journal writes nothing more; the store cannot acknowledge).
        """
        if not help_:
            self._await_syncer(ticket, lambda: self._written)
        while self._written < ticket:
            with self._io:
                if self._error is not None:
                    raise self._error
                if self._written >= ticket:
                    return
                try:
                    self._write_queued()
                except OSError as exc:
                    self._error = exc
                    with self._cond:
                        self._cond.notify_all()
                    raise

    def _write_queued(self) -> None:
        """Write the queued records (under `_io`): the records before the first rotation in one `writev`, chained
        (each seals the previous one's crc32); at a rotation the segment is closed with its `end` record."""
        with self._lock:
            items: list[tuple[int, Prepared | None, bytes | None]] = []
            while self._queue and self._queue[0][1] is not None and len(items) < 512:
                items.append(self._queue.popleft())
            rotate = not items and bool(self._queue)
            if rotate:
                end_lsn = self._queue.popleft()[0]
        if rotate:
            assert self._file is not None
            self._file.write(seal(prepare("end", {}), end_lsn, self._prev)[0])
            self._file.finish()
            os.fdatasync(self._fd)  # the old segment whole on disk: the new one's records never outlive it
            self._retired.append(self._file)
            self._written = end_lsn
            self.stats["fsyncs"] += 1
            with self._cond:
                self._durable = max(self._durable, end_lsn)
                self._cond.notify_all()
            self._open_segment()
            return
        pieces: list[Any] = []
        total, prev = 0, self._prev
        for lsn, record, meta in items:
            assert record is not None
            p, prev = seal(record, lsn, prev, meta)
            pieces.extend(p)
            total += record.size
        assert self._file is not None
        c0 = time.thread_time()
        for i in range(0, len(pieces), 1000):  # IOV_MAX
            chunk = pieces[i:i + 1000]
            self._file.write(chunk, None if i or len(pieces) > 1000 else total)
        self.stats["syscall_cpu_s"] += time.thread_time() - c0
        self._prev = prev
        self._size += total
        self._written = items[-1][0]
        self.stats["records"] += len(items)
        self.stats["bytes"] += total
        with self._cond:
            if self.policy == "os":
                self._durable = self._written
            self._cond.notify_all()

    def record_consumed(self, task: str, seqs: np.ndarray, meta: dict[str, Any] | None = None) -> int:
        """Record that `task` consumed the rows `seqs` (the consume path calls this when it marks rows consumed
        without a lease, and the lease path when a lease is acked); `meta`: more of the record's meta (the
        consumer and time, for the lineage). Returns the ticket to `wait` for before the rows are handed out (or the
        ack returns)."""
        seqs = np.ascontiguousarray(seqs, dtype=np.int64)
        return self.append("consumed", {**(meta or {}), "task": task}, seqs.tobytes())

    def is_durable(self, ticket: int) -> bool:
        """Whether record `ticket` (and every one before it) is durable under the policy now."""
        return self._durable >= ticket

    def wait(self, ticket: int, timeout: float | None = None) -> bool:
        """Return once the record `ticket` (and every one before it) is durable under the policy (True), or, with a
        `timeout`, after that many seconds if it is not (False; the journal's sync thread goes on with it).

        Leader and followers: a caller takes the sync lock and fdatasyncs everything written so far (writing the
        queued records up to its own first); callers that arrive meanwhile queue on the lock and find their records
        covered (one fdatasync for all of them) or sync the next batch. "group" first waits (at most its window)
        for records other writers announced (`expect`).

        Raises:
            OSError: the journal could not write or sync the record (it is not acknowledged).
        """
        if self._durable >= ticket:
            return True
        if self.policy == "os":
            self.flush(ticket, help_=False)
            return True
        if timeout is not None:
            return self._wait_for(ticket, timeout)
        self._await_syncer(ticket, lambda: self._durable)
        if self._durable < ticket:
            self._sync_upto(ticket, gather=self.policy == "group")
        return True

    def _await_syncer(self, ticket: int, done: Any) -> None:
        """While the sync thread is working on record `ticket` (it took the `sync_soon` request), wait until
        `done()` >= ticket: its write or fdatasync is not done twice, nor on the caller's thread; returns at once
        otherwise (a sync thread not running yet, on a busy machine: the caller does the work itself)."""
        syncer = self._syncer
        with self._cond:
            while done() < ticket and self._taken >= ticket and not self._closed and self._error is None and \
                    syncer is not None and syncer.is_alive():
                self._cond.wait(0.05)

    def _wait_for(self, ticket: int, timeout: float) -> bool:
        """`wait` with a timeout: the sync thread makes the record durable; this waits for it, at most `timeout`."""
        self.sync_soon(ticket)
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while self._durable < ticket and not self._closed and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        if self._durable < ticket and self._error is not None:
            raise self._error
        return self._durable >= ticket

    def sync_soon(self, ticket: int, lazy: bool = False) -> None:
        """Start making record `ticket` durable (but under "os": written) on the journal's sync thread, and return at
        once: a writer that appends its record before it copies its rows calls this, copies (the fdatasync runs
        meanwhile), then `wait`s, which then mostly finds it done.
        `lazy` (a record nobody waits for yet: a pipelined `extend(wait=False)`): under "group" the sync thread
        starts at most `window_s` later, so that the records appended meanwhile share its fdatasync; a `wait` for
        the record before then syncs at once (on the waiter's thread)."""
        if self._durable >= ticket:
            return
        at = time.monotonic() + self.window_s if lazy and self.policy == "group" else 0.0
        with self._kick:
            if self._syncer is None and not self._closed:
                self._syncer = threading.Thread(target=self._sync_loop, name="arrowbuf-journal-sync", daemon=True)
                self._syncer.start()
            if self._kick_upto <= self._durable:  # nothing pending: this request sets when the thread starts
                self._kick_at = at
            self._kick_upto = max(self._kick_upto, ticket)
            self._kick_at = min(self._kick_at, at)
            self._kick.notify()

    def _sync_loop(self) -> None:
        while True:
            with self._kick:
                while not self._closed:
                    if self._kick_upto <= self._durable:
                        self._kick.wait()
                        continue
                    left = self._kick_at - time.monotonic()
                    if left <= 0:
                        break
                    self._kick.wait(left)  # a lazy request: records appended meanwhile share the fdatasync
                if self._closed:
                    return
                upto = self._taken = self._kick_upto
            try:
                if self.policy == "os":
                    self.flush(upto)
                else:
                    self._sync_upto(upto, gather=self.policy == "group")
            except OSError:  # the callers' `wait` syncs itself and raises to them
                with self._kick:
                    self._kick_upto = self._taken = self._durable
                with self._cond:
                    self._cond.notify_all()

    def _sync_upto(self, ticket: int, gather: bool = False) -> None:
        self.flush(ticket)
        with self._sync_lock:
            if self._durable >= ticket or self._closed:
                return
            if self._error is not None:  # an earlier fdatasync or write failed: nothing more is acknowledged
                raise self._error
            if gather:
                self._gather()
                self.flush(self._next - 1)  # the records that came meanwhile share this fdatasync
            with self._io:
                fd, last, retired, self._retired = self._fd, self._written, self._retired, []
            c0 = time.thread_time()
            try:
                os.fdatasync(fd)
            except OSError as exc:  # the kernel may have dropped the pages (and marked them clean): a retry could
                self._error = exc   # "succeed" without them on disk, so the journal fails, as after a failed write
                with self._cond:
                    self._cond.notify_all()
                raise
            self.stats["syscall_cpu_s"] += time.thread_time() - c0
            for old in retired:
                old.close()
            self.stats["fsyncs"] += 1
            with self._cond:
                self._durable = max(self._durable, last)
                self._cond.notify_all()  # `wait(ticket, timeout)` callers

    def _gather(self) -> None:
        """Group commit: wait until the records other writers announced are appended (they then share this
        fdatasync), at most `window_s`; at once when none is announced."""
        deadline = time.monotonic() + self.window_s
        with self._cond:
            while self._coming > 0 and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def rotate(self) -> int:
        """Start a new segment (the old one is closed with an `end` record and synced); returns its first lsn: the
        records from there on are those a checkpoint taken now does not cover."""
        first = self.cut()
        self.flush(first - 1)
        return first

    def cut(self) -> int:
        """`rotate`'s cut point alone: the records appended from now on go to a new segment, whose first lsn is
        returned; the old segment is closed (written and synced) by the next `flush` or `wait` that reaches it. A
        checkpoint takes its cut under the store's locks (cheap: no I/O there) and flushes it after."""
        with self._lock:
            if self._closed:
                raise InvalidArgument("the journal is closed")
            end_lsn = self._next
            self._queue.append((end_lsn, None, None))
            self._next += 1
            self._queued_bytes = len(_SCHEMA_BYTES)
        return end_lsn + 1

    def truncate_before(self, lsn: int) -> int:
        """Delete the segments holding only records before `lsn` (a checkpoint covers them); returns how many."""
        names = sorted(n for n in os.listdir(self.dir) if SEGMENT.match(n))
        firsts = [int(n[:20]) for n in names]
        gone = 0
        for i, n in enumerate(names):
            nxt = firsts[i + 1] if i + 1 < len(names) else None
            if nxt is not None and nxt <= lsn:
                os.unlink(os.path.join(self.dir, n))
                gone += 1
        if gone:
            _fsync_dir(self.dir)
        return gone

    @property
    def next_lsn(self) -> int:
        return self._next

    @property
    def durable_lsn(self) -> int:
        """The last record durable under the policy (every record up to it survives a crash); `next_lsn - 1` when
        nothing waits for a write or an fdatasync."""
        return self._durable

    def close(self) -> None:
        """Write and make everything durable, and close; idempotent."""
        if self._error is None and not self._closed:
            try:
                self.flush(self._next - 1)
            except OSError:
                pass  # closed below all the same; the records not written are not acknowledged
        with self._sync_lock, self._io, self._lock:
            if self._closed:
                return
            try:
                assert self._file is not None
                self._file.finish()  # also after a failure: the bytes a failed write left past `size` are cut
                if self._error is None:
                    os.fdatasync(self._fd)
            finally:
                for f in (*self._retired, self._file):
                    if f is not None:
                        f.close()
                self._retired = []
            with self._cond:
                if self._error is None:
                    self._durable = self._written
                self._closed = True
                self._cond.notify_all()
            os.close(self._owner)  # releases the directory
        with self._kick:
            self._kick.notify_all()
            syncer = self._syncer
        if syncer is not None and syncer is not threading.current_thread():
            syncer.join()


def check_journal_dir(directory: str) -> None:
    """Refuse a durable directory, or a `_journal` directory in it, that is not this user's alone
    (`manifest.check_private`) or is a link.

    Raises:
        InvalidArgument: naming the directory.
    """
    check_private(os.fspath(directory))
    d = os.path.join(os.fspath(directory), JOURNAL)
    if os.path.lexists(d):
        check_private(d)


def lock_journal(directory: str) -> int:
    """Make `directory/_journal` and take its owner lock (flock, released when the fd closes or the process dies):
    one store journals into a durable directory at a time, and no restore cuts a segment a live store writes.

    Raises:
        InvalidArgument: another store (in this or another process) has the directory open.
    """
    d = os.path.join(os.fspath(directory), JOURNAL)
    if os.path.islink(d):
        raise InvalidArgument(f"{d} is a symbolic link; a journal never follows links")
    make_dirs(os.fspath(directory))
    make_dirs(d)  # its entry in the durable directory is fsynced before any record in it is acknowledged
    fd = os.open(os.path.join(d, OWNER), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise InvalidArgument(f"the durable store in {directory} is open (a live store journals into it); close it "
                              "first (a killed process releases it)") from None
    return fd


# ---------------------------------------------------------------------- reading
def segments(directory: str) -> list[tuple[int, str]]:
    """(first lsn, path) of the journal's segments under durable directory `directory`, oldest first."""
    d = os.path.join(os.fspath(directory), JOURNAL)
    if not os.path.isdir(d):
        return []
    return sorted((int(n[:20]), os.path.join(d, n)) for n in os.listdir(d) if SEGMENT.match(n))


@dataclass
class TornTail:
    """Where the last segment's intact records end (the torn record from `offset` on is dropped)."""

    path: str
    offset: int
    size: int


def read_segments(directory: str, from_lsn: int) -> tuple[list[Record], TornTail | None, int]:
    """The records with lsn >= `from_lsn`, checked, in order; the torn tail of the last segment, if any; and the
    lsn after the last intact record (where the journal goes on).

    Raises:
        StoreCorrupt: a record fails its checksum, a record or segment is missing, or a segment other than the last
            is cut short; the message names the segment.
    """
    recs, torn, nxt, _ = read_journal(directory, from_lsn)
    return recs, torn, nxt


def read_journal(directory: str, from_lsn: int, progress: ProgressSink | None = None
                 ) -> tuple[list[Record], TornTail | None, int, int]:
    """`read_segments`, and the crc32 of the newest segment's last intact record (`seal_last` chains to it).
    Segments are memory-mapped: payloads are zero-copy views of the files. `progress` hears the segment bytes
    read and checked (phase "journal: read")."""
    segs = segments(directory)
    sizes = [os.path.getsize(path) for _, path in segs] if progress is not None else []
    total = sum(sizes)
    done = 0
    if progress is not None:
        progress("journal: read", 0, total, "B")
    out: list[Record] = []
    torn: TornTail | None = None
    expect: int | None = None
    last_crc = _SCHEMA_CRC
    for i, (first, path) in enumerate(segs):
        last = i == len(segs) - 1
        nxt = segs[i + 1][0] if not last else None
        if nxt is not None and nxt <= from_lsn:
            continue  # covered by the checkpoint (kept only until truncation caught up)
        if expect is not None and first != expect:
            raise StoreCorrupt(f"journal segment {path} starts at lsn {first}, expected {expect}: a segment is "
                               "missing; the journal cannot be replayed past it")
        recs, cut, last_crc = _read_segment(path, first)
        if cut is not None:
            if not last:
                raise StoreCorrupt(f"journal segment {path} is cut short at byte {cut.offset} of {cut.size} but "
                                   "is not the newest segment: it is damaged")
            torn = cut
        elif not last and (not recs or recs[-1].kind != "end"):
            raise StoreCorrupt(f"journal segment {path} has no end record but is not the newest segment")
        expect = (recs[-1].lsn + 1) if recs else first
        out.extend(r for r in recs if r.lsn >= from_lsn and r.kind != "end")
        if progress is not None:
            done += sizes[i]
            progress("journal: read", done, total, "B")
    return out, torn, max(from_lsn, expect if expect is not None else from_lsn), last_crc


def _read_segment(path: str, first: int) -> tuple[list[Record], TornTail | None, int]:
    loader = _Loader(path)
    try:
        return _check_segment(path, first, loader)
    finally:
        loader.join()


def _check_segment(path: str, first: int, loader: _Loader) -> tuple[list[Record], TornTail | None, int]:
    buf = loader.buf
    view = memoryview(buf).cast("B")
    size = len(view)
    hs = len(_SCHEMA_BYTES)
    loader.upto(max(hs, len(_V1_SCHEMA_BYTES)))
    if size < hs or view[:hs] != _SCHEMA_BYTES:
        head = bytes(view[:hs])
        if size < hs and _SCHEMA_BYTES.startswith(head):
            return [], TornTail(path, 0, size), _SCHEMA_CRC  # a segment whose header write was cut
        if size >= len(_V1_SCHEMA_BYTES) and bytes(view[:len(_V1_SCHEMA_BYTES)]) == _V1_SCHEMA_BYTES:
            raise StoreCorrupt(f"journal segment {path} is in journal format version 1; this arrowbuf reads version "
                               f"{FORMAT_VERSION} only (docs/format.md): restore it with the arrowbuf that wrote it")
        raise StoreCorrupt(f"journal segment {path}: not an arrowbuf journal segment of format version "
                           f"{FORMAT_VERSION} (bad header)")
    off = hs
    recs: list[Record] = []
    lsn = first
    prev = _SCHEMA_CRC
    while off < size:
        total = _frame_size(view, off, loader.upto)  # loads the framing and metadata first ...
        loader.upto(off + total if total > 0 else size)  # ... then the whole record
        rec, end, crc = _parse_at(buf, view, off, lsn, prev, total)
        if rec is None:
            loader.upto(size)
            if _torn(buf, view, off, total, lsn, prev):
                return recs, TornTail(path, off, size), prev
            raise StoreCorrupt(f"journal segment {path}: record {lsn} at byte {off} is corrupt (checksum or "
                               "framing) and is not a torn tail (docs/format.md); the journal cannot be replayed "
                               "past it")
        recs.append(rec)
        prev = crc
        lsn += 1
        off = end
    return recs, None, prev


def _frame_size(view: memoryview, off: int, need: Any = None) -> int:
    """The byte size of the encapsulated IPC message at `off` from its framing (continuation marker, metadata
    length, the flatbuffer's bodyLength); 0 when the bytes end inside the framing (torn), -1 when it is malformed.
    `need(k)`: called before bytes below k are read (a segment still being loaded)."""
    size = len(view)
    need = need or (lambda k: None)
    need(off + 8)
    head = bytes(view[off:off + 8])
    if len(head) < 8:
        ok = b"\xff\xff\xff\xff".startswith(head[:4]) or head.count(0) == len(head)
        return 0 if ok else -1
    if head[:4] != b"\xff\xff\xff\xff":
        need(size)
        return 0 if bytes(view[off:]).count(0) == size - off else -1  # zeros: written size, never written data
    mlen = int.from_bytes(head[4:8], "little", signed=True)
    if mlen <= 0 or mlen % 8:
        return -1
    if off + 8 + mlen > size:
        return 0
    need(off + 8 + mlen)
    meta = bytes(view[off + 8:off + 8 + mlen])
    try:  # flatbuffer Message: slots version, header_type, header, bodyLength, custom_metadata
        root = int.from_bytes(meta[0:4], "little")
        vt = root - int.from_bytes(meta[root:root + 4], "little", signed=True)
        vt_len = int.from_bytes(meta[vt:vt + 2], "little")
        slot = vt + 4 + 2 * 3
        voff = int.from_bytes(meta[slot:slot + 2], "little") if 4 + 2 * 3 < vt_len else 0
        body = int.from_bytes(meta[root + voff:root + voff + 8], "little", signed=True) if voff else 0
    except (IndexError, ValueError):
        return -1
    if body < 0 or not 0 <= vt < mlen or not 0 <= root < mlen:
        return -1
    total = 8 + mlen + body
    if body < 24:  # at least lsn, prev and crc32
        return -1
    return 0 if off + total > size else total


def _check_bytes(view: memoryview, off: int, total: int) -> int | None:
    """The crc32 of the record in bytes [off, off + total) when its bytes check (module docstring), else None."""
    end = off + total
    crc = _U32.unpack_from(view, end - 8)[0]
    if view[end - 4:end] != _ZERO4 or record_crc(view, off, total) != crc:
        return None
    return int(crc)


def _parse_at(buf: pa.Buffer, view: memoryview, off: int, lsn: int, prev: int,
              total: int) -> tuple[Record | None, int, int]:
    """The record at byte `off` (of `total` bytes: `_frame_size`), where it ends and its crc32; (None, 0, 0) when the
    bytes end inside it (torn, or zeros where a crashed machine never wrote the data), (None, -1, 0) when it is
    complete but wrong. The bytes are checked before pyarrow parses them."""
    if total <= 0:
        return None, total, 0
    crc = _check_bytes(view, off, total)
    if crc is None:
        return None, -1, 0
    try:
        batch = pa.ipc.read_record_batch(pa.ipc.read_message(buf.slice(off, total)), RECORD_SCHEMA)
        if batch.num_rows != 1:
            return None, -1, 0
        row = {name: batch.column(name)[0].as_py() for name in ("lsn", "kind", "meta", "prev", "crc32")}
        payload = _payload(batch.column("payload"))
    except (EOFError, OSError, pa.ArrowInvalid, IndexError, TypeError):
        return None, -1, 0
    if row["lsn"] != lsn or row["prev"] != prev or row["crc32"] != crc or None in row.values():
        return None, -1, 0
    try:
        meta = json.loads(row["meta"])
    except ValueError:
        return None, -1, 0
    return Record(lsn, row["kind"], meta, payload), off + total, crc


def _payload(arr: pa.Array) -> Any:
    """The payload of a one-row binary column, zero-copy (a `pa.Buffer`)."""
    if arr.null_count:
        return b""
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32, count=2, offset=4 * arr.offset)
    data = arr.buffers()[2]
    lo, hi = int(offsets[0]), int(offsets[1])
    if data is None or not 0 <= lo <= hi <= data.size:
        raise IndexError("payload offsets out of range")
    return data.slice(lo, hi - lo)


def _torn(buf: pa.Buffer, view: memoryview, off: int, total: int, lsn: int, prev: int) -> bool:
    """Whether the record at byte `off` that did not check (lsn `lsn`, after the record whose crc32 is `prev`) is a
    torn tail: bytes a crash left unwritten, never acknowledged (docs/format.md, "Torn tails"). It is when
    - no intact record follows it (the damage is not in the middle of the segment),
    - its trailer (the previous record's crc32 as its `prev`, then its own crc32, each padded with 4 zero bytes) is
      not there with only zeros after it: a record whose every byte is there is whole and wrong (a flipped bit,
      its length fields included), never torn; and
    - the file ends inside it (its framing announces more bytes than there are: a write cut short), or its crc32
      slot and every byte after it to the end of the file are zeros (data the machine never wrote: a lost page
      cache, an unwritten extent after a direct write)."""
    size = len(view)
    if _later_record(buf, view, off + 8, lsn + 1) or _whole_at_end(view, off, prev):
        return False
    if total == 0:
        return True
    if total < 0:
        return False
    return not np.frombuffer(view[off + total - 8:size], dtype=np.uint8).any()


def _whole_at_end(view: memoryview, off: int, prev: int) -> bool:
    """Whether the bytes from `off` hold a record's trailer chained to `prev` (`prev`, 4 zero bytes, a crc32, 4 zero
    bytes; 8-byte aligned) followed by nothing but zeros to the end of the file: the record is all there."""
    size = len(view)
    data = bytes(view[off:size])
    pat = _U32.pack(prev) + _ZERO4
    i = data.find(pat)
    while i != -1:
        end = i + 16
        if i % 8 == 0 and end <= len(data) and data[i + 12:end] == _ZERO4 and \
                not np.frombuffer(view[off + end:size], dtype=np.uint8).any():
            return True
        i = data.find(pat, i + 1)
    return False


def _later_record(buf: pa.Buffer, view: memoryview, start: int, lsn: int) -> bool:
    """Whether an intact record with lsn >= `lsn` starts somewhere after `start` (8-byte aligned, as IPC messages
    are): then the damage is in the middle of the segment, not a torn tail."""
    data = bytes(view)
    marker = b"\xff\xff\xff\xff"
    i = data.find(marker, start)
    while i != -1:
        if i % 8 == 0:
            total = _frame_size(view, i)
            if total > 0 and _check_bytes(view, i, total) is not None:
                try:
                    msg = pa.ipc.read_message(buf.slice(i, total))
                    got = pa.ipc.read_record_batch(msg, RECORD_SCHEMA).column("lsn")[0].as_py()
                    if got is not None and got >= lsn:
                        return True
                except (EOFError, OSError, pa.ArrowInvalid, IndexError, TypeError):
                    pass
        i = data.find(marker, i + 1)
    return False


def seal_last(directory: str, next_lsn: int, torn: TornTail | None, prev: int | None = None) -> int:
    """Before a restored store journals again: cut the torn record off the newest segment (if any) and close that
    segment with an `end` record of lsn `next_lsn`; returns the first lsn of the segment to open next. `prev`: the
    crc32 of the segment's last intact record (`read_journal`; read again when not given)."""
    segs = segments(directory)
    if not segs:
        return next_lsn
    first, path = segs[-1]
    if prev is None:
        _, _, prev = _read_segment(path, first)  # the crc of the last intact record (the end record chains to it)
    fd = open_segment(path, os.O_RDWR)
    with os.fdopen(fd, "r+b") as f:
        if torn is not None and torn.path == path:
            f.truncate(torn.offset)
            f.seek(torn.offset)
            if torn.offset == 0:
                f.write(_SCHEMA_BYTES)
        else:
            f.seek(0, os.SEEK_END)
        f.write(encode(next_lsn, "end", {}, b"", prev))
        f.flush()
        os.fsync(f.fileno())
    return next_lsn + 1

