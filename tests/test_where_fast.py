"""Fast `where=` (issue 28): compiled predicates agree with DuckDB, a store's sandbox connection is cached, hostile
predicates are still refused, and every cache is bounded (arrowbuf/query/predicate.py, sql.Sandbox, filters.py)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from conftest import LLM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.query import filters as F
from arrowbuf.query import sql
from arrowbuf.query.predicate import compile_where

LATER = {**LLM, "fields": {**LLM["fields"], "reward": {"dtype": "float32", "later": True}}}

pytest.importorskip("duckdb")

COLUMNS = {"i": pa.int64(), "j": pa.int32(), "u": pa.uint16(), "f": pa.float32(), "d": pa.float64(),
           "b": pa.bool_(), "s": pa.string()}


def _query(where: str) -> str:
    return f"SELECT seq FROM experience WHERE ({where})"


def _table(rng: np.random.Generator, n: int, nan: bool = False) -> pa.Table:
    def masked(values: np.ndarray) -> pa.Array:
        return pa.array(values, mask=rng.random(n) < 0.2)

    d = np.round(rng.normal(0, 3, n), 1)
    if nan:
        d[rng.random(n) < 0.3] = np.nan
    return pa.table({"seq": np.arange(n, dtype=np.int64), "i": masked(rng.integers(-5, 6, n)),
                     "j": masked(rng.integers(-5, 6, n).astype(np.int32)),
                     "u": masked(rng.integers(0, 6, n).astype(np.uint16)),
                     "f": masked(np.round(rng.normal(0, 3, n), 1).astype(np.float32)), "d": masked(d),
                     "b": masked(rng.random(n) < 0.5), "s": masked(rng.choice(["a", "b", "it's", "B", ""], n))})


_NUM_COLS = st.sampled_from(["i", "j", "u", "f", "d"])
_NUM_LIT = st.one_of(st.integers(-7, 7).map(str), st.sampled_from(["0.5", "-1.5", "0.1", "2.25", "1e1", "-2e0",
                                                                   "3.0", "0.3", "-0.1", "9999999999"]))
_OPS = st.sampled_from(["=", "<>", "!=", "<", "<=", ">", ">="])


@st.composite
def _atom(draw: st.DrawFn) -> str:
    kind = draw(st.integers(0, 8))
    if kind == 0:
        return f"{draw(_NUM_COLS)} {draw(_OPS)} {draw(_NUM_LIT)}"
    if kind == 1:
        return f"{draw(_NUM_LIT)} {draw(_OPS)} {draw(_NUM_COLS)}"
    if kind == 2:
        text = draw(st.sampled_from(["a", "b", "B", "it''s", "", "zz"]))
        return f"s {draw(_OPS)} '{text}'"
    if kind == 3:
        return draw(st.sampled_from(["b", "NOT b", "b = true", "b <> false", "B", "b IS NULL"]))
    if kind == 4:
        return f"{draw(st.sampled_from(list(COLUMNS)))} IS {draw(st.sampled_from(['', 'NOT ']))}NULL"
    if kind == 5:
        items = draw(st.lists(st.one_of(_NUM_LIT, st.just("NULL")), min_size=1, max_size=4))
        return f"{draw(_NUM_COLS)} {draw(st.sampled_from(['', 'NOT ']))}IN ({', '.join(items)})"
    if kind == 6:
        return f"{draw(_NUM_COLS)} {draw(st.sampled_from(['', 'NOT ']))}BETWEEN {draw(_NUM_LIT)} AND {draw(_NUM_LIT)}"
    if kind == 7:
        col = draw(st.sampled_from(list(COLUMNS)))
        return f"{col} {draw(_OPS)} {col.upper()}" if col != "b" else "b = b"
    return f"i {draw(_OPS)} NULL"


@st.composite
def _predicate(draw: st.DrawFn, depth: int = 0) -> str:
    if depth >= 2 or draw(st.booleans()):
        return draw(_atom())
    left = draw(_predicate(depth + 1))
    right = draw(_predicate(depth + 1))
    op = draw(st.sampled_from(["AND", "OR"]))
    out = f"({left}) {op} ({right})"
    return f"NOT ({out})" if draw(st.integers(0, 3)) == 0 else out


@pytest.fixture(scope="module")
def box():
    sandbox = sql.Sandbox()
    yield sandbox
    sandbox.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(where=_predicate(), seed=st.integers(0, 2**16), nan=st.booleans())
def test_compiled_predicates_select_the_rows_duckdb_selects(box, where, seed, nan):
    table = _table(np.random.default_rng(seed), 40, nan)
    fast = compile_where(box.parse(_query(where)), table.schema)
    assert fast is not None, where  # every generated predicate is in the compiled subset
    expected = np.sort(sql.run(table, _query(where), sandbox=box).column(0).to_numpy())
    passed = fast(table)
    if passed is None:  # a NaN in a compared float column: the sandbox decides
        assert nan and np.isnan(table.column("d").to_numpy(zero_copy_only=False)).any()
        return
    np.testing.assert_array_equal(np.flatnonzero(passed), expected, err_msg=where)


@pytest.mark.parametrize("where", ["abs(i) > 1", "i + 1 > 2", "s LIKE 'a%'", "i > '3'", "f = d",
                                   "seq IN (SELECT 1)", "i > 99999999999999999999", "d > 0.1234567890123456789",
                                   "i IN (" + ", ".join(map(str, range(100))) + ")", "experience.i > 0",
                                   "CASE WHEN b THEN i ELSE j END > 0", "i::DOUBLE > 0.5"])
def test_predicates_outside_the_subset_are_left_to_the_sandbox(box, where):
    table = _table(np.random.default_rng(1), 30)
    assert compile_where(box.parse(_query(where)), table.schema) is None


def test_the_compiled_subset_needs_the_plain_select_around_it(box):
    table = _table(np.random.default_rng(1), 30)
    for query in ["SELECT seq FROM experience WHERE (i > 0) UNION SELECT 2",
                  "SELECT seq FROM experience WHERE (i > 0) LIMIT 1",
                  "SELECT seq FROM experience WHERE (i > 0) ORDER BY 1",
                  "WITH x AS (SELECT 1) SELECT seq FROM experience WHERE (i > 0)",
                  "SELECT i FROM experience WHERE (i > 0)", "SELECT seq AS i FROM experience WHERE (i > 0)",
                  "SELECT seq FROM experience WHERE (i > 0) GROUP BY seq"]:
        assert compile_where(box.parse(query), table.schema) is None, query


# ------------------------------------------------------------------------------------------- through the store
def rows(n, start=0):
    i = np.arange(start, start + n)
    return {"prompt_id": i // 4, "response_tokens": [[int(k)] * (int(k) % 5 + 1) for k in i],
            "done": i % 3 == 0, "policy_version": i % 5}


STORE_PREDICATES = ["reward > 0", "reward >= 1.5 AND policy_version IN (1, 3)", "NOT done OR prompt_id < 3",
                    "reward IS NULL", "policy_version BETWEEN 1 AND 2 AND reward <> 0", "done",
                    "abs(reward) > 1", "prompt_id % 2 = 0 AND reward > -1", "seq > 10 AND step >= 0",
                    "reward = 0.5 OR episode_id IS NOT NULL AND policy_version = 4"]


@pytest.mark.parametrize("where", STORE_PREDICATES)
def test_consume_where_delivers_what_the_old_path_selects(where):
    """The old path: the predicate run in a fresh sandbox over the candidate rows' scalar columns."""
    s = ab.ExperienceStore(LATER, capacity=64, tasks=["t"])
    ids = s.extend(rows(40))
    s.update(ids[:30], {"reward": (np.arange(30) % 7 - 3).astype(np.float32)})
    table = s.to_table().drop_columns(["response_tokens"])
    expected = np.sort(sql.run(table, _query(where)).column(0).to_numpy())
    got = s.consume("t", 100, where=where)
    np.testing.assert_array_equal(np.sort(got.indices), ids[np.isin(ids, expected)])
    np.testing.assert_array_equal(np.sort(s.consume("t", 100).indices), ids[~np.isin(ids, expected)])
    s.close()


