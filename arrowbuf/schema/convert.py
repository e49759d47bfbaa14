"""Converting a field's incoming values into its stored form: the rules `ExperienceSchema.validate_batch`, `update`
and the restore path apply to each field's values (dtypes and safe casts, shapes, ragged lists, null rows of later
fields, stream keys), and whether an Arrow column's type can convert at all (checked before any bulk data is read).

Every function takes the field's `FieldSpec` (`arrowbuf.schema.spec`) and raises `SchemaError` naming the field,
what was expected and what came.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import SchemaError
from . import dtypes as _dtypes
from . import jsonvalues as _json
from .inputs import Converted
from .spec import FieldSpec


def absent_values(spec: FieldSpec, n: int) -> Converted:
    """`n` rows of later field `spec` with no value: a `np.ma.MaskedArray` (zeros, all masked) for a fixed field,
    a `pa.ListArray` of nulls for a ragged one (what `validate_batch` gives for a later field left out)."""
    if spec.ragged:
        return pa.nulls(n, type=spec.physical_type())
    return np.ma.MaskedArray(np.zeros((n, *spec.shape), dtype=spec.dtype), mask=np.ones((n, *spec.shape), bool))


def later_mask(values: Converted) -> np.ndarray | None:
    """Per row, whether a later field's validated values (`validate_batch`, `convert_later`) hold a value; None
    when every row does."""
    if isinstance(values, np.ma.MaskedArray):
        mask = np.asarray(np.ma.getmaskarray(values), dtype=bool)
        present = np.asarray(~mask.reshape(len(mask), -1).any(axis=1) if mask.ndim > 1 else ~mask, dtype=bool)
        return None if present.all() else present
    if isinstance(values, pa.Array) and values.null_count:
        return arrow_to_numpy(values.is_valid())
    return None


def convert_later(spec: FieldSpec, value: object, single: bool = False) -> Converted:
    """Validate values of a later field: as `_convert_field`, but rows may be null (an Arrow null, a masked row of
    a `np.ma.MaskedArray`, or None in a list). Only the rows with a value are checked. Returns numpy (no null), a
    `np.ma.MaskedArray` (zeros where null; fixed fields) or a `pa.ListArray` with nulls (ragged fields)."""
    mask: np.ndarray | None = None  # rows without a value
    if single:
        if isinstance(value, np.ma.MaskedArray):
            if np.ma.getmaskarray(value).any():
                return absent_values(spec, 1)
            value = np.ma.getdata(value)
        return _convert_field(spec, value, True)
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks() if value.num_chunks != 1 else value.chunk(0)
    if isinstance(value, pa.Array):
        if value.null_count:
            mask = arrow_to_numpy(value.is_null())
            value = value.filter(numpy_to_arrow(~mask))
    elif isinstance(value, np.ma.MaskedArray):
        m = np.asarray(np.ma.getmaskarray(value), dtype=bool)
        if m.any():
            mask = np.asarray(m.reshape(len(m), -1).any(axis=1) if m.ndim > 1 else m, dtype=bool)
            value = np.ma.getdata(value)[~mask]
        else:
            value = np.ma.getdata(value)
    elif isinstance(value, (list, tuple)) and any(v is None for v in value):
        mask = np.array([v is None for v in value], dtype=bool)
        value = [v for v in value if v is not None]
    if mask is None:
        return _convert_field(spec, value, False)
    n = len(mask)
    if mask.all():
        return absent_values(spec, n)
    checked = _convert_field(spec, value, False)
    if spec.ragged:
        return _scatter_ragged(spec, checked, mask)
    data = np.zeros((n, *spec.shape), dtype=spec.dtype)
    data[~mask] = checked
    full = np.broadcast_to(mask.reshape((-1,) + (1,) * len(spec.shape)), data.shape)
    return np.ma.MaskedArray(data, mask=np.array(full))


def _scatter_ragged(spec: FieldSpec, values: pa.Array, mask: np.ndarray) -> pa.Array:
    """A list array of len(mask) rows: null where `mask`, else the rows of `values` in order."""
    idx = np.full(len(mask), -1, dtype=np.int64)
    idx[~mask] = np.arange(int((~mask).sum()))
    out = values.take(pa.array(idx, mask=mask))
    return out.cast(spec.physical_type()) if out.type != spec.physical_type() else out


def _scalar_fits(dtype: np.dtype, t: pa.DataType) -> bool:
    """Whether an Arrow value type converts to `dtype` by `_cast`'s rules (checked again on the values)."""
    if pa.types.is_boolean(t):
        return dtype.kind in "biu"
    if pa.types.is_integer(t):
        return dtype.kind in "biuf"
    if pa.types.is_floating(t):
        return dtype.kind == "f"
    return False


