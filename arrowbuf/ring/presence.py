"""Presence of the fields filled later: a validity array per `later: true` field, addressed by ring position.

A schema field marked `later: true` (`FieldSpec.later`) may be left out when a row is written and filled afterwards
by `store.update` (arrowbuf.engine.update). Its column arena holds the values (zeros where a row has none, so an absent
value never shows a previous row's data); `Presence` holds, per ring position, whether the row has a value. Readers
turn the two into an Arrow column whose validity bitmap is this array (`to_nullable`): absent values read as null.

Consistency: a row's values are written either by its writer (positions not yet live: the ring's seq check protects
readers) or by `update`, which writes live rows in place. Updates bracket their writes with a seqlock (`epoch`, odd
while writing): a reader notes the epoch, reads validity and values, and reads again if the epoch moved, so it never
returns half an update (a tensor row partly old, partly new) nor a value that is marked present but not yet written.
For a shared tier, the arrays and the epoch live in the tier's memory: every process of the store sees them.

Usage (what `arrowbuf.ring.columns.ColumnArenas` does)::

    presence = Presence(schema, tier, arena_rows)
    data = presence.mark("reward", first_pos, values)   # after validate_batch: records which rows have a value
    with presence.updating():                           # store.update, under the store's write lock
        arena[positions] = values; presence.valid["reward"][positions] = True
    values, present = presence.read("reward", positions, take)
    presence.present(["reward"], positions)             # bool per position
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import pyarrow as pa

from ..errors import ArrowbufError, SchemaError
from ..schema import ExperienceSchema, FieldSpec
from ..schema import logical as _logical
from ..schema.convert import later_mask, numpy_to_arrow
from ..schema.inputs import Converted, Gathered
from ..tiers.base import Tier

T = TypeVar("T")

_GIVE_UP_S = 30.0  # seqlock: seconds of overlapping updates before a read gives up (one takes micro- to milliseconds)


class Presence:
    """Validity arrays of a store's later fields (see the module docstring).

    Args:
        schema: the store's schema; its `later` fields get a validity array each.
        tier: where the arrays live (the store's tier: shared memory for a shared store).
        arena_rows: ring positions.

    Attributes:
        valid: per later field, a bool array over ring positions (True: the row there has a value).
        specs: per later field, its `FieldSpec`.
    """

    def __init__(self, schema: ExperienceSchema, tier: Tier, arena_rows: int) -> None:
        self.specs: dict[str, FieldSpec] = {f.name: f for f in schema.fields.values() if f.later}
        self.valid: dict[str, np.ndarray] = {}
        self.epoch = np.zeros(1, dtype=np.int64)
        if not self.specs:
            return
        for name in self.specs:
            self.valid[name] = tier.allocate(f"valid.{name}", np.dtype(np.bool_), arena_rows)
        self.epoch = tier.allocate("valid.epoch", np.dtype(np.int64), 1)
        if tier.fresh:  # an attaching process must not reset what the creator's users wrote
            for arr in self.valid.values():
                arr.fill(False)
            self.epoch.fill(0)

    def __contains__(self, name: object) -> bool:
        return name in self.valid

    def __bool__(self) -> bool:
        return bool(self.valid)

    # ------------------------------------------------------------------ writes
    def mark(self, name: str, first_pos: int, values: Converted) -> Converted:
        """Record which of the rows [first_pos, first_pos + len(values)) hold a value (from `validate_batch`'s
        masked or null rows); returns the values to store (numpy data, zeros where absent, or the Arrow list)."""
        present = later_mask(values)
        self.valid[name][first_pos:first_pos + len(values)] = True if present is None else present
        return np.ma.getdata(values) if isinstance(values, np.ma.MaskedArray) else values

    def mark_row(self, name: str, pos: int) -> None:
        """Row `pos` of `name` was written with a value (the one-row write path)."""
        self.valid[name][pos] = True

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Bracket an in-place write of live rows (update): readers re-read rows they read meanwhile. Callers hold
        the store's write lock, so updates never overlap."""
        if self.epoch[0] & 1:  # an updater died mid-write (its process was killed): close its bracket
            self.epoch[0] += 1
        self.epoch[0] += 1
        try:
            yield
        finally:
            self.epoch[0] += 1

    # ------------------------------------------------------------------ reads
    def present(self, fields: list[str], positions: np.ndarray, schema: ExperienceSchema) -> np.ndarray:
        """True where every one of `fields` has a value at ring `positions` (fields not filled later always do).

        Raises:
            SchemaError: a name that is not a field of the schema.
        """
        positions = np.asarray(positions, dtype=np.int64)
        out = np.ones(len(positions), dtype=bool)
        if isinstance(fields, str):
            fields = [fields]
        for name in fields:
            if name not in schema.fields:
                raise SchemaError(f"unknown field {name!r}; expected one of {sorted(schema.fields)} (the fields "
                                  f"filled later are {sorted(self.specs)})")
            if name in self.valid:
                out &= self.valid[name][positions]
        return out

    def read(self, name: str, positions: np.ndarray, take: Callable[[np.ndarray], T]) -> tuple[T, np.ndarray]:
        """`take(positions)` and the rows' validity, consistent with each other (the update seqlock)."""
        valid = self.valid[name]
        return self.consistent(lambda: (take(positions), valid[positions]), name)

    def consistent(self, read: Callable[[], T], what: str = "fields filled later") -> T:
        """`read()` run while no update writes: again if one wrote meanwhile (the update seqlock). Reading several
        later fields inside one `read` sees all of each update or none of it, across the fields (an update of
        several fields is one bracket: `ColumnArenas.update_fields`). Nested reads are fine (they wait likewise)."""
        epoch = self.epoch
        if not self.valid:
            return read()
        deadline = None
        while True:
            e0 = int(epoch[0])
            if not e0 & 1:
                out = read()
                if int(epoch[0]) == e0:
                    return out
            # an update is writing (or wrote meanwhile): let it finish; sched_yield also releases the GIL
            if deadline is None:
                deadline = time.monotonic() + _GIVE_UP_S
            elif time.monotonic() > deadline:
                raise ArrowbufError(f"could not read a consistent copy of {what!r}: updates kept overlapping "
                                    f"the read for {_GIVE_UP_S:.0f} s (an updating process stopped mid-write?)")
            os.sched_yield()


def to_nullable(spec: FieldSpec, values: Gathered, present: np.ndarray, shape: tuple[int, ...] = ()) -> Gathered:
    """Values of a later field as delivered: numpy (or a device tensor) shaped `shape + spec.shape` when every row has
    a value, else an Arrow array whose validity is `present` (null where a row has none; tensor fields as
    `fixed_shape_tensor`).

    Raises:
        SchemaError: sequence windows (`shape` of two dims) with absent rows: a window cannot hold a null row.
    """
    if present.all():
        return values.reshape(shape + tuple(values.shape[1:])) if len(shape) > 1 else values
    if len(shape) > 1:
        raise SchemaError(f"field {spec.name!r} is absent in {int((~present).sum())} row(s) of the sampled windows; "
                          "sequence windows deliver later fields only where present: leave it out of columns=, or "
                          "sample after the update")
    if not isinstance(values, np.ndarray):  # a device tensor: nulls live on the host
        values = values.detach().cpu().numpy()
    return nullable_array(spec, values, present)


def nullable_array(spec: FieldSpec, values: np.ndarray, present: np.ndarray) -> pa.Array:
    """`values` ([n, *shape] numpy) as an Arrow array of the field's type, null where not `present`."""
    mask = ~np.asarray(present, dtype=bool)
    if not spec.plain:  # bfloat16, float8, complex: the Arrow type of the dtype over the same memory
        return _logical.to_arrow(spec, values, mask)
    if not spec.shape:
        return pa.array(values, type=pa.from_numpy_dtype(spec.dtype), mask=mask)
    flat = numpy_to_arrow(np.ascontiguousarray(values).reshape(-1), pa.from_numpy_dtype(spec.dtype))
    size = int(np.prod(spec.shape))
    storage = pa.FixedSizeListArray.from_arrays(flat, size, mask=numpy_to_arrow(mask))
    return pa.ExtensionArray.from_storage(spec.arrow_type(), storage)
