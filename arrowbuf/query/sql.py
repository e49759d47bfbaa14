"""The SQL sandbox: the one place arrowbuf runs DuckDB over a store's rows.

Every query surface goes through `run`: `store.sql(...)`, the Flight server's `sql` ticket, the Ray handle's
`sql`, and any `where=` filter. A query sees one table, `experience`, and nothing else:

- No file system at all. DuckDB keeps a few paths under the working directory writable even with external
  access disabled (`<cwd>/:memory:.wal`, `<cwd>/.tmp/`), so the sandbox also disables the `LocalFileSystem`,
  empties the temporary directory (nothing spills to disk) and then locks the configuration.
- One statement, and it must be a `SELECT`: the query is parsed first (DuckDB's own parser, through
  `json_serialize_sql`) and rejected if it is anything else, reads a table other than `experience` or its own
  CTEs, calls a table function other than `range`/`generate_series`/`unnest`, names a function with a schema or
  catalog, or calls a function that reports the server's settings, paths or versions (`duckdb_settings()`,
  `current_setting(...)`, `version()`, ...).
- Bounded: a deadline (the connection is interrupted from a timer, and also when `cancelled()` says the caller
  went away), a memory limit, a result-size limit, one thread, and a cap on the query's length.

Usage::

    limits = SqlLimits(timeout=5.0, memory_limit=128 << 20, max_result_bytes=16 << 20)
    table = run(store.to_table(), "SELECT episode_id, sum(reward) FROM experience GROUP BY 1", limits)

A stopped query raises `QueryTimeout` (deadline or cancellation) or `ResourceExhausted` (memory, result size);
a query the sandbox refuses, or one DuckDB rejects, raises `InvalidArgument`.
"""

from __future__ import annotations

import contextvars
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa

from ..errors import InvalidArgument, QueryTimeout, ResourceExhausted, require

if TYPE_CHECKING:  # pragma: no cover
    from duckdb import DuckDBPyConnection

N = TypeVar("N", int, float)

#: Table functions a query may call (everything else is a file reader, a catalog view or a nested query runner).
TABLE_FUNCTIONS = frozenset({"range", "generate_series", "unnest"})
#: Substrings of scalar function names a query may not call: they report settings, paths, versions, users or run
#: nested SQL. (The file system is disabled as well, so file readers fail even if one slipped through.)
_DENIED = ("setting", "variable", "version", "duckdb", "pragma", "secret", "extension", "getenv", "_sql", "file",
           "read_", "platform", "current_database", "current_catalog", "current_schema", "current_query", "user",
           "query", "glob", "sniff", "parquet", "iceberg", "delta")
#: How often the deadline thread looks at `cancelled()` (pyarrow has no callback for a cancelled call).
_CANCEL_CHECK_S = 0.05


@dataclass(frozen=True)
class SqlLimits:
    """Bounds of one sandboxed query.

    Attributes:
        timeout: seconds a query may run (None: no deadline); then it is interrupted (`QueryTimeout`).
        memory_limit: bytes DuckDB may use for the query's work (None: DuckDB's default, most of the RAM);
            past it the query fails (`ResourceExhausted`). Nothing spills to disk.
        max_result_bytes: bytes of result a query may return (None: no limit; `ResourceExhausted`).
        max_query_chars: longest query text accepted.
        threads: DuckDB worker threads per query.
    """

    timeout: float | None = 10.0
    memory_limit: int | None = 256 << 20
    max_result_bytes: int | None = 64 << 20
    max_query_chars: int = 64 << 10
    threads: int = 1

    def __post_init__(self) -> None:
        if self.timeout is not None and not (isinstance(self.timeout, (int, float)) and 0 < self.timeout <= 1e6):
            raise InvalidArgument(f"SqlLimits.timeout must be in (0, 1e6] seconds or None, got {self.timeout!r}")
        for name in ("memory_limit", "max_result_bytes"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1 << 20):
                raise InvalidArgument(f"SqlLimits.{name} must be an integer of at least 1 MiB or None, "
                                      f"got {value!r}")
        if not isinstance(self.max_query_chars, int) or self.max_query_chars < 1:
            raise InvalidArgument(f"SqlLimits.max_query_chars must be a positive integer, got {self.max_query_chars!r}")
        if not isinstance(self.threads, int) or not 1 <= self.threads <= 64:
            raise InvalidArgument(f"SqlLimits.threads must be an integer in [1, 64], got {self.threads!r}")

    @classmethod
    def unbounded(cls) -> SqlLimits:
        """No deadline, memory or result limit (still no file system): `store.sql` in the caller's own process."""
        return cls(timeout=None, memory_limit=None, max_result_bytes=None, max_query_chars=1 << 24, threads=4)

    def tighter(self, other: SqlLimits) -> SqlLimits:
        """The stricter of `self` and `other` in every bound (None is no bound)."""

        def least(a: N | None, b: N | None) -> N | None:
            return b if a is None else a if b is None else min(a, b)

        return SqlLimits(timeout=least(self.timeout, other.timeout),
                         memory_limit=least(self.memory_limit, other.memory_limit),
                         max_result_bytes=least(self.max_result_bytes, other.max_result_bytes),
                         max_query_chars=min(self.max_query_chars, other.max_query_chars),
                         threads=min(self.threads, other.threads))

    def describe(self) -> dict[str, Any]:
        """The limits as JSON-ready values (the server states them in `describe`)."""
        return {"timeout": self.timeout, "memory_limit": self.memory_limit,
                "max_result_bytes": self.max_result_bytes, "max_query_chars": self.max_query_chars}


