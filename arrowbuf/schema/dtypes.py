"""Dtypes that numpy or Arrow lack: bfloat16, the float8 formats, complex numbers (and "json", in
`arrowbuf.schema.jsonvalues`), as Arrow extension types over documented physical storage (docs/format.md).

Inside a store a field of such a dtype is its *physical* numpy array: the raw bits for bfloat16 (uint16) and the
float8 formats (uint8), numpy's own complex64/complex128 for complex numbers. So the ring, every tier, gathers and
the output pool treat a bfloat16 field exactly as a uint16 field of the same shape (same speed, no per-element
Python). The *logical* dtype lives in the Arrow type of the column: an extension type per dtype
(`arrowbuf.bfloat16`, `arrowbuf.float8_e4m3fn`, ..., `arrowbuf.complex64`, `arrowbuf.complex128`) with the
per-row shape as its parameter, over

- bits dtypes: the bits type (uint16 / uint8) for a scalar, `fixed_size_list<bits, prod(shape)>` for a tensor
  (row-major: the storage of `arrow.fixed_shape_tensor`);
- complex dtypes: `fixed_size_list<float32|float64, 2 * prod(shape)>`, (real, imaginary) interleaved, as numpy
  lays complex numbers out in memory (so the storage is a zero-copy view of a complex array).

A reader that knows the type (pyarrow with arrowbuf imported, which registers them) gets it back from IPC and
Parquet files; one that does not (DuckDB, Polars, pyarrow without arrowbuf) reads the storage.

Conversion happens at the edges only:

    values = input_values(name, value, where)   # torch tensors, ml_dtypes arrays, bits, Arrow -> physical numpy
    arr = to_arrow(arrow_type(name, shape), physical)    # physical [n, *shape] -> the Arrow column (zero-copy)
    physical = to_physical(arr)                  # the inverse (zero-copy)
    tensor = torch_view(physical, name)          # a torch tensor of the logical dtype over the same memory

`import arrowbuf` needs only numpy and pyarrow: torch is imported by the functions that deliver torch tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from ..errors import SchemaError


@dataclass(frozen=True)
class BitsDtype:
    """A floating-point format numpy lacks, stored as its raw bits.

    Attributes:
        name: the dtype's name (torch's and ml_dtypes' spelling).
        bits: the numpy dtype of the bits (uint16 or uint8).
        exp_mask: the exponent field's bits.
        man_mask: the mantissa field's bits.
        kind: where the format keeps NaN and infinities (`nonfinite`): "ieee" (exponent all ones: NaN with a
            mantissa, infinity without), "fn" (exponent and mantissa all ones is NaN; no infinity), "fnuz" (only the
            negative-zero pattern is NaN; no infinity), "e8m0" (0xFF is NaN; no sign, no mantissa).
    """

    name: str
    bits: np.dtype
    exp_mask: int
    man_mask: int
    kind: str

    def nonfinite(self, bits: np.ndarray) -> np.ndarray:
        """Mask of the values that are NaN or infinite."""
        u = bits.view(self.bits)
        if self.kind == "ieee":
            return (u & self.exp_mask) == self.exp_mask
        if self.kind == "fn":
            return (u & (self.exp_mask | self.man_mask)) == (self.exp_mask | self.man_mask)
        if self.kind == "fnuz":
            return u == (1 << (8 * self.bits.itemsize - 1))
        return u == 0xFF  # e8m0: no sign, no mantissa


U16, U8 = np.dtype(np.uint16), np.dtype(np.uint8)

#: The dtypes stored as raw bits: bfloat16 and every float8 format torch 2.x has. (torch's float4_e2m1fn_x2 packs
#: two values per byte and complex32 has no numpy counterpart: neither is supported; see docs/fields.md.)
BITS: dict[str, BitsDtype] = {d.name: d for d in (
    BitsDtype("bfloat16", U16, 0x7F80, 0x007F, "ieee"),
    BitsDtype("float8_e4m3fn", U8, 0x78, 0x07, "fn"),
    BitsDtype("float8_e4m3fnuz", U8, 0x78, 0x07, "fnuz"),
    BitsDtype("float8_e5m2", U8, 0x7C, 0x03, "ieee"),
    BitsDtype("float8_e5m2fnuz", U8, 0x7C, 0x03, "fnuz"),
    BitsDtype("float8_e8m0fnu", U8, 0xFF, 0x00, "e8m0"),
)}

#: complex dtype -> the float dtype of its parts.
COMPLEX: dict[str, np.dtype] = {"complex64": np.dtype(np.float32), "complex128": np.dtype(np.float64)}

#: Every dtype name this module adds to a schema (besides "json").
NAMES = (*BITS, *COMPLEX)


def physical_dtype(name: str) -> np.dtype:
    """The numpy dtype a store keeps a value of dtype `name` in (bits dtypes: their bits; complex: itself)."""
    if name in BITS:
        return BITS[name].bits
    return np.dtype(name)


# ---------------------------------------------------------------------------------------------- extension types
class LogicalType(pa.ExtensionType):
    """An arrowbuf dtype over its physical storage (see the module docstring): one subclass per dtype, whose
    extension name is `arrowbuf.<dtype>`; the parameter is the per-row shape (() for a scalar), serialized as JSON
    `{"shape": [...]}`.

    Args:
        shape: the per-row shape; () for a scalar column.
    """

    dtype_name: ClassVar[str]

    def __init__(self, shape: tuple[int, ...] | list[int] = ()) -> None:
        self.shape = tuple(int(s) for s in shape)
        if any(s < 1 for s in self.shape):
            raise ValueError(f"arrowbuf.{self.dtype_name}: a shape of positive sizes, got {list(self.shape)}")
        super().__init__(_storage_type(self.dtype_name, self.shape), f"arrowbuf.{self.dtype_name}")

    @property
    def numpy_dtype(self) -> np.dtype:
        """The physical numpy dtype of one value (bits, or the complex dtype)."""
        return physical_dtype(self.dtype_name)

    @property
    def layout(self) -> tuple[np.dtype, pa.DataType, int]:
        """(the physical numpy dtype, the storage's element type, elements per row: 0 for a scalar of bits,
        which is stored as the bits themselves)."""
        out = _LAYOUTS.get(self)
        if out is None:
            st = self.storage_type
            if pa.types.is_fixed_size_list(st):
                out = (self.numpy_dtype, st.value_type, st.list_size)
            else:
                out = (self.numpy_dtype, st, 0)
            _LAYOUTS[self] = out
        return out

    def __arrow_ext_serialize__(self) -> bytes:
        return json.dumps({"shape": list(self.shape)}).encode()

    @classmethod
    def __arrow_ext_deserialize__(cls, storage_type: pa.DataType, serialized: bytes) -> LogicalType:
        try:
            shape = json.loads(serialized.decode() or "{}").get("shape", [])
            out = cls(tuple(shape))
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"arrowbuf.{cls.dtype_name}: malformed type parameters {serialized[:100]!r}: "
                             f"{exc}") from None
        if out.storage_type != storage_type:
            raise ValueError(f"arrowbuf.{cls.dtype_name} of shape {list(out.shape)} has storage "
                             f"{out.storage_type}, got {storage_type}")
        return out

    def __arrow_ext_class__(self) -> type:
        return LogicalArray

    def __hash__(self) -> int:
        return hash((self.extension_name, self.shape))

    def __reduce__(self) -> Any:
        return type(self), (self.shape,)


class LogicalArray(pa.ExtensionArray):
    """An array of an arrowbuf dtype (`LogicalType`)."""

    def to_numpy_ndarray(self) -> np.ndarray:
        """The physical values as numpy [rows, *shape] (bits, or complex numbers; zero-copy where Arrow's memory
        allows; null rows hold whatever their storage holds)."""
        return to_physical(self)


def _storage_type(name: str, shape: tuple[int, ...]) -> pa.DataType:
    size = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if name in BITS:
        bits = pa.from_numpy_dtype(BITS[name].bits)
        return pa.list_(bits, size) if shape else bits
    part = pa.from_numpy_dtype(COMPLEX[name])
    return pa.list_(part, 2 * size)


def _type_class(name: str) -> type[LogicalType]:
    cls = type(f"{_camel(name)}Type", (LogicalType,), {"dtype_name": name, "__module__": __name__,
                                                        "__doc__": f"`arrowbuf.{name}` (see `LogicalType`)."})
    return cls


def _camel(name: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in name.split("_"))


#: dtype name -> its extension type class (`BFloat16Type`, `Float8E4m3fnType`, ..., `Complex64Type`).
TYPES: dict[str, type[LogicalType]] = {name: _type_class(name) for name in NAMES}
globals().update({cls.__name__: cls for cls in TYPES.values()})  # importable by name: pickles of the types

for _cls in TYPES.values():
    try:
        pa.register_extension_type(_cls())
    except pa.ArrowKeyError:  # registered already (this module imported twice, e.g. by a reload)
        pa.unregister_extension_type(_cls().extension_name)
        pa.register_extension_type(_cls())

_CACHE: dict[tuple[str, tuple[int, ...]], LogicalType] = {}
_LAYOUTS: dict[LogicalType, tuple[np.dtype, pa.DataType, int]] = {}


def arrow_type(name: str, shape: tuple[int, ...] = ()) -> LogicalType:
    """The extension type of dtype `name` (a bits or complex dtype) for rows of `shape` (cached)."""
    key = (name, tuple(shape))
    t = _CACHE.get(key)
    if t is None:
        t = _CACHE.setdefault(key, TYPES[name](shape))
    return t


def is_logical(t: pa.DataType) -> bool:
    """Whether `t` is one of this module's extension types."""
    return isinstance(t, LogicalType)