@pytest.mark.parametrize("where", [
    "reward > 100) UNION SELECT seq + 1000 FROM experience --", "reward > (SELECT version())",
    "current_setting('memory_limit') IS NOT NULL", "seq IN (SELECT seq FROM read_csv('/etc/passwd'))",
    "1; COPY (SELECT 1) TO '/tmp/x.csv'", "getenv('HOME') IS NOT NULL",
    "seq IN (SELECT 1 FROM duckdb_settings())", "reward > 0) ; SET threads=8; SELECT (1",
    "len(response_tokens) > 1", "x" * (F.MAX_WHERE_CHARS + 1)])
def test_hostile_predicates_are_still_refused_and_the_cached_connection_survives(where):
    s = ab.ExperienceStore(LATER, capacity=64, tasks=["t"])
    s.update(s.extend(rows(8)), {"reward": np.arange(8, dtype=np.float32)})
    assert len(s.consume("t", 1, where="abs(reward) >= 0")) == 1  # opens the store's cached connection
    if where.startswith("reward > 100)"):  # escapes its parentheses: only candidate rows can pass
        assert len(s.consume("t", 100, where=where)) == 0
    else:
        with pytest.raises(ab.InvalidArgument):
            s.consume("t", 100, where=where)
    assert len(s.consume("t", 2, where="abs(reward) >= 0")) == 2  # the sandbox still works after the refusal
    assert len(s.consume("t", 100)) == 5
    s.close()


