"""What a durable store's journal records hold, and replaying them onto a restored store.

A record's payload is Arrow (module `journal`): a batch's rows are the validated input columns as an Arrow IPC
stream (fields, derived fields given on episode ends, stream keys); an update's are `seq` plus the updated fields;
priorities are `seq` and `priority`; consumption is the seqs as little-endian int64. For the lineage, a batch's
meta names its writer and the time it was recorded (`w`, `t`: Unix microseconds), a consumption's its consumer,
time and lineage outcome (`c`, `t`, `o`: 1 delivered, 3 acked); replay puts them back (`restamp_written`,
`restamp_consumed`), so a restored store does not show the restoring process as the writer and consumer of the
replayed rows. Records without them (older journals) replay as before.

`replay(records, target)` applies the records after the checkpoint in journal order onto `target` (a
`ReplayTarget`: the restored store's internals, with the journal and the eviction hold off). Rules that make it
exact:

- A batch record names its first seq: one the checkpoint already holds is skipped; a gap before it (seqs issued to a
  batch whose record never made it: a writer killed mid-batch, or an aborted copy) becomes holes, so the batch gets
  its own seqs back and the skipped ones never name another row. A batch with an `aborted` record (recorded at its
  reservation, then its copy failed: the writer raised) becomes holes too. At the end, seqs issued (`issued`
  records) beyond the last batch become holes too.
- Updates, priorities and consumption of rows whose batch record comes later in the journal (a batch recorded
  outside the writer's reservation, after its commit: another thread may log a change to its rows first) wait until
  the batch is applied.
  Re-applying any of them is harmless (they set values), so a record the checkpoint already covers may be replayed.
- Bulk: consecutive batch records with consecutive seqs and nothing between them (no other record, no aborted batch)
  are applied as one extend (at most `BULK_ROWS` rows and `BULK_BYTES` bytes of payload, records of at most
  `BULK_RECORD_BYTES` each: a big record goes alone, its copy already dominates the per-call cost). The store that
  results is the same as applying them one by one (`tests/persist/test_journal_bulk.py`): the rows, seqs, episodes
  and every later record apply to the same state; only the per-call work (validation, reservation, episode
  planning) is paid once per run instead of once per record.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from ..errors import StoreCorrupt
from ..observe.meter import ProgressSink
from ..schema import dtypes as _dtypes
from .journal import Record, payload_table
from .snapshot import tensor_array


class ReplayTarget(Protocol):
    """What replay drives: a restored store's write paths without journaling or eviction holds."""

    def next_seq(self) -> int: ...
    def apply_batch(self, table: pa.Table) -> np.ndarray: ...
    def skip(self, n: int) -> None: ...
    def apply_update(self, seqs: np.ndarray, values: dict[str, Any]) -> None: ...
    def apply_priorities(self, seqs: np.ndarray, priorities: np.ndarray) -> None: ...
    def apply_task(self, name: str) -> None: ...
    def apply_policy_version(self, value: int) -> None: ...
    def apply_consumed(self, task: str, seqs: np.ndarray) -> None: ...
    def apply_end_episode(self, actor: Any, final: dict[str, Any]) -> None: ...
    def restamp_written(self, first: int, n: int, writer: str, at: float) -> None: ...
    def restamp_consumed(self, task: str, seqs: np.ndarray, consumer: str, at: float, outcome: int) -> None: ...


def column_array(col: Any) -> pa.Array:
    """A validated column (`ExperienceSchema.validate_batch`) as an Arrow array: numpy -> plain or fixed-shape
    tensor arrays (zero-copy), masked arrays -> arrays with nulls, Arrow arrays as they are."""
    if isinstance(col, (pa.Array, pa.ChunkedArray)):
        return col
    if np.ma.getdata(col).dtype.kind == "c":  # Arrow has no complex type: arrowbuf's (arrowbuf.schema.dtypes)
        return _complex_array(col)
    if isinstance(col, np.ma.MaskedArray):
        data = np.ascontiguousarray(np.ma.getdata(col))
        m = np.asarray(np.ma.getmaskarray(col), dtype=bool)
        rows = m.reshape(len(m), -1).any(axis=1) if m.ndim > 1 else m
        if data.ndim > 1:
            storage = pa.FixedSizeListArray.from_arrays(pa.array(data.reshape(-1)), int(np.prod(data.shape[1:])),
                                                        mask=pa.array(rows))
            return pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(storage.type.value_type,
                                                                        list(data.shape[1:])), storage)
        return pa.array(data, mask=rows)
    arr = np.asarray(col)
    if arr.ndim > 1:
        return tensor_array(arr)
    if arr.dtype.kind in "UO":
        return pa.array(arr.tolist())
    return pa.array(arr)


def _complex_array(col: Any) -> pa.Array:
    data = np.ma.getdata(col)
    mask = None
    if isinstance(col, np.ma.MaskedArray):
        m = np.asarray(np.ma.getmaskarray(col), dtype=bool)
        mask = np.asarray(m.reshape(len(m), -1).any(axis=1) if m.ndim > 1 else m, dtype=bool)
    return _dtypes.to_arrow(_dtypes.arrow_type(data.dtype.name, tuple(data.shape[1:])), data, mask)


