"""`where=` filters of `consume`: SQL predicates over a store's scalar columns, run in the SQL sandbox, cached per row.

A predicate is a SQL boolean expression over the scalar columns only: the schema's scalar fields, `episode_id`,
`step` and `seq` (a field filled later reads NULL until written). It runs as
`SELECT seq FROM experience WHERE (<predicate>)` in `arrowbuf.query.sql`'s sandbox (no file system, no extensions,
bounded) over a table built from those columns alone: ragged and tensor columns are never read for it. The
query's result only selects among the rows it was given, so a predicate that escapes its parentheses cannot add
rows.

Opening a sandboxed DuckDB connection costs about 0.1 s here, so a store keeps its own (`sql.Sandbox`: cached
sandboxed connections, one query at a time) and validates each distinct predicate once (the last
`MAX_VALID_PREDICATES` are remembered). A predicate in the simple subset of `arrowbuf.query.predicate` (comparisons
of scalar columns with literals, AND/OR/NOT, IN, BETWEEN, IS NULL) is compiled once to `pyarrow.compute` calls and
runs without DuckDB (tens of microseconds); any other runs on the store's cached connection under the sandbox's
limits (a compiled predicate takes no slot of a server's SQL gate: it runs no query; its first validation does).
Neither runs under the store's lock nor once per call: each predicate keeps, per ring position, the seq of the row
it was evaluated for and the result. A consumer asks `mask` (under the lock) which candidate rows pass and which
are not evaluated yet, and `evaluate`s those with the lock released. A row is evaluated again when it changes: a
later field of it was written since (its presence bits differ) or `store.update` rewrote it (`on_update`, the
store core's update hook). A shared-memory store's rows are also updated by other processes, whose hook cannot reach
this one: there each result also keeps the values of the later scalar fields it was computed from, and a row whose
values differ now (or are NaN) is evaluated again.

Usage (what `arrowbuf.engine.consume.ConsumeTracker` does)::

    filters = RowFilters(core, view)
    filters.check("reward > 0")                      # InvalidArgument for a bad predicate; cached once valid
    ok, pending = filters.mask("reward > 0", seqs)   # under the store's lock
    filters.evaluate("reward > 0", pending)          # called holding the lock; releases it while DuckDB runs
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import InvalidArgument
from .predicate import CompiledPredicate, compile_where

#: Longest predicate accepted (characters).
MAX_WHERE_CHARS = 4096
#: Predicates whose per-row results are kept (least recently used go first): each takes 10 bytes per ring row.
MAX_CACHED_PREDICATES = 4
#: Distinct predicates remembered as valid (with their compiled form); least recently used go first.
MAX_VALID_PREDICATES = 256
_SYSTEM = ("episode_id", "step", "seq")


class _Results:
    """One predicate's results per ring position: the seq evaluated, presence bits then, and pass/fail; for a shared
    store also the later fields' values then (`values`)."""

    def __init__(self, rows: int, values: dict[str, np.dtype] | None = None) -> None:
        self.seq = np.full(rows, -1, dtype=np.int64)
        self.bits = np.zeros(rows, dtype=np.uint8)
        self.ok = np.zeros(rows, dtype=bool)
        self.values = {name: np.zeros(rows, dtype=dt) for name, dt in (values or {}).items()}


