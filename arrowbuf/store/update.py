"""`store.update`: fill fields of rows already stored (the LLM post-training path: rewards, reference log-probs).

A schema marks the fields a later stage produces with `later: true` (`arrowbuf.schema.FieldSpec.later`); a row may be
written without them (they read as null) and a reward worker or a reference-model worker fills them afterwards::

    ids = store.extend(rollouts)                                   # reward, ref_logprobs left out
    store.update(ids, {"reward": rewards})                         # one value per id
    store.update(ids[:2], {"ref_logprobs": [lp0, lp1]})            # ragged: one list per id (or a pa.ListArray)
    store.stats()["update_skipped"]                                # ids whose row was evicted meanwhile

Semantics:
- Only fields declared `later: true` can be updated. The others are written with their row and never change: the
  store's episode links, samplers and snapshots rely on that (a row's data is immutable until eviction, which is
  what lets a checkpoint copy sealed chunks without a lock). Declare a field `later` to fill or correct it.
- Updating a row whose field already has a value overwrites it (last write wins; a reward worker may retry).
- Validation is `extend`'s: the field exists, the dtype converts without loss, the shape (or a ragged field's
  element dtype) matches, `allow_nan`, and one value per id. Everything is checked before anything is written, under
  the store's write lock, so a call is atomic: readers see all of its rows or none of a row (see
  `arrowbuf.ring.presence`).
- Ids are what `extend`/`append` returned. An id whose row was evicted or replaced (the ring's seq check, as for
  `update_priorities`) is skipped and counted in `stats()["update_skipped"]`; the call returns the rows written. An
  id this store never issued (negative, at or past the next id, another store's encoding such as a ShardedStore's
  global id) raises `InvalidArgument`, and nothing is written. So does an id given twice.
- After writing, consumers waiting for fields (`store.consume(require=...)`) are woken: the store's condition is
  notified, then `StoreCore.on_update(positions, fields)` is called when set (under the write lock only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import InvalidArgument, SchemaError
from ..schema.convert import convert_field
from .core import StoreCore

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


class StoreUpdater:
    """`update` over a store's `StoreCore` (see the module docstring)."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core

    def update(self, ids: Any, values: Any) -> int:
        """Fill later fields of stored rows; returns the number of rows written (see the module docstring).

        Raises:
            SchemaError, InvalidArgument: bad input; nothing written.
            StoreClosed: the store is closed.
        """
        seqs = update_ids(ids)
        single = isinstance(ids, (int, np.integer)) and not isinstance(ids, bool)
        cols = validate_update(self.core.schema, seqs, values, single)
        return self.apply(seqs, cols)

    def check_issued(self, seqs: np.ndarray) -> None:
        """Refuse ids this store never issued (negative, or at or past its next id).

        Raises:
            InvalidArgument: naming the id.
            StoreClosed: the store is closed.
        """
        c = self.core
        c.check_open()
        if len(seqs) and seqs.min() < 0:
            raise InvalidArgument(f"update: id {int(seqs.min())} is negative; ids are what extend/append returned")
        hi = c.index.hi
        if len(seqs) and seqs.max() >= hi:
            raise InvalidArgument(f"update: id {int(seqs.max())} was never issued by store {c.name!r} (its next "
                                  f"id is {hi}); pass ids this store's extend/append returned (a ShardedStore's "
                                  "ids go to the ShardedStore)")

    def apply(self, seqs: np.ndarray, cols: dict[str, Any]) -> int:
        """`update` of ids and columns already checked (`update_ids`, `validate_update`); returns the rows written.

        Raises:
            InvalidArgument: an id never issued (`check_issued`); nothing written.
            StoreClosed: the store is closed.
        """
        c = self.core
        self.check_issued(seqs)
        with c.write_lock:  # rows are evicted only by writers: holding it, a live row stays live until we finish
            c.check_open()
            idx = c.index
            live = idx.live(seqs)
            keep = np.flatnonzero(live)
            pos = seqs[keep] % c.arena_rows
            if len(keep):
                parts = {name: col if len(keep) == len(seqs) else (
                    col.take(pa.array(keep)) if isinstance(col, pa.Array) else col[keep]) for name, col in cols.items()}
                c.cols.update_fields(pos, parts)  # one bracket: readers see all of a row's update or none
            with c.cond:
                skipped = len(seqs) - len(keep)
                if skipped:
                    idx.count("update_skipped", skipped)
                if len(keep):
                    c.cond.notify_all()  # consumers waiting for fields (consume require=) check again
            if len(keep) and c.on_update is not None:
                c.on_update(pos, list(cols))
        return len(keep)