def _elements(t: pa.DataType) -> tuple[pa.DataType, int]:
    """(the value type, values per row) of a scalar, `fixed_shape_tensor` or (nested) fixed-size list type."""
    if isinstance(t, pa.FixedShapeTensorType):
        return t.value_type, int(np.prod(t.shape))
    size = 1
    while pa.types.is_fixed_size_list(t):
        size *= t.list_size
        t = t.value_type
    return t, size


def _logical_fits(spec: FieldSpec, t: pa.DataType) -> bool:
    """Whether an Arrow column of type `t` converts to a bits, complex or json field (`_convert_logical`'s rules)."""
    if spec.is_json:
        return _json.is_text_type(t)
    if spec.ragged:
        if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
            return False
        vt = t.value_type
        if isinstance(vt, _dtypes.LogicalType):
            return vt.dtype_name == spec.dtype_name and not vt.shape
        bits = _dtypes.BITS[spec.dtype_name].bits
        return (pa.types.is_integer(vt) and vt.bit_width == 8 * bits.itemsize) or (
            spec.dtype_name == "bfloat16" and pa.types.is_floating(vt))
    if isinstance(t, _dtypes.LogicalType):
        return t.dtype_name == spec.dtype_name and int(np.prod(t.shape)) == int(np.prod(spec.shape))
    own = spec.arrow_type()
    if t == own.storage_type:  # the column as stored, from a reader that dropped the extension type
        return True
    value, size = _elements(t)
    if size != int(np.prod(spec.shape)) or (not spec.shape and t != value):
        return False
    if spec.logical is not None:
        bits = _dtypes.BITS[spec.logical].bits
        return (pa.types.is_integer(value) and value.bit_width == 8 * bits.itemsize) or (
            spec.logical == "bfloat16" and pa.types.is_floating(value))
    return pa.types.is_integer(value) or pa.types.is_floating(value)  # complex from real values


def arrow_type_fits(spec: FieldSpec, t: pa.DataType) -> bool:
    if not spec.plain:
        return _logical_fits(spec, t)
    if spec.ragged:
        return (pa.types.is_list(t) or pa.types.is_large_list(t)) and _scalar_fits(spec.dtype, t.value_type)
    if not spec.shape:
        return _scalar_fits(spec.dtype, t)
    if isinstance(t, pa.FixedShapeTensorType):
        return tuple(t.shape) == spec.shape and _scalar_fits(spec.dtype, t.value_type)
    if not pa.types.is_fixed_size_list(t):
        return False
    size = 1
    while pa.types.is_fixed_size_list(t):
        size *= t.list_size
        t = t.value_type
    return size == int(np.prod(spec.shape)) and _scalar_fits(spec.dtype, t)


