"""What the server puts on the wire: sampled batches as Arrow record batches over the same memory (tensor columns
zero-copy, layouts' types cached), one-batch DoGet streams sent from C++, and the IPC options of every stream."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ..schema.convert import numpy_to_arrow
from . import protocol as P

if TYPE_CHECKING:  # pragma: no cover
    from ..delivery.batch import SampleBatch

#: (dtype, shape) -> (tensor type, its storage's value type, values per row): built once per layout.
_TENSOR_TYPES: dict[tuple[Any, tuple[int, ...]], tuple[pa.DataType, pa.DataType, int]] = {}
#: The IPC options of every stream this server writes: pyarrow's default, built once (given none, pyarrow builds
#: them per stream from two environment variables).
WIRE_OPTIONS = pa.ipc.IpcWriteOptions()


def wire_batch(batch: SampleBatch, meta: str = "json") -> tuple[pa.RecordBatch, pa.Buffer | None]:
    """A SampleBatch as the RecordBatch and app_metadata that go on the wire (tensor columns zero-copy).

    `meta` "json": the ids and weights in the app_metadata; "columns": as trailing columns, and no app_metadata
    (`protocol.SAMPLE_META`).
    """
    arrays = [wire_array(batch[name]) for name in batch.columns]
    names = list(batch.columns)
    if meta == "json":
        return (pa.RecordBatch.from_arrays(arrays, names=names),
                pa.py_buffer(P.encode_sample_meta(batch.indices, batch.weights, getattr(batch, "lease", None))))
    arrays.append(wire_array(np.ascontiguousarray(batch.indices, dtype=np.int64).reshape(-1)))
    names.append(P.ID_COLUMN)
    if batch.weights is not None:
        arrays.append(wire_array(np.ascontiguousarray(batch.weights, dtype=np.float32).reshape(-1)))
        names.append(P.WEIGHT_COLUMN)
    return pa.RecordBatch.from_arrays(arrays, names=names), None


def one_batch_stream(data: pa.RecordBatch, meta: pa.Buffer | None) -> flight.FlightDataStream:
    """The stream of a DoGet that answers with one batch: without app_metadata it is sent from C++ alone (no
    Python generator to resume, no GIL, for each message and for the end of the stream)."""
    if meta is None:
        return flight.RecordBatchStream(pa.Table.from_batches([data]), WIRE_OPTIONS)
    return flight.GeneratorStream(data.schema, iter([(data, meta)]), WIRE_OPTIONS)


def wire_array(value: np.ndarray | pa.Array | pa.ChunkedArray) -> pa.Array:
    """One sampled column as an Arrow array over the same memory: 1-D as a plain array, [B, *shape] as a
    `fixed_shape_tensor` column.

    A numeric tensor is wrapped from its buffer with a type cached per (dtype, shape): about 5x cheaper per call
    than `FixedShapeTensorArray.from_numpy_ndarray`, which makes a new type every time (a mujoco batch-256 sample
    has three tensor columns).
    """
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        return value
    if value.ndim == 1:
        return numpy_to_arrow(value)
    shape = tuple(value.shape[1:])
    key = (value.dtype, shape)
    cached = _TENSOR_TYPES.get(key)
    if cached is None:
        value_type = pa.from_numpy_dtype(value.dtype)
        cached = _TENSOR_TYPES.setdefault(key, (pa.fixed_shape_tensor(value_type, shape), value_type,
                                                int(np.prod(shape))))
    typ, _, size = cached
    values = numpy_to_arrow(np.ascontiguousarray(value).reshape(-1))  # (numbers wrapped, bools bit-packed)
    return typ.wrap_array(pa.FixedSizeListArray.from_arrays(values, size))


__all__ = ["WIRE_OPTIONS", "one_batch_stream", "wire_array", "wire_batch"]
