"""The per-step checks of `append`'s fast path: which values it stores as they come, which it converts, and why a
step goes to the general path instead.

`StoreWriter.append` (arrowbuf/writer.py) stores a step without building batch arrays when every value is one the
general path (`ExperienceSchema.validate_batch`) would accept and convert without an error. These rules mirror
`convert._cast` exactly, so both paths store the same values and reject the same ones:

- a bool field takes `bool` / `np.bool_`, or an integer 0 or 1;
- an integer field takes any integer or bool scalar (Python or numpy, 0-d arrays too) within the field's range;
- a float field takes any integer or float scalar that fits its range (NaN and infinities pass unless the field
  says `allow_nan: false`; a finite value beyond float32's range is an error, as in `extend`);
- a tensor field takes an `np.ndarray` of its shape whose dtype is its own, or one it converts without loss or
  error checks (`np.can_cast(src, dst, "safe")`, e.g. int32 into int64), or a float array into a narrower float
  field (float64 into float32) with the overflow check of `extend`.

Anything else (lists, arrays of another shape, unsafe integer casts, Arrow values) takes the general path, which
either converts it or raises the schema's error; `StoreWriter` counts those steps in `stats()["append_slow_path"]`
and warns once (`AppendSlowPathWarning`) with the reason `slow_reason` gives.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..schema import FieldSpec

#: numpy scalar types by kind (the platform's aliases included: np.longlong is a type of its own)
_NP_SCALARS = {
    "b": (np.bool_,),
    "i": (np.int8, np.int16, np.int32, np.int64, np.intc, np.int_, np.longlong),
    "u": (np.uint8, np.uint16, np.uint32, np.uint64, np.uintc, np.uint, np.ulonglong),
    "f": (np.float16, np.float32, np.float64, np.longdouble),
}
_I64 = (-(2 ** 63), 2 ** 63 - 1)


def scalar_rule(spec: FieldSpec) -> tuple[frozenset, frozenset, frozenset, float | int, float | int]:
    """(exact, finite, ranged, lo, hi) for a scalar field: a value whose class is in `exact` is stored as it is (numpy
    converts it on assignment without loss); one in `finite` when `math.isfinite(value)`; one in `ranged` when
    `lo <= value <= hi`. Anything else needs `scalar_ok`. (Comparisons of numpy scalars cost about 0.5 us each,
    so the common classes need none.)"""
    dst = spec.dtype
    kind = dst.kind
    ints = (*_NP_SCALARS["i"], *_NP_SCALARS["u"])
    if kind == "b":
        return frozenset({bool, np.bool_}), frozenset(), frozenset({int, *ints}), 0, 1
    safe = {t for t in ints if np.can_cast(t, dst, "safe")}
    if kind in "iu":
        info = np.iinfo(dst)
        return (frozenset({bool, np.bool_, *safe}), frozenset(), frozenset({int, *ints} - safe), int(info.min),
                int(info.max))
    narrow: set[type] = {t for t in _NP_SCALARS["f"] if np.dtype(t).itemsize <= dst.itemsize}
    if dst.itemsize >= 8:
        narrow.add(float)
    ranged: set[type] = set()
    ranged.update((float, *_NP_SCALARS["f"], *ints))
    ranged -= narrow | safe
    big = float(np.finfo(dst).max)
    if spec.allow_nan:
        return frozenset(narrow | safe), frozenset(), frozenset(ranged), -big, big
    return frozenset(safe), frozenset(narrow), frozenset(ranged), -big, big


def scalar_ok(spec: FieldSpec, v: Any) -> Any:
    """The value to store for scalar field `spec`, or `None` when the general path must handle `v` (the rare
    cases `scalar_rule` leaves out: 0-d arrays, Python ints in bool or float fields, NaN and infinities)."""
    if v.__class__ is np.ndarray:
        if v.ndim != 0:
            return None
        v = v[()]
    kind = spec.dtype.kind
    cls = v.__class__
    exact, finite, ranged, lo, hi = scalar_rule(spec)
    if cls is int and kind == "f":  # np.asarray of an int beyond int64 is no number array: the general path
        return v if _I64[0] <= v <= _I64[1] and lo <= v <= hi else None
    if cls in exact or (cls in finite and math.isfinite(v)) or (cls in ranged and lo <= v <= hi):
        return v
    if kind == "f" and spec.allow_nan and cls in ranged and (v != v or v == np.inf or v == -np.inf):
        return v  # NaN and infinities are stored as they are; a finite value out of range is an error
    return None


def array_cast(spec: FieldSpec, src: np.dtype) -> str | None:
    """How a tensor field takes an array of dtype `src`: "same" (as it is), "safe" (convert, no check), "narrow"
    (a wider float: convert, then the overflow check), or None (the general path)."""
    dst = spec.dtype
    if src == dst:
        return "same"
    if dst.kind == "f" and src.kind == "f" and src.itemsize > dst.itemsize:
        return "narrow"
    kinds = {"b": "b", "i": "biu", "u": "biu", "f": "iuf"}[dst.kind]  # what `extend` converts (convert._cast)
    if src.kind in kinds and np.can_cast(src, dst, "safe"):
        return "safe"
    return None


def array_ok(spec: FieldSpec, v: Any) -> np.ndarray | None:
    """The array to store for tensor field `spec` (converted when its dtype differs), or None for the general
    path. `extend`'s rules: no silent overflow to infinity, and no NaN or infinity when the field forbids them."""
    if v.__class__ is not np.ndarray or v.shape != spec.shape:
        return None
    how = array_cast(spec, v.dtype)
    if how is None:
        return None
    if how == "narrow":
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is checked below, as `extend` does
            out = v.astype(spec.dtype)
    else:
        out = v if how == "same" else v.astype(spec.dtype)
    if spec.dtype.kind == "f":
        if not spec.allow_nan:
            if not np.isfinite(out).all():
                return None
        elif how == "narrow":
            inf = np.isinf(out)
            if inf.any() and (inf & ~np.isinf(v)).any():
                return None
    return out


def slow_reason(schema: Any, step: Any, derived: tuple[str, ...]) -> str:
    """Why a step (that the general path then stored) did not take the fast path: a short category that names the
    field and what came, e.g. "field 'action': list (expected int64 scalar)"."""
    if type(step) is not dict:
        return f"the step is a {type(step).__name__}, not a dict"
    for name, spec in schema.fields.items():
        if not spec.plain:
            return f"field {name!r} is {spec.dtype_name} (the general path converts it)"
        if spec.ragged or spec.later:
            return f"field {name!r} is {'ragged' if spec.ragged else 'filled later'} (the general path stores it)"
        if name not in step:
            return f"field {name!r} is missing"
        v = step[name]
        if spec.shape:
            if array_ok(spec, v) is None:
                got = (f"{v.dtype} array of shape {list(v.shape)}" if isinstance(v, np.ndarray)
                       else type(v).__name__)
                return f"field {name!r}: {got} (expected {spec.describe()})"
        elif scalar_ok(spec, v) is None:
            got = f"{type(v).__name__}" + (f" {v.dtype}" if isinstance(v, (np.ndarray, np.generic)) else "")
            return f"field {name!r}: {got} (expected {spec.describe()} scalar)"
    extra = sorted(set(step) - set(schema.fields) - {"actor", *derived})
    if extra:
        return f"extra keys {extra}"
    if "actor" in step and type(step["actor"]) not in (int, str):
        return f"actor is a {type(step['actor']).__name__} (the fast path takes int or str)"
    return "a derived field's value needs converting"