# ---------------------------------------------------------------------------------------------- conversions
def to_arrow(t: LogicalType, values: np.ndarray, mask: np.ndarray | None = None) -> pa.Array:
    """Physical values [n, *t.shape] as an array of `t` (zero-copy for a C-contiguous array); `mask`: rows
    that are null (an absent later value). A few microseconds whatever the size (the sample path calls it per
    column: its layout is looked up once per type)."""
    phys, value_type, size = t.layout
    arr = values if type(values) is np.ndarray else np.asarray(values)
    if arr.dtype != phys:
        if arr.dtype.itemsize != phys.itemsize or arr.dtype.kind not in "iuc":
            raise SchemaError(f"arrowbuf.{t.dtype_name}: expected physical values of {phys}, got {arr.dtype}")
        arr = arr.view(phys)
    n = arr.shape[0] if arr.ndim else 1
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    count = n * size
    if mask is not None and np.any(mask):
        nulls = np.asarray(mask, dtype=bool)
        if not size:
            return t.wrap_array(pa.array(arr.reshape(-1), type=value_type, mask=nulls))
        inner = pa.Array.from_buffers(value_type, count, [None, pa.py_buffer(arr)])
        return t.wrap_array(pa.FixedSizeListArray.from_arrays(inner, size, mask=pa.array(nulls)))
    inner = pa.Array.from_buffers(value_type, count if size else n, [None, pa.py_buffer(arr)])
    return t.wrap_array(pa.FixedSizeListArray.from_arrays(inner, type=t.storage_type) if size else inner)