def test_every_where_cache_is_bounded():
    s = ab.ExperienceStore(LATER, capacity=64, tasks=["t"])
    s.update(s.extend(rows(20)), {"reward": np.arange(20, dtype=np.float32)})
    for k in range(F.MAX_VALID_PREDICATES + 40):
        pred = f"reward > {k}" if k % 2 else f"abs(reward) > {k}"
        s.consume("t", 1, where=pred, timeout=0)
    sizes = s._consume.filters.cache_sizes()
    assert sizes == {"valid": F.MAX_VALID_PREDICATES, "results": F.MAX_CACHED_PREDICATES, "connections": 1}, sizes


def test_a_sandbox_reuses_its_connection_and_replaces_one_that_was_interrupted():
    box = sql.Sandbox()
    table = pa.table({"seq": np.arange(5)})
    try:
        assert sql.run(table, "SELECT seq FROM experience WHERE seq > 2", sandbox=box).num_rows == 2
        first = box.connections()
        assert len(first) == 1
        sql.run(table, "SELECT seq FROM experience WHERE seq > 3", sandbox=box)
        assert box.connections() == first  # the same connection
        with pytest.raises(ab.QueryTimeout):
            sql.run(table, "SELECT count(*) FROM range(100000000000) t(i) WHERE i % 7 = 3",
                    sql.SqlLimits(timeout=0.2), sandbox=box)
        assert box.connections() == []  # interrupted: closed, not reused
        assert sql.run(table, "SELECT seq FROM experience", sandbox=box).num_rows == 5
        with pytest.raises(ab.InvalidArgument):
            sql.run(table, "SELECT nope FROM experience", sandbox=box)
        assert len(box.connections()) == 1  # a binder error leaves the connection as it was
        big = pa.table({"seq": np.arange(1 << 21)})
        with pytest.raises(ab.ResourceExhausted):
            sql.run(big, "SELECT seq FROM experience", sql.SqlLimits(max_result_bytes=1 << 20), sandbox=box)
        assert sql.run(table, "SELECT seq FROM experience", sandbox=box).num_rows == 5
    finally:
        box.close()
    assert box.connections() == []