def stream_column(name: str, value: object, single: bool) -> np.ndarray:
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        value = arrow_to_numpy(value)
    arr = np.asarray(value)
    if single:
        arr = arr.reshape(1) if arr.ndim == 0 else arr
    if arr.ndim != 1:
        raise SchemaError(f"stream key {name!r}: expected one value per step, got shape {list(arr.shape)}")
    if name == "episode_id":
        if arr.dtype.kind not in "iu":
            raise SchemaError(f"stream key 'episode_id': expected integers, got {arr.dtype}")
        if len(arr) and arr.min() < 0:
            raise SchemaError("stream key 'episode_id': expected non-negative integers, got a negative one")
        if len(arr) and arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:
            raise SchemaError(f"stream key 'episode_id': {arr.max()} is over the largest id {np.iinfo(np.int64).max} "
                              "(ids are stored as int64)")
        return arr.astype(np.int64, copy=False)
    if arr.dtype.kind not in "iuUSO":
        raise SchemaError(f"stream key 'actor': expected ints or strings, got {arr.dtype}")
    if arr.dtype.kind == "O":  # from lists or Arrow strings with nulls: every value must be one int or one string
        kinds = {type(v) for v in arr.tolist()}
        if not (kinds <= {int} or kinds <= {str}):
            shown = sorted(k.__name__ for k in kinds)
            raise SchemaError(f"stream key 'actor': expected all ints or all strings (no None), got {shown}")
    return arr


#: numpy's dtype of each Arrow number type `arrow_to_numpy` reads from its buffer.
_NUMBERS: dict[pa.DataType, np.dtype[Any]] = {
    pa.from_numpy_dtype(np.dtype(c)): np.dtype(c)
    for c in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
              "float64")}

_ARROW_OF = {dt: t for t, dt in _NUMBERS.items()}


def numpy_to_arrow(value: Any, typ: pa.DataType | None = None) -> pa.Array:
    """`pa.array(value, type=typ)`; a 1-D numpy array of numbers or bools is wrapped from its buffer (zero-copy for
    contiguous numbers in native order). `pa.array` looks for pandas objects first, and the first such look in a
    process imports pandas: 1-2 s that a cold process's first put, get or sample paid."""
    if not isinstance(value, np.ndarray):
        return pa.array(value, type=typ)
    if typ is None or value.dtype == _NUMBERS.get(typ) or (value.dtype == np.bool_ and typ == pa.bool_()):
        if value.ndim == 1 and value.dtype.isnative and value.flags.c_contiguous:
            if value.dtype == np.bool_:
                bits = np.packbits(value, bitorder="little")
                return pa.Array.from_buffers(pa.bool_(), len(value), [None, pa.py_buffer(bits)])
            t = _ARROW_OF.get(value.dtype)
            if t is not None:
                return pa.Array.from_buffers(t, len(value), [None, pa.py_buffer(value)])
    return pa.array(value, type=typ)


def arrow_to_numpy(value: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """`value.to_numpy(zero_copy_only=False)` (numbers zero-copy and read-only, bools unpacked), read from the
    buffers for numbers and bools without nulls. pyarrow's `to_numpy` looks for pandas first, and the first such look
    in a process imports pandas: 1-2 s that a cold process's first put, get or sample paid."""
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks() if value.num_chunks != 1 else value.chunk(0)
    if value.null_count == 0:
        n, off = len(value), value.offset
        dt = _NUMBERS.get(value.type)
        if dt is not None:
            buf = value.buffers()[1]
            if buf is None:  # (an empty array may have no data buffer)
                return np.zeros(0, dtype=dt)
            out = np.frombuffer(buf, dtype=dt, count=n, offset=off * dt.itemsize)
            out.flags.writeable = False
            return out
        if pa.types.is_boolean(value.type):
            buf = value.buffers()[1]
            if buf is None or n == 0:
                return np.zeros(0, dtype=np.bool_)
            first, last = off // 8, (off + n + 7) // 8
            bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8, count=last - first, offset=first),
                                 bitorder="little")
            return bits[off - 8 * first:off - 8 * first + n].astype(np.bool_)
    return value.to_numpy(zero_copy_only=False)


def tensor_to_numpy(value: pa.FixedShapeTensorArray) -> np.ndarray:
    """A `fixed_shape_tensor` array as an ndarray `[rows, *shape]`, bool tensors included (pyarrow's
    `to_numpy_ndarray` refuses them: "bool is not valid data type for a tensor")."""
    t = value.type
    if pa.types.is_boolean(t.value_type):
        flat = arrow_to_numpy(value.storage.flatten())
        return flat.reshape((len(value), *t.shape))
    return value.to_numpy_ndarray()