def wrap_list(name: str, arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A list column of bits (`list<uint16>` of a ragged bfloat16 field, as the ring keeps it) as a list of
    `arrowbuf.<name>` values over the same buffers; a list already of that type passes through."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if isinstance(arr.type.value_type, LogicalType):
        return arr
    t = arrow_type(name, ())
    list_type = pa.large_list(t) if pa.types.is_large_list(arr.type) else pa.list_(t)
    return pa.Array.from_buffers(list_type, len(arr), arr.buffers()[:2], null_count=arr.null_count,
                                 offset=arr.offset, children=[t.wrap_array(arr.values)])


def unwrap_list(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """The inverse of `wrap_list`: a list of an arrowbuf dtype as the list of its storage (zero-copy)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    vt = arr.type.value_type
    if not isinstance(vt, LogicalType):
        return arr
    list_type = pa.large_list(vt.storage_type) if pa.types.is_large_list(arr.type) else pa.list_(vt.storage_type)
    return pa.Array.from_buffers(list_type, len(arr), arr.buffers()[:2], null_count=arr.null_count,
                                 offset=arr.offset, children=[arr.values.storage])


def storage_values(arr: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, pa.Array]:
    """(the physical element values as a flat numpy array, the storage array) of an array of a `LogicalType` or of
    its storage type: zero-copy (read-only unless the Arrow buffer is mutable)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    storage = arr.storage if isinstance(arr, pa.ExtensionArray) else arr
    if pa.types.is_fixed_size_list(storage.type):
        size = storage.type.list_size
        child = storage.values  # the whole child: slice by the list array's own offset
        values = _flat_numpy(child).reshape(-1)
        values = values[storage.offset * size:(storage.offset + len(storage)) * size]
    else:
        values = _flat_numpy(storage)
    return values, storage


def _flat_numpy(arr: pa.Array) -> np.ndarray:
    """A primitive array's values as numpy over its buffer (nulls hold what the buffer holds), writable when the
    buffer is mutable."""
    buf = arr.buffers()[1]
    dtype = np.dtype(arr.type.to_pandas_dtype())
    if buf is None:
        return np.zeros(len(arr), dtype=dtype)
    return np.frombuffer(buf, dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


def to_physical(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """An array of a `LogicalType` as physical numpy [n, *shape] (zero-copy; the inverse of `to_arrow`)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    t = arr.type
    assert isinstance(t, LogicalType)
    values, _ = storage_values(arr)
    if t.dtype_name in COMPLEX:
        values = values.view(t.numpy_dtype)
    return values.reshape((len(arr), *t.shape))


def round_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """Floats as bfloat16 bits (uint16), rounded to nearest even as torch's `.to(torch.bfloat16)` rounds (a
    float64 goes through float32 first, as in torch). NaN stays a quiet NaN of the same sign."""
    f32 = np.asarray(values, dtype=np.float32) if values.dtype != np.float32 else values
    u = np.ascontiguousarray(f32).view(np.uint32)
    with np.errstate(over="ignore"):
        out = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(f32)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits as float32 values (exact: a bfloat16 is the top half of a float32)."""
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


# ---------------------------------------------------------------------------------------------- torch
_TORCH: list[Any] = []


def _torch() -> Any:
    if not _TORCH:  # imported on first use (`import arrowbuf` needs no torch), then kept: the sample path asks
        from ..errors import require

        _TORCH.append(require("torch", "torch"))
    return _TORCH[0]


_TORCH_DTYPES: dict[str, Any] = {}


def torch_dtype(name: str) -> Any:
    """The torch dtype of `name` (needs torch; looked up once per name: the sample path asks per column)."""
    t = _TORCH_DTYPES.get(name)
    if t is not None:
        return t
    torch = _torch()
    t = getattr(torch, name, None)
    if t is None:
        raise SchemaError(f"dtype {name!r}: this torch ({torch.__version__}) has no torch.{name}")
    return _TORCH_DTYPES.setdefault(name, t)


def is_tensor(value: Any) -> bool:
    """A torch tensor, recognised without importing torch."""
    return type(value).__module__.startswith("torch") and hasattr(value, "dtype") and hasattr(value, "device")


def torch_view(values: np.ndarray, name: str) -> Any:
    """Physical numpy values as a CPU torch tensor of dtype `name`, over the same memory (a read-only array is
    copied first: torch tensors are writable)."""
    torch = _torch()
    if not values.flags.writeable:
        values = values.copy()
    if name in COMPLEX:
        return torch.from_numpy(values)
    bits = values.view(np.int16 if values.dtype.itemsize == 2 else np.uint8)
    return torch.from_numpy(bits).view(torch_dtype(name))


def tensor_dtype_name(value: Any) -> str:
    """The dtype name of a torch tensor ("bfloat16", "float32", ...)."""
    return str(value.dtype).removeprefix("torch.")


def tensor_numpy(value: Any, name: str | None = None) -> np.ndarray:
    """A torch tensor as numpy: a tensor of dtype `name` (an arrowbuf dtype) as its physical values, any other
    tensor of a dtype numpy lacks (bfloat16, float8) as float32 values (exact), the rest as `Tensor.numpy()`.
    Zero-copy for a contiguous CPU tensor except for the float32 widening."""
    torch = _torch()
    t = value.detach().cpu()
    if name is not None and name in BITS and t.dtype == torch_dtype(name):
        bits = t.contiguous().view(torch.int16 if BITS[name].bits.itemsize == 2 else torch.uint8)
        return bits.numpy().view(BITS[name].bits)
    if t.dtype == torch.bfloat16 or str(t.dtype).startswith("torch.float8"):
        return t.to(torch.float32).numpy()
    if t.dtype == torch.uint16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return np.asarray(t.numpy())


def from_device(value: Any, name: str) -> Any:
    """A gathered torch tensor (a GPU tier's delivery of physical values) as a tensor of dtype `name`.

    The GPU tier stores uint16 as int16 and delivers it widened to int64 (`arrowbuf.tiers.gpu`): those values go
    back to 16 bits exactly (no wrap-around reliance) before the view."""
    torch = _torch()
    if name in COMPLEX:
        return value
    want = torch_dtype(name)
    if value.dtype == want:
        return value
    if value.dtype in (torch.int32, torch.int64):
        value = torch.where(value >= 32768, value - 65536, value).to(torch.int16)
    elif value.dtype == torch.uint16:
        value = value.view(torch.int16)
    return value.view(want)


__all__ = ["BITS", "COMPLEX", "NAMES", "BitsDtype", "LogicalArray", "LogicalType", "TYPES", "arrow_type",
           "bfloat16_to_float32", "from_device", "is_logical", "is_tensor", "physical_dtype", "round_to_bfloat16",
           "storage_values", "tensor_dtype_name", "tensor_numpy", "to_arrow", "to_physical", "torch_view",
           "unwrap_list", "wrap_list"]
