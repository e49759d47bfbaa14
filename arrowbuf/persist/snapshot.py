"""The consistent part of a checkpoint: what is copied while the store's locks are held, and the chunk reader.

`capture(core)` holds the store's write lock (so no batch is half-applied: rows, episode streams and ids agree)
and its state lock (commits and sampling wait) for a short, bounded copy of:

- the live range `[lo, hi)`, the header counters (inserts, samples: what the rate limiter decides on);
- per live row its index entries (episode id, step, successor, sampleable) and times sampled;
- the sampler's state of those rows (priorities of both trees, the max priority, FIFO cursor ...);
- consumption per task of those rows, the policy version and the consume counters (`ConsumeTracker.state`);
- the final observations live rows point to; the open tail chunk's rows; the episode streams; the RNG state.

Sealed chunks are not copied here: they are immutable until the ring evicts them, so `read_chunk` reads them
afterwards, without any lock, and then checks each row's seq (a seqlock: a writer sets a row's seq to -1 before it
overwrites it, and the seq never comes back). A chunk whose rows were overwritten while it was read fails that check
and is not used (`intact_from`: a writer overwrites a chunk oldest row first, so the rows still intact are the
chunk's newest; `arrowbuf.persist.checkpoint` keeps them and the snapshot starts there). A torn row is never
written.
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from ..engine.core import StoreCore
from ..ring.reservations import HOLE
from ..samplers import Sampler
from ..schema import jsonvalues as _json
from ..schema.convert import tensor_to_numpy
from ..schema.dtypes import LogicalType, to_arrow, to_physical, wrap_list


@dataclass
class Snapshot:
    """What `capture` copied at the snapshot point (rows are addressed by seq; arrays are in seq order)."""

    lo: int
    hi: int
    header: np.ndarray
    chunks: list[tuple[int, int, int, int]]          # (slot, p0, p1, first_seq) of the live range, oldest first
    sealed: list[bool]
    index: dict[str, np.ndarray]                     # next_pos, valid, [times_sampled] per live row
    sampler_meta: dict[str, Any]
    sampler_arrays: dict[str, np.ndarray]            # per live row
    final: dict[str, Any]                            # slot, owner (seq), and the source columns' rows
    episodes: dict[str, Any]
    rng: dict[str, Any]
    tail: dict[str, Any] = field(default_factory=dict)    # column -> rows of the open chunk (copied)
    ragged: dict[str, list[pa.Array]] = field(default_factory=dict)
    later: dict[str, list[pa.Array]] = field(default_factory=dict)  # later field -> per live chunk (nulls: absent)
    episode_id: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    consume_meta: dict[str, Any] | None = None                # tasks, policy version, counters (None: no tracker)
    consume_arrays: dict[str, np.ndarray] = field(default_factory=dict)  # task -> consumed, per live row
    step: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    lineage_meta: dict[str, Any] | None = None                # names, tasks, counters (None: no lineage recorded)
    lineage_arrays: dict[str, np.ndarray] = field(default_factory=dict)  # per live row (arrowbuf.observe.lineage)


def capture(core: StoreCore) -> Snapshot:
    """Copy the consistent state of a store (see the module docstring); holds its locks for the copy only."""
    with core.write_lock:
        return capture_held(core)


def capture_held(core: StoreCore, journaled: bool = False) -> Snapshot:
    """`capture` by a caller that holds the store's write lock already (a durable store cuts its journal under it,
    at the same point; `journaled`: the consumption of a batch still being gathered is in that journal, before the
    cut, so the snapshot records it as consumed: `ConsumeRecord.state`)."""
    with core.lock:
        idx = core.index
        lo, hi = idx.lo, idx.hi
        pos = np.arange(lo, hi, dtype=np.int64) % core.arena_rows
        chunks = core.directory.live_chunks(lo, hi)
        sealed = [bool(core.directory.is_sealed(c, hi)) for c in chunks]
        index = {"next_pos": idx.next_pos[pos], "valid": idx.valid[pos]}
        if idx.counter("holes"):  # seqs a dead writer's reservation left without a row (tiers/reservations.py)
            index["hole"] = idx.seq[pos] == HOLE
        if len(core.times_sampled):
            index["times_sampled"] = core.times_sampled[pos]
        meta, arrays = sampler_state(core.sampler, pos)
        snap = Snapshot(lo=lo, hi=hi, header=idx.header.copy(), chunks=chunks, sealed=sealed, index=index,
                        sampler_meta=meta, sampler_arrays=arrays, final=_final_state(core, pos, lo),
                        episodes=core.episodes.state(), rng=copy.deepcopy(dict(core.rng.bit_generator.state)),
                        episode_id=idx.episode_id[pos], step=idx.step[pos])
        snap.ragged = core.cols.ragged_snapshot()
        if core.consume is not None:  # under the state lock: what consumers marked at the snapshot point
            snap.consume_meta, snap.consume_arrays = core.consume.state(np.arange(lo, hi, dtype=np.int64), journaled)
        if core.lineage is not None:  # who wrote and consumed the rows (arrowbuf.observe.lineage)
            snap.lineage_meta, snap.lineage_arrays = core.lineage.state(np.arange(lo, hi, dtype=np.int64))
        # fields filled later change in sealed chunks too (`store.update`): copied now, with their presence
        snap.later = {f.name: [core.cols.snapshot_later(f.name, p0, p1) for _, p0, p1, _ in chunks]
                      for f in core.schema.fields.values() if f.later and not f.ragged}
        if chunks and not sealed[-1]:  # the open tail: committed rows that later writes leave alone, copied now
            _, p0, p1, _ = chunks[-1]
            snap.tail = {f.name: np.array(core.cols.view(f.name, p0, p1))
                         for f in core.schema.fields.values() if not f.ragged and f.name not in snap.later}
    return snap


def _final_state(core: StoreCore, pos: np.ndarray, lo: int) -> dict[str, Any]:
    """The final observations that live rows point to (slot, owning seq, the rows of each source column)."""
    nxt = core.index.next_pos[pos]
    fin = np.flatnonzero(nxt >= core.arena_rows)
    slots = nxt[fin] - core.arena_rows
    owners = lo + fin
    keep = core.final_owner[slots] == owners
    slots, owners = slots[keep], owners[keep]
    data = {src: np.asarray(core.cols.take_next(src, slots + core.arena_rows))
            for src in core.cols.final_sources} if len(slots) else {}
    return {"slot": slots, "owner": owners, "data": data}


def sampler_state(sampler: Sampler, pos: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A sampler's state for the rows at `pos`: JSON-able scalars and per-row arrays (`Sampler.state`).

    Raises:
        InvalidArgument: a sampler that does not say (its state could not be restored).
    """
    meta, arrays = sampler.state(pos)
    return meta, arrays