def columns_table(cols: dict[str, Any]) -> pa.Table:
    """Validated columns as a table (a batch record's payload)."""
    return pa.table({name: column_array(c) for name, c in cols.items()})


def _seqs(payload: bytes) -> np.ndarray:
    return np.frombuffer(payload, dtype="<i8").astype(np.int64)


def _split(seqs: np.ndarray, hi: int) -> tuple[np.ndarray, np.ndarray]:
    now = seqs < hi
    return now, ~now


#: Bulk replay (module docstring): a run of batch records applied as one extend holds at most this many rows ...
BULK_ROWS = 65536
#: ... and this many payload bytes; a record larger than `BULK_RECORD_BYTES` is applied alone. 0 rows: no bulk.
BULK_BYTES = 16 << 20
BULK_RECORD_BYTES = 1 << 20
#: `replay` tells its `progress` every this many records.
PROGRESS_RECORDS = 1024


def _bulk_runs(records: list[Record], aborted: set[int], capacity: int | None) -> dict[int, int]:
    """{index of a run's first record: index after its last} for the runs of >= 2 batch records applied as one
    extend (module docstring). `capacity`: the store's rows (a run never holds more than half of it)."""
    limit = BULK_ROWS if capacity is None else min(BULK_ROWS, max(0, capacity // 2))
    runs: dict[int, int] = {}
    if limit <= 0:
        return runs
    i, n = 0, len(records)
    while i < n:
        start = i
        rows = nbytes = 0
        expect = None
        while i < n:
            r = records[i]
            if r.kind != "batch":
                break
            try:
                first, k = int(r.meta["first"]), int(r.meta["n"])
            except (KeyError, TypeError, ValueError):
                break
            size = len(r.payload)
            if (first in aborted or size > BULK_RECORD_BYTES or (expect is not None and first != expect)
                    or rows + k > limit or nbytes + size > BULK_BYTES):
                break
            rows, nbytes, expect = rows + k, nbytes + size, first + k
            i += 1
        if i - start >= 2:
            runs[start] = i
        if i == start:
            i += 1
    return runs


def replay(records: list[Record], target: ReplayTarget, where: str, capacity: int | None = None,
           progress: ProgressSink | None = None) -> dict[str, int]:
    """Apply `records` (checked, in journal order) onto `target`; returns counts per kind. `capacity`: the store's
    rows (bounds a bulk run; None: `BULK_ROWS` alone). `progress` hears the records applied (phase
    "journal: replay", every `PROGRESS_RECORDS` records and at the end).

    Raises:
        StoreCorrupt: a record that cannot be applied (the message names it and `where`).
    """
    counts: dict[str, int] = {}
    pending: list[tuple[str, np.ndarray, Any]] = []  # (kind, seqs, args) of rows not written yet
    issued = 0
    # batches recorded at their reservation whose copy then failed: their seqs are holes (the writer raised)
    aborted = {int(r.meta["first"]) for r in records if r.kind == "aborted" and isinstance(r.meta.get("first"), int)}

    def apply(kind: str, seqs: np.ndarray, args: Any) -> None:
        if kind == "update":
            target.apply_update(seqs, args)
        elif kind == "priorities":
            target.apply_priorities(seqs, args)
        else:
            task, consumer, at, outcome = args
            target.apply_consumed(task, seqs)
            if consumer is not None:
                target.restamp_consumed(task, seqs, consumer, at, outcome)

    def restamp(rec: Record) -> None:
        """Put back who wrote a replayed batch and when (journals before lineage was recorded: nothing)."""
        who, at = rec.meta.get("w"), rec.meta.get("t")
        if isinstance(who, str) and isinstance(at, int):
            target.restamp_written(int(rec.meta["first"]), int(rec.meta["n"]), who, at / 1e6)

    def take(kind: str, seqs: np.ndarray, args: Any, select: Any) -> None:
        hi = target.next_seq()
        now, later = _split(seqs, hi)
        if now.any():
            apply(kind, seqs[now], select(args, now))
        if later.any():
            pending.append((kind, seqs[later], select(args, later)))

    def flush_pending() -> None:
        if not pending:
            return
        waiting = list(pending)
        pending.clear()
        for kind, seqs, args in waiting:
            take(kind, seqs, args, _select)

    runs = _bulk_runs(records, aborted, capacity)
    run_end = -1  # records before this index were applied with their run
    if progress is not None:
        progress("journal: replay", 0, len(records), "record")
    for i, r in enumerate(records):
        if progress is not None and i % PROGRESS_RECORDS == 0:
            progress("journal: replay", i, len(records), "record")
        if i < run_end:
            counts["batch"] = counts.get("batch", 0) + 1
            continue
        try:
            tables = _run_tables(records[i:runs[i]]) if i in runs and int(r.meta["first"]) >= target.next_seq() \
                else None
            if tables is not None:
                end = runs[i]
                first = int(r.meta["first"])
                n = sum(int(x.meta["n"]) for x in records[i:end])
                issued = max(issued, first + n)
                target.skip(first - target.next_seq())
                ids = target.apply_batch(pa.concat_tables(tables, promote_options="none"))
                if len(ids) != n or int(ids[0]) != first:
                    raise StoreCorrupt(f"{where}: batch records {r.lsn}..{records[end - 1].lsn} replayed as seqs "
                                       f"{ids[:1]}.. ({len(ids)} rows), the journal says {first}.. ({n} rows)")
                for x in records[i:end]:
                    restamp(x)
                flush_pending()
                run_end = end
                counts["batch"] = counts.get("batch", 0) + 1
                counts["bulk_runs"] = counts.get("bulk_runs", 0) + 1
                continue
            if r.kind == "issued":
                issued = max(issued, int(r.meta["next"]))
            elif r.kind == "aborted":
                pass  # applied with its batch record (`aborted`, above)
            elif r.kind == "batch":
                first, n = int(r.meta["first"]), int(r.meta["n"])
                issued = max(issued, first + n)
                hi = target.next_seq()
                if first + n <= hi:
                    continue  # the checkpoint holds it
                if first < hi:
                    raise StoreCorrupt(f"{where}: batch record {r.lsn} starts at seq {first}, inside the rows "
                                       f"already restored (up to {hi})")
                if first in aborted:
                    target.skip(first + n - hi)  # recorded, never stored: holes, as in the live store
                    continue
                target.skip(first - hi)
                ids = target.apply_batch(payload_table(r.payload))
                if len(ids) != n or (n and int(ids[0]) != first):
                    raise StoreCorrupt(f"{where}: batch record {r.lsn} replayed as seqs {ids[:1]}.. ({len(ids)} "
                                       f"rows), the journal says {first}.. ({n} rows)")
                restamp(r)
                flush_pending()
            elif r.kind == "update":
                t = payload_table(r.payload)
                seqs = np.asarray(t.column("seq").to_numpy(), dtype=np.int64)
                values = {name: t.column(name).combine_chunks() for name in t.column_names if name != "seq"}
                take("update", seqs, values, _select)
            elif r.kind == "priorities":
                t = payload_table(r.payload)
                take("priorities", np.asarray(t.column("seq").to_numpy(), dtype=np.int64),
                     np.asarray(t.column("priority").to_numpy(), dtype=np.float64), _select)
            elif r.kind == "consumed":
                consumer, at, outcome = r.meta.get("c"), r.meta.get("t"), r.meta.get("o")
                ok = isinstance(consumer, str) and isinstance(at, int) and outcome in (1, 3)
                seconds = at / 1e6 if isinstance(at, int) else 0.0
                who = (str(r.meta["task"]), consumer if ok else None, seconds, outcome)
                take("consumed", _seqs(r.payload), who, _select)
            elif r.kind == "task":
                target.apply_task(str(r.meta["name"]))
            elif r.kind == "policy_version":
                target.apply_policy_version(int(r.meta["value"]))
            elif r.kind == "end_episode":
                t = payload_table(r.payload) if r.payload else pa.table({})
                final = {name: t.column(name).to_numpy(zero_copy_only=False)[0] for name in t.column_names}
                for name, col in ((n, t.column(n)) for n in t.column_names):
                    if isinstance(col.type, pa.FixedShapeTensorType):
                        final[name] = np.asarray(col.combine_chunks().to_numpy_ndarray())[0]
                target.apply_end_episode(r.meta.get("actor"), final)
            else:
                raise StoreCorrupt(f"{where}: record {r.lsn} has an unknown kind {r.kind!r}")
        except (KeyError, TypeError, ValueError, pa.ArrowInvalid) as exc:
            raise StoreCorrupt(f"{where}: record {r.lsn} ({r.kind}) cannot be replayed: {str(exc)[:300]}") from None
        counts[r.kind] = counts.get(r.kind, 0) + 1
    hi = target.next_seq()
    if issued > hi:  # seqs a writer reserved before the crash whose batch never made it to the journal
        target.skip(issued - hi)
        counts["skipped_seqs"] = issued - hi
    flush_pending()  # rows that exist now; what is still pending names rows that never came (nothing to apply)
    if progress is not None:
        progress("journal: replay", len(records), len(records), "record")
    return counts


def _run_tables(run: list[Record]) -> list[pa.Table] | None:
    """The payload tables of a bulk run, or None when their schemas differ (a batch that gave a later field or a
    null where the others did not): then its records are applied one by one."""
    tables = [payload_table(x.payload) for x in run]
    schema = tables[0].schema
    if any(not t.schema.equals(schema, check_metadata=False) for t in tables[1:]):
        return None
    return tables


def _select(args: Any, mask: np.ndarray) -> Any:
    if isinstance(args, dict):
        idx = pa.array(np.flatnonzero(mask))
        return {k: v.take(idx) for k, v in args.items()}
    if isinstance(args, np.ndarray):
        return args[mask]
    return args
