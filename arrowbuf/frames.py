"""Dataframe views of a store: pandas, Polars, DuckDB SQL and the episode summary.

pandas, Polars and DuckDB are optional (`pip install 'arrowbuf[query]'`) and imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import SchemaError, require

if TYPE_CHECKING:  # pragma: no cover
    from .sql import SqlLimits
    from .store import ExperienceStore


def _plain(table: pa.Table) -> pa.Table:
    """Tensor extension columns as plain (nested) fixed-size lists, which every dataframe library reads."""
    cols = []
    for col in table.columns:
        if isinstance(col.type, pa.FixedShapeTensorType):
            col = pa.chunked_array([c.storage for c in col.chunks], type=col.type.storage_type)
        cols.append(col)
    return pa.Table.from_arrays(cols, names=table.column_names)


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


def run_sql(store: Any, query: str, limits: "SqlLimits | None" = None, *,
            cancelled: Callable[[], bool] | None = None) -> pa.Table:
    """DuckDB over the store's rows, registered as `experience` (scalar columns; tensor columns as lists).

    Runs in the SQL sandbox (`arrowbuf.sql`): one SELECT, no file system. `limits` defaults to
    `SqlLimits.unbounded()` (no deadline or memory limit: the caller's own process); the Flight server passes its
    own limits and `cancelled`.
    """
    from . import sql

    if not isinstance(query, str) or not query.strip():
        raise SchemaError("sql() takes a non-empty SQL string")
    return sql.run(_plain(store.to_table()), query, limits or sql.SqlLimits.unbounded(), cancelled=cancelled)


def episode_table(store: "ExperienceStore") -> pa.Table:
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
