"""Simple `where=` predicates compiled to `pyarrow.compute` calls: the same rows as DuckDB, without a query.

`compile_where` takes the parse tree the SQL sandbox returns for `SELECT seq FROM experience WHERE (<predicate>)`
(`sql.Sandbox.parse`: the sandbox has already refused anything hostile) and the schema of the table the predicate
runs over, and returns a `CompiledPredicate`, or None when the predicate is outside the subset below; the caller then
runs it in the sandbox as before. The subset, with SQL's semantics (three-valued logic, a row passes only when the
predicate is TRUE):

- column references (one name, matched case-insensitively as DuckDB does) of signed or unsigned (<= 32-bit) integer,
  float32, float64, boolean and string types; literals: integers in int64, decimals of at most 15 digits, doubles
  (`1e3`), strings, booleans, NULL;
- `=`, `<>`/`!=`, `<`, `<=`, `>`, `>=` between a column and a literal (either side) or two columns of the same
  type; `[NOT] BETWEEN` and `[NOT] IN (literals...)` (at most 64) with a column on the left; `IS [NOT] NULL`;
  `AND`, `OR`, `NOT`; a boolean column alone.

Types follow DuckDB's casts: an integer or decimal literal compared with a float32 column is rounded to float32 (as
DuckDB casts it to FLOAT), a double literal widens the float32 column to float64; integer columns compared with a
non-integer literal are compared as float64 (exact for integers below 2**53). DuckDB orders NaN above every number
and equal to itself, where IEEE comparisons are false: `CompiledPredicate.__call__` returns None when a compared
float column holds a NaN, and the caller runs the predicate in the sandbox instead. tests/test_where_fast.py checks
the compiled results against DuckDB's on random predicates and rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

#: Most literals in one IN list that are compiled (a longer list runs in the sandbox).
MAX_IN_LIST = 64
_DECIMAL = re.compile(r"^-?(\d*)\.?(\d*)$")
_COMPARE = {"COMPARE_EQUAL": "equal", "COMPARE_NOTEQUAL": "not_equal", "COMPARE_LESSTHAN": "less",
            "COMPARE_LESSTHANOREQUALTO": "less_equal", "COMPARE_GREATERTHAN": "greater",
            "COMPARE_GREATERTHANOREQUALTO": "greater_equal"}
_MIRROR = {"equal": "equal", "not_equal": "not_equal", "less": "greater", "less_equal": "greater_equal",
           "greater": "less", "greater_equal": "less_equal"}


class _Unsupported(Exception):
    """The predicate is outside the compiled subset (not an error: the sandbox runs it)."""


# An operand: ("col", name, arrow type) or ("lit", kind, python value) with kind in int, decimal, double, str,
# bool, null. A compiled boolean node: a function of the table's columns returning a boolean array.
#: A literal's value: an int, a float, a decimal's text, a string, a bool, or None (NULL).
_Value = int | float | str | bool | None
_Operand = tuple[str, str, Any]
_Node = Callable[[dict[str, pa.Array], int], pa.Array]


class CompiledPredicate:
    """A predicate compiled to `pyarrow.compute` calls (module docstring).

    Attributes:
        columns: the columns it reads.
        floats: the float columns it compares (a NaN in one sends the evaluation to the sandbox).
    """

    def __init__(self, node: _Node, columns: set[str], floats: set[str]) -> None:
        self._node = node
        self.columns = tuple(sorted(columns))
        self.floats = tuple(sorted(floats))

    def __call__(self, table: pa.Table) -> np.ndarray | None:
        """Which rows of `table` pass (a bool array), or None when the sandbox must decide (a NaN)."""
        cols = {name: table.column(name).combine_chunks() for name in self.columns}
        for name in self.floats:
            if pc.any(pc.is_nan(cols[name])).as_py():
                return None
        out = self._node(cols, table.num_rows)
        return np.asarray(pc.fill_null(out, False).to_numpy(zero_copy_only=False), dtype=bool)


def compile_where(statement: dict[str, Any], schema: pa.Schema) -> CompiledPredicate | None:
    """Compile the WHERE clause of `SELECT seq FROM experience WHERE (...)`'s parse tree, or None (module docstring)."""
    node = statement.get("node") or {}
    if not _is_plain_select(node):
        return None
    names: dict[str, list[str]] = {}
    for name in schema.names:
        names.setdefault(name.lower(), []).append(name)
    compiler = _Compiler(schema, names)
    try:
        root = compiler.boolean(node["where_clause"])
    except (_Unsupported, KeyError, TypeError, ValueError, OverflowError):
        return None
    return CompiledPredicate(root, compiler.columns, compiler.floats)