def restore_sampler_state(sampler: Sampler, pos: np.ndarray, meta: dict[str, Any], arrays: dict[str, np.ndarray],
                          dropped_valid: int = 0) -> None:
    """Put back what `sampler_state` recorded, for the rows now at `pos` (a fresh store's sampler)."""
    sampler.load_state(pos, meta, arrays, dropped_valid)


def arrow_column(values: np.ndarray | pa.Array, arrow_type: pa.DataType) -> pa.Array:
    """A numpy column (rows first) as the Arrow array of the stored column's type; a json column's bytes (the
    ring's `list<uint8>`) as `arrow.json`."""
    if isinstance(arrow_type, LogicalType):  # bfloat16, float8, complex (arrowbuf.schema.dtypes)
        return to_arrow(arrow_type, values)
    if isinstance(arrow_type, pa.JsonType):
        return _json.to_arrow(values)
    if pa.types.is_list(arrow_type) and isinstance(arrow_type.value_type, LogicalType):  # a ragged bfloat16 field
        return wrap_list(arrow_type.value_type.dtype_name, values)
    if isinstance(values, pa.Array):
        return values
    if isinstance(arrow_type, pa.FixedShapeTensorType):
        return tensor_array(values)
    return pa.array(values, type=arrow_type)


def tensor_array(values: np.ndarray) -> pa.Array:
    """Rows of a [n, *shape] array as a fixed-shape tensor array, zero-copy for a C-contiguous array (built from
    its storage: pyarrow's `from_numpy_ndarray` costs far more per call, and refuses n == 0)."""
    values = np.ascontiguousarray(values)
    shape = list(values.shape[1:])
    value_type = pa.from_numpy_dtype(values.dtype)
    storage = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), type=value_type),
                                                int(np.prod(shape)))
    return pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(value_type, shape), storage)


