"""TransferQueue fields <-> Arrow columns, exactly or not at all.

TransferQueue is schema-free: a field is whatever tensor the first writer passed. arrowbuf stores typed columns, so
each field gets a `FieldKind` inferred from the first put of it into a partition, and every later put of that field
must match it. What maps, and how:

| TransferQueue value (a batch of B)                     | kind      | Arrow column                        |
|--------------------------------------------------------|-----------|-------------------------------------|
| dense tensor / ndarray `[B, *shape]` (bool, ints, floats) | `dense`   | scalar or `fixed_shape_tensor`      |
| jagged nested tensor `[B, j]`, or B 1-D tensors         | `jagged`  | `list<dtype>` (ragged; offsets = cu_seqlens) |
| `NonTensorStack` of str, or a list of B str            | `str`     | `list<uint8>` of the UTF-8 bytes    |

Refused with `SchemaError` (nothing is written): bfloat16, complex and object dtypes, nested tensors whose components
are not 1-D, B tensors of mixed dtypes or of mixed ranks, a batch dimension that disagrees with the keys, and a later
put whose dtype, shape or kind differs from the field's first put.

torch is needed (TransferQueue's values are tensors); tensordict is optional: without it, plain dicts of tensors go
in and come out (`str` fields come out as lists of str).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ...errors import SchemaError
from ...schema.convert import tensor_to_numpy
from ...schema.spec import DTYPES

#: What a field is, so that a get returns what the put gave.
KINDS = ("dense", "jagged", "str")


@dataclass(frozen=True)
class FieldKind:
    """The inferred type of one field: its kind, element dtype and per-sample shape (`()` for jagged and str)."""

    kind: str
    dtype: str
    shape: tuple[int, ...] = ()

    def schema_entry(self) -> dict[str, Any]:
        """This field as an entry of an arrowbuf schema dict."""
        if self.kind == "dense":
            return {"dtype": self.dtype, "shape": list(self.shape)}
        return {"dtype": self.dtype, "ragged": True}

    def to_json(self) -> list[Any]:
        return [self.kind, self.dtype, list(self.shape)]

    @classmethod
    def from_json(cls, value: Any) -> FieldKind:
        """Parse `to_json`'s output; raises SchemaError on anything else (remote input)."""
        if (not isinstance(value, list) or len(value) != 3 or value[0] not in KINDS or value[1] not in DTYPES
                or not isinstance(value[2], list) or len(value[2]) > 8
                or not all(isinstance(d, int) and 0 <= d < 2**31 for d in value[2])):
            raise SchemaError(f"bad field kind {value!r}")
        return cls(value[0], value[1], tuple(value[2]))


def torch_module() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the compat extra installs it
        raise ImportError("arrowbuf.compat needs torch: pip install 'arrowbuf[compat]'") from e
    return torch


def tensordict_module() -> Any | None:
    """tensordict, or None when it is not installed (plain dicts then)."""
    try:
        import tensordict
    except ImportError:
        return None
    return tensordict


def _np_dtype(where: str, dtype: Any) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise SchemaError(f"field {where!r}: dtype {name} cannot be stored exactly (expected one of "
                          f"{', '.join(sorted(DTYPES))}); cast it first, e.g. bfloat16 -> float32")
    return name


def _to_numpy(where: str, value: Any) -> np.ndarray:
    torch = torch_module()
    if isinstance(value, torch.Tensor):
        _np_dtype(where, value.dtype)
        return value.detach().cpu().contiguous().numpy()
    arr = np.asarray(value)
    if arr.dtype == object or arr.dtype.kind in "USc":
        raise SchemaError(f"field {where!r}: values of dtype {arr.dtype} cannot be stored exactly; pass tensors, "
                          "arrays or a list of str")
    _np_dtype(where, arr.dtype)
    return arr


def _ragged(values: np.ndarray, lengths: np.ndarray) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def _jagged_from_list(where: str, items: list[Any]) -> tuple[FieldKind, pa.Array]:
    arrays = [_to_numpy(where, v) for v in items]
    dtypes = {a.dtype.name for a in arrays}
    if len(dtypes) > 1:
        raise SchemaError(f"field {where!r}: mixed dtypes {sorted(dtypes)} in one batch; a field has one dtype")
    ranks = {a.ndim for a in arrays}
    if len(ranks) > 1:
        raise SchemaError(f"field {where!r}: samples of mixed ranks {sorted(ranks)}; a field has one rank")
    shapes = {a.shape for a in arrays}
    dtype = dtypes.pop() if dtypes else "float32"
    if len(shapes) <= 1:  # every sample has the same shape: a dense field
        shape = shapes.pop() if shapes else ()
        dense = np.stack(arrays) if arrays else np.zeros((0, *shape), dtype=dtype)
        return dense_column(where, dense)
    if ranks != {1}:
        raise SchemaError(f"field {where!r}: samples of shapes {sorted(shapes)[:3]}...: only 1-D samples may differ "
                          "in length (a ragged column); pad or flatten them")
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
    return FieldKind("jagged", dtype), _ragged(flat, lengths)


def dense_column(where: str, arr: np.ndarray) -> tuple[FieldKind, pa.Array]:
    """A dense batch `[B, *shape]` as its kind and Arrow column."""
    dtype = _np_dtype(where, arr.dtype)
    if arr.ndim == 0:
        raise SchemaError(f"field {where!r}: a scalar has no batch dimension; pass one value per sample")
    kind = FieldKind("dense", dtype, tuple(int(d) for d in arr.shape[1:]))
    if arr.ndim == 1:
        return kind, pa.array(arr)
    return kind, pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(arr))


