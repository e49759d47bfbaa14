"""JSON fields (`dtype: json`): JSON-like Python values (dicts, lists, strings, numbers, booleans, None: chat
messages, tool calls, metadata) stored as UTF-8 JSON text, without pickle.

What is a JSON value here: `dict` (string keys only), `list`, `str`, `int`, `float` (finite), `bool` and `None`, nested
at most `MAX_DEPTH` deep, encoded in at most `MAX_VALUE_BYTES`; subclasses of these (an `OrderedDict`) and numpy
scalars (`np.int64`, `np.float32`, `np.bool_`) are taken as the JSON value they equal and come back as the plain
Python type. Anything else is refused with a `SchemaError` naming the field, the row and the offending type: a
tuple (it would come back as a list), a set, bytes, a custom object, NaN or an infinity (JSON has none), a non-string
dict key (JSON would turn it into a string). Refusing is the point: a value either round-trips equal, or is not
stored.

Layout: the store keeps a JSON field as a ragged column of bytes (`list<uint8>`, the ring's variable-length column
kind, `arrowbuf.ring.ragged_arena`): each row the value's compact JSON text. Its Arrow type outside the store is the
canonical `arrow.json` extension type over `utf8` (the same offsets and bytes, zero-copy), which DuckDB reads as its
`JSON` type and other readers as a string column.

Usage::

    physical = encode("field 'meta'", [{"role": "user", "content": "hi"}, None])   # list<uint8>
    arr = to_arrow(physical)                  # arrow.json over utf8, zero-copy
    decode(arr)                               # [{'role': 'user', 'content': 'hi'}, None]
    from_text("field 'meta'", pa.array(['{"a": 1}']))   # JSON text (an Arrow column) -> physical, validated
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import SchemaError

#: The deepest nesting of lists and dicts a value may have (a value at the top level is depth 1).
MAX_DEPTH = 64
#: The most bytes one value's JSON text may take.
MAX_VALUE_BYTES = 64 << 20
#: The Arrow type of a JSON column outside the store.
JSON_TYPE = pa.json_(pa.string())
#: What the ring keeps: the UTF-8 bytes of each row's JSON text.
PHYSICAL_TYPE = pa.list_(pa.uint8())

_LEAVES = (str, int, float, type(None))  # bool is an int
_NUMPY = (np.integer, np.floating, np.bool_)
_RULE = "dicts with string keys, lists, strings, finite numbers, booleans and None are"


def _refuse(where: str, row: int | None, what: str) -> SchemaError:
    at = f"{where}" + (f" row {row}" if row is not None else "")
    return SchemaError(f"{at}: {what}; a json field stores JSON values ({_RULE}), never pickles; convert the value "
                       "(e.g. a tuple to a list, a set to a sorted list)")


def check(where: str, value: Any, row: int | None = None) -> None:
    """Refuse `value` unless it is a JSON value (see the module docstring); iterative, so any nesting is an error
    of its own, never a RecursionError (a value that contains itself is too deep)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, _LEAVES):
            if isinstance(v, float) and not math.isfinite(v):
                raise _refuse(where, row, f"{v!r} is not a JSON number")
            continue
        if isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                raise _refuse(where, row, f"a value nested more than {MAX_DEPTH} levels deep")
            if isinstance(v, dict):
                for k, x in v.items():
                    if not isinstance(k, str):
                        raise _refuse(where, row, f"dict key {_clip(k)} ({type(k).__name__}) is not a string")
                    stack.append((x, depth + 1))
            else:
                stack.extend((x, depth + 1) for x in v)
            continue
        if isinstance(v, _NUMPY):
            if isinstance(v, np.floating) and not np.isfinite(v):
                raise _refuse(where, row, f"{v!r} is not a JSON number")
            continue
        raise _refuse(where, row, f"a {type(v).__module__}.{type(v).__qualname__} is not JSON"
                      if type(v).__module__ != "builtins" else f"a {type(v).__name__} is not JSON")


def _numpy_default(v: Any) -> Any:
    if isinstance(v, _NUMPY):
        return v.item()
    raise TypeError(f"{type(v).__name__} is not JSON")  # not reached: `check` refused it


def dumps(where: str, value: Any, row: int | None = None) -> bytes:
    """One checked value as compact UTF-8 JSON text (non-ASCII characters as they are; a string holding a lone
    surrogate, which UTF-8 cannot hold, makes the value's text ASCII with escapes instead: still exact)."""
    check(where, value, row)
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_numpy_default)
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            data = json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"),
                              default=_numpy_default).encode("ascii")
    except (ValueError, TypeError, RecursionError) as exc:  # e.g. an int of more digits than Python prints
        raise _refuse(where, row, f"not encodable as JSON ({str(exc)[:200]})") from None
    if len(data) > MAX_VALUE_BYTES:
        raise _refuse(where, row, f"{len(data)} bytes of JSON text, more than the {MAX_VALUE_BYTES} a value may take")
    return data


def _physical(parts: list[bytes], nulls: np.ndarray | None = None) -> pa.Array:
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise SchemaError(f"{int(offsets[-1])} bytes of JSON text in one batch, more than a column's int32 offsets "
                          "address; send fewer rows per call")
    data = pa.py_buffer(b"".join(parts))
    values = pa.Array.from_buffers(pa.uint8(), len(data), [None, data])
    mask = None if nulls is None or not nulls.any() else pa.array(nulls)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values, type=PHYSICAL_TYPE, mask=mask)


def encode(where: str, values: Iterable[Any]) -> pa.Array:
    """Python values (one per row) as the physical column (`list<uint8>` of JSON text).

    Raises:
        SchemaError: a value that is not JSON (see the module docstring), naming `where` and its row.
    """
    return _physical([dumps(where, v, i) for i, v in enumerate(values)])


