"""Gathers of ragged (Arrow list) columns as the ring stores them: rows of one list array (`take`) or of per-chunk
list arrays (`take_chunked`), one ranged copy each, and the ownership record that lets delivery hand out the values
of a gather result as writable arrays without a copy (`private_values`).

Why gathers go through a ListView: `pc.list_flatten` of a `ListViewArray` built from (starts, lengths) over the
source values copies each row as one contiguous range in C++ (memcpy speed, ~3.9 GB/s here), where Arrow's `take` on a
list column or a numpy gather of per-element indices builds an 8-byte index per value (0.5-0.9 GB/s). Consecutive rows
(FIFO, consume) are served as zero-copy slices.
"""

from __future__ import annotations

import weakref

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import InvalidArgument
from ..schema.convert import arrow_to_numpy, numpy_to_arrow


def one_array(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        return values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
    return values


def _consecutive(rows: np.ndarray) -> bool:
    return rows.size <= 1 or bool(rows[-1] - rows[0] == rows.size - 1 and np.all(np.diff(rows) == 1))


def _ranges(arr: pa.Array, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(starts into arr.values, lengths, validity or None) of `rows` of one list array; null rows get length 0."""
    offs = arrow_to_numpy(arr.offsets)  # length len(arr)+1, already shifted by a slice's offset
    starts = offs[rows].astype(np.int64)
    lens = offs[rows + 1].astype(np.int64) - starts
    valid = None
    if arr.null_count:
        valid = np.asarray(arr.is_valid(), dtype=bool)[rows]
        lens[~valid] = 0
    return starts, lens, valid


def _gather_values(values: pa.Array, starts: np.ndarray, lens: np.ndarray) -> pa.Array:
    """The ranges [starts, starts + lens) of `values`, concatenated in order: one ranged copy in C++."""
    if not starts.size:
        return values.slice(0, 0)
    if int(starts.max(initial=0)) + int(lens.max(initial=0)) < 2**31:
        view = pa.ListViewArray.from_arrays(numpy_to_arrow(starts.astype(np.int32)),
                                            numpy_to_arrow(lens.astype(np.int32)), values)
    else:
        view = pa.LargeListViewArray.from_arrays(numpy_to_arrow(starts), numpy_to_arrow(lens), values)
    return pc.list_flatten(view)


def _assemble(list_type: pa.DataType, values: pa.Array, lens: np.ndarray, valid: np.ndarray | None) -> pa.Array:
    offs = np.zeros(lens.size + 1, dtype=np.int64)
    np.cumsum(lens, out=offs[1:])
    large = pa.types.is_large_list(list_type)
    if not large and offs[-1] >= 2**31:
        raise InvalidArgument(f"a gathered ragged column holds {int(offs[-1])} values, more than a list column's "
                              "int32 offsets address; gather fewer rows per batch")
    cls = pa.LargeListArray if large else pa.ListArray
    offsets = numpy_to_arrow(offs if large else offs.astype(np.int32))
    mask = None if valid is None or valid.all() else numpy_to_arrow(~valid)
    out = cls.from_arrays(offsets, values, type=list_type, mask=mask)
    return out


def take(values: pa.Array | pa.ChunkedArray, rows: npt.ArrayLike) -> pa.Array:
    """Rows `rows` (int positions, any order, repeats allowed) of one list column, as a new list array.

    Consecutive rows are a zero-copy slice; otherwise the row values are copied once, range by range (no per-row
    Python, no per-value index).
    """
    arr = one_array(values)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= len(arr)):
        raise InvalidArgument(f"take: row positions must be in [0, {len(arr)}); got {rows.min()}..{rows.max()}")
    if _consecutive(rows):
        return arr.slice(int(rows[0]) if rows.size else 0, int(rows.size))
    starts, lens, valid = _ranges(arr, rows)
    return own(_assemble(arr.type, _gather_values(arr.values, starts, lens), lens, valid))


def take_chunked(chunks: list[pa.Array], chunk_rows: int, positions: np.ndarray) -> pa.Array:
    """Rows at ring `positions` of a column kept as one list array of `chunk_rows` rows per chunk slot.

    Consecutive positions within one slot are a zero-copy slice. Rows that visit each slot in one run (FIFO across
    chunk boundaries and the ring's wrap) cost one ranged copy (or slice) per slot and one concatenation. Rows
    interleaved across slots (uniform sampling) cost one more ranged copy that puts them in the order asked, or, when
    the batch holds at least as many values as the slots it touches, one sequential copy of those slots and one
    ranged copy (about 30% faster there).
    """
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    if not pos.size:
        return chunks[0].slice(0, 0)
    slot = pos // chunk_rows
    off = pos - slot * chunk_rows
    if slot[0] == slot[-1] and _consecutive(off):
        return chunks[int(slot[0])].slice(int(off[0]), int(pos.size))
    valid = np.ones(pos.size, dtype=bool)
    lens = np.empty(pos.size, dtype=np.int64)
    starts = np.empty(pos.size, dtype=np.int64)
    runs = np.split(np.arange(pos.size), np.flatnonzero(np.diff(slot)) + 1)  # runs of one slot, in row order
    distinct = np.unique(slot)
    blocks = len(runs) == len(distinct)  # each slot's rows are one block of the output (FIFO, even across the wrap)
    if blocks:
        groups = runs
    else:
        order = np.argsort(slot, kind="stable")
        groups = np.split(order, np.flatnonzero(np.diff(slot[order])) + 1)  # one entry per slot touched
    used = [chunks[int(slot[idx[0]])] for idx in groups]
    for idx, arr in zip(groups, used):
        s, ln, v = _ranges(arr, off[idx])
        starts[idx], lens[idx] = s, ln
        if v is not None:
            valid[idx] = v
    list_type = chunks[0].type
    if not blocks and sum(len(a.values) for a in used) <= int(lens.sum()):
        # the batch holds at least as many values as the slots it touches (a large uniform batch): copy the slots'
        # values side by side (sequential) and gather once in the order asked: two copies instead of three
        base = np.zeros(len(used), dtype=np.int64)
        np.cumsum([len(a.values) for a in used[:-1]], out=base[1:])
        for k, idx in enumerate(groups):
            starts[idx] += base[k]
        values = _gather_values(pa.concat_arrays([a.values for a in used]), starts, lens)
        return own(_assemble(list_type, values, lens, valid))
    parts = []
    for idx, arr in zip(groups, used):  # one ranged copy (or a zero-copy slice) per slot touched
        if _consecutive(off[idx]) and not arr.null_count:
            parts.append(arr.values.slice(int(starts[idx[0]]), int(lens[idx].sum())))
        else:
            parts.append(_gather_values(arr.values, starts[idx], lens[idx]))
    if blocks:
        values = parts[0] if len(parts) == 1 else pa.concat_arrays(parts)
        return own(_assemble(list_type, values, lens, valid))
    # interleaved slots: the rows sit in `grouped` in slot order; one more ranged copy puts them in the order asked
    grouped = pa.concat_arrays(parts)
    glens = lens[order]
    gstarts = np.zeros(pos.size, dtype=np.int64)
    np.cumsum(glens[:-1], out=gstarts[1:])
    back = np.empty(pos.size, dtype=np.int64)
    back[order] = gstarts
    return own(_assemble(list_type, _gather_values(grouped, back, lens), lens, valid))


# ---------------------------------------------------------------------------------------------------- ownership
# Gather results whose values buffer this module allocated for them alone (never a view of a store's memory): a
# trainer may get those values as writable arrays without a defensive copy. Keyed by id, checked by identity, and
# forgotten when the array is collected.
_PRIVATE: dict[int, tuple[weakref.ref, np.ndarray | None]] = {}


def own(arr: pa.Array, values: np.ndarray | None = None) -> pa.Array:
    """Record that the values buffer of list array `arr` was allocated for it alone (a gather's fresh output, a
    received Flight message), so `private_values` may hand it out writable. Only for memory no store or other array
    shares. `values`: a writable numpy view of `arr.values` (all of the child array, from its offset) to hand out,
    for memory Arrow marks immutable (a received message) though nothing else sees it."""
    key = id(arr)

    def forget(ref: weakref.ref, key: int = key) -> None:
        entry = _PRIVATE.get(key)
        if entry is not None and entry[0] is ref:
            _PRIVATE.pop(key, None)

    _PRIVATE[key] = (weakref.ref(arr, forget), values)
    return arr


def private_values(arr: pa.Array | None) -> np.ndarray | None:
    """A writable view of the values of list array `arr` (no nulls) when a gather here allocated them for it, or a
    receiver recorded them as its own (`own`)."""
    entry = _PRIVATE.get(id(arr))
    if entry is None or entry[0]() is not arr or arr is None or arr.null_count:
        return None
    child = arr.values
    if isinstance(child, pa.ExtensionArray):  # a list of bfloat16 or float8 values: their bits
        child = child.storage
    if not (pa.types.is_integer(child.type) or pa.types.is_floating(child.type)):
        return None
    offs = arrow_to_numpy(arr.offsets)
    dtype = np.dtype(child.type.to_pandas_dtype())
    first = int(offs[0]) if len(offs) else 0
    count = int(offs[-1]) - first if len(offs) else 0
    if entry[1] is not None:
        return entry[1][first:first + count]
    buf = child.buffers()[1]
    if buf is None or not buf.is_mutable:
        return None
    return np.frombuffer(buf, dtype=dtype, count=count, offset=(child.offset + first) * dtype.itemsize)


def own_as(src: pa.Array, dst: pa.Array) -> pa.Array:
    """`dst`, a list array over the same buffers as `src` under another type (a ragged bfloat16 field's bits seen as
    bfloat16 values), owned as `src` is: `private_values(dst)` hands them out writable when it would for `src`."""
    entry = _PRIVATE.get(id(src))
    if entry is not None and entry[0]() is src:
        own(dst, entry[1])
    return dst


__all__ = ["one_array", "own", "own_as", "private_values", "take", "take_chunked"]
