"""Experience schemas: the declared layout of a step, and validation of incoming batches against it.

A schema is declared once, in YAML, a dict, or a `pa.Schema`::

    name: atari
    version: 1                       # optional
    fields:
      obs:        {dtype: uint8, shape: [4, 84, 84]}
      action:     {dtype: int64}
      reward:     {dtype: float32, allow_nan: false}
      terminated: {dtype: bool}
      truncated:  {dtype: bool}
      score:      {dtype: float32, later: true}   # filled later by `store.update`: absent (null) until then
    derived:
      next_obs: {next_of: obs}      # read from the next step of the same episode, not stored twice
    episode_end: [terminated, truncated]   # optional; default: the fields named done/terminated/truncated
    truncation: [truncated]          # optional: the episode_end fields that cut an episode short (time limits):
                                     # n-step returns bootstrap there; the others terminate. Default: `truncated`
    metadata: {owner: team-a}        # optional: string -> string, kept with the schema (manifests, checkpoints,
                                     # Arrow schema metadata `arrowbuf.meta.<key>`); arrowbuf never reads it

Usage::

    schema = load_schema("schemas/atari.yaml")
    columns, n = schema.validate_batch(batch)     # SchemaError naming the field on bad input

How each field's values are checked and converted (dtypes, casts, shapes, ragged lists, null rows of later fields)
lives in arrowbuf/schema/convert.py.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import SchemaError
from . import dtypes as _dtypes
from .convert import (
    absent_values,
    arrow_type_fits,
    convert_field,
    convert_later,
    stream_column,
)
from .spec import (
    DEFAULT_EPISODE_END,
    DEFAULT_TRUNCATION,
    JSON,
    STREAM_KEYS,
    SYSTEM_COLUMNS,
    DerivedSpec,
    FieldSpec,
    parse_dtype,
)

#: Arrow schema metadata keys of `ExperienceSchema.metadata` entries.
_META_PREFIX = b"arrowbuf.meta."


@dataclass(frozen=True)
class ExperienceSchema:
    """The layout of one step: stored fields, derived fields and which fields end an episode.

    Build one with `load_schema` (a YAML path, a dict of the same form, or a `pa.Schema`).
    """

    name: str
    fields: dict[str, FieldSpec]
    derived: dict[str, DerivedSpec] = field(default_factory=dict)
    episode_end: tuple[str, ...] = ()
    version: int | str | None = None
    #: The episode_end fields that mean truncation (bootstrap from the next observation); the other end fields
    #: mean termination. Default: `truncated`, when it is an end field.
    truncation: tuple[str, ...] = DEFAULT_TRUNCATION
    #: Free-form string -> string metadata that travels with the schema (to_dict, to_arrow, shared-memory manifests,
    #: checkpoints); arrowbuf itself never interprets it (integrations keep their own layout descriptions there).
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.fields:
            raise SchemaError(f"schema {self.name!r}: 'fields' is empty; declare at least one field")
        for name in self.fields:
            if name in SYSTEM_COLUMNS or name in STREAM_KEYS:
                raise SchemaError(f"schema {self.name!r}: field name {name!r} is reserved for the store")
        for d in self.derived.values():
            if d.name in self.fields:
                raise SchemaError(f"schema {self.name!r}: derived field {d.name!r} is also a stored field")
            src = self.fields.get(d.next_of)
            if src is None:
                raise SchemaError(
                    f"schema {self.name!r}: derived field {d.name!r} has next_of={d.next_of!r}, "
                    f"which is not a field; expected one of {sorted(self.fields)}"
                )
            if src.ragged:
                raise SchemaError(f"schema {self.name!r}: derived field {d.name!r} cannot derive from ragged field")
            if src.logical is not None:
                raise SchemaError(f"schema {self.name!r}: derived field {d.name!r} cannot derive from a "
                                  f"{src.dtype_name} field ({d.next_of!r}); store it as a field of its own")
            if src.later:
                raise SchemaError(f"schema {self.name!r}: derived field {d.name!r} derives from {d.next_of!r}, which "
                                  "is filled later; a next_of source is written with its row (drop `later`)")
        for name in self.episode_end:
            spec = self.fields.get(name)
            if spec is None or spec.dtype != np.bool_ or spec.shape or spec.ragged:
                raise SchemaError(
                    f"schema {self.name!r}: episode_end field {name!r} must be a scalar bool field"
                )
            if spec.later:
                raise SchemaError(f"schema {self.name!r}: episode_end field {name!r} cannot be filled later: the "
                                  "store links episodes when a row is written (drop `later`, or leave it out of "
                                  "episode_end)")
        self._check_truncation()

    def _check_truncation(self) -> None:
        """Resolve the default `truncation`; refuse end fields whose meaning is ambiguous."""
        if self.truncation is DEFAULT_TRUNCATION:
            object.__setattr__(self, "truncation", tuple(n for n in DEFAULT_TRUNCATION if n in self.episode_end))
            for name in self.episode_end:
                if name in self.truncation or name.lower() in _TERMINATION_NAMES:
                    continue
                if any(h in name.lower() for h in _TIME_LIMIT_HINTS):
                    raise SchemaError(
                        f"schema {self.name!r}: episode_end field {name!r} reads as a time limit, but only "
                        f"{list(DEFAULT_TRUNCATION)} means truncation by default, so it would count as termination "
                        f"(no bootstrapping); declare it: truncation: [{name}] (or truncation: [] if it really "
                        "terminates)")
                warnings.warn(f"schema {self.name!r}: episode_end field {name!r} is treated as termination (no "
                              f"bootstrapping); if it marks a time limit, declare truncation: [{name}]", stacklevel=4)
            return
        object.__setattr__(self, "truncation", tuple(self.truncation))
        for name in self.truncation:
            if name not in self.episode_end:
                raise SchemaError(f"schema {self.name!r}: truncation names {name!r}, which is not an episode_end "
                                  f"field ({list(self.episode_end)}); add it to episode_end or drop it")

    # ---------------------------------------------------------------- views
    def to_arrow(self) -> pa.Schema:
        """The `pa.Schema` of the stored columns: the fields, then the system columns."""
        cols = [pa.field(f.name, f.arrow_type(), nullable=f.later, metadata=_field_metadata(f))
                for f in self.fields.values()]
        cols += [pa.field(n, t, nullable=False) for n, t in SYSTEM_COLUMNS.items()]
        meta = {b"arrowbuf.schema": self.name.encode(), b"arrowbuf.version": str(self.version or "").encode()}
        if self.derived:
            meta[b"arrowbuf.derived"] = ",".join(f"{d.name}:{d.next_of}" for d in self.derived.values()).encode()
        if self.episode_end:
            meta[b"arrowbuf.episode_end"] = ",".join(self.episode_end).encode()
            meta[b"arrowbuf.truncation"] = ",".join(self.truncation).encode()
        for k, v in self.metadata.items():
            meta[_META_PREFIX + k.encode()] = v.encode()
        return pa.schema(cols, metadata=meta)

    def input_schema(self) -> pa.Schema:
        """The `pa.Schema` a writer sends: the fields, plus the derived fields (needed on episode ends)."""
        cols = [pa.field(f.name, f.arrow_type(), metadata=_field_metadata(f)) for f in self.fields.values()]
        for d in self.derived.values():
            cols.append(pa.field(d.name, self.fields[d.next_of].arrow_type()))
        return pa.schema(cols)

    def sample_schema(self, columns: list[str] | None = None) -> pa.Schema:
        """The `pa.Schema` of `SampleBatch.data` for the given columns."""
        names = self.resolve_columns(columns)
        return pa.schema([pa.field(n, self.column_type(n), nullable=n in self.later_fields) for n in names])

    def column_type(self, name: str) -> pa.DataType:
        if name in self.fields:
            return self.fields[name].arrow_type()
        if name in self.derived:
            return self.fields[self.derived[name].next_of].arrow_type()
        if name in SYSTEM_COLUMNS:
            return SYSTEM_COLUMNS[name]
        raise SchemaError(f"unknown column {name!r}; expected one of {self.column_names()}")

    def column_names(self) -> list[str]:
        return [*self.fields, *self.derived, *SYSTEM_COLUMNS]

    @property
    def later_fields(self) -> list[str]:
        """Names of the fields filled later (`later: true`), in schema order."""
        return [f.name for f in self.fields.values() if f.later]

    def resolve_columns(self, columns: list[str] | tuple[str, ...] | None) -> list[str]:
        """The columns a sample returns: all fields and derived fields by default."""
        if columns is None:
            return [*self.fields, *self.derived]
        if isinstance(columns, str):
            columns = [columns]
        out = list(dict.fromkeys(columns))
        for c in out:
            self.column_type(c)
        return out

    def spec_of(self, name: str) -> FieldSpec:
        """The FieldSpec of a stored or derived column."""
        if name in self.fields:
            return self.fields[name]
        d = self.derived[name]
        return dataclasses.replace(self.fields[d.next_of], name=d.name)

    @property
    def row_bytes(self) -> int:
        return sum(f.row_bytes for f in self.fields.values())

    def to_dict(self) -> dict[str, Any]:
        """The dict form `load_schema` accepts (round-trips)."""
        fields: dict[str, Any] = {}
        for f in self.fields.values():
            d: dict[str, Any] = {"dtype": f.dtype_name}
            if f.shape:
                d["shape"] = list(f.shape)
            if f.ragged and not f.is_json:
                d["ragged"] = True
            if not f.allow_nan:
                d["allow_nan"] = False
            if f.later:
                d["later"] = True
            if f.mean_length is not None:
                d["mean_length"] = f.mean_length
            fields[f.name] = d
        out: dict[str, Any] = {"name": self.name, "fields": fields}
        if self.version is not None:
            out["version"] = self.version
        if self.derived:
            out["derived"] = {d.name: {"next_of": d.next_of} for d in self.derived.values()}
        out["episode_end"] = list(self.episode_end)
        out["truncation"] = list(self.truncation)
        if self.metadata:
            out["metadata"] = dict(self.metadata)
        return out

    # ---------------------------------------------------------------- validation
    def check_input_types(self, incoming: pa.Schema, where: str = "input") -> None:
        """Check a writer's Arrow schema (names, types, shapes) before any of its data is read.

        Accepts what `validate_batch` converts without loss: a scalar field from a bool/integer/float column the
        dtype rules allow, a tensor field from a `fixed_shape_tensor` of its shape or (nested) fixed-size lists of
        its element count, a ragged field from a list column, `episode_id` from integers, `actor` from integers or
        strings. A DoPut stream's schema message is checked with this before its first batch.

        Raises:
            SchemaError: naming the column, what was expected and what came.
        """
        names = list(incoming.names)
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise SchemaError(f"{where}: duplicate column name(s) {_clip(dup)}; send each field once")
        allowed = set(self.fields) | set(self.derived) | set(STREAM_KEYS)
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise SchemaError(f"{where}: unknown column(s) {_clip(unknown)} for schema {self.name!r}; expected fields "
                              f"{sorted(self.fields)} (GetSchema [store, \"input\"] gives the exact schema)")
        missing = [k for k in self.fields if k not in names and not self.fields[k].later]
        if missing:
            raise SchemaError(f"{where}: missing field(s) {missing} for schema {self.name!r}: every step needs them"
                              + _later_hint(self))
        for f in incoming:
            if f.name in STREAM_KEYS:
                ok = pa.types.is_integer(f.type) or (f.name == "actor" and (pa.types.is_string(f.type)
                                                                             or pa.types.is_large_string(f.type)))
                want = "integers" if f.name == "episode_id" else "integers or strings"
            else:
                spec = self.spec_of(f.name)
                ok, want = arrow_type_fits(spec, f.type), spec.describe()
            if not ok:
                raise SchemaError(f"{where}: column {f.name!r} has Arrow type {_clip(str(f.type))}; expected "
                                  f"{want} (GetSchema [store, \"input\"] gives the exact schema)")

    def validate_batch(self, batch: Any, *, single: bool = False) -> tuple[dict[str, Any], int]:
        """Check a batch against the schema and convert it to columns.

        Args:
            batch: dict of arrays with a leading dimension, `pa.RecordBatch` or `pa.Table`; with `single=True` a
                dict of one step's values (no leading dimension).
            single: the batch is one step.

        Returns:
            (columns, n): numpy arrays of shape [n, *shape] for fixed fields, `pa.ListArray` for ragged fields; the
            derived fields (final observations) and stream keys (`episode_id`, `actor`) when given.

        Raises:
            SchemaError: naming the field, what was expected and what came.
        """
        if isinstance(batch, (pa.RecordBatch, pa.Table)):
            if single:
                raise SchemaError("append takes one step as a dict; use extend for a RecordBatch or Table")
            names = batch.schema.names
            if len(set(names)) != len(names):
                dup = sorted({n for n in names if names.count(n) > 1})
                raise SchemaError(f"duplicate column name(s) {_clip(dup)}; send each field once")
            raw: dict[str, Any] = {name: batch.column(i) for i, name in enumerate(names)}
        elif isinstance(batch, Mapping):
            raw = dict(batch)
        else:
            raise SchemaError(
                f"expected a dict of arrays, a pa.RecordBatch or a pa.Table; got {type(batch).__name__}"
            )
        allowed = set(self.fields) | set(self.derived) | set(STREAM_KEYS)
        unknown = [k for k in raw if k not in allowed]
        if unknown:
            raise SchemaError(
                f"unknown field(s) {unknown} for schema {self.name!r}; expected fields {sorted(self.fields)}"
                + (f", derived {sorted(self.derived)}" if self.derived else "")
                + f" and optional stream keys {list(STREAM_KEYS)}"
            )
        missing = [k for k in self.fields if k not in raw and not self.fields[k].later]
        if missing:
            raise SchemaError(f"missing field(s) {missing} for schema {self.name!r}: every step needs them"
                              + _later_hint(self))
        out: dict[str, Any] = {}
        n: int | None = None
        for name, value in raw.items():
            if name in STREAM_KEYS:
                col = stream_column(name, value, single)
            elif name in self.fields and self.fields[name].later:
                if single and value is None:  # append({..., "reward": None}): not produced yet
                    continue
                col = convert_later(self.fields[name], value, single)
            else:
                col = convert_field(self.spec_of(name), value, single)
            rows = len(col)
            if n is None:
                n = rows
            elif rows != n:
                first = next(iter(out))
                raise SchemaError(
                    f"field {name!r} has {rows} rows but {first!r} has {n}; every field needs the same leading dim"
                )
            out[name] = col
        n = 1 if single else int(n or 0)
        for spec in self.fields.values():  # later fields left out: every row absent
            if spec.later and spec.name not in out:
                out[spec.name] = absent_values(spec, n)
        return out, n

# End-field names that read as termination; other end fields need `truncation` to say what they are.
_TERMINATION_NAMES = {"done", "dones", "terminated", "terminal", "terminals", "is_terminal", "terminate"}
# End-field names that read as a time limit: without `truncation`, treating them as termination is an error.
_TIME_LIMIT_HINTS = ("trunc", "timeout", "time_out", "time_limit", "timelimit")



def _field_metadata(f: FieldSpec) -> dict[bytes, bytes] | None:
    """The Arrow field metadata that carries what an Arrow type cannot say (allow_nan, later)."""
    meta = {}
    if not f.allow_nan:
        meta[b"arrowbuf.allow_nan"] = b"false"
    if f.later:
        meta[b"arrowbuf.later"] = b"true"
    if f.mean_length is not None:
        meta[b"arrowbuf.mean_length"] = str(f.mean_length).encode()
    return meta or None


def _later_hint(schema: ExperienceSchema) -> str:
    later = schema.later_fields
    if later:
        return f" (only the fields filled later, {later}, may be left out)"
    return " (a field that a later stage fills can be declared `later: true` and left out)"


def _clip(value: Any, limit: int = 200) -> str:
    """A client-supplied value cut to `limit` characters for an error message."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