#: What a remote client gets unless the server says otherwise (`ab.serve(..., sql_limits=...)`).
DEFAULT_LIMITS = SqlLimits()


@dataclass(frozen=True)
class _Serving:
    limits: SqlLimits
    gate: Callable[[], ContextManager[Any]] | None
    cancelled: Callable[[], bool] | None


_SERVING: contextvars.ContextVar[_Serving | None] = contextvars.ContextVar("arrowbuf_sql_serving", default=None)


@contextmanager
def serving(limits: SqlLimits, *, gate: Callable[[], ContextManager[Any]] | None = None,
            cancelled: Callable[[], bool] | None = None) -> Iterator[None]:
    """Bound every query this thread runs through `run` while the block runs, whoever calls `run`.

    A server wraps the store calls it makes for a client in it, so that queries the store runs on its own behalf
    (a `consume(where=...)` filter) are bounded like the client's `sql` tickets: by the stricter of `limits` and
    the caller's own limits, holding a slot of `gate()` (a context manager, e.g. a `CallGate` slot; it may refuse
    with `ResourceExhausted`) only while each query runs, and stopped when `cancelled()` says the client went away.

    Usage::

        with sql.serving(server_limits, gate=lambda: calls.enter("sql"), cancelled=context.is_cancelled):
            store.consume("train", 256, where="reward > 0")
    """
    token = _SERVING.set(_Serving(limits, gate, cancelled))
    try:
        yield
    finally:
        _SERVING.reset(token)


def caller_cancelled() -> Callable[[], bool] | None:
    """The `cancelled` test of the `serving` block this thread runs in (None outside one, or when it has none). A
    store's long waits (a `consume` waiting for rows) poll it, so that a server's call whose client went away stops
    waiting and takes nothing."""
    context = _SERVING.get()
    return None if context is None else context.cancelled


def run(table: pa.Table, query: str, limits: SqlLimits | None = None, *,
        cancelled: Callable[[], bool] | None = None, sandbox: Sandbox | None = None,
        tables: dict[str, pa.Table] | None = None) -> pa.Table:
    """Run one SELECT over `table` (registered as `experience`) in the sandbox.

    Args:
        table: the rows to query (tensor columns should be plain fixed-size lists; see `frames`).
        query: one SQL SELECT statement.
        limits: the bounds (`DEFAULT_LIMITS` when None).
        cancelled: called while the query runs; when it returns True (the caller went away) the query stops.
        sandbox: a `Sandbox` whose cached connections to use (None: a fresh connection for this query alone).
        tables: more tables the query may read beside `experience`, by name (e.g. `lineage`; such a query runs on a
            fresh connection).

    Returns:
        The result as a `pa.Table`.

    Raises:
        InvalidArgument: the query is empty, too long, not a single SELECT, reaches outside `experience`, or
            DuckDB rejects it.
        QueryTimeout: the deadline passed or the caller went away.
        ResourceExhausted: the query needed more memory than `memory_limit` or returned more than
            `max_result_bytes`.
    """
    limits = limits or DEFAULT_LIMITS
    context = _SERVING.get()
    if context is None:
        return _run(table, query, limits, cancelled, sandbox, tables)
    if context.cancelled is not None:
        cancelled = _either(cancelled, context.cancelled)
    with context.gate() if context.gate is not None else nullcontext():
        return _run(table, query, limits.tighter(context.limits), cancelled, sandbox, tables)