def _arrow_to_numpy(spec: FieldSpec, value: pa.Array | pa.ChunkedArray) -> Converted:
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks() if value.num_chunks != 1 else value.chunk(0)
    if value.null_count:
        raise SchemaError(f"field {spec.name!r}: {value.null_count} null value(s); every step needs a value")
    nulls = _inner_nulls(value)
    if nulls:
        raise SchemaError(f"field {spec.name!r}: {nulls} null element(s) inside its values; every element needs a "
                          "value (nulls would be stored as 0)")
    t = value.type
    if isinstance(value, pa.FixedShapeTensorArray):
        return tensor_to_numpy(value)
    if pa.types.is_fixed_size_list(t):
        flat = value.flatten()
        inner = _arrow_to_numpy(FieldSpec(spec.name, spec.dtype), flat)
        return inner.reshape(len(value), -1)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return value
    return arrow_to_numpy(value)


def _inner_nulls(value: pa.Array) -> int:
    """Nulls inside the elements of a (tensor, fixed-size list or list) column, at any depth."""
    if isinstance(value, pa.ExtensionArray):
        value = value.storage
    total = 0
    while pa.types.is_fixed_size_list(value.type) or pa.types.is_list(value.type) or \
            pa.types.is_large_list(value.type):
        value = value.flatten()
        total += value.null_count
    return total


def _convert_field(spec: FieldSpec, value: object, single: bool) -> Converted:
    """Validate one field's values; return [n, *shape] numpy (fixed) or a pa.ListArray (ragged)."""
    if spec.is_json:
        return _convert_json(spec, value, single)
    if not spec.plain and not spec.ragged:
        return _convert_logical(spec, value, single)
    if _dtypes.is_tensor(value):  # a torch tensor, also of a dtype numpy lacks (bfloat16 -> float32 is exact)
        value = _dtypes.tensor_numpy(value, spec.logical)
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        if single:
            raise SchemaError(f"field {spec.name!r}: append takes plain values, not Arrow arrays")
        value = _arrow_to_numpy(spec, value)
    if spec.ragged:
        return _convert_ragged(spec, value, single)
    if isinstance(value, pa.Array):
        raise SchemaError(
            f"field {spec.name!r}: expected fixed {spec.describe()} per step, got a list (ragged) column"
        )
    try:
        arr = np.asarray(value)
    except ValueError as exc:  # inhomogeneous nested lists
        raise SchemaError(
            f"field {spec.name!r}: expected fixed {spec.describe()} per step, got ragged values ({exc})"
        ) from None
    if arr.dtype == object:
        raise SchemaError(
            f"field {spec.name!r}: expected fixed {spec.describe()} per step, got ragged or object values"
        )
    return _cast(spec, _shaped(spec, arr, single))


def _shaped(spec: FieldSpec, arr: np.ndarray, single: bool) -> np.ndarray:
    """`arr` as [n, *spec.shape] (a leading dimension added for one step; flattened tensors reshaped)."""
    if single:
        arr = arr[None, ...]
    if arr.ndim == 0:
        raise SchemaError(f"field {spec.name!r}: expected a leading batch dimension, got a scalar (use append)")
    if tuple(arr.shape[1:]) != spec.shape:
        if arr.shape[1:] and int(np.prod(arr.shape[1:])) == int(np.prod(spec.shape)) and arr.ndim == 2 and spec.shape:
            arr = arr.reshape((arr.shape[0], *spec.shape))  # flattened tensors from a FixedSizeList column
        else:
            got = list(arr.shape[1:]) if not single else list(arr.shape[1:])
            raise SchemaError(
                f"field {spec.name!r}: expected shape {list(spec.shape)} per step, got {got}"
                + (f" (batch shape {list(arr.shape)})" if not single else "")
                + "; reshape the input or fix the schema"
            )
    return arr


