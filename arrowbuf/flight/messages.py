"""Client-side conversions between arrowbuf objects and Flight messages: validated columns into the RecordBatch a
writer sends (`record_batch`, `table_to_batch`), a DoPut acknowledgement into row ids (`ack_ids`), and a received
sample into a `SampleBatch` (`sample_batch`: ids and weights from the app_metadata or from trailing columns; arrays
made writable over the received memory, copied once when gRPC delivered them misaligned, `received`), plus the
padding a client asks for so that later replies arrive aligned (`misalignment`, `request_key`, `MAX_PADS`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..delivery.batch import SampleBatch
from ..errors import SchemaError
from ..ring.ragged_gather import own
from ..schema import ExperienceSchema
from ..schema import logical as _logical
from ..schema.convert import arrow_to_numpy, numpy_to_arrow, tensor_to_numpy
from ..schema.dtypes import LogicalType, to_arrow, to_physical
from . import protocol as P
from .heap import release_after
from .wire import wire_array


def ack_ids(ack: dict[str, int], rows: int) -> np.ndarray:
    """The ids of a batch from its DoPut acknowledgement: the committed range [first_seq, first_seq + rows)."""
    if ack["rows"] != rows:
        raise SchemaError(f"DoPut acknowledgement: {ack['rows']} rows committed for a batch of {rows}; "
                          "the server and this client disagree about the protocol")
    return np.arange(ack["first_seq"], ack["first_seq"] + rows, dtype=np.int64)


#: Sample requests whose padding a client remembers (any more: it starts over).
MAX_PADS = 64


def request_key(n: int, cols: list[str] | None, timeout: float | None,
                options: dict[str, Any]) -> tuple[Any, ...] | None:
    """A hashable key of a sample request (None when an option value is not hashable: such a request is not
    padded)."""
    key = (n, None if cols is None else tuple(cols), timeout, tuple(options.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def misalignment(data: pa.RecordBatch) -> int:
    """How many bytes past an 8-byte boundary the received body starts (every buffer of an IPC body starts a
    multiple of 8 bytes into it; the last column, the ids or the weights, is fixed-width)."""
    if not data.num_columns:
        return 0
    buffers = data.column(data.num_columns - 1).buffers()
    if len(buffers) < 2 or buffers[1] is None or not buffers[1].size:
        return 0
    return int(buffers[1].address % 8)


def sample_batch(data: pa.RecordBatch, meta: pa.Buffer | None, form: str = "json") -> SampleBatch:
    """A received sample as a SampleBatch: ids and weights from the app_metadata (`form` "json") or from the
    trailing columns (`form` "columns", `protocol.split_sample_columns`)."""
    names = data.schema.names
    if form == "columns":
        keep, ids, w = P.split_sample_columns(data)
        indices, weights = received(ids), (None if w is None else received(w))
        names = names[:keep]
    else:
        indices, weights = P.decode_sample_meta(meta, data.num_rows)
    arrays: dict[str, Any] = {}
    for i, name in enumerate(names):
        col = data.column(i)
        t = col.type
        if isinstance(t, LogicalType) and not col.null_count:  # bfloat16, float8, complex: Arrow, as a local
            # sample gives them, over a writable view of the received memory (to_torch takes it without a copy)
            arrays[name] = to_arrow(t, received(to_physical(col)))
        elif col.null_count or isinstance(t, (LogicalType, pa.JsonType)):  # a field filled later, absent in some
            # rows: Arrow with nulls, as a local sample gives them; JSON values as Arrow (decoded by to_numpy)
            arrays[name] = col
        elif isinstance(t, pa.FixedShapeTensorType):
            arrays[name] = received(tensor_to_numpy(col))
        elif pa.types.is_list(t) or pa.types.is_large_list(t):
            arrays[name] = _own_received(col)
        else:
            arrays[name] = received(arrow_to_numpy(col))
    release_after(data.nbytes)  # the receive's freed gRPC pieces: back to the OS, not kept for the next peak
    return SampleBatch(arrays, indices, weights)


def _own_received(col: pa.Array) -> pa.Array:
    """A received list column whose values `to_torch(pack=True)` may hand over writable, without a copy (the
    message was received for this batch alone; see `_ReceivedMemory`). Values that `received` had to copy (not
    aligned) are not recorded: the column and a tensor would no longer share memory, so `to_torch` copies as before."""
    child = col.values
    if not (pa.types.is_integer(child.type) or pa.types.is_floating(child.type)) or child.null_count:
        return col
    view = arrow_to_numpy(child)
    mine = received(view)
    if view.size and mine.ctypes.data == view.ctypes.data:
        own(col, mine)
    return col


class _ReceivedMemory:
    """Exposes a read-only numpy view of a received Flight message as writable memory, and keeps the view (and so
    the message's buffer) alive for as long as any array over it lives.

    Safe because the message was received for one batch alone: nothing else (no store, no other reader) sees that
    memory, so the batch's user may write it, and torch may take it without the defensive copy that read-only
    memory (a store's shared mapping) needs.
    """

    __slots__ = ("__array_interface__", "_view")

    def __init__(self, view: np.ndarray) -> None:
        self._view = view
        interface = dict(view.__array_interface__)
        interface["data"] = (interface["data"][0], False)  # (address, read-only flag)
        self.__array_interface__ = interface


def received(arr: np.ndarray) -> np.ndarray:
    """`arr` (a view of a received message, or a conversion's own copy) as a writable array over the same memory.

    A view that is not aligned to its dtype (a small message that gRPC delivered in one piece lands at any byte
    offset) is copied once here instead, so torch and numpy never see misaligned data. The copy goes into a buffer
    of Arrow's memory pool (64-byte aligned, memory the pool reuses from call to call): a fresh numpy allocation of
    this size is new pages from the OS every call, and faulting them in cost more than the copy (about 130 µs of a
    mujoco batch-256 sample's 0.4 ms).
    """
    if arr.flags.writeable or arr.size == 0:
        return arr
    if not arr.flags.aligned:
        out = np.frombuffer(pa.allocate_buffer(arr.nbytes), dtype=arr.dtype).reshape(arr.shape)
        out[...] = arr
        return out
    return np.asarray(_ReceivedMemory(arr))


def record_batch(schema: ExperienceSchema, cols: dict[str, Any]) -> pa.RecordBatch:
    """Validated columns (numpy, or Arrow lists for ragged fields) as the RecordBatch a writer sends."""
    names, arrays = [], []
    for name, value in cols.items():
        names.append(name)
        spec = schema.spec_of(name) if name in schema.fields or name in schema.derived else None
        if spec is not None and not spec.plain:  # bfloat16, float8, complex, json: the column of its dtype
            arrays.append(_logical.to_arrow(spec, value))
        elif isinstance(value, (pa.Array, pa.ChunkedArray)):
            arrays.append(value)
        elif isinstance(value, np.ma.MaskedArray):  # a field filled later with rows absent: nulls on the wire
            from ..ring.presence import nullable_array
            from ..schema.convert import later_mask

            present = later_mask(value)
            data = np.ma.getdata(value)
            arrays.append(nullable_array(schema.fields[name], data, np.ones(len(data), bool) if present is None
                                         else present))
        elif value.ndim > 1 and len(value) == 0:  # from_numpy_ndarray refuses an empty array
            typ = pa.fixed_shape_tensor(pa.from_numpy_dtype(value.dtype), value.shape[1:])
            storage = pa.FixedSizeListArray.from_arrays(numpy_to_arrow([], pa.from_numpy_dtype(value.dtype)),
                                                        int(np.prod(value.shape[1:])))
            arrays.append(pa.ExtensionArray.from_storage(typ, storage))
        elif value.ndim > 1:
            if not value.flags.c_contiguous or len(value) < 2:  # one row may carry a zero leading stride
                value = value.copy(order="C")
            arrays.append(wire_array(value))
        else:
            arrays.append(numpy_to_arrow(value))
    return pa.RecordBatch.from_arrays(arrays, names=names)


def table_to_batch(table: pa.Table) -> pa.RecordBatch:
    batches = table.combine_chunks().to_batches()
    if not batches:
        return pa.RecordBatch.from_pylist([], schema=table.schema)
    if len(batches) == 1:
        return batches[0]
    return pa.concat_batches(batches)


__all__ = ["MAX_PADS", "ack_ids", "misalignment", "record_batch", "received", "request_key", "sample_batch",
           "table_to_batch"]