# ---------------------------------------------------------------- loading
#: The schemas shipped with arrowbuf: the repository's top-level schemas/ (arrowbuf/schemas links to it in a checkout;
#: the wheel carries copies), so `load_schema("atari")` works from a pip install too.
_BUNDLED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "schemas")


def bundled_schemas() -> list[str]:
    """Names of the schemas shipped with arrowbuf (`load_schema(name)` loads one), e.g. ['atari', 'cartpole', ...]."""
    try:
        return sorted(f[:-5] for f in os.listdir(_BUNDLED) if f.endswith(".yaml"))
    except OSError:
        return []


def bundled_schema_path(name: str) -> str | None:
    """The file of the shipped schema `name` ("atari" or "atari.yaml"), or None when there is no such schema."""
    base = name[:-5] if name.endswith(".yaml") else name
    if not base or not all(c.isalnum() or c in "_-" for c in base):
        return None
    path = os.path.join(_BUNDLED, base + ".yaml")
    return path if os.path.isfile(path) else None


def load_schema(source: str | os.PathLike | Mapping[str, Any] | pa.Schema | ExperienceSchema) -> ExperienceSchema:
    """Load an `ExperienceSchema` from a YAML path, the name of a shipped schema ("atari", see `bundled_schemas`), a
    dict of the same form, or a `pa.Schema`.

    Raises:
        SchemaError: the file or dict is malformed; the message says where and what was expected.
    """
    if isinstance(source, ExperienceSchema):
        return source
    if isinstance(source, pa.Schema):
        return _from_arrow(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):
            bundled = bundled_schema_path(path)
            if bundled is None:
                raise SchemaError(f"schema file {path!r} does not exist, and it is not the name of a schema shipped "
                                  f"with arrowbuf ({', '.join(bundled_schemas())}); pass a path or one of those names")
            path = bundled
        import yaml

        try:
            with open(path) as fh:
                data = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise SchemaError(f"schema file {path!r} is not valid YAML: {exc}") from None
        if not isinstance(data, Mapping):
            raise SchemaError(f"schema file {path!r}: expected a mapping with 'name' and 'fields' at the top")
        data = dict(data)
        data.setdefault("name", os.path.splitext(os.path.basename(path))[0])
        return _from_dict(data, where=path)
    if isinstance(source, Mapping):
        return _from_dict(source, where="schema")
    raise SchemaError(f"load_schema takes a path, a dict or a pa.Schema; got {type(source).__name__}")


