"""Field specs: one stored or derived field of a step, its dtype, shape and Arrow type (a leaf module: the schema
and the conversion of incoming values both build on it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import SchemaError

SYSTEM_COLUMNS: dict[str, pa.DataType] = {"episode_id": pa.int64(), "step": pa.int64(), "seq": pa.int64()}
#: Keys an input batch may carry besides the schema's fields: who wrote the step.
STREAM_KEYS = ("episode_id", "actor")
#: Field names that end an episode unless the schema says otherwise.
DEFAULT_EPISODE_END = ("done", "terminated", "truncated")
#: The episode_end fields that mean truncation unless the schema's `truncation` says otherwise.
DEFAULT_TRUNCATION: tuple[str, ...] = ("truncated",)

DTYPES = {
    "bool": np.bool_,
    "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
    "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "float16": np.float16, "float32": np.float32, "float64": np.float64,
}


def parse_dtype(where: str, value: Any) -> np.dtype:
    if isinstance(value, np.dtype):
        dtype = value
    else:
        name = str(getattr(value, "__name__", value)).lower()
        name = {"float": "float64", "int": "int64", "double": "float64", "half": "float16",
                "bool_": "bool", "boolean": "bool"}.get(name, name)
        if name not in DTYPES:
            raise SchemaError(
                f"{where}: unknown dtype {value!r}; expected one of {', '.join(sorted(DTYPES))}"
            )
        dtype = np.dtype(DTYPES[name])
    if dtype.name not in DTYPES:
        raise SchemaError(f"{where}: unsupported dtype {dtype}; expected one of {', '.join(sorted(DTYPES))}")
    return dtype


@dataclass(frozen=True)
class FieldSpec:
    """One stored field of a step.

    Attributes:
        name: column name.
        dtype: numpy dtype of one element.
        shape: per-step shape, () for a scalar.
        ragged: a variable-length 1-D list per step (token ids, logprobs); `shape` is then ().
        allow_nan: when False, NaN and infinite values are rejected on ingest (floating fields only).
        later: a field that a later stage fills (`store.update`): nullable, and `extend`/`append` may leave it out
            (the row then holds no value for it, read back as null, until an update writes one).
        mean_length: ragged fields: the expected mean number of elements per row. Sizes the flat storage of a
            store in shared memory or on disk (one ring of `arena_rows * mean_length` elements per column: the rows
            in the ring may hold that many on average, whatever one chunk holds; more raises `OutOfSpace`) and the
            chunk size estimate. None: 256. A host store's arena grows to what the rows need.
    """

    name: str
    dtype: np.dtype
    shape: tuple[int, ...] = ()
    ragged: bool = False
    allow_nan: bool = True
    later: bool = False
    mean_length: int | None = None

    @property
    def row_bytes(self) -> int:
        """Bytes one step of this field takes (ragged fields: an estimate for sizing chunks)."""
        if self.ragged:
            return 64 if self.mean_length is None else self.mean_length * self.dtype.itemsize
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def arrow_type(self) -> pa.DataType:
        """The Arrow type of the stored column."""
        value = pa.from_numpy_dtype(self.dtype)
        if self.ragged:
            return pa.list_(value)
        if self.shape:
            return pa.fixed_shape_tensor(value, list(self.shape))
        return value

    def describe(self) -> str:
        if self.ragged:
            return f"ragged list of {self.dtype}"
        return f"{self.dtype} shape {list(self.shape)}"


@dataclass(frozen=True)
class DerivedSpec:
    """A field read from another step instead of stored: `next_of` names the source field."""

    name: str
    next_of: str