def _either(a: Callable[[], bool] | None, b: Callable[[], bool]) -> Callable[[], bool]:
    return b if a is None else (lambda: a() or b())


class Sandbox:
    """Cached sandboxed connections: what `run` opens per query (about 0.1 s), opened once and reused.

    A connection is opened as `run` opens one (no file system, locked configuration, one SELECT at a time) and is
    kept per (memory limit, threads), since those are fixed when it opens; deadlines, cancellation and result
    limits apply per query as in `run`. Queries on one `Sandbox` run one at a time (a lock). Between queries the
    connection holds nothing: the `experience` table is unregistered after each query, and a connection that was
    interrupted or failed inside DuckDB is closed and replaced. A query cannot change a connection's state: the
    parser admits one SELECT only and the configuration is locked.

    Usage (what `arrowbuf.query.filters.RowFilters` does, one per store)::

        box = Sandbox()
        tree = box.parse("SELECT seq FROM experience WHERE (reward > 0)")   # refused like `run` refuses
        out = run(table, "SELECT seq FROM experience WHERE (reward > 0)", sandbox=box)
        box.close()
    """

    #: Connections kept at most (one per distinct (memory limit, threads)); the oldest is closed first.
    MAX_CONNECTIONS = 2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cons: dict[tuple[int | None, int], Any] = {}

    def parse(self, query: str, limits: SqlLimits | None = None) -> dict[str, Any]:
        """Check `query` as `run` does before running it; return DuckDB's parse tree of its one SELECT."""
        duckdb = require("duckdb", "query")
        limits = limits or DEFAULT_LIMITS
        _check_text(query, limits)
        with self._lock:
            con = self._connection(duckdb, limits)
            try:
                return _check(con, query)
            except InvalidArgument:
                raise
            except Exception:
                self._drop(limits)
                raise

    def _query(self, duckdb: ModuleType, table: pa.Table, query: str, limits: SqlLimits,
               cancelled: Callable[[], bool] | None) -> pa.Table:
        with self._lock:
            con = self._connection(duckdb, limits)
            healthy = False
            try:
                out = _query(duckdb, con, table, query, limits, cancelled)
                healthy = True
                return out
            except (InvalidArgument, ResourceExhausted) as exc:
                healthy = getattr(exc, "_arrowbuf_clean", False)
                raise
            finally:
                if healthy:
                    try:
                        con.unregister("experience")
                    except Exception:  # noqa: BLE001 - a connection that cannot unregister is replaced
                        healthy = False
                if not healthy:
                    self._drop(limits)

    def _connection(self, duckdb: ModuleType, limits: SqlLimits) -> DuckDBPyConnection:
        key = (limits.memory_limit, limits.threads)
        con = self._cons.get(key)
        if con is None:
            while len(self._cons) >= self.MAX_CONNECTIONS:
                self._cons.pop(next(iter(self._cons))).close()
            con = self._cons[key] = _connect(duckdb, limits)
        return con

    def _drop(self, limits: SqlLimits) -> None:
        con = self._cons.pop((limits.memory_limit, limits.threads), None)
        if con is not None:
            con.close()

    def connections(self) -> list[int]:
        """Identities of the connections open now (tests and stats: a reused connection keeps its identity)."""
        with self._lock:
            return [id(con) for con in self._cons.values()]

    def close(self) -> None:
        """Close the cached connections (idempotent; a later query opens new ones)."""
        with self._lock:
            while self._cons:
                self._cons.popitem()[1].close()


def _check_text(query: str, limits: SqlLimits) -> None:
    if not isinstance(query, str) or not query.strip():
        raise InvalidArgument("sql: expected a non-empty SQL SELECT string")
    if len(query) > limits.max_query_chars:
        raise InvalidArgument(f"sql: the query has {len(query)} characters, over the limit of "
                              f"{limits.max_query_chars}; shorten it")


