"""Lineage, recorded by the store: who wrote each row, when, under which policy version; who consumed it for each
task, when, and at which staleness.

A `Lineage` lives beside the ring: arrays indexed by ring position (capacity plus the spare chunk), so it is
bounded like the ring and a recycled position simply gets the new row's record at its commit. Bytes per row:

- per row: writer (int32 code of a name, `arrowbuf.observe.identity`), written_at (float64, Unix seconds),
  version (int64, the store's `policy_version` at the commit): 20 bytes;
- per (row, task): seq (int64, the row the record is about: a generation check, as consumption per task), time
  (float64), consumer (int32), staleness (int64), outcome (int8: 1 delivered, 2 dropped as stale): 29 bytes;
- per batch of `MIN_RUN` rows or more: one run record (first seq, rows, writer, time: 28 bytes) instead of the
  batch's per-row writer and time, in a ring of `arena_rows // MIN_RUN + 2` records (at most 1.75 bytes per row).

A batch (`extend`) of `MIN_RUN` rows or more costs one run record, whatever its length: its rows' writer and time
are read from the run whose seqs hold the row (runs are recorded in commit order, so their first seqs are sorted and
a row's run is a binary search away). Shorter batches and `append` store per row. The ring of runs never drops a run
with a live row: between a run and the one that reuses its record, `arena_rows` rows or more were committed.

The writer's hook is one call in the commit routine (`StoreWriter._commit_locked`, under the store's state lock);
the consumer's hook is one call where `ConsumeTracker.consume` marks rows consumed (and where it drops stale rows),
also under that lock. The `policy_version` the lineage reports for a row is the row's own `policy_version` field when
the schema has an integer one (the version that generated it, which staleness is measured against), else the store's
version at the commit. Staleness at delivery = the store's `policy_version` then - that version.

`table()` is the SQL sandbox's `lineage` table (`store.sql("... FROM lineage")`): one row per (live row, declared
task), or one per live row when no task is declared; `consumed_at`, `consumer`, `staleness`, `outcome` are NULL
while the task has not taken the row.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from . import identity

_now = time.time
#: what one row's record is stamped with: the writer's code (`identity.current`) and the time (Unix seconds). The
#: append path of `arrowbuf.engine.writer` stores these itself through `Lineage.stamp` (module docstring)
STAMP_WRITER = identity.CURRENT.get
STAMP_CLOCK = _now

DELIVERED = 1
STALE = 2
ACKED = 3  # a leased delivery, acknowledged (leases: consume(..., lease=s) then ack)
OUTCOMES = {DELIVERED: "delivered", STALE: "stale", ACKED: "acked"}
#: Staleness values counted one by one in the per-task histogram; larger ones share the last bucket.
MAX_STALENESS_BUCKET = 64

#: Bytes per row (module docstring): fixed, and per declared task.
ROW_BYTES = 4 + 8 + 8
TASK_BYTES = 8 + 8 + 4 + 8 + 1
#: A batch of this many rows or more is recorded as one run (module docstring); bytes per run record.
MIN_RUN = 16
RUN_BYTES = 8 + 8 + 4 + 8  # first seq (int64), rows (int64), writer (int32), time (float64)

SCHEMA = pa.schema([("seq", pa.int64()), ("writer", pa.string()), ("written_at", pa.timestamp("us", tz="UTC")),
                    ("policy_version", pa.int64()), ("task", pa.string()),
                    ("consumed_at", pa.timestamp("us", tz="UTC")), ("consumer", pa.string()),
                    ("staleness", pa.int64()), ("outcome", pa.string())])


class _TaskRecord:
    """Per-position consumption records of one task (module docstring), and its counters."""

    def __init__(self, rows: int) -> None:
        self.seq = np.full(rows, -1, dtype=np.int64)
        self.at = np.full(rows, 0.0, dtype=np.float64)
        self.consumer = np.full(rows, 0, dtype=np.int32)
        self.staleness = np.full(rows, 0, dtype=np.int64)
        self.outcome = np.full(rows, 0, dtype=np.int8)
        self.delivered = 0
        self.stale = 0
        self.hist = np.zeros(MAX_STALENESS_BUCKET + 1, dtype=np.int64)  # staleness at delivery: 0..64+
        self.pending: list[np.ndarray] = []  # staleness arrays of deliveries not yet counted in `hist`

    def fold(self) -> None:
        """Count the pending deliveries' staleness into `hist` (under the store's state lock)."""
        if self.pending:
            s = np.concatenate(self.pending)
            self.pending.clear()
            self.hist += np.bincount(np.minimum(np.maximum(s, 0), MAX_STALENESS_BUCKET),
                                     minlength=MAX_STALENESS_BUCKET + 1)


class Lineage:
    """The lineage of one store's rows (module docstring).

    Args:
        arena_rows: ring positions (the store's capacity plus its spare chunk).
        version: returns the store's current policy version.
        row_version: returns the rows' own `policy_version` at ring positions, or None when the schema has none
            (then the store's version is recorded at each commit).
        live: returns the store's live seq range `(lo, hi)` (for `restamp_written` and `load_state`, which turn
            the run records of live rows back into per-row records); None: every run recorded is taken as live.
        version_view: a live one-element view of the store's version (`view[0]` equals `version()`), read by the
            one-row hook without a call; None: `version()` is called.
    """

    def __init__(self, arena_rows: int, version: Callable[[], int],
                 row_version: Callable[[np.ndarray], np.ndarray] | None = None,
                 live: Callable[[], tuple[int, int]] | None = None, version_view: Any = None) -> None:
        self.arena_rows = int(arena_rows)
        self.names = identity.NAMES
        self._version = version
        self._row_version = row_version
        self._live = live
        self._version_view = version_view
        # run records of batches (module docstring): a ring, `runs` recorded so far
        self.run_cap = self.arena_rows // MIN_RUN + 2
        self.run_seq = np.full(self.run_cap, -1, dtype=np.int64)
        self.run_rows = np.zeros(self.run_cap, dtype=np.int64)
        self.run_writer = np.zeros(self.run_cap, dtype=np.int32)
        self.run_at = np.zeros(self.run_cap, dtype=np.float64)
        self.runs = 0
        self._rsv: Any = self.run_seq.data
        self._rnv: Any = self.run_rows.data
        self._rwv: Any = self.run_writer.data
        self._rtv: Any = self.run_at.data
        # filled (not np.zeros' untouched pages): the first write of each page would fault on the commit path
        self.writer = np.full(self.arena_rows, 0, dtype=np.int32)
        self.written_at = np.full(self.arena_rows, 0.0, dtype=np.float64)
        self.version = np.full(self.arena_rows, 0, dtype=np.int64)
        self._wv: Any = self.writer.data  # scalar stores for the one-row commit (append)
        self._tv: Any = self.written_at.data
        self._vv: Any = self.version.data
        self.tasks: dict[str, _TaskRecord] = {}
        self.one = self._one_row()
        #: (writer codes, write times) as memoryviews when one row's record is just those two scalars (its version
        #: is read from the row itself): a one-row commit may store `STAMP_WRITER()` and `STAMP_CLOCK()` at the
        #: row's position itself instead of calling `one` (the append path: a call is ~1% of an append). None:
        #: the record has more (a version stamp), call `one`.
        self.stamp: tuple[Any, Any] | None = (self._wv, self._tv) if self._row_version is not None else None

    def _one_row(self) -> Callable[[int], None]:
        """`wrote` for one row at an int position, as a closure over its arrays (the append path: no attribute
        lookups)."""
        wv, tv, vv, who, now, version = self._wv, self._tv, self._vv, identity.CURRENT.get, _now, self._version
        cur = self._version_view
        if self._row_version is not None:
            def one(pos: int) -> None:
                wv[pos] = who()
                tv[pos] = now()
        elif cur is not None:
            def one(pos: int) -> None:
                wv[pos] = who()
                tv[pos] = now()
                vv[pos] = cur[0]
        else:
            def one(pos: int) -> None:
                wv[pos] = who()
                tv[pos] = now()
                vv[pos] = version()
        return one

    @property
    def nbytes(self) -> int:
        """Bytes the records take (module docstring)."""
        return self.arena_rows * (ROW_BYTES + TASK_BYTES * len(self.tasks)) + self.run_cap * RUN_BYTES

    # ------------------------------------------------------------------ hooks (under the store's state lock)
    def wrote(self, pos: Any, first: int | None = None) -> None:
        """Rows were committed at ring positions `pos` (an int for one row, else an array) by `identity.current()`;
        `first`: when given, the rows are one batch of consecutive seqs from `first` on (what a writer's batch is).

        One row costs a context-variable read, a clock read and two or three scalar stores; a batch of `MIN_RUN`
        rows or more with its `first` seq one run record (plus one slice of versions when the rows have no version
        of their own); a shorter batch slices."""
        if pos.__class__ is int:
            self.one(pos)
            return
        n = len(pos)
        if first is not None and n >= MIN_RUN:
            i = self.runs % self.run_cap
            self._rsv[i] = first
            self._rnv[i] = n
            self._rwv[i] = identity.CURRENT.get()
            self._rtv[i] = _now()
            self.runs += 1
            if self._row_version is not None:
                return
        elif not n:
            return
        code = identity.CURRENT.get()
        p0 = int(pos[0])
        if int(pos[-1]) == p0 + n - 1:  # one contiguous run of positions (no wrap): slices, not fancy indexing
            pos = slice(p0, p0 + n)
        if first is None or n < MIN_RUN:  # (a run has them)
            self.writer[pos] = code
            self.written_at[pos] = _now()
        if self._row_version is None:
            self.version[pos] = self._version()

    def consumed(self, task: str, seqs: np.ndarray, outcome: int = DELIVERED) -> None:
        """Task `task` took the rows `seqs` now (`outcome`: DELIVERED, ACKED for a leased delivery acknowledged now,
        or STALE for rows dropped as stale)."""
        if not len(seqs):
            return
        t = self.tasks.get(task)
        if t is None:
            t = self.tasks[task] = _TaskRecord(self.arena_rows)
        pos = seqs % self.arena_rows  # (rows of whole groups need not be in order: no slices here)
        staleness = self._version() - self._versions(pos)
        t.seq[pos] = seqs
        t.at[pos] = _now()
        t.consumer[pos] = identity.CURRENT.get()
        t.staleness[pos] = staleness
        t.outcome[pos] = outcome
        if outcome != STALE:
            t.delivered += len(seqs)
            t.pending.append(staleness)  # counted in bulk (`fold`): a consume pays a list append
            if len(t.pending) >= 256:
                t.fold()
        else:
            t.stale += len(seqs)

    # ------------------------------------------------------------------ replay (a journal puts recorded facts back)
    def restamp_written(self, pos: Any, writer: str, at: float) -> None:
        """Replay: the rows at ring positions `pos` were written by `writer` at Unix time `at` (not by whoever
        replays them now). A journal records both per batch and calls this after replaying the batch, under the
        store's state lock."""
        self._flatten()
        self.writer[pos] = self.names.code(writer)
        self.written_at[pos] = float(at)

    def restamp_consumed(self, task: str, seqs: np.ndarray, consumer: str, at: float) -> None:
        """Replay: task `task` took rows `seqs` at `at`, by `consumer` (after `consumed` recorded the replay; under
        the store's state lock)."""
        t = self.tasks.get(task)
        if t is None or not len(seqs):
            return
        pos = np.asarray(seqs, dtype=np.int64) % self.arena_rows
        mine = t.seq[pos] == seqs
        t.consumer[pos[mine]] = self.names.code(consumer)
        t.at[pos[mine]] = float(at)

    def add_task(self, task: str) -> None:
        """Declare `task` (its records start empty)."""
        if task not in self.tasks:
            self.tasks[task] = _TaskRecord(self.arena_rows)

    def _flatten(self) -> None:
        """Turn the run records of live rows into per-row records and drop every run (before per-row records are
        put back: `restamp_written`, `load_state`). Rows of the live range only: a run's evicted rows' positions
        may hold newer rows."""
        h = self.runs
        if not h:
            return
        lo, hi = self._live() if self._live is not None else (-1, 1 << 62)
        lo = max(lo, hi - self.arena_rows)
        for j in range(max(0, h - self.run_cap), h):  # oldest first
            i = j % self.run_cap
            s0, s1 = max(int(self.run_seq[i]), lo), min(int(self.run_seq[i] + self.run_rows[i]), hi)
            if s1 > s0:
                p = np.arange(s0, s1, dtype=np.int64) % self.arena_rows
                self.writer[p] = self.run_writer[i]
                self.written_at[p] = self.run_at[i]
        self.run_seq[:] = -1
        self.run_rows[:] = 0
        self.runs = 0

    def _stamps(self, seqs: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Writer codes and write times of the rows `seqs` at positions `pos`: from their run, else per row."""
        writer = self.writer[pos]
        at = self.written_at[pos]
        h = self.runs
        if h and len(seqs):
            order = np.arange(max(0, h - self.run_cap), h, dtype=np.int64) % self.run_cap  # oldest first
            first = self.run_seq[order]
            i = np.searchsorted(first, seqs, side="right") - 1
            j = order[np.maximum(i, 0)]
            mine = (i >= 0) & (seqs < self.run_seq[j] + self.run_rows[j])
            writer[mine] = self.run_writer[j[mine]]
            at[mine] = self.run_at[j[mine]]
        return writer, at

    def _versions(self, pos: Any) -> np.ndarray:
        if self._row_version is not None:
            return np.asarray(self._row_version(pos), dtype=np.int64)
        return self.version[pos]

    # ------------------------------------------------------------------ reading
    def counters(self) -> dict[str, dict[str, Any]]:
        """Per task: rows `delivered`, rows dropped as `stale`, and `staleness` (counts at delivery, index =
        staleness, the last entry counting MAX_STALENESS_BUCKET and more). Call under the store's state lock."""
        for t in self.tasks.values():
            t.fold()
        return {task: {"delivered": t.delivered, "stale": t.stale, "staleness": t.hist.tolist()}
                for task, t in self.tasks.items()}

    def table(self, seqs: np.ndarray, tasks: list[str] | None = None) -> pa.Table:
        """The lineage of the live rows `seqs` (call under the store's state lock): see the module docstring."""
        seqs = np.asarray(seqs, dtype=np.int64)
        pos = seqs % self.arena_rows
        names = np.array(self.names.names(), dtype=object)
        codes, at0 = self._stamps(seqs, pos)
        writer = names[codes]
        written = (at0 * 1e6).astype("datetime64[us]")
        version = self._versions(pos)
        tasks = list(self.tasks) if tasks is None else tasks
        if not tasks:
            n = len(seqs)
            none = pa.nulls(n)
            return pa.table([pa.array(seqs), pa.array(writer, pa.string()), pa.array(written, SCHEMA[2].type),
                             pa.array(version), none.cast(pa.string()), none.cast(SCHEMA[5].type),
                             none.cast(pa.string()), none.cast(pa.int64()), none.cast(pa.string())], schema=SCHEMA)
        parts = []
        for task in tasks:
            t = self.tasks.get(task) or _TaskRecord(0)
            if len(t.seq):
                took = t.seq[pos] == seqs
                at = np.where(took, t.at[pos], 0.0)
                who = np.where(took, t.consumer[pos], 0)
                stale = t.staleness[pos].astype(np.int64)
                out = t.outcome[pos]
            else:
                took = np.zeros(len(seqs), dtype=bool)
                at = np.zeros(len(seqs))
                who = np.zeros(len(seqs), dtype=np.int32)
                stale = np.zeros(len(seqs), dtype=np.int64)
                out = np.zeros(len(seqs), dtype=np.int8)
            miss = ~took
            outcome = np.array([OUTCOMES.get(int(o), None) for o in out], dtype=object) if len(out) else \
                np.zeros(0, dtype=object)
            parts.append(pa.table([
                pa.array(seqs), pa.array(writer, pa.string()), pa.array(written, SCHEMA[2].type), pa.array(version),
                pa.array([task] * len(seqs), pa.string()),
                pa.array((at * 1e6).astype("datetime64[us]"), SCHEMA[5].type, mask=miss),
                pa.array(names[who], pa.string(), mask=miss), pa.array(stale, pa.int64(), mask=miss),
                pa.array(outcome, pa.string(), mask=miss)], schema=SCHEMA))
        return pa.concat_tables(parts)

    # ------------------------------------------------------------------ checkpoints (arrowbuf.persist)
    def state(self, seqs: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """What a checkpoint keeps for the live rows `seqs` (under the state lock): JSON-able metadata (names,
        tasks, counters) and arrays per row."""
        pos = seqs % self.arena_rows
        everyone = self.names.names()
        used: dict[int, int] = {}  # process code -> code in the checkpoint's own name list

        def local(codes: np.ndarray) -> np.ndarray:
            uniq, inv = np.unique(codes, return_inverse=True)
            for c in uniq.tolist():
                used.setdefault(int(c), len(used))
            return np.array([used[int(c)] for c in uniq.tolist()], dtype=np.int32)[inv].reshape(-1)

        codes, at = self._stamps(seqs, pos)
        arrays: dict[str, np.ndarray] = {"writer": local(codes), "written_at": at, "version": self.version[pos]}
        tasks = list(self.tasks)
        for i, task in enumerate(tasks):
            t = self.tasks[task]
            arrays[f"t{i}.took"] = t.seq[pos] == seqs
            arrays[f"t{i}.at"] = t.at[pos]
            arrays[f"t{i}.consumer"] = local(t.consumer[pos])
            arrays[f"t{i}.staleness"] = t.staleness[pos]
            arrays[f"t{i}.outcome"] = t.outcome[pos]
        names = [""] * len(used)
        for c, i in used.items():
            names[i] = everyone[c]
        meta = {"names": names, "tasks": tasks, "counters": self.counters()}
        return meta, arrays

    def load_state(self, seqs: np.ndarray, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Put back what `state` recorded, for the rows now at `seqs` (a restored store, under its state lock).

        Raises:
            ValueError: the arrays do not match `seqs` or the metadata.
        """
        pos = seqs % self.arena_rows
        names = [str(n) for n in meta.get("names", [])]
        for k, a in arrays.items():
            if len(a) != len(seqs):
                raise ValueError(f"lineage state {k!r} has {len(a)} rows for {len(seqs)}")
        codes = np.asarray(arrays["writer"], dtype=np.int32)
        if len(codes) and (codes.min() < 0 or codes.max() >= len(names)):
            raise ValueError("lineage state names a writer outside its name table")
        remap = np.array([self.names.code(n) for n in names] or [0], dtype=np.int32)  # into this process's table
        self._flatten()  # the restored rows' runs (the restoring writes) give way to the recorded facts
        self.writer[pos] = remap[codes]
        self.written_at[pos] = arrays["written_at"]
        self.version[pos] = arrays["version"]
        counters = meta.get("counters", {})
        for i, task in enumerate(meta.get("tasks", [])):
            t = self.tasks.setdefault(str(task), _TaskRecord(self.arena_rows))
            took = np.asarray(arrays[f"t{i}.took"], dtype=bool)
            who = np.asarray(arrays[f"t{i}.consumer"], dtype=np.int32)
            if len(who) and (who.min() < 0 or who.max() >= len(names)):
                raise ValueError(f"lineage state of task {task!r} names a consumer outside its name table")
            t.seq[pos[took]] = seqs[took]
            t.at[pos] = arrays[f"t{i}.at"]
            t.consumer[pos] = remap[who]
            t.staleness[pos] = arrays[f"t{i}.staleness"]
            t.outcome[pos] = arrays[f"t{i}.outcome"]
            c = counters.get(task, {})
            t.delivered = int(c.get("delivered", 0))
            t.stale = int(c.get("stale", 0))
            hist = np.asarray(c.get("staleness", []), dtype=np.int64)[: MAX_STALENESS_BUCKET + 1]
            t.hist[: len(hist)] = hist


def write_table(table: pa.Table, path: Any, format: str = "parquet") -> str:
    """Write a lineage table as a Parquet (or, `format="arrow"`, Arrow IPC) file at `path`; returns the path.
    (`store.export` puts it in the export's metadata folder: `arrowbuf.persist.datasets.lineage_path`.)"""
    import os

    path = os.fspath(path)
    if format == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, path)
    else:
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
    return path


def for_core(core: Any, version: Callable[[], int], tasks: list[str], version_view: Any = None) -> Lineage:
    """The `Lineage` of a store's internals (`StoreCore`): the rows' own `policy_version` when the schema has an
    integer one, else the store's `version()` at each commit (`version_view`: see `Lineage`); `tasks` declared."""
    spec = core.schema.fields.get("policy_version")
    row_version = None
    if spec is not None and not spec.shape and not spec.ragged and spec.plain and spec.dtype.kind in "iu":
        def row_version(pos: Any) -> np.ndarray:
            return np.asarray(core.cols.column("policy_version")[pos])

    idx = core.index
    lineage = Lineage(core.arena_rows, version, row_version, live=lambda: (idx.lo, idx.hi), version_view=version_view)
    for t in tasks:
        lineage.add_task(t)
    return lineage


def live_table(core: Any, tasks: list[str]) -> pa.Table:
    """The lineage table of a store's live rows (takes its state lock).

    Raises:
        InvalidArgument: the store records no lineage.
    """
    from ..errors import InvalidArgument

    if core.lineage is None:
        raise InvalidArgument(f"store {core.name!r} records no lineage (created with observe=False, or a "
                              "shared-memory store); create it with observe=True")
    with core.lock:
        idx = core.index
        seqs = np.arange(idx.lo, idx.hi, dtype=np.int64)
        seqs = seqs[idx.seq[seqs % core.arena_rows] == seqs]
        table: pa.Table = core.lineage.table(seqs, tasks)
        return table
