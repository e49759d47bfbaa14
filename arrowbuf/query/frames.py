"""Dataframe views of a store: pandas, Polars, DuckDB SQL and the episode summary.

pandas, Polars and DuckDB are optional (`pip install 'arrowbuf[query]'`) and imported on first use.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import SchemaError, require
from ..schema.dtypes import LogicalType, unwrap_list
from ..surface import LineageSource

if TYPE_CHECKING:  # pragma: no cover
    from ..schema import ExperienceSchema
    from .sql import SqlLimits


class RowSource(Protocol):
    """What the views here read of a store: any store surface (`ab.StoreSurface`) has both."""

    schema: ExperienceSchema

    def to_table(self, columns: list[str] | None = None) -> pa.Table: ...


def _plain(table: pa.Table, sql: bool = False) -> pa.Table:
    """Extension columns as their storage, which every dataframe library reads: tensors as (nested) fixed-size
    lists, bfloat16/float8 as their bits (uint16/uint8), complex numbers as fixed-size lists of (real, imaginary)
    floats, JSON as its text (docs/fields.md). For DuckDB (`sql`): JSON stays `arrow.json` (DuckDB's JSON type) and
    float16 becomes float32 (exact: DuckDB reads no half floats)."""
    cols = []
    for col in table.columns:
        t = col.type
        if isinstance(t, pa.FixedShapeTensorType) or isinstance(t, LogicalType) or (
                isinstance(t, pa.JsonType) and not sql):
            col = pa.chunked_array([c.storage for c in col.chunks], type=t.storage_type)
        elif (pa.types.is_list(t) or pa.types.is_large_list(t)) and isinstance(t.value_type, LogicalType):
            col = pa.chunked_array([unwrap_list(c) for c in col.chunks])  # ragged bfloat16/float8: their bits
        if sql and _has_half(col.type):
            col = col.cast(_no_half(col.type))
        cols.append(col)
    return pa.Table.from_arrays(cols, names=table.column_names)


def _has_half(t: pa.DataType) -> bool:
    if pa.types.is_float16(t):
        return True
    return (pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t)) and \
        _has_half(t.value_type)


def _no_half(t: pa.DataType) -> pa.DataType:
    """`t` with float16 values as float32 (exact), inside lists too."""
    if pa.types.is_float16(t):
        return pa.float32()
    if pa.types.is_fixed_size_list(t):
        return pa.list_(_no_half(t.value_type), t.list_size)
    if pa.types.is_large_list(t):
        return pa.large_list(_no_half(t.value_type))
    return pa.list_(_no_half(t.value_type))


def table_to_pandas(table: pa.Table) -> Any:
    require("pandas", "query")
    df = _plain(table).to_pandas()
    for f in table.schema:
        if isinstance(f.type, pa.FixedShapeTensorType):
            shape = tuple(f.type.shape)
            df[f.name] = [np.asarray(v).reshape(shape) for v in df[f.name]]
    return df


def table_to_polars(table: pa.Table) -> Any:
    pl = require("polars", "query")
    return pl.from_arrow(_plain(table))


def run_sql(store: RowSource, query: str, limits: SqlLimits | None = None, *,
            cancelled: Callable[[], bool] | None = None) -> pa.Table:
    """DuckDB over the store's rows, registered as `experience` (scalar columns; tensor columns as lists).

    Runs in the SQL sandbox (`arrowbuf.query.sql`): one SELECT, no file system. `limits` defaults to
    `SqlLimits.unbounded()` (no deadline or memory limit: the caller's own process); the Flight server passes its
    own limits and `cancelled`.
    """
    from . import sql

    if not isinstance(query, str) or not query.strip():
        raise SchemaError("sql() takes a non-empty SQL string")
    tables = {}
    if isinstance(store, LineageSource) and _LINEAGE.search(_STRINGS.sub(" ", query)):  # the table `lineage`
        tables["lineage"] = store.lineage_table()
    if tables and not _EXPERIENCE.search(_STRINGS.sub(" ", query)):  # only the other tables: copy no rows
        table = store.schema.to_arrow().empty_table()
    else:
        table = store.to_table(sql_columns(query, store.schema.to_arrow().names))
    return sql.run(_plain(table, sql=True), query, limits or sql.SqlLimits.unbounded(), cancelled=cancelled,
                   tables=tables)


_LINEAGE = re.compile(r"\blineage\b", re.I)
_EXPERIENCE = re.compile(r"\bexperience\b", re.I)


_STRINGS = re.compile(r"'(?:[^']|'')*'|--[^\n]*|/\*.*?\*/", re.S)  # literals and comments: no column names
_COUNT_STAR = re.compile(r"\bcount\s*\(\s*\*\s*\)", re.I)
_STAR = re.compile(r"(?:[(,.]|\bselect|\bdistinct|\ball)\s*\*", re.I)  # SELECT *, t.*, f(*), COLUMNS(*)
_FROM_FIRST = re.compile(r"(?:^|[(]|\bunion|\bexcept|\bintersect|\ball|\bdistinct|\bby)\s*from\b", re.I)  # FROM t: all
_WHOLE_ROW_WORDS = frozenset({"columns", "unpack", "pivot", "unpivot", "summarize", "describe"})
_WORDS = re.compile(r'"((?:[^"]|"")*)"|([A-Za-z_][A-Za-z0-9_$]*)')


def sql_columns(query: str, names: list[str]) -> list[str] | None:
    """The stored columns `query` may read, so that `sql()` snapshots only those (a copy of each): every column whose
    name appears in the query as an identifier (outside literals and comments), in store order, plus `seq` (so the
    table keeps its row count when none does). None (all columns) whenever the query could read columns it does not
    name: `*` as a column list (`SELECT *`, `t.*`, `f(*)`; `count(*)` is no such use), DuckDB's `COLUMNS(...)`,
    `FROM experience` without a select list, PIVOT/UNPIVOT/SUMMARIZE, positional references (`#1`), the table or an
    alias of it used as a value (a row struct: `SELECT experience`), or columns renamed by position
    (`experience AS t(a, b)`). Conservative: a name in the query that is not a column reference only copies more.
    """
    text = _STRINGS.sub(" ", query)
    if _STAR.search(_COUNT_STAR.sub(" ", text)) or _FROM_FIRST.search(text) or "#" in text:
        return None
    words = [(m.group(1).replace('""', '"') if m.group(1) is not None else m.group(2)).lower()
             for m in _WORDS.finditer(text)]
    if _WHOLE_ROW_WORDS.intersection(words):
        return None
    # aliases of the table: FROM/JOIN experience [AS] alias; any use of the table or an alias other than `x.col`
    # could read the whole row
    tables = {"experience"}
    for i, w in enumerate(words):
        if w == "experience" and i + 1 < len(words):
            j = i + 2 if words[i + 1] == "as" else i + 1
            if j < len(words) and words[j] not in _AFTER_TABLE:
                tables.add(words[j])
    positions = [m for m in _WORDS.finditer(text)]
    for k, m in enumerate(positions):
        if words[k] not in tables:
            continue
        rest = text[m.end():].lstrip()
        prev = words[k - 1] if k else ""
        if rest.startswith("."):
            continue  # experience.col / alias.col: the column's own name appears too
        if rest.startswith("("):
            return None  # experience AS t(a, b): columns renamed by position
        if words[k] == "experience" and prev in ("from", "join"):
            continue
        if k >= 1 and words[k - 1] == "experience" or k >= 2 and words[k - 1] == "as" and words[k - 2] == "experience":
            continue  # the alias's own declaration
        return None
    lower = {n.lower(): n for n in names}
    used = {lower[w] for w in words if w in lower}
    return [n for n in names if n in used or n == "seq"]


#: words that may follow a table name without being its alias
_AFTER_TABLE = frozenset({
    "where", "group", "order", "limit", "offset", "having", "join", "inner", "left", "right", "full", "cross",
    "natural", "on", "using", "union", "except", "intersect", "window", "qualify", "sample", "as",
    "positional", "asof", "semi", "anti", "lateral", "tablesample", "returning",
})


def episode_table(store: RowSource) -> pa.Table:
    """episode_id, length, return, first_seq, last_seq, complete, for each episode with live rows.

    `length` counts live rows; `return` sums the `reward` field (0 when the schema has none); `complete` is true when
    the episode's first step is still stored and its last stored step ends the episode.
    """
    schema = store.schema
    cols = ["episode_id", "step", "seq", *schema.episode_end]
    has_reward = "reward" in schema.fields and not schema.fields["reward"].shape
    if has_reward:
        cols.append("reward")
    t = store.to_table(cols)
    out_schema = pa.schema([("episode_id", pa.int64()), ("length", pa.int64()), ("return", pa.float64()),
                            ("first_seq", pa.int64()), ("last_seq", pa.int64()), ("complete", pa.bool_())])
    if t.num_rows == 0:
        return out_schema.empty_table()
    ends = np.zeros(t.num_rows, dtype=bool)
    for e in schema.episode_end:
        ends |= t.column(e).to_numpy(zero_copy_only=False)
    reward = t.column("reward").to_numpy().astype(np.float64) if has_reward else np.zeros(t.num_rows)
    work = pa.table({"episode_id": t.column("episode_id"), "seq": t.column("seq"), "step": t.column("step"),
                     "reward": reward, "end": ends})
    g = work.group_by("episode_id").aggregate([
        ("seq", "count"), ("reward", "sum"), ("seq", "min"), ("seq", "max"), ("step", "min"), ("end", "any")])
    # the end flag must be on the episode's last stored row; ended episodes take no further rows, so "any" is it
    complete = pc.and_(pc.equal(g.column("step_min"), 0), g.column("end_any"))
    res = pa.table({"episode_id": g.column("episode_id"), "length": g.column("seq_count"),
                    "return": g.column("reward_sum"), "first_seq": g.column("seq_min"),
                    "last_seq": g.column("seq_max"), "complete": complete}, schema=out_schema)
    return res.sort_by("first_seq")