class RowFilters:
    """The `where=` predicates of one store (see the module docstring).

    Args:
        core: the store's `StoreCore` (schema, index, condition, update hook).
        view: reads scalar values and presence at ring positions (`values(name, pos)`, `present(fields, pos)`).
    """

    def __init__(self, core: Any, view: Any) -> None:
        self.core = core
        self.view = view
        schema = core.schema
        # plain scalars only: a bfloat16 or float8 column holds bits, which a comparison would misread
        self.scalars = [n for n, f in schema.fields.items() if not f.shape and not f.ragged and f.plain]
        self.later = [n for n in self.scalars if getattr(schema.fields[n], "later", False)]
        self._results: OrderedDict[str, _Results] = OrderedDict()
        self._valid: OrderedDict[str, CompiledPredicate | None] = OrderedDict()
        from .sql import Sandbox

        self.sandbox = Sandbox()
        self._inflight: list[list[np.ndarray]] = []
        #: later scalar fields whose values each result keeps (a shared store: other processes update rows)
        self._kept = {n: np.dtype(schema.fields[n].dtype) for n in self.later} if core.tier.shared else {}
        if getattr(core, "on_update", "missing") is None:
            core.on_update = self.on_update

    @property
    def columns(self) -> list[str]:
        """The columns a predicate may name."""
        return [*self.scalars, *_SYSTEM]

    # ------------------------------------------------------------------ validation
    def check(self, where: Any) -> None:
        """Raise `InvalidArgument` unless `where` is a predicate over the scalar columns (compiled once)."""
        if not isinstance(where, str) or not where.strip():
            raise InvalidArgument(f"consume: where= takes a SQL predicate string, got {where!r:.100}")
        if len(where) > MAX_WHERE_CHARS:
            raise InvalidArgument(f"consume: where= has {len(where)} characters, over the limit of "
                                  f"{MAX_WHERE_CHARS}; shorten it")
        if where in self._valid:
            self._valid.move_to_end(where)
            return
        empty = self.table(np.zeros(0, dtype=np.int64))
        self._run(where, empty)  # the sandbox checks it and DuckDB binds the columns: errors come now
        from .sql import DEFAULT_LIMITS

        tree = self.sandbox.parse(_query(where), DEFAULT_LIMITS)
        self._valid[where] = compile_where(tree, empty.schema)
        if len(self._valid) > MAX_VALID_PREDICATES:
            self._valid.popitem(last=False)

    def cache_sizes(self) -> dict[str, int]:
        """How many predicates are remembered as valid, have per-row results, and open sandbox connections."""
        return {"valid": len(self._valid), "results": len(self._results),
                "connections": len(self.sandbox.connections())}

    def compiled(self, where: str) -> CompiledPredicate | None:
        """The compiled form of a predicate `check` accepted (None: it runs in the sandbox, or is not known)."""
        return self._valid.get(where)

    # ------------------------------------------------------------------ per-row results
    def mask(self, where: str, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Under the store's lock: (rows of `seqs` known to pass, rows not evaluated yet for their current data)."""
        res = self._results.get(where)
        if res is None:
            return np.zeros(len(seqs), dtype=bool), seqs
        self._results.move_to_end(where)
        pos = seqs % self.core.arena_rows
        known = (res.seq[pos] == seqs) & (res.bits[pos] == self._bits(pos))
        for name, kept in res.values.items():  # rewritten by another process since (NaN: never known)
            known &= np.asarray(self.view.values(name, pos)) == kept[pos]
        return known & res.ok[pos], seqs[~known]

    def evaluate(self, where: str, seqs: np.ndarray) -> None:
        """Evaluate `where` for rows `seqs` and keep the results. Called holding the store's lock; releases it while
        the query runs (rows updated meanwhile are left for the next evaluation)."""
        cond = self.core.cond
        pos = seqs % self.core.arena_rows
        bits = self._bits(pos)
        values = {name: np.asarray(self.view.values(name, pos)) for name in self._kept}  # read under the lock
        table = self.table(seqs)
        changed: list[np.ndarray] = []
        self._inflight.append(changed)
        cond.release()
        try:
            passed = self._run(where, table)
        finally:
            cond.acquire()
            self._inflight.remove(changed)
        res = self._results.get(where)
        if res is None:
            res = self._results[where] = _Results(self.core.arena_rows, self._kept)
            if len(self._results) > MAX_CACHED_PREDICATES:
                self._results.popitem(last=False)
        keep = ~np.isin(pos, np.concatenate(changed)) if changed else np.ones(len(pos), dtype=bool)
        res.seq[pos[keep]] = seqs[keep]
        res.bits[pos[keep]] = bits[keep]
        res.ok[pos[keep]] = np.isin(seqs[keep], passed)  # only the rows asked about can pass
        for name, kept in res.values.items():
            kept[pos[keep]] = values[name][keep]

    def on_update(self, positions: np.ndarray, fields: list[str]) -> None:
        """The store core's update hook: rows at `positions` changed, so their results are void; wake consumers."""
        with self.core.cond:
            for res in self._results.values():
                res.seq[positions] = -1
            for changed in self._inflight:
                changed.append(np.asarray(positions, dtype=np.int64))
            self.core.cond.notify_all()

    def _bits(self, pos: np.ndarray) -> np.ndarray:
        """Presence of the later scalar fields, one bit each (folded into 8 bits: a change shows in at least one)."""
        bits = np.zeros(len(pos), dtype=np.uint8)
        for i, name in enumerate(self.later):
            bits ^= self.view.present([name], pos).astype(np.uint8) << np.uint8(i % 8)
        return bits

    # ------------------------------------------------------------------ the sandbox
    def table(self, seqs: np.ndarray) -> pa.Table:
        """The scalar columns of rows `seqs` (never a ragged or tensor column); unwritten later fields are NULL."""
        pos = seqs % self.core.arena_rows
        cols: dict[str, pa.Array] = {}
        for name in self.columns:
            if name == "seq":
                cols[name] = pa.array(seqs, type=pa.int64())
                continue
            values = self.view.values(name, pos)
            if values.dtype == np.float16:  # DuckDB reads no half floats: float32 holds every one exactly
                values = values.astype(np.float32)
            missing = None if name in _SYSTEM else ~self.view.present([name], pos)
            cols[name] = pa.array(values, mask=missing if missing is not None and missing.any() else None)
        return pa.table(cols)

    def _run(self, where: str, table: pa.Table) -> np.ndarray:
        from . import sql

        fast = self._valid.get(where)
        if fast is not None and table.num_rows:
            passed = fast(table)
            if passed is not None:
                return table.column("seq").to_numpy()[passed]
        try:
            out = sql.run(table, _query(where), sql.DEFAULT_LIMITS, sandbox=self.sandbox)
        except InvalidArgument as exc:
            raise InvalidArgument(f"consume: where={where[:200]!r} is not a predicate over the scalar columns "
                                  f"{table.column_names} ({exc}); ragged, tensor, json, bfloat16, float8 and "
                                  "complex columns cannot be filtered on") from None
        return out.column(0).to_numpy(zero_copy_only=False) if out.num_rows else np.zeros(0, np.int64)


def _query(where: str) -> str:
    return f"SELECT seq FROM experience WHERE ({where})"


__all__ = ["MAX_CACHED_PREDICATES", "MAX_VALID_PREDICATES", "MAX_WHERE_CHARS", "RowFilters"]