def _run(table: pa.Table, query: str, limits: SqlLimits, cancelled: Callable[[], bool] | None,
         sandbox: Sandbox | None = None, tables: dict[str, pa.Table] | None = None) -> pa.Table:
    duckdb = require("duckdb", "query")
    _check_text(query, limits)
    if sandbox is not None and not tables:
        return sandbox._query(duckdb, table, query, limits, cancelled)
    con = _connect(duckdb, limits)
    try:
        return _query(duckdb, con, table, query, limits, cancelled, tables)
    finally:
        con.close()


def _query(duckdb: ModuleType, con: DuckDBPyConnection, table: pa.Table, query: str, limits: SqlLimits,
           cancelled: Callable[[], bool] | None, tables: dict[str, pa.Table] | None = None) -> pa.Table:
    """Check and run `query` over `table` (and the `tables` beside it) on an open sandboxed connection. An
    `InvalidArgument` or `ResourceExhausted` that left the connection as it was carries `_arrowbuf_clean = True`."""
    extra = {str(k).lower(): v for k, v in (tables or {}).items()}
    try:
        _check(con, query, frozenset(extra))
    except InvalidArgument as exc:
        exc._arrowbuf_clean = True  # type: ignore[attr-defined]
        raise
    con.register("experience", table)
    for name, t in extra.items():
        con.register(name, t)
    with _Deadline(con, limits.timeout, cancelled) as deadline:
        try:
            return _fetch(con, query, limits)
        except duckdb.InterruptException:
            raise deadline.error() from None
        except duckdb.OutOfMemoryException:
            raise ResourceExhausted(f"sql: the query needed more than the sandbox's memory limit of "
                                    f"{_mib(limits.memory_limit)}; aggregate more or select fewer rows") from None
        except (duckdb.Error, pa.ArrowException) as exc:  # errors while streaming come as Arrow errors
            if deadline.fired:  # an interrupt can surface as another DuckDB error mid-operator
                raise deadline.error() from None
            error = InvalidArgument(f"sql: the query failed: {_short(str(exc))}")
            error._arrowbuf_clean = isinstance(exc, (duckdb.BinderException, duckdb.ParserException))  # type: ignore[attr-defined]
            raise error from None


def _connect(duckdb: ModuleType, limits: SqlLimits) -> DuckDBPyConnection:
    config: dict[str, Any] = {"enable_external_access": False, "temp_directory": "", "threads": limits.threads,
                              "autoload_known_extensions": False, "autoinstall_known_extensions": False}
    if limits.memory_limit is not None:
        config["memory_limit"] = f"{limits.memory_limit}B"
    con = duckdb.connect(":memory:", config=config)
    try:
        for statement in ("SET disabled_filesystems='LocalFileSystem'", "SET max_temp_directory_size='0B'",
                          "SET secret_directory=''", "SET extension_directory=''",
                          "SET python_enable_replacements=false",  # no Python variables as tables
                          "SET lock_configuration=true"):
            con.execute(statement)
    except Exception:
        con.close()
        raise
    return con


def _check(con: DuckDBPyConnection, query: str, extra: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Parse `query` with DuckDB's parser and refuse anything but one SELECT over `experience` (and the `extra`
    tables) (module docstring); return the statement's parse tree."""
    raw = con.execute("SELECT json_serialize_sql(?::VARCHAR)", [query]).fetchall()[0][0]
    tree = json.loads(raw)
    if tree.get("error"):
        message = str(tree.get("error_message", ""))
        if "Only SELECT" in message:
            raise InvalidArgument("sql: only one SELECT statement is allowed (no COPY, SET, PRAGMA, ATTACH, "
                                  "CREATE, INSERT, ...)")
        raise InvalidArgument(f"sql: the query does not parse: {_short(message)}")
    statements = tree.get("statements") or []
    if len(statements) != 1:
        raise InvalidArgument(f"sql: expected exactly one SELECT statement, got {len(statements)}")
    ctes = {str(key).lower() for key in _cte_names(statements[0])}
    for node in _walk(statements[0]):
        kind = node.get("type")
        if kind == "BASE_TABLE":
            name = str(node.get("table_name", "")).lower()
            if node.get("schema_name") or node.get("catalog_name") or (name != "experience" and name not in ctes
                                                                              and name not in extra):
                raise InvalidArgument(f"sql: a query reads only the table `experience` (and its own CTEs), not "
                                      f"{_short(_qualified(node, 'table_name'))!r}")
        elif kind == "TABLE_FUNCTION":
            fn = node.get("function") or {}
            name = str(fn.get("function_name", "")).lower()
            if name not in TABLE_FUNCTIONS or fn.get("schema") or fn.get("catalog"):
                raise InvalidArgument(f"sql: table function {_short(name)!r} is not allowed; the sandbox allows "
                                      f"{sorted(TABLE_FUNCTIONS)}")
        elif node.get("class") == "FUNCTION" and "function_name" in node:
            name = str(node.get("function_name", "")).lower()
            if node.get("schema") or node.get("catalog") or any(d in name for d in _DENIED):
                raise InvalidArgument(f"sql: function {_short(_qualified(node, 'function_name'))!r} is not "
                                      "allowed in the sandbox (it reports server settings or reaches outside "
                                      "`experience`)")
    return dict(statements[0])