def _from_dict(data: Mapping[str, Any], where: str) -> ExperienceSchema:
    known = {"name", "version", "fields", "derived", "episode_end", "truncation", "description", "metadata"}
    extra = set(data) - known
    if extra:
        raise SchemaError(f"{where}: unknown top-level key(s) {sorted(extra)}; expected {sorted(known)}")
    fields_raw = data.get("fields")
    if not isinstance(fields_raw, Mapping) or not fields_raw:
        raise SchemaError(f"{where}: 'fields' must be a non-empty mapping of name -> {{dtype, shape?, ragged?}}")
    fields: dict[str, FieldSpec] = {}
    for name, spec in fields_raw.items():
        loc = f"{where}: field {name!r}"
        if isinstance(spec, str):
            spec = {"dtype": spec}
        if not isinstance(spec, Mapping):
            raise SchemaError(f"{loc}: expected a mapping {{dtype, shape?, ragged?}}, got {spec!r}")
        bad = set(spec) - {"dtype", "shape", "ragged", "allow_nan", "later", "mean_length", "description"}
        if bad:
            raise SchemaError(f"{loc}: unknown key(s) {sorted(bad)}; expected dtype, shape, ragged, allow_nan, later, "
                              "mean_length")
        if "dtype" not in spec:
            raise SchemaError(f"{loc}: missing 'dtype'")
        dtype, logical = parse_dtype(loc, spec["dtype"])
        shape_raw = spec.get("shape", []) or []
        if isinstance(shape_raw, int):
            shape_raw = [shape_raw]
        if not isinstance(shape_raw, (list, tuple)) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape_raw
        ):
            raise SchemaError(f"{loc}: 'shape' must be a list of positive integers, got {shape_raw!r}")
        ragged = spec.get("ragged", False)
        if not isinstance(ragged, bool):
            raise SchemaError(f"{loc}: 'ragged' must be true or false, got {ragged!r}")
        if ragged and shape_raw:
            raise SchemaError(f"{loc}: a ragged field is a 1-D list per step; drop 'shape'")
        allow_nan = spec.get("allow_nan", True)
        if not isinstance(allow_nan, bool):
            raise SchemaError(f"{loc}: 'allow_nan' must be true or false, got {allow_nan!r}")
        later = spec.get("later", False)
        if not isinstance(later, bool):
            raise SchemaError(f"{loc}: 'later' must be true or false, got {later!r}")
        mean_length = spec.get("mean_length")
        if logical == JSON and ragged:
            raise SchemaError(f"{loc}: a json field holds one JSON value per step (a list is a value); drop "
                              "'ragged'")
        if mean_length is not None and (not isinstance(mean_length, int) or isinstance(mean_length, bool)
                                        or not 0 < mean_length <= 1 << 30 or not (ragged or logical == JSON)):
            raise SchemaError(f"{loc}: 'mean_length' is the mean elements per row of a ragged field (bytes of text "
                              "of a json field): a positive integer (at most 2**30) on a field with ragged: true "
                              f"or dtype: json; got {mean_length!r}")
        fields[str(name)] = FieldSpec(str(name), dtype, tuple(shape_raw), ragged, allow_nan, later, mean_length,
                                      logical)
    derived: dict[str, DerivedSpec] = {}
    derived_raw = data.get("derived") or {}
    if not isinstance(derived_raw, Mapping):
        raise SchemaError(f"{where}: 'derived' must be a mapping like {{next_obs: {{next_of: obs}}}}")
    for name, spec in derived_raw.items():
        if not isinstance(spec, Mapping) or set(spec) != {"next_of"}:
            raise SchemaError(f"{where}: derived field {name!r}: expected {{next_of: <field>}}, got {spec!r}")
        derived[str(name)] = DerivedSpec(str(name), str(spec["next_of"]))
    if "episode_end" in data:
        ends = data["episode_end"] or []
        if isinstance(ends, str):
            ends = [ends]
        if not isinstance(ends, (list, tuple)):
            raise SchemaError(f"{where}: 'episode_end' must be a list of bool field names")
        for e in ends:
            if e not in fields:
                raise SchemaError(f"{where}: episode_end names {e!r}, which is not a field")
        episode_end = tuple(ends)
    else:
        episode_end = tuple(n for n in DEFAULT_EPISODE_END if n in fields and fields[n].dtype == np.bool_)
    name = data.get("name", "experience")
    if not isinstance(name, str) or not name:
        raise SchemaError(f"{where}: 'name' must be a non-empty string")
    version = data.get("version")
    if version is not None and not isinstance(version, (int, str)):
        raise SchemaError(f"{where}: 'version' must be an integer or string, got {version!r}")
    truncation = DEFAULT_TRUNCATION
    if "truncation" in data:
        raw = data["truncation"] or []
        raw = [raw] if isinstance(raw, str) else raw
        if not isinstance(raw, (list, tuple)) or not all(isinstance(t, str) for t in raw):
            raise SchemaError(f"{where}: 'truncation' must be a list of episode_end field names, got {raw!r}")
        truncation = tuple(raw)
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in metadata.items()):
        raise SchemaError(f"{where}: 'metadata' must be a mapping of strings to strings, got {metadata!r}")
    return ExperienceSchema(name=name, fields=fields, derived=derived, episode_end=episode_end, version=version,
                            truncation=truncation, metadata=dict(metadata))


