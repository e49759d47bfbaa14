"""Columns of fields whose dtype numpy or Arrow lacks (bfloat16, float8, complex, json), between the physical
arrays a store keeps and gathers and the Arrow columns it hands out.

A store gathers such a field as it gathers any other: a bfloat16 field as its uint16 bits, a json field as the bytes
of its text (`FieldSpec.dtype`, `FieldSpec.physical_type`). What leaves the store (a `SampleBatch`, `to_table`, a
checkpoint's row file, the wire) is the column of its logical type (`FieldSpec.arrow_type`), over the same memory:

    arrays = deliver(schema, arrays)          # a gather's physical arrays -> logical columns (a sample's batch)
    col = to_arrow(spec, values, mask=None)   # one physical column [n, *shape] -> its Arrow array
    values = to_physical(spec, col)           # the inverse: numpy [n, *shape] (bits, complex) or list<uint8> (json)

Plain fields pass through unchanged, so a schema without these dtypes costs nothing here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from . import dtypes as _dtypes
from . import jsonvalues as _json
from .spec import FieldSpec


def to_arrow(spec: FieldSpec, values: Any, mask: np.ndarray | None = None) -> Any:
    """A physical column of field `spec` as its Arrow column (zero-copy where the layout allows): numpy
    [n, *rest] of a bits or complex field as its extension type of shape `rest` (a sequence batch [B, T, *shape]
    gives shape (T, *shape)), the bytes of a json field's text (`list<uint8>`) as `arrow.json`. An Arrow array of the
    right type passes through; a torch tensor (a GPU tier's gather) becomes a tensor of the logical dtype. `mask`:
    rows that are null (numpy input only).
    """
    if spec.plain:
        return values
    if spec.is_json:
        return _json.to_arrow(values)
    name = spec.dtype_name
    if spec.ragged:  # bfloat16 / float8 lists: list<bits> as a list of the dtype, over the same buffers
        return _dtypes.wrap_list(name, values)
    if _dtypes.is_tensor(values):
        return _dtypes.from_device(values, name)
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        if isinstance(values.type, _dtypes.LogicalType):
            return values
        own = spec.arrow_type()
        if values.type == own.storage_type:
            return pa.ExtensionArray.from_storage(own, values.combine_chunks()
                                                  if isinstance(values, pa.ChunkedArray) else values)
        raise TypeError(f"field {spec.name!r}: an Arrow column of {values.type} is not the storage of {own}")
    if isinstance(values, np.ma.MaskedArray):
        m = np.asarray(np.ma.getmaskarray(values), dtype=bool)
        mask = np.asarray(m.reshape(len(m), -1).any(axis=1) if m.ndim > 1 else m, dtype=bool)
        values = np.ma.getdata(values)
    arr = np.asarray(values)
    phys = _dtypes.physical_dtype(name)
    if arr.dtype != phys and arr.dtype.kind in "iu" and arr.dtype.itemsize > phys.itemsize:
        arr = arr.astype(phys)  # bits a GPU tier delivered widened (uint16 as int64: `arrowbuf.tiers.gpu`)
    return _dtypes.to_arrow(_dtypes.arrow_type(name, tuple(arr.shape[1:])), arr, mask)


def to_physical(spec: FieldSpec, column: Any) -> Any:
    """The inverse of `to_arrow`: numpy [n, *shape] of a bits or complex field (its physical values, zero-copy),
    the `list<uint8>` bytes of a json field's text. Plain fields pass through."""
    if spec.plain:
        return column
    if spec.is_json:
        return _json.to_physical(column)
    if spec.ragged:
        return _dtypes.unwrap_list(column)
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if isinstance(column, pa.Array) and not isinstance(column.type, _dtypes.LogicalType):
        column = to_arrow(spec, column)
    if isinstance(column, pa.Array):
        return _dtypes.to_physical(column)
    return np.asarray(column)


def deliver(schema: Any, arrays: dict[str, Any]) -> dict[str, Any]:
    """A gather's columns (`arrays`, keyed by column name) with every column of a bits, complex or json field as
    its Arrow column (`to_arrow`), in place; `n_step_<name>` columns follow their derived field `<name>`."""
    for name, values in arrays.items():
        spec = _spec(schema, name)
        if spec is not None and not spec.plain:
            arrays[name] = to_arrow(spec, values)
    return arrays


def _spec(schema: Any, name: str) -> FieldSpec | None:
    if name in schema.fields:
        return schema.fields[name]
    if name in schema.derived:
        return schema.spec_of(name)
    if name.startswith("n_step_") and name[7:] in schema.derived:
        return schema.spec_of(name[7:])
    return None


def needs_delivery(schema: Any) -> bool:
    """Whether any field of `schema` has a dtype `deliver` converts (else it is a no-op)."""
    return any(not f.plain for f in schema.fields.values())


__all__ = ["deliver", "needs_delivery", "to_arrow", "to_physical"]