def numpy_column(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """An Arrow column of a row file as numpy (tensors [rows, *shape])."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if isinstance(array.type, LogicalType):
        return to_physical(array)
    if isinstance(array.type, pa.FixedShapeTensorType):
        if len(array) == 0:
            return np.empty((0, *array.type.shape), dtype=array.type.value_type.to_pandas_dtype())
        return np.asarray(tensor_to_numpy(array))
    return np.asarray(array.to_numpy(zero_copy_only=False))


def read_chunk(core: StoreCore, snap: Snapshot, i: int, schema: pa.Schema) -> pa.RecordBatch:
    """The rows of live chunk `i` as a record batch (zero-copy views where the tier allows: the caller must
    serialise it, then call `intact_from`)."""
    slot, p0, p1, first = snap.chunks[i]
    n = p1 - p0
    off = first - snap.lo
    arrays = []
    for f in schema:
        name = f.name
        if name in snap.later:
            arrays.append(snap.later[name][i])
        elif name in snap.tail and i == len(snap.chunks) - 1 and not snap.sealed[i]:
            arrays.append(arrow_column(snap.tail[name], f.type))
        elif name in snap.ragged:
            arrays.append(arrow_column(snap.ragged[name][slot].slice(p0 - slot * core.chunk_rows, n), f.type))
        elif name == "seq":
            arrays.append(pa.array(np.arange(first, first + n, dtype=np.int64)))
        elif name == "episode_id":
            arrays.append(pa.array(snap.episode_id[off:off + n]))
        elif name == "step":
            arrays.append(pa.array(snap.step[off:off + n]))
        else:
            arrays.append(arrow_column(core.cols.view(name, p0, p1), f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def later_columns(core: StoreCore, snap: Snapshot, i: int) -> dict[str, pa.Array]:
    """The columns of live chunk `i` that `store.update` may still change (fields filled later), as captured."""
    slot, p0, p1, _ = snap.chunks[i]
    out = {name: arrays[i] for name, arrays in snap.later.items()}
    for f in core.schema.fields.values():
        if f.later and f.ragged:
            out[f.name] = snap.ragged[f.name][slot].slice(p0 - slot * core.chunk_rows, p1 - p0)
    return out


def later_digest(columns: dict[str, Any]) -> str | None:
    """A checksum of the values and presence of a chunk's later fields (None without any), the same for the same
    content however it is laid out in memory: a chunk file is reused only while its later fields are unchanged."""
    if not columns:
        return None
    crc = 0
    for name in sorted(columns):
        a = columns[name]
        if isinstance(a, pa.ChunkedArray):
            a = a.combine_chunks()
        if isinstance(a.type, pa.JsonType):  # as the ring holds it (list<uint8>): the same digest either way
            a = _json.to_physical(a)
        valid = np.asarray(a.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        crc = zlib.crc32(valid.tobytes(), zlib.crc32(name.encode(), crc))
        given = a.filter(pa.array(valid))
        if isinstance(given, pa.ExtensionArray):
            given = given.storage
        if pa.types.is_list(given.type) or pa.types.is_large_list(given.type) or \
                pa.types.is_fixed_size_list(given.type):
            if not pa.types.is_fixed_size_list(given.type):
                crc = zlib.crc32(np.asarray(given.value_lengths().to_numpy(zero_copy_only=False)).tobytes(), crc)
            given = given.flatten()
        crc = zlib.crc32(np.ascontiguousarray(given.to_numpy(zero_copy_only=False)).tobytes(), crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def intact_from(core: StoreCore, snap: Snapshot, i: int) -> int:
    """How many of live chunk `i`'s first rows were overwritten since the snapshot: its rows from there on still
    hold their seqs (or are holes). A writer overwrites a chunk's rows in seq order, oldest first (it sets each seq to
    -1 before it writes the row, and the seq never comes back), so what was overwritten is always a prefix. Called
    before a chunk is read (to skip what is gone) and after it was serialised (a seqlock: the rows from the
    returned offset on were not touched while they were read)."""
    _, p0, p1, first = snap.chunks[i]
    now = core.index.seq[p0:p1]
    ok = now == np.arange(first, first + p1 - p0, dtype=np.int64)
    hole = snap.index.get("hole")
    if hole is not None:  # a hole at the snapshot point stays one until its position is reused
        off = first - snap.lo
        ok |= (now == HOLE) & hole[off:off + p1 - p0]
    bad = np.flatnonzero(~ok)
    return 0 if not len(bad) else int(bad[-1]) + 1