def _from_arrow(schema: pa.Schema) -> ExperienceSchema:
    meta = schema.metadata or {}
    fields: dict[str, FieldSpec] = {}
    for f in schema:
        if f.name in SYSTEM_COLUMNS:
            continue
        t = f.type
        if isinstance(t, _dtypes.LogicalType):
            fields[f.name] = FieldSpec(f.name, t.dtype_name, t.shape)  # type: ignore[arg-type]  # a dtype name
        elif isinstance(t, pa.JsonType):
            fields[f.name] = FieldSpec(f.name, JSON)  # type: ignore[arg-type]  # a dtype name
        elif isinstance(t, pa.FixedShapeTensorType):
            fields[f.name] = FieldSpec(f.name, np.dtype(t.value_type.to_pandas_dtype()), tuple(t.shape))
        elif pa.types.is_fixed_size_list(t):
            fields[f.name] = FieldSpec(f.name, np.dtype(t.value_type.to_pandas_dtype()), (t.list_size,))
        elif (pa.types.is_list(t) or pa.types.is_large_list(t)) and isinstance(t.value_type, _dtypes.LogicalType):
            fields[f.name] = FieldSpec(f.name, t.value_type.dtype_name, (), ragged=True)  # type: ignore[arg-type]
        elif pa.types.is_list(t) or pa.types.is_large_list(t):
            fields[f.name] = FieldSpec(f.name, np.dtype(t.value_type.to_pandas_dtype()), (), ragged=True)
        else:
            try:
                dtype = np.dtype(t.to_pandas_dtype())
            except (NotImplementedError, TypeError):
                raise SchemaError(f"pa.Schema field {f.name!r}: unsupported Arrow type {t}") from None
            np_dtype, logical = parse_dtype(f"field {f.name!r}", dtype)
            fields[f.name] = FieldSpec(f.name, np_dtype, logical=logical)
        meta_f = f.metadata or {}
        if meta_f.get(b"arrowbuf.allow_nan") == b"false" or meta_f.get(b"arrowbuf.later") == b"true" or \
                b"arrowbuf.mean_length" in meta_f:
            spec = fields[f.name]
            mean = meta_f.get(b"arrowbuf.mean_length")
            fields[f.name] = dataclasses.replace(
                spec, allow_nan=meta_f.get(b"arrowbuf.allow_nan") != b"false",
                later=meta_f.get(b"arrowbuf.later") == b"true",
                mean_length=int(mean) if mean is not None and mean.isdigit() and spec.ragged else None)
    derived = {}
    if b"arrowbuf.derived" in meta:
        for pair in meta[b"arrowbuf.derived"].decode().split(","):
            d, src = pair.split(":")
            derived[d] = DerivedSpec(d, src)
    if b"arrowbuf.episode_end" in meta:
        ends = tuple(e for e in meta[b"arrowbuf.episode_end"].decode().split(",") if e)
    else:
        ends = tuple(n for n in DEFAULT_EPISODE_END if n in fields and fields[n].dtype == np.bool_)
    name = meta.get(b"arrowbuf.schema", b"experience").decode()
    version = meta.get(b"arrowbuf.version", b"").decode() or None
    trunc = DEFAULT_TRUNCATION
    if b"arrowbuf.truncation" in meta:
        trunc = tuple(t for t in meta[b"arrowbuf.truncation"].decode().split(",") if t)
    metadata = {k[len(_META_PREFIX):].decode(): v.decode() for k, v in meta.items() if k.startswith(_META_PREFIX)}
    return ExperienceSchema(name=name, fields=fields, derived=derived, episode_end=ends, version=version,
                            truncation=trunc, metadata=metadata)