def _convert_json(spec: FieldSpec, value: object, single: bool) -> pa.Array:
    """A json field's values (Python values, one per step; or an Arrow column of JSON text) as the physical
    `list<uint8>` column of their JSON text (`arrowbuf.schema.jsonvalues`)."""
    where = f"field {spec.name!r}"
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        if single:
            raise SchemaError(f"{where}: append takes plain values, not Arrow arrays")
        if not _json.is_text_type(value.type):
            raise SchemaError(f"{where}: expected a column of JSON text (arrow.json, string or binary), got Arrow "
                              f"type {value.type}; or pass Python values, one per step")
        return _json.from_text(where, value)
    if single:
        return _json.encode(where, [value])
    if isinstance(value, np.ndarray):
        rows = value.tolist()
    elif isinstance(value, (list, tuple)):
        rows = value
    elif isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise SchemaError(f"{where}: extend takes a list of JSON values, one per step; got a {type(value).__name__} "
                          "(append takes one step's value)")
    else:
        rows = list(value)
    return _json.encode(where, rows)


def _convert_logical(spec: FieldSpec, value: object, single: bool) -> np.ndarray:
    """A bits (bfloat16, float8) or complex field's values as physical numpy [n, *shape] (`_cast_logical`)."""
    name = spec.dtype_name
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        if single:
            raise SchemaError(f"field {spec.name!r}: append takes plain values, not Arrow arrays")
        arr = _logical_from_arrow(spec, value)
    elif _dtypes.is_tensor(value):
        arr = _dtypes.tensor_numpy(value, name)
    else:
        try:
            arr = np.asarray(value)
        except ValueError as exc:  # inhomogeneous nested lists
            raise SchemaError(f"field {spec.name!r}: expected fixed {spec.describe()} per step, got ragged values "
                              f"({exc})") from None
    if arr.dtype == object:
        raise SchemaError(f"field {spec.name!r}: expected fixed {spec.describe()} per step, got ragged or object "
                          "values")
    return _cast_logical(spec, _shaped(spec, arr, single))