def str_column(where: str, items: list[Any]) -> tuple[FieldKind, pa.Array]:
    """B strings as UTF-8 bytes in a `list<uint8>` column."""
    if not all(isinstance(s, str) for s in items):
        kinds = sorted({type(s).__name__ for s in items})
        raise SchemaError(f"field {where!r}: mixed value types {kinds}; a non-tensor field holds str only")
    raw = [s.encode("utf-8") for s in items]
    flat = np.frombuffer(b"".join(raw), dtype=np.uint8)
    return FieldKind("str", "uint8"), _ragged(flat, np.array([len(r) for r in raw], dtype=np.int64))


def to_column(where: str, value: Any, batch: int) -> tuple[FieldKind, pa.Array]:
    """One field's batch of values as `(kind, Arrow column)`, or SchemaError naming the field."""
    torch = torch_module()
    td = tensordict_module()
    if td is not None and isinstance(value, td.NonTensorStack):
        value = value.tolist()
    elif td is not None and isinstance(value, td.NonTensorData):
        value = [value.data] * batch
    if isinstance(value, torch.Tensor) and value.is_nested:
        if value.layout == torch.jagged:
            if value.dim() != 2:
                raise SchemaError(f"field {where!r}: a jagged tensor of {value.dim()} dims; only [B, j] (1-D "
                                  "samples) maps onto a ragged column")
            _np_dtype(where, value.dtype)
            values = value.values().detach().cpu().contiguous().numpy()
            offsets = value.offsets().detach().cpu().numpy().astype(np.int64)
            if offsets[0] != 0 or values.shape[0] != offsets[-1]:
                values, lengths = values[offsets[0]:offsets[-1]], np.diff(offsets)
            else:
                lengths = np.diff(offsets)
            kind, col = FieldKind("jagged", values.dtype.name), _ragged(values, lengths)
        else:
            kind, col = _jagged_from_list(where, list(value.unbind(0)))
    elif isinstance(value, (list, tuple)):
        if value and all(isinstance(v, str) for v in value):
            kind, col = str_column(where, list(value))
        elif any(isinstance(v, str) for v in value):
            raise SchemaError(f"field {where!r}: mixed str and non-str values in one batch")
        else:
            kind, col = _jagged_from_list(where, list(value))
    else:
        kind, col = dense_column(where, _to_numpy(where, value))
    if len(col) != batch:
        raise SchemaError(f"field {where!r}: batch dimension {len(col)} does not match the {batch} keys/samples "
                          "given; nothing was written")
    return kind, col


def batch_items(fields: Any) -> tuple[list[tuple[str, Any]], int | None]:
    """The (name, value) pairs of a TensorDict or dict, and the TensorDict's batch size (None for a dict)."""
    td = tensordict_module()
    if td is not None and isinstance(fields, td.TensorDictBase):
        size = int(fields.batch_size[0]) if len(fields.batch_size) else None
        out = []
        for name in fields.keys():
            if not isinstance(name, str):
                raise SchemaError(f"nested keys are not supported: {name!r}; flatten the TensorDict first")
            out.append((name, fields.get(name)))
        return out, size
    if isinstance(fields, dict):
        for name in fields:
            if not isinstance(name, str) or not name:
                raise SchemaError(f"field names are non-empty str, got {name!r}")
        return list(fields.items()), None
    raise SchemaError(f"fields must be a TensorDict or a dict of tensors, got {type(fields).__name__}")


def columns_of(fields: Any, batch: int) -> tuple[dict[str, FieldKind], dict[str, pa.Array]]:
    """Convert every field of a batch (all or nothing)."""
    items, size = batch_items(fields)
    if size is not None and size != batch:
        raise SchemaError(f"the TensorDict's batch_size {size} does not match the {batch} keys/samples given; "
                          "nothing was written")
    kinds: dict[str, FieldKind] = {}
    cols: dict[str, pa.Array] = {}
    for name, value in items:
        kinds[name], cols[name] = to_column(name, value, batch)
    return kinds, cols


def dense_numpy(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A scalar or `fixed_shape_tensor` column as an ndarray `[B, *shape]` (bool tensors included, which
    pyarrow's `to_numpy_ndarray` refuses)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if isinstance(col.type, pa.FixedShapeTensorType):
        return tensor_to_numpy(col)
    return col.to_numpy(zero_copy_only=False)


def from_column(kind: FieldKind, col: pa.Array | pa.ChunkedArray) -> Any:
    """An Arrow column back to what the put gave: a tensor, a jagged nested tensor, or a list of str."""
    torch = torch_module()
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if kind.kind == "dense":
        arr = np.asarray(dense_numpy(col), dtype=kind.dtype).reshape((len(col), *kind.shape))
        return torch.from_numpy(np.array(arr, copy=True) if not arr.flags.writeable else arr)
    offsets = np.asarray(col.offsets, dtype=np.int64)
    flat = col.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
    offsets = offsets - offsets[0]
    if kind.kind == "str":
        raw = flat.tobytes()
        return [raw[offsets[i]:offsets[i + 1]].decode("utf-8") for i in range(len(col))]
    values = torch.from_numpy(np.array(flat, dtype=kind.dtype, copy=True))
    return torch.nested.nested_tensor_from_jagged(values, torch.from_numpy(offsets))


def to_output(data: dict[str, Any], batch: int, as_tensordict: bool = True) -> Any:
    """A TensorDict of `data` (str fields as `NonTensorStack`) when tensordict is installed, else the dict."""
    td = tensordict_module()
    if td is None or not as_tensordict:
        return data
    out = td.TensorDict({}, batch_size=[batch])
    for name, value in data.items():
        if isinstance(value, list):
            out.set(name, td.NonTensorStack.from_list(value))
        else:
            out.set(name, value)
    return out
