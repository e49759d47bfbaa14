"""Ragged (Arrow list) columns as trainers want them, without a Python loop over rows.

A list column's offsets are the `cu_seqlens` of varlen attention: packing is a zero-copy view of the values plus the
offsets rebased to 0; padding is one scatter of the values into [B, max_len].

Usage::

    values, offsets = flat(list_array)          # numpy values (nulls: empty) and int64 offsets from 0, length B+1
    lengths(list_array)                         # int64 [B]
    position_ids(offsets)                       # 0..len-1 per row, concatenated
    padded, mask = pad(list_array, value=0)     # [B, max_len] and a bool mask
    split_rows(list_array)                      # list of per-row numpy views (None for null rows)
    take(list_array, rows)                      # rows of one list array, gathered (one C++ ranged copy)
    take_chunked(slot_arrays, chunk_rows, pos)  # rows at ring positions of per-chunk list arrays (the store's)

`take` and `take_chunked` are the ring's gathers (`arrowbuf.ring.ragged_gather`), re-exported here.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import InvalidArgument
from ..ring.ragged_gather import one_array, private_values, take, take_chunked
from ..schema.convert import arrow_to_numpy, numpy_to_arrow


def is_ragged(values: object) -> bool:
    """Whether `values` is an Arrow list column (list or large_list)."""
    if not isinstance(values, (pa.Array, pa.ChunkedArray)):
        return False
    t = values.type
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t))


def flat(values: pa.Array | pa.ChunkedArray, writable: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets): the concatenated row values and int64 offsets starting at 0 (length rows + 1).

    Null rows count as empty. Zero-copy for the values where the dtype allows (a sliced array is respected); the
    values are read-only unless `writable` and the array is a gather result that owns them alone (`take`,
    `take_chunked`), so a caller that must hand out writable memory copies only when it has to.
    """
    if writable:
        private = private_values(values)
        if private is not None:
            offs = arrow_to_numpy(values.offsets).astype(np.int64)
            return private, offs - offs[0]
    arr = one_array(values)
    if not is_ragged(arr):
        raise InvalidArgument(f"expected a ragged (list) column, got {arr.type}")
    offs = arrow_to_numpy(arr.offsets).astype(np.int64)  # respects a slice; nulls may hold garbage-free equal offsets
    if arr.null_count:
        # Arrow allows a null list to span values; count nulls as empty rows by rebuilding the lengths
        lens = np.diff(offs)
        valid = np.asarray(arr.is_valid(), dtype=bool)
        lens = np.where(valid, lens, 0)
        offs = np.concatenate(([0], np.cumsum(lens)))
        vals = arr.flatten()  # skips null rows
    else:
        vals = arr.values.slice(int(offs[0]), int(offs[-1] - offs[0])) if len(arr) else arr.values.slice(0, 0)
        offs = offs - offs[0]
    return arrow_to_numpy(vals), offs


def lengths(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """int64 length of each row (0 for null rows)."""
    return np.diff(flat(values)[1])


def position_ids(offsets: np.ndarray) -> np.ndarray:
    """0, 1, ..., len_i - 1 for each row i, concatenated (int64, writable, freshly allocated), from offsets starting
    at 0.

    Each row is one ranged copy of a shared 0..max_len-1 ramp (a `ListViewArray` of (0, len_i) over the ramp,
    flattened in C++): one write pass over the output, about memcpy speed, where a fill and a running sum took two
    passes and a Python loop over rows would take one call per row.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    lens = np.diff(offsets)
    total = int(offsets[-1]) if offsets.size else 0
    if not total:
        return np.zeros(0, dtype=np.int64)
    longest = int(lens.max())
    ramp = numpy_to_arrow(np.arange(longest, dtype=np.int64))
    if longest < 2**31 and lens.size < 2**31:
        view: pa.Array = pa.ListViewArray.from_arrays(numpy_to_arrow(np.zeros(lens.size, np.int32)),
                                                      numpy_to_arrow(lens.astype(np.int32)), ramp)
    else:
        view = pa.LargeListViewArray.from_arrays(numpy_to_arrow(np.zeros(lens.size, np.int64)), numpy_to_arrow(lens),
                                                 ramp)
    flat_ids = pc.list_flatten(view)
    buf = flat_ids.buffers()[1]
    if buf is None or not buf.is_mutable:  # not expected: list_flatten allocates its output
        return np.array(arrow_to_numpy(flat_ids), dtype=np.int64)
    return np.frombuffer(buf, dtype=np.int64, count=total, offset=flat_ids.offset * 8)


def pad(values: pa.Array | pa.ChunkedArray, value: float = 0,
        length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """([B, L] padded values, [B, L] bool mask); L is the longest row unless `length` is given (>= it)."""
    vals, offs = flat(values)
    lens = np.diff(offs)
    longest = int(lens.max()) if lens.size else 0
    width = longest if length is None else int(length)
    if width < longest:
        raise InvalidArgument(f"pad: length {width} is shorter than the longest row ({longest})")
    rows = lens.size
    out = np.full(rows * width, value, dtype=vals.dtype)
    pos = np.repeat(np.arange(rows, dtype=np.int64) * width, lens) + position_ids(offs)
    out[pos] = vals
    mask = np.zeros(rows * width, dtype=bool)
    mask[pos] = True
    return out.reshape(rows, width), mask.reshape(rows, width)


def split_rows(values: pa.Array | pa.ChunkedArray) -> list[np.ndarray | None]:
    """Per-row numpy views over one flat buffer (None for null rows): `np.split`, not `to_pylist`."""
    arr = one_array(values)
    vals, offs = flat(arr)
    rows: list[np.ndarray | None] = list(np.split(vals, offs[1:-1])) if len(arr) else []
    if arr.null_count:
        for i in np.flatnonzero(~np.asarray(arr.is_valid(), dtype=bool)).tolist():
            rows[i] = None
    return rows


__all__ = ["flat", "is_ragged", "lengths", "pad", "position_ids", "split_rows", "take", "take_chunked"]