def _logical_from_arrow(spec: FieldSpec, value: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """numpy of an Arrow column for a bits or complex field: the physical values of its own extension type or of
    that type's storage, else the column's numbers (for `_cast_logical`)."""
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks() if value.num_chunks != 1 else value.chunk(0)
    if value.null_count:
        raise SchemaError(f"field {spec.name!r}: {value.null_count} null value(s); every step needs a value")
    if _inner_nulls(value):
        raise SchemaError(f"field {spec.name!r}: null element(s) inside its values; every element needs a value")
    t = value.type
    if isinstance(t, _dtypes.LogicalType):
        if t.dtype_name != spec.dtype_name:
            raise SchemaError(f"field {spec.name!r}: expected {spec.describe()}, got an Arrow column of "
                              f"{t.dtype_name}; convert it explicitly (no silent rounding)")
        return _dtypes.to_physical(value)
    own = spec.arrow_type()
    if t == own.storage_type:
        phys = _dtypes.to_physical(pa.ExtensionArray.from_storage(own, value))
        return phys
    if not (pa.types.is_integer(_elements(t)[0]) or pa.types.is_floating(_elements(t)[0])):
        raise SchemaError(f"field {spec.name!r}: expected {spec.describe()}, got Arrow type {t}")
    return np.asarray(_arrow_to_numpy(FieldSpec(spec.name, np.dtype(np.float64)), value))


def _cast_logical(spec: FieldSpec, arr: np.ndarray) -> np.ndarray:
    """Values for a bits or complex field as its physical numpy values.

    Bits dtypes (bfloat16, float8): an array of the dtype itself (ml_dtypes), or integers of the same width (the
    bits: a torch tensor's `.view(torch.int16)`, `to_numpy()` of a batch); bfloat16 also takes floats, rounded to
    nearest even as torch rounds (an out-of-range finite value is an error, as in float fields). Complex: complex
    numbers, or real numbers (integers, floats), with the overflow check of float fields."""
    name = spec.dtype_name
    src = arr.dtype
    if spec.logical is not None:
        bits = _dtypes.BITS[name]
        if src == bits.bits or (src.name == name and src.itemsize == bits.bits.itemsize) or (
                src.kind in "iu" and src.itemsize == bits.bits.itemsize):
            out = arr.view(bits.bits) if src != bits.bits else arr
        elif name == "bfloat16" and src.kind == "f":
            with np.errstate(over="ignore", invalid="ignore"):
                wide = arr.astype(np.float32)
            out = _dtypes.round_to_bfloat16(wide)
            overflow = ((out & 0x7FFF) == 0x7F80) & ~np.isinf(arr.astype(np.float64)) if arr.size else out[:0]
            if overflow.any():
                raise SchemaError(f"field {spec.name!r}: {int(overflow.sum())} value(s) of {src} are out of the range "
                                  "of bfloat16 (they would be stored as infinity); scale them or widen the field")
        elif src.kind == "f" or src.name in _dtypes.NAMES:
            raise SchemaError(f"field {spec.name!r}: expected {name}, got {src}; rounding to {name} is not done "
                              f"implicitly: pass a torch tensor of dtype torch.{name} (x.to(torch.{name})), an "
                              f"ml_dtypes array, or the bits as {bits.bits} (a tensor's .view(torch.uint8))")
        else:
            raise SchemaError(f"field {spec.name!r}: expected {name} (or its bits as {bits.bits}), got {src}")
        if not spec.allow_nan and out.size and bits.nonfinite(out).any():
            raise SchemaError(f"field {spec.name!r}: NaN or infinite values are not allowed by the schema "
                              "(allow_nan: false)")
        return out
    dst = spec.dtype
    if src == dst:
        out = arr
    elif src.kind in "iufc" and src.kind != "b":
        with np.errstate(over="ignore", invalid="ignore"):
            out = arr.astype(dst)
        if arr.size and (src.kind in "iu" or src.itemsize > dst.itemsize):
            overflow = np.isinf(out) & ~np.isinf(arr) if src.kind in "fc" else np.isinf(out)
            if overflow.any():
                raise SchemaError(f"field {spec.name!r}: {int(overflow.sum())} value(s) of {src} are out of the range "
                                  f"of {dst} (they would be stored as infinity); scale them or widen the field")
    else:
        raise SchemaError(f"field {spec.name!r}: expected {dst} (or real numbers), got {src}")
    if not spec.allow_nan and out.size and not np.isfinite(out).all():
        raise SchemaError(f"field {spec.name!r}: NaN or infinite values are not allowed by the schema "
                          "(allow_nan: false)")
    return out


def convert_field(spec: FieldSpec, value: object, single: bool = False) -> Converted:
    """Validate values of one field as `validate_batch` does (no null allowed): [n, *shape] numpy for a fixed field,
    a `pa.ListArray` for a ragged one; with `single`, one value (returned with a leading dimension of 1).

    Raises:
        SchemaError: naming the field, what was expected and what came.
    """
    return _convert_field(spec, value, single)


def _cast(spec: FieldSpec, arr: np.ndarray) -> np.ndarray:
    src, dst = arr.dtype, spec.dtype
    if src == dst:
        out = arr
    elif dst.kind == "b":
        if src.kind in "iu" and (arr.size == 0 or ((arr == 0) | (arr == 1)).all()):
            out = arr.astype(np.bool_)
        else:
            raise SchemaError(f"field {spec.name!r}: expected bool, got {src}; pass booleans (or 0/1 integers)")
    elif dst.kind in "iu":
        if src.kind not in "iub":
            raise SchemaError(
                f"field {spec.name!r}: expected {dst}, got {src}; convert explicitly (no silent float->int rounding)"
            )
        if src.kind != "b" and arr.size:
            info = np.iinfo(dst)
            lo, hi = arr.min(), arr.max()
            if lo < info.min or hi > info.max:
                raise SchemaError(
                    f"field {spec.name!r}: expected {dst}, got {src} with values in [{lo}, {hi}] outside "
                    f"[{info.min}, {info.max}]"
                )
        out = arr.astype(dst)
    elif dst.kind == "f":
        if src.kind not in "iuf":
            raise SchemaError(f"field {spec.name!r}: expected {dst}, got {src}")
        with np.errstate(over="ignore", invalid="ignore"):
            out = arr.astype(dst)
        if arr.size and (src.kind in "iu" or src.itemsize > dst.itemsize):
            overflow = np.isinf(out) & ~np.isinf(arr) if src.kind == "f" else np.isinf(out)
            if overflow.any():
                raise SchemaError(f"field {spec.name!r}: {int(overflow.sum())} value(s) of {src} are out of the range "
                                  f"of {dst} (they would be stored as infinity); scale them or widen the field")
    else:  # pragma: no cover - _DTYPES has no other kinds
        raise SchemaError(f"field {spec.name!r}: unsupported dtype {dst}")
    if not spec.allow_nan and out.dtype.kind == "f" and not np.isfinite(out).all():
        raise SchemaError(f"field {spec.name!r}: NaN or infinite values are not allowed by the schema "
                          "(allow_nan: false)")
    return out


def _check_offsets(spec: FieldSpec, arr: pa.Array) -> None:
    """Refuse a list array whose offsets decrease: Arrow's cheap validation (what the IPC reader of a Flight server
    runs on a received batch) checks only the first and last offsets, so such an array can arrive from a client, and
    its rows would read values never written for them and store negative lengths (O(rows), no values read)."""
    offsets = getattr(arr, "offsets", None)
    if offsets is None or len(offsets) < 2:
        return
    offs = arrow_to_numpy(offsets)
    if offs[0] < 0 or (np.diff(offs) < 0).any():
        raise SchemaError(f"field {spec.name!r}: a ragged column whose list offsets decrease (or start below 0) is "
                          "not a valid Arrow list array; build it with pyarrow (pa.array, ListArray.from_arrays)")


def _convert_ragged(spec: FieldSpec, value: Any, single: bool) -> pa.Array:  # anything: `list()` says if it is rows
    value_type = pa.from_numpy_dtype(spec.dtype)
    cast = _cast if spec.plain else _cast_logical  # bfloat16 / float8 lists: the bits, `_cast_logical`'s rules
    if isinstance(value, pa.Array):
        arr = value
        _check_offsets(spec, arr)
        vt = arr.type.value_type
        if isinstance(vt, _dtypes.LogicalType):
            if spec.plain or vt.dtype_name != spec.dtype_name or vt.shape:
                raise SchemaError(f"field {spec.name!r}: expected a {spec.describe()}, got Arrow type {arr.type}; "
                                  "convert it explicitly (no silent rounding)")
            arr = _dtypes.unwrap_list(arr)  # its bits, zero-copy
            vt = arr.type.value_type
        if vt != value_type:
            inner = cast(spec, arrow_to_numpy(arr.flatten()))
            arr = pa.ListArray.from_arrays(arr.offsets, numpy_to_arrow(inner, value_type))
        elif isinstance(arr, pa.LargeListArray):
            arr = arr.cast(pa.list_(value_type))
        if not spec.allow_nan:
            cast(spec, arrow_to_numpy(arr.flatten()))
        return arr
    rows = [value] if single else value
    if isinstance(rows, np.ndarray) and rows.dtype != object and rows.ndim == 2:
        rows = list(rows)
    try:
        rows = list(rows)
    except TypeError:
        raise SchemaError(f"field {spec.name!r}: expected a ragged list per step, got {type(value).__name__}") from None
    parts = []
    ndarray = np.ndarray
    for r in rows:
        a = r if type(r) is ndarray else (  # the common case first: one type check per row
            _dtypes.tensor_numpy(r, spec.logical) if _dtypes.is_tensor(r) else np.asarray(r))
        if a.ndim != 1:
            raise SchemaError(
                f"field {spec.name!r}: expected a 1-D list of {spec.dtype_name} per step, got shape {list(a.shape)}"
            )
        parts.append(cast(spec, a) if a.size else np.zeros(0, spec.dtype))
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int32, count=len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(parts) if parts else np.zeros(0, spec.dtype)
    return pa.ListArray.from_arrays(numpy_to_arrow(offsets),
                                    numpy_to_arrow(flat.astype(spec.dtype, copy=False), value_type))