def _walk(value: object) -> Iterator[dict[str, Any]]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _cte_names(tree: object) -> Iterator[str]:
    for node in _walk(tree):
        cte_map = node.get("cte_map")
        if isinstance(cte_map, dict):
            for entry in cte_map.get("map") or []:
                if isinstance(entry, dict) and "key" in entry:
                    yield str(entry["key"])


def _qualified(node: dict[str, Any], key: str) -> str:
    parts = [str(node.get(k) or "") for k in ("catalog_name", "catalog", "schema_name", "schema")]
    return ".".join([p for p in parts if p] + [str(node.get(key, ""))])


def _fetch(con: DuckDBPyConnection, query: str, limits: SqlLimits) -> pa.Table:
    """Stream the result batch by batch, stopping as soon as it passes `max_result_bytes`."""
    relation = con.sql(query)
    reader_of = getattr(relation, "to_arrow_reader", None) or relation.fetch_arrow_reader  # DuckDB >= 1.4 / older
    reader = reader_of(8192)
    batches, total = [], 0
    for batch in reader:
        total += batch.nbytes
        if limits.max_result_bytes is not None and total > limits.max_result_bytes:
            raise ResourceExhausted(f"sql: the result is larger than the sandbox's limit of "
                                    f"{_mib(limits.max_result_bytes)}; aggregate, filter or add LIMIT")
        batches.append(batch)
    return pa.Table.from_batches(batches, schema=reader.schema)


class _Deadline:
    """Interrupts a DuckDB connection when its deadline passes or its caller goes away (one thread per query)."""

    def __init__(self, con: DuckDBPyConnection, timeout: float | None, cancelled: Callable[[], bool] | None) -> None:
        self._con = con
        self._timeout = timeout
        self._cancelled = cancelled
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: str | None = None

    def __enter__(self) -> _Deadline:
        if self._timeout is not None or self._cancelled is not None:
            self._thread = threading.Thread(target=self._watch, name="arrowbuf-sql-deadline", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        end = None if self._timeout is None else time.monotonic() + self._timeout
        while True:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                self.fired = "deadline"
                break
            # without `cancelled` this is one wait for the whole deadline; with it, a check every 50 ms
            # (pyarrow tells a handler about a cancelled call only when asked)
            step = left if self._cancelled is None else min(_CANCEL_CHECK_S, left if left is not None else 1.0)
            if self._done.wait(step):
                return
            if self._cancelled is not None and self._cancelled():
                self.fired = "cancelled"
                break
        self._con.interrupt()

    def error(self) -> QueryTimeout:
        if self.fired == "cancelled":
            return QueryTimeout("sql: the query was stopped because its caller went away")
        return QueryTimeout(f"sql: the query ran past the sandbox's deadline of {self._timeout} s; "
                            "make it cheaper (filter, aggregate, LIMIT)")


def _mib(n: int | None) -> str:
    return "unlimited" if n is None else f"{n / (1 << 20):.0f} MiB"


def _short(text: str, limit: int = 300) -> str:
    """A client-supplied or client-influenced string cut to `limit` characters for an error message."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


__all__ = ["DEFAULT_LIMITS", "Sandbox", "SqlLimits", "TABLE_FUNCTIONS", "run"]
