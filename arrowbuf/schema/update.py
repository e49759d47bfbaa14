"""Checking an update's input against a schema (`store.update(ids, values)`, no store state needed): the ids, the
values of fields filled later, and the Arrow types of an update sent over Flight. The store (`arrowbuf.engine.update`),
the Flight client and server, and Ray shards check with these before anything is sent or written."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import InvalidArgument, SchemaError
from .convert import convert_field

#: Most ids one update call takes (a remote call is bounded by the same number; split larger updates).
MAX_UPDATE_ROWS = 1 << 24


def update_ids(ids: Any) -> np.ndarray:
    """`ids` (a sequence, numpy or Arrow array of integers) as a 1-D int64 array.

    Raises:
        InvalidArgument: not a 1-D array of integers, or too many.
    """
    if isinstance(ids, (pa.Array, pa.ChunkedArray)):
        if ids.null_count:
            raise InvalidArgument(f"update ids: {ids.null_count} null id(s); pass the ids extend/append returned")
        ids = ids.to_numpy(zero_copy_only=False)
    if isinstance(ids, (int, np.integer)) and not isinstance(ids, bool):
        ids = [ids]
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu") or arr.dtype == np.bool_:
        raise InvalidArgument(f"update ids: expected a 1-D array of integer ids (what extend/append returned), got "
                              f"{arr.dtype} with shape {list(arr.shape)}")
    if len(arr) > MAX_UPDATE_ROWS:
        raise InvalidArgument(f"update of {len(arr)} ids is over the limit of {MAX_UPDATE_ROWS}; split it")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise InvalidArgument(f"update ids: {arr.max()} is not an id of this store (ids are int64 seqs)")
    return arr.astype(np.int64, copy=False)


def validate_update(schema: Any, ids: np.ndarray, values: Any, single: bool = False) -> dict[str, Any]:
    """Check an update's values against the schema (no store state needed); returns the converted columns.
    `single`: one id was given as a plain int, and each field's value is one row's value.

    Raises:
        SchemaError: an unknown field, a field not filled later, a wrong dtype, shape or ragged element type, NaN
            where `allow_nan` is false, or a length other than `len(ids)`.
        InvalidArgument: `values` is not a non-empty mapping, or an id repeats.
    """
    if not isinstance(values, Mapping) or not values:
        raise InvalidArgument("update takes a non-empty dict {field: values}, e.g. store.update(ids, "
                              f"{{'reward': rewards}}); got {type(values).__name__}")
    later = schema.later_fields
    out: dict[str, Any] = {}
    for name, value in values.items():
        spec = schema.fields.get(name)
        if spec is None:
            raise SchemaError(f"update: unknown field {name!r} for schema {schema.name!r}; the fields filled later "
                              f"are {later}")
        if not spec.later:
            raise SchemaError(f"update: field {name!r} is written with its row and cannot be updated; only fields "
                              f"declared `later: true` can ({later or 'none in this schema'}): declare it so in the "
                              "schema to fill it later")
        if isinstance(value, np.ma.MaskedArray) and np.ma.getmaskarray(value).any():
            raise SchemaError(f"update: field {name!r} has masked (missing) values; update takes a value for every "
                              "id (leave the ids without one out)")
        col = convert_field(spec, value, single)
        if len(col) != len(ids):
            raise SchemaError(f"update: field {name!r} has {len(col)} value(s) for {len(ids)} id(s); pass one value "
                              "per id")
        out[name] = col
    if len(ids) > 1:
        s = np.sort(ids)
        dup = s[1:][s[1:] == s[:-1]]
        if len(dup):
            raise InvalidArgument(f"update: id {int(dup[0])} appears more than once; pass each id once")
    return out


def check_update_types(schema: Any, incoming: pa.Schema, id_column: str = "id", where: str = "update") -> None:
    """Check an update stream's Arrow schema before any of its data is read: an integer `id_column` and one column
    per field to fill, each a field declared `later: true` of a type `extend` would take for it.

    Raises:
        SchemaError: naming the column, what was expected and what came.
    """
    from ..schema.convert import arrow_type_fits

    names = list(incoming.names)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SchemaError(f"{where}: duplicate column name(s) {dup[:10]}; send each column once")
    if id_column not in names:
        raise SchemaError(f"{where}: no {id_column!r} column; send the rows' ids (int64) in a column {id_column!r}")
    if not pa.types.is_integer(incoming.field(id_column).type):
        raise SchemaError(f"{where}: column {id_column!r} has Arrow type {str(incoming.field(id_column).type)[:80]}; "
                          "expected int64 ids")
    fields = [n for n in names if n != id_column]
    if not fields:
        raise SchemaError(f"{where}: no field to fill; send columns of the fields filled later "
                          f"({schema.later_fields})")
    for name in fields:
        spec = schema.fields.get(name)
        if spec is None or not spec.later:
            shown = name if len(name) <= 80 else name[:80] + "..."
            raise SchemaError(f"{where}: column {shown!r} is not a field filled later of schema {schema.name!r}; "
                              f"expected some of {schema.later_fields}")
        t = incoming.field(name).type
        if not arrow_type_fits(spec, t):
            raise SchemaError(f"{where}: column {name!r} has Arrow type {str(t)[:200]}; expected {spec.describe()} "
                              "(GetSchema [store, \"input\"] gives the exact type)")


__all__ = ["MAX_UPDATE_ROWS", "check_update_types", "update_ids", "validate_update"]