def _strict_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads_checked(where: str, text: bytes | str, row: int | None = None) -> Any:
    """Parse one row's JSON text, refusing what `check` refuses (NaN and Infinity literals, deep nesting)."""
    try:
        value = json.loads(text, parse_constant=_strict_constant)
    except RecursionError:
        raise _refuse(where, row, f"a value nested more than {MAX_DEPTH} levels deep") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise SchemaError(f"{where}" + (f" row {row}" if row is not None else "") +
                          f": not valid JSON text ({str(exc)[:200]}); a json field's Arrow column holds one JSON "
                          "text per row (UTF-8)") from None
    check(where, value, row)
    return value


def is_text_type(t: pa.DataType) -> bool:
    """Whether an Arrow column of type `t` can hold JSON text (what a json field takes as the column as stored)."""
    if isinstance(t, pa.BaseExtensionType):
        return t == JSON_TYPE or isinstance(t, pa.JsonType) and is_text_type(t.storage_type)
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
                or pa.types.is_large_binary(t) or t == PHYSICAL_TYPE or t == pa.large_list(pa.uint8()))


def to_physical(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """An Arrow column of JSON text (`arrow.json`, string, binary, or `list<uint8>`; large variants too) as the
    physical `list<uint8>` over the same bytes (zero-copy for 32-bit offsets). Not validated: see `from_text`."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if isinstance(arr, pa.ExtensionArray):
        arr = arr.storage
    t = arr.type
    if t == PHYSICAL_TYPE:
        return arr
    if t == pa.large_list(pa.uint8()):
        return arr.cast(PHYSICAL_TYPE)
    if pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        arr = arr.cast(pa.binary())
        t = arr.type
    if not (pa.types.is_string(t) or pa.types.is_binary(t)):
        raise SchemaError(f"expected JSON text (a string column), got {t}")
    validity, offsets, data = arr.buffers()
    end = int(np.frombuffer(offsets, dtype=np.int32, count=len(arr) + 1 + arr.offset)[-1]) if offsets else 0
    values = pa.Array.from_buffers(pa.uint8(), end, [None, data if data is not None else pa.py_buffer(b"")])
    return pa.Array.from_buffers(PHYSICAL_TYPE, len(arr), [validity, offsets], null_count=arr.null_count,
                                 offset=arr.offset, children=[values])


def to_arrow(physical: pa.Array | pa.ChunkedArray) -> pa.Array:
    """The physical column (`list<uint8>` of JSON text) as an `arrow.json` array over the same bytes."""
    if isinstance(physical, pa.ChunkedArray):
        physical = physical.combine_chunks() if physical.num_chunks != 1 else physical.chunk(0)
    if physical.type == JSON_TYPE:
        return physical
    if physical.type != PHYSICAL_TYPE:
        physical = to_physical(physical)
    validity, offsets = physical.buffers()[:2]
    child = physical.values  # the whole child: the list's offsets index it from its own offset
    data = child.buffers()[1]
    if data is None:
        data = pa.py_buffer(b"")
    elif child.offset:
        data = data.slice(child.offset)
    if offsets is None:  # an empty list array may carry no offsets buffer
        offsets = pa.py_buffer(np.zeros(physical.offset + len(physical) + 1, dtype=np.int32).tobytes())
    text = pa.Array.from_buffers(pa.string(), len(physical), [validity, offsets, data],
                                 null_count=physical.null_count, offset=physical.offset)
    return pa.ExtensionArray.from_storage(JSON_TYPE, text)


def from_text(where: str, arr: pa.Array | pa.ChunkedArray, allow_nulls: bool = False) -> pa.Array:
    """An Arrow column of JSON text, each row parsed and checked, as the physical column (the text kept as given).

    Raises:
        SchemaError: a row that is not valid UTF-8 JSON text, or holds what `check` refuses; a null row unless
            `allow_nulls`.
    """
    physical = to_physical(arr)
    if physical.null_count and not allow_nulls:
        raise SchemaError(f"{where}: {physical.null_count} null value(s); every step needs a value (JSON null is the "
                          "text 'null')")
    offs = np.asarray(physical.offsets, dtype=np.int64)
    whole = physical.values.slice(int(offs[0]), int(offs[-1] - offs[0])).to_numpy(zero_copy_only=False).tobytes() \
        if len(physical) else b""
    rel = (offs - offs[0]).tolist()
    valid = None if not physical.null_count else np.asarray(physical.is_valid(), dtype=bool)
    for i in range(len(physical)):
        if valid is not None and not valid[i]:
            continue
        piece = whole[rel[i]:rel[i + 1]]
        if len(piece) > MAX_VALUE_BYTES:
            raise _refuse(where, i, f"{len(piece)} bytes of JSON text, more than the {MAX_VALUE_BYTES} a value may "
                          "take")
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError:
            raise SchemaError(f"{where} row {i}: the JSON text is not valid UTF-8") from None
        loads_checked(where, text, i)
    return physical


def decode(arr: pa.Array | pa.ChunkedArray) -> list[Any]:
    """A JSON column (physical or `arrow.json`) as Python values, one per row; None for a null row (a later value
    not written yet) as for JSON null: `arr.is_valid()` tells them apart."""
    text = to_arrow(arr).storage
    return [None if s is None else json.loads(s) for s in text.to_pylist()]


def _clip(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


__all__ = ["JSON_TYPE", "MAX_DEPTH", "MAX_VALUE_BYTES", "PHYSICAL_TYPE", "check", "decode", "dumps", "encode",
           "from_text", "is_text_type", "loads_checked", "to_arrow", "to_physical"]
