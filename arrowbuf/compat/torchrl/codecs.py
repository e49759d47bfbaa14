"""How one leaf of TorchRL data becomes one arrowbuf column, and back: a codec per kind of leaf.

    codec = codec_for(leaf)                       # DenseCodec, BitsCodec or JsonCodec
    spec = codec.field_spec(feature_shape)        # the schema field, e.g. {"dtype": "float32", "shape": [4]}
    column = codec.encode(leaf_rows)              # what `store.extend` takes for that field
    value = codec.decode(gathered_column, shape)  # a tensor (or a list of JSON values) shaped [*shape, *feature]

- `DenseCodec`: tensors whose dtype arrowbuf stores (bool, (u)int8-64, float16/32/64): the column holds the values.
- `BitsCodec`: tensors of any other dtype (bfloat16, complex, float8): the column holds their bits as unsigned
  integers of the same width (complex128: 16 bytes per element as a trailing uint8 dim), the dtype is kept in the
  layout, and `decode` views the bits back: the round trip is exact. When the store holds these dtypes itself
  (the store-wide bf16/complex/float8 column types), `codec_for` picks `DenseCodec` for them and old layouts still
  decode (their codec name is recorded per leaf).
- `JsonCodec`: `NonTensorData` values (str, int, float, bool, None, lists and str-keyed dicts of those) as UTF-8
  JSON text in a ragged uint8 column. A value JSON would change (a tuple, a set, an int dict key, NaN, an
  object) raises `SchemaError` naming the field, never a lookalike. When the store's "json" column type lands,
  `field_spec` becomes {"dtype": "json"} and encode/decode hand the values over as they are; nothing else changes.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from ...errors import SchemaError

#: torch dtypes arrowbuf columns hold as they are (their numpy name is the schema dtype)
DENSE = {torch.bool: "bool", torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16", torch.int32: "int32",
         torch.int64: "int64", torch.float16: "float16", torch.float32: "float32", torch.float64: "float64",
         torch.uint16: "uint16", torch.uint32: "uint32", torch.uint64: "uint64"}
_UNSIGNED = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}
_NUMPY_UNSIGNED = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named `name` ("bfloat16", "complex64", ...)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SchemaError(f"unknown torch dtype {name!r} in a stored layout")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class DenseCodec:
    """A tensor leaf whose dtype arrowbuf stores: the column holds the values."""

    name = "dense"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def field_spec(self, shape: tuple[int, ...]) -> dict[str, Any]:
        return {"dtype": DENSE[self.dtype], "shape": list(shape), "later": True}

    def encode(self, t: torch.Tensor) -> np.ndarray:
        return t.detach().cpu().contiguous().numpy()

    def decode(self, column: Any, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(column)).reshape(shape)


class BitsCodec:
    """A tensor leaf of a dtype arrowbuf columns do not hold yet (bfloat16, complex, float8): its bits, exactly."""

    name = "bits"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()

    def _trailing(self) -> tuple[int, ...]:
        return () if self.itemsize in _UNSIGNED else (self.itemsize,)

    def field_spec(self, shape: tuple[int, ...]) -> dict[str, Any]:
        dtype = _NUMPY_UNSIGNED.get(self.itemsize, "uint8")
        return {"dtype": dtype, "shape": [*shape, *self._trailing()], "later": True}

    def encode(self, t: torch.Tensor) -> np.ndarray:
        t = t.detach().cpu().contiguous()
        if self.itemsize in _UNSIGNED:
            return t.view(_UNSIGNED[self.itemsize]).numpy()
        return t.unsqueeze(-1).view(torch.uint8).numpy()

    def decode(self, column: Any, shape: tuple[int, ...]) -> torch.Tensor:
        bits = torch.from_numpy(np.ascontiguousarray(column))
        if self.itemsize in _UNSIGNED:
            return bits.view(self.dtype).reshape(shape)
        return bits.view(self.dtype).squeeze(-1).reshape(shape)



def check_json(value: Any, where: str) -> None:
    """Raise `SchemaError` unless `value` survives JSON exactly (same types, same values)."""
    t = type(value)
    if t in (str, bool, type(None), int):
        return
    if t is float:
        if not math.isfinite(value):
            raise SchemaError(f"{where}: the non-finite float {value!r} has no exact JSON form; arrowbuf stores "
                              "non-tensor values as JSON (str, int, finite float, bool, None, list, dict with str "
                              "keys). Store it in a tensor instead")
        return
    if t is list:
        for v in value:
            check_json(v, where)
        return
    if t is dict:
        for k, v in value.items():
            if type(k) is not str:
                raise SchemaError(f"{where}: dict key {k!r} ({type(k).__name__}) would come back as a str from "
                                  "JSON; arrowbuf stores non-tensor values as JSON (dicts need str keys)")
            check_json(v, where)
        return
    raise SchemaError(f"{where}: a non-tensor value of type {type(value).__name__} cannot be stored exactly: "
                      "arrowbuf's TorchRL storage keeps NonTensorData as JSON (str, int, float, bool, None, list, "
                      "dict with str keys); a tuple would come back as a list, other objects not at all. Convert it "
                      "(e.g. to a list) or keep it out of the stored data")


class JsonCodec:
    """`NonTensorData` values as JSON text (UTF-8) in a ragged uint8 column; each row holds one element's value
    (a nested list when the element has batch dims of its own)."""

    name = "json"
    dtype = None

    def field_spec(self, shape: tuple[int, ...]) -> dict[str, Any]:
        return {"dtype": "uint8", "ragged": True, "later": True}

    def encode_values(self, values: list[Any], where: str) -> pa.Array:
        blobs = []
        for v in values:
            check_json(v, where)
            blobs.append(json.dumps(v, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode())
        offsets = np.zeros(len(blobs) + 1, dtype=np.int32)
        np.cumsum([len(b) for b in blobs], out=offsets[1:])
        values_arr = np.frombuffer(b"".join(blobs), dtype=np.uint8)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values_arr, type=pa.uint8()))

    def decode_values(self, rows: Any) -> list[Any]:
        """The values of gathered rows (`SampleBatch.to_numpy()`'s list of uint8 arrays, one per row)."""
        return [json.loads(np.asarray(r, dtype=np.uint8).tobytes().decode()) for r in rows]


Codec = DenseCodec | BitsCodec | JsonCodec


def tensor_codec(dtype: torch.dtype) -> DenseCodec | BitsCodec:
    """The codec of a tensor leaf of `dtype`."""
    if dtype in DENSE:
        return DenseCodec(dtype)
    if dtype.is_complex or dtype.is_floating_point or dtype in _UNSIGNED.values():
        return BitsCodec(dtype)
    raise SchemaError(f"tensors of dtype {dtype} cannot be stored by arrowbuf's TorchRL storage")


def codec_from(name: str, dtype: str | None) -> Codec:
    """The codec a stored layout names."""
    if name == "json":
        return JsonCodec()
    if dtype is None:
        raise SchemaError(f"a stored layout names codec {name!r} without a dtype")
    if name == "dense":
        return DenseCodec(torch_dtype(dtype))
    if name == "bits":
        return BitsCodec(torch_dtype(dtype))
    raise SchemaError(f"a stored layout names the unknown codec {name!r} (written by a newer arrowbuf?)")