def _is_plain_select(node: dict[str, Any]) -> bool:
    """`SELECT seq FROM experience WHERE ...` and nothing else (no CTE, grouping, modifiers, sample, qualify)."""
    select = node.get("select_list") or []
    table = node.get("from_table") or {}
    return (node.get("type") == "SELECT_NODE" and len(select) == 1 and select[0].get("class") == "COLUMN_REF"
            and select[0].get("column_names") == ["seq"] and not select[0].get("alias")
            and table.get("type") == "BASE_TABLE" and str(table.get("table_name", "")).lower() == "experience"
            and not table.get("schema_name") and not table.get("catalog_name")
            and not (node.get("cte_map") or {}).get("map") and not node.get("group_expressions")
            and not node.get("group_sets") and node.get("having") is None and node.get("qualify") is None
            and not node.get("modifiers") and node.get("sample") is None
            and node.get("aggregate_handling", "STANDARD_HANDLING") == "STANDARD_HANDLING"
            and node.get("where_clause") is not None)


class _Compiler:
    def __init__(self, schema: pa.Schema, names: dict[str, list[str]]) -> None:
        self.schema = schema
        self.names = names
        self.columns: set[str] = set()
        self.floats: set[str] = set()

    # ------------------------------------------------------------------ boolean nodes
    def boolean(self, node: dict[str, Any]) -> _Node:
        kind = node.get("type")
        if node.get("alias"):
            raise _Unsupported
        if kind in ("CONJUNCTION_AND", "CONJUNCTION_OR"):
            parts = [self.boolean(child) for child in node["children"]]
            fn = pc.and_kleene if kind == "CONJUNCTION_AND" else pc.or_kleene

            def conj(cols: dict[str, pa.Array], n: int) -> pa.Array:
                out = parts[0](cols, n)
                for part in parts[1:]:
                    out = fn(out, part(cols, n))
                return out
            return conj
        if kind == "OPERATOR_NOT":
            (child,) = node["children"]
            inner = self.boolean(child)
            return lambda cols, n: pc.invert(inner(cols, n))
        if kind in ("OPERATOR_IS_NULL", "OPERATOR_IS_NOT_NULL"):
            (child,) = node["children"]
            op = self.operand(child)
            if op[0] != "col":
                raise _Unsupported
            name = op[1]
            test = pc.is_null if kind == "OPERATOR_IS_NULL" else pc.is_valid
            return lambda cols, n: test(cols[name])
        if kind in _COMPARE:
            return self.compare(_COMPARE[kind], self.operand(node["left"]), self.operand(node["right"]))
        if kind == "COMPARE_BETWEEN":
            value = self.operand(node["input"])
            if value[0] != "col":
                raise _Unsupported
            low = self.compare("greater_equal", value, self.operand(node["lower"]))
            high = self.compare("less_equal", value, self.operand(node["upper"]))
            return lambda cols, n: pc.and_kleene(low(cols, n), high(cols, n))
        if kind in ("COMPARE_IN", "COMPARE_NOT_IN"):
            value, *items = [self.operand(child) for child in node["children"]]
            if value[0] != "col" or not items or len(items) > MAX_IN_LIST or any(i[0] != "lit" for i in items):
                raise _Unsupported
            tests = [self.compare("equal", value, item) for item in items]

            def member(cols: dict[str, pa.Array], n: int) -> pa.Array:
                out = tests[0](cols, n)
                for test in tests[1:]:
                    out = pc.or_kleene(out, test(cols, n))
                return out
            return member if kind == "COMPARE_IN" else (lambda cols, n: pc.invert(member(cols, n)))
        if node.get("class") == "COLUMN_REF":
            op = self.operand(node)
            if not pa.types.is_boolean(op[2]):
                raise _Unsupported
            name = op[1]
            return lambda cols, n: cols[name]
        raise _Unsupported

    # ------------------------------------------------------------------ comparisons
    def compare(self, fn_name: str, left: _Operand, right: _Operand) -> _Node:
        if left[0] == "lit" and right[0] == "col":
            left, right, fn_name = right, left, _MIRROR[fn_name]
        if left[0] != "col":
            raise _Unsupported
        fn = getattr(pc, fn_name)
        name, ctype = left[1], left[2]
        if right[0] == "col":
            other = right[1]
            if right[2] != ctype:
                raise _Unsupported
            if pa.types.is_floating(ctype):
                self.floats.update((name, other))
            return lambda cols, n: fn(cols[name], cols[other])
        kind, value = right[1], right[2]
        if kind == "null":
            return lambda cols, n: pa.nulls(n, pa.bool_())
        scalar, widen = self._literal(ctype, kind, value)
        if pa.types.is_floating(ctype):
            self.floats.add(name)
        if widen is not None:
            return lambda cols, n: fn(pc.cast(cols[name], widen), scalar)
        return lambda cols, n: fn(cols[name], scalar)

    def _literal(self, ctype: pa.DataType, kind: str, value: Any) -> tuple[pa.Scalar, pa.DataType | None]:
        """The scalar to compare a column of `ctype` with, and the type to widen the column to (or None)."""
        if pa.types.is_boolean(ctype):
            if kind != "bool":
                raise _Unsupported
            return pa.scalar(value, pa.bool_()), None
        if pa.types.is_string(ctype) or pa.types.is_large_string(ctype):
            if kind != "str":
                raise _Unsupported
            return pa.scalar(value, ctype), None
        if kind not in ("int", "decimal", "double"):
            raise _Unsupported
        if pa.types.is_float32(ctype):
            if kind == "double":
                return pa.scalar(float(value), pa.float64()), pa.float64()
            return pa.scalar(np.float32(float(value)), pa.float32()), None  # DuckDB casts the literal to FLOAT
        if pa.types.is_float64(ctype):
            return pa.scalar(float(value), pa.float64()), None
        if _is_integer(ctype):
            if kind == "int":
                return pa.scalar(int(value), pa.int64()), None
            number = float(value)
            if not math.isfinite(number):
                raise _Unsupported
            return pa.scalar(number, pa.float64()), pa.float64()
        raise _Unsupported

    # ------------------------------------------------------------------ operands
    def operand(self, node: dict[str, Any]) -> _Operand:
        if node.get("alias"):
            raise _Unsupported
        if node.get("class") == "COLUMN_REF":
            parts = node.get("column_names") or []
            if len(parts) != 1:
                raise _Unsupported
            found = self.names.get(str(parts[0]).lower(), [])
            if len(found) != 1:
                raise _Unsupported
            name = found[0]
            ctype = self.schema.field(name).type
            if not (pa.types.is_boolean(ctype) or pa.types.is_string(ctype) or pa.types.is_large_string(ctype)
                    or pa.types.is_float32(ctype) or pa.types.is_float64(ctype) or _is_integer(ctype)):
                raise _Unsupported
            self.columns.add(name)
            return ("col", name, ctype)
        if node.get("class") == "CONSTANT" and node.get("type") == "VALUE_CONSTANT":
            return ("lit", *_literal(node.get("literal") or {}))
        raise _Unsupported


def _literal(literal: dict[str, Any]) -> tuple[str, _Value]:
    kind, text = literal.get("kind"), literal.get("text")
    if not isinstance(text, str):
        raise _Unsupported
    if kind == "INTEGER":
        value = int(text)
        if not -(1 << 63) <= value < (1 << 63):
            raise _Unsupported
        return "int", value
    if kind == "NUMERIC":
        if "e" in text.lower():
            number = float(text)
            if not math.isfinite(number):
                raise _Unsupported
            return "double", number
        match = _DECIMAL.match(text)
        if match is None or not (match.group(1) or match.group(2)) or len(match.group(1) + match.group(2)) > 15:
            raise _Unsupported
        return "decimal", text
    if kind == "STRING":
        return "str", text
    if kind == "BOOLEAN" and text.lower() in ("true", "false"):
        return "bool", text.lower() == "true"
    if kind == "NULL_LITERAL":
        return "null", None
    raise _Unsupported


def _is_integer(ctype: pa.DataType) -> bool:
    return pa.types.is_signed_integer(ctype) or (pa.types.is_unsigned_integer(ctype) and ctype.bit_width <= 32)


__all__ = ["MAX_IN_LIST", "CompiledPredicate", "compile_where"]
