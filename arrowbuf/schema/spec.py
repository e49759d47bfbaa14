"""Field specs: one stored or derived field of a step, its dtype, shape and Arrow type (a leaf module: the schema
and the conversion of incoming values both build on it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import SchemaError
from . import dtypes as _dtypes
from . import jsonvalues as _json

SYSTEM_COLUMNS: dict[str, pa.DataType] = {"episode_id": pa.int64(), "step": pa.int64(), "seq": pa.int64()}
#: Keys an input batch may carry besides the schema's fields: who wrote the step.
STREAM_KEYS = ("episode_id", "actor")
#: Field names that end an episode unless the schema says otherwise.
DEFAULT_EPISODE_END = ("done", "terminated", "truncated")
#: The episode_end fields that mean truncation unless the schema's `truncation` says otherwise.
DEFAULT_TRUNCATION: tuple[str, ...] = ("truncated",)
#: The dtype of JSON fields.
JSON = "json"

#: numpy dtypes a field may have, stored as they are.
DTYPES = {
    "bool": np.bool_,
    "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
    "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "float16": np.float16, "float32": np.float32, "float64": np.float64,
    "complex64": np.complex64, "complex128": np.complex128,
}
#: dtypes numpy lacks, stored as their bits (`arrowbuf.schema.dtypes`), and JSON values (`arrowbuf.schema.jsonvalues`).
LOGICAL = (*_dtypes.BITS, JSON)
_ALIASES = {"float": "float64", "int": "int64", "double": "float64", "half": "float16", "bool_": "bool",
            "boolean": "bool", "bf16": "bfloat16", "complex": "complex128", "cfloat": "complex64",
            "cdouble": "complex128"}


def dtype_names() -> list[str]:
    """Every dtype name a field may have (what `load_schema` lists when it refuses one)."""
    return sorted([*DTYPES, *LOGICAL])


def parse_dtype(where: str, value: Any) -> tuple[np.dtype, str | None]:
    """A field's dtype from its declaration (a name, a numpy dtype or type, a torch dtype): (the numpy dtype the
    store keeps it in, the logical dtype name for the dtypes numpy lacks, else None)."""
    if isinstance(value, np.dtype):
        name = value.name
    else:
        name = str(getattr(value, "__name__", value)).lower()
        name = name[len("torch."):] if name.startswith("torch.") else name
        name = _ALIASES.get(name, name)
    if name in _dtypes.BITS:
        return _dtypes.BITS[name].bits, name
    if name == JSON:
        return np.dtype(np.uint8), JSON
    if name not in DTYPES:
        raise SchemaError(f"{where}: unknown dtype {value!r}; expected one of {', '.join(dtype_names())}")
    return np.dtype(DTYPES[name]), None


@dataclass(frozen=True)
class FieldSpec:
    """One stored field of a step.

    Attributes:
        name: column name.
        dtype: numpy dtype of one element as the store keeps it: the field's dtype, or for the dtypes numpy lacks
            (`logical`) their bits (uint16 for bfloat16, uint8 for the float8 formats and for the bytes of JSON text).
            `FieldSpec("x", "bfloat16")` (a name) sets both.
        shape: per-step shape, () for a scalar.
        ragged: a variable-length 1-D list per step (token ids, logprobs); `shape` is then (). A json field is
            ragged too (the bytes of its JSON text: the ring's variable-length column kind).
        allow_nan: when False, NaN and infinite values are rejected on ingest (floating and complex fields).
        later: a field that a later stage fills (`store.update`): nullable, and `extend`/`append` may leave it out
            (the row then holds no value for it, read back as null, until an update writes one).
        mean_length: ragged fields: the expected mean number of elements per row (json: bytes of text). Sizes the
            flat storage of a store in shared memory or on disk (one ring of `arena_rows * mean_length` elements per
            column: the rows in the ring may hold that many on average, whatever one chunk holds; more raises
            `OutOfSpace`) and the chunk size estimate. None: 256. A host store's arena grows to what the rows need.
        logical: the dtype numpy lacks that `dtype` stores ("bfloat16", "float8_e4m3fn", ..., "json"), or None.
    """

    name: str
    dtype: np.dtype
    shape: tuple[int, ...] = ()
    ragged: bool = False
    allow_nan: bool = True
    later: bool = False
    mean_length: int | None = None
    logical: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, np.dtype) or self.dtype.name not in DTYPES:
            dtype, logical = parse_dtype(f"field {self.name!r}", self.dtype)
            object.__setattr__(self, "dtype", dtype)
            object.__setattr__(self, "logical", logical)
        if self.logical is not None:
            if self.logical not in LOGICAL:
                raise SchemaError(f"field {self.name!r}: unknown dtype {self.logical!r}; expected one of "
                                  f"{', '.join(dtype_names())}")
            want = np.dtype(np.uint8) if self.logical == JSON else _dtypes.BITS[self.logical].bits
            if self.dtype != want:
                raise SchemaError(f"field {self.name!r}: a {self.logical} field is stored as {want}, got {self.dtype}")
        if self.logical == JSON:
            if self.shape:
                raise SchemaError(f"field {self.name!r}: a json field holds one JSON value per step; drop 'shape' "
                                  "(a list is a JSON value)")
            object.__setattr__(self, "ragged", True)
        elif self.ragged and self.dtype.kind == "c":
            raise SchemaError(f"field {self.name!r}: ragged {self.dtype_name} fields are not supported; declare a "
                              "shape, or store real and imaginary parts as two float fields")

    @property
    def dtype_name(self) -> str:
        """The field's dtype as a schema names it ("float32", "bfloat16", "json", ...)."""
        return self.logical or self.dtype.name

    @property
    def plain(self) -> bool:
        """Whether numpy and Arrow both hold the field's values as they are (bool, integers, float16/32/64), so the
        store's fast paths (per-step append, numpy batches) apply; False for bits dtypes, complex and json."""
        return self.logical is None and self.dtype.kind in "biuf"

    @property
    def is_json(self) -> bool:
        """A json field (`arrowbuf.schema.jsonvalues`)."""
        return self.logical == JSON

    @property
    def row_bytes(self) -> int:
        """Bytes one step of this field takes (ragged fields: an estimate for sizing chunks)."""
        if self.ragged:
            return 64 if self.mean_length is None else self.mean_length * self.dtype.itemsize
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def arrow_type(self) -> pa.DataType:
        """The Arrow type of the stored column, as users, files and the wire see it."""
        if self.logical == JSON:
            return _json.JSON_TYPE
        if self.logical is not None or self.dtype.kind == "c":
            scalar = _dtypes.arrow_type(self.dtype_name, () if self.ragged else self.shape)
            return pa.list_(scalar) if self.ragged else scalar
        value = pa.from_numpy_dtype(self.dtype)
        if self.ragged:
            return pa.list_(value)
        if self.shape:
            return pa.fixed_shape_tensor(value, list(self.shape))
        return value

    def physical_type(self) -> pa.DataType:
        """The Arrow type of the column inside the store's ring where it keeps Arrow arrays (ragged columns: a list
        of `dtype`; json: the bytes of its text); the same as `arrow_type` for plain fields."""
        if self.ragged:
            return pa.list_(pa.from_numpy_dtype(self.dtype))
        return self.arrow_type()

    def describe(self) -> str:
        if self.logical == JSON:
            return "json value (dicts, lists, strings, numbers, booleans, None)"
        if self.ragged:
            return f"ragged list of {self.dtype_name}"
        return f"{self.dtype_name} shape {list(self.shape)}"


@dataclass(frozen=True)
class DerivedSpec:
    """A field read from another step instead of stored: `next_of` names the source field."""

    name: str
    next_of: str


