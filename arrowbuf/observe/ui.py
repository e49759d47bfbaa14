"""The live web inspector (`arrowbuf ui`, `arrowbuf serve --ui`, `ab.observe.ui.Inspector`): one page over a store.

What it shows: the overview (capacity, fill, bytes per tier, placement per column and tier, chunks), ingest and
consume rates over the last minutes, per-task progress (ready, waiting, consumed, in flight) and staleness,
episode returns (RL) or group reward distributions (GRPO: a `prompt_id` and a `reward` field), a read-only SQL box,
and the lineage of a row.

Why the standard library only: the page is one HTML document with its script and styles inline (no CDN, no build
step; the machine that runs it may have no internet), and the server is `http.server.ThreadingHTTPServer` answering
a handful of JSON endpoints. A web framework would add a dependency to every install for five routes; the data
already comes as dicts and Arrow tables.

Safety (docs/security.md, "inspector"): binds 127.0.0.1 by default and refuses a non-loopback address without a
token (and warns with one: the page sends it over plain HTTP every second); with a token every `/api/` call needs
`Authorization: Bearer <token>` (the page asks for it, or reads `#token=` from its address; compared in constant
time), checked before a request's body is read. Every request's Host must name this machine and a request from a
page its own origin (`arrowbuf.serving.http.RequestGuard`: no DNS rebinding, no cross-site request), a POST must be
`application/json`, no answer may be framed; connections are capped and time out (`BoundedHTTPServer`). SQL runs
in the SQL sandbox (`arrowbuf.query.sql`) with the inspector's `SqlLimits` (or, for a remote store, the server's),
each query holding a slot of `sql_gate` (`arrowbuf serve --ui` shares the Flight server's, so `max_concurrent_sql`
bounds both together, and with it the columns queries copy out of the store); results are cut at `MAX_ROWS` rows.
"""

from __future__ import annotations

import collections
import hmac
import json
import logging
import math
import threading
import time
from datetime import datetime
from decimal import Decimal
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np

from ..errors import InvalidArgument
from ..query.sql import SqlLimits
from ..serving.http import BoundedHTTPServer, GuardedHandler, RequestGuard
from ..serving.limits import CallGate, NetLimits, check_bind, check_json_depth
from ..surface import Observable, StoreSurface
from .metrics import parse_address
from .ui_page import PAGE

log = logging.getLogger("arrowbuf.observe")

#: Rows of a query result sent to the page (the rest are counted, not sent).
MAX_ROWS = 1000
#: Largest request body read (a SQL query), in bytes.
MAX_BODY = 128 << 10
#: A body over MAX_BODY but at most this is read and dropped before the 413 (see `_refuse_body`).
DRAIN_BODY = 8 << 20
#: Points of the rate history kept (one per `interval`): 5 minutes at 1 s.
HISTORY = 300
#: The inspector's own bounds of a query over an in-process store.
DEFAULT_SQL_LIMITS = SqlLimits(timeout=5.0, memory_limit=256 << 20, max_result_bytes=16 << 20)
#: The inspector's HTTP bounds (docs/security.md): a request body is a SQL query.
DEFAULT_LIMITS = NetLimits(max_request_bytes=MAX_BODY)
#: The page's Content-Security-Policy: its inline script and styles, nothing from elsewhere, never framed.
PAGE_CSP = ("default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; "
            "frame-ancestors 'none'; form-action 'none'; base-uri 'none'")


class Inspector:
    """A running inspector over `store` (anything with the store surface: an `ExperienceStore`, a `RemoteStore`,
    a `ShardedStore`); see the module docstring. A context manager; `url` is the page's address.

    Args:
        store: the store to show.
        address: "HOST:PORT" to bind (port 0 picks one).
        token: the bearer token `/api/` calls need (None: none; then only a loopback address is allowed).
        interval: seconds between two samples of the rates.
        sql_limits: the bounds of queries over an in-process store.
        limits: the HTTP bounds (`NetLimits`: connections, idle and total timeouts, request bytes, JSON depth, SQL
            queries at once).
        sql_gate: the `CallGate` whose "sql" slots queries take (`arrowbuf serve --ui`: the Flight server's
            `server.calls`, shared); None: the inspector's own, of `limits.max_concurrent_sql` slots.
        allowed_hosts: names other than loopback ones and IP addresses that the Host header may carry (a DNS name
            of this machine, when bound beyond loopback).

    Attributes:
        url, port: where it serves. http: the HTTP server (its connections, `refused`).
    """

    def __init__(self, store: StoreSurface, address: str = "127.0.0.1:0", *, token: str | None = None,
                 interval: float = 1.0, sql_limits: SqlLimits | None = None, limits: NetLimits | None = None,
                 sql_gate: CallGate | None = None, allowed_hosts: tuple[str, ...] = ()) -> None:
        host, port = parse_address(address)
        if token is not None and (not isinstance(token, str) or not token):
            raise InvalidArgument("token must be a non-empty string (or None)")
        if not (isinstance(interval, (int, float)) and 0.05 <= interval <= 60):
            raise InvalidArgument(f"interval must be in [0.05, 60] seconds, got {interval!r}")
        check_bind("the inspector", host, token, plain_http=True, stacklevel=3)
        self.store: StoreSurface = store
        self.token = token
        self.interval = float(interval)
        self.sql_limits = sql_limits or DEFAULT_SQL_LIMITS
        self.limits = limits or DEFAULT_LIMITS
        self.sql_gate = sql_gate if sql_gate is not None else CallGate({"sql": self.limits.max_concurrent_sql})
        if "sql" not in self.sql_gate.limits:
            raise InvalidArgument("sql_gate must count 'sql' slots (a Flight server's `server.calls`, or a "
                                  "CallGate({'sql': n}))")
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self._stop = threading.Event()
        handler = type("Handler", (_Handler,), {"inspector": self, "limits": self.limits,
                                                "guard": RequestGuard(host, allowed_hosts)})
        self.http = BoundedHTTPServer((host, port), handler, self.limits)
        self._httpd = self.http
        self.port = int(self._httpd.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/"
        self._sampler = threading.Thread(target=self._sample_loop, name="arrowbuf-ui-rates", daemon=True)
        self._server = threading.Thread(target=self._httpd.serve_forever, name="arrowbuf-ui", daemon=True)
        self._sample()
        self._sampler.start()
        self._server.start()

    # ------------------------------------------------------------------ rates
    def _sample(self) -> None:
        try:
            st = self.store.stats()
        except Exception as exc:  # noqa: BLE001 - a closed store: keep serving what we have
            log.debug("inspector: stats failed: %s", exc)
            return
        self.history.append({"t": time.time(), "inserts": int(st.get("inserts", 0)),
                             "samples": int(st.get("samples", 0)),
                             "consumed": {k: int(v) for k, v in (st.get("consumed") or {}).items()}})

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def rates(self) -> list[dict[str, Any]]:
        """Per interval of the history: time, rows inserted / sampled / consumed per task per second."""
        pts = list(self.history)
        out = []
        for a, b in zip(pts, pts[1:]):
            dt = max(1e-9, b["t"] - a["t"])
            out.append({"t": b["t"], "ingest": (b["inserts"] - a["inserts"]) / dt,
                        "sample": (b["samples"] - a["samples"]) / dt,
                        "consume": {k: (v - a["consumed"].get(k, 0)) / dt for k, v in b["consumed"].items()}})
        return out

    # ------------------------------------------------------------------ what the page asks for
    def overview(self) -> dict[str, Any]:
        """Stats, placement, per-task progress and staleness, rates (JSON-able)."""
        store = self.store
        st = store.stats()
        out: dict[str, Any] = {"stats": {k: st.get(k) for k in (
            "name", "schema", "size", "capacity", "inserts", "samples", "first_seq", "next_seq", "chunk_rows",
            "chunks", "sealed_chunks", "bytes", "rows_bytes", "reserved_bytes", "columns", "policy_version", "tasks",
            "consumed", "stale_dropped",
            "groups_dropped_zero_variance", "sampler")}}
        obs = None
        out["placement"], out["chunks"] = [], []
        if isinstance(store, Observable):  # a store in this process (a remote or sharded one shows its stats)
            out["placement"] = store.placement().select(["column", "tier", "chunks", "bytes"]).to_pylist()
            out["chunks"] = _chunks(store)
            obs = store.observability()
        tasks = {}
        for task in st.get("tasks") or []:
            row: dict[str, Any] = {"delivered": int((st.get("consumed") or {}).get(task, 0))}
            if obs is not None:
                row.update((obs["progress"]["tasks"] or {}).get(task, {}))
                lin = (obs.get("lineage") or {}).get(task)
                if lin is not None:
                    counts = np.asarray(lin["staleness"], dtype=np.int64)
                    n = int(counts.sum())
                    row["stale"] = int(lin["stale"])
                    row["mean_staleness"] = float((counts * np.arange(len(counts))).sum() / n) if n else None
                    row["staleness"] = counts.tolist()
            tasks[task] = row
        out["tasks"] = tasks
        if obs is not None:
            out["live"] = obs["progress"]["live"]
            out["produced"] = obs["progress"]["produced"]
            out["lineage_bytes"] = obs["lineage_bytes"]
            out["checkpoints"] = obs["checkpoints"]
        out["rates"] = self.rates()[-120:]
        return _jsonable(out)

    def sql(self, query: str) -> dict[str, Any]:
        """Run `query` in the sandbox; columns and at most MAX_ROWS rows."""
        if not isinstance(query, str) or not query.strip():
            raise InvalidArgument("sql: expected a non-empty SQL SELECT string")
        with self.sql_gate.enter("sql"):  # held while the store's columns are copied out, and the query runs
            if isinstance(self.store, Observable):  # a store in this process: the inspector's own bounds
                from ..query.frames import run_sql

                table = run_sql(self.store, query, self.sql_limits)
            else:  # a remote or sharded store: its server's sandbox and limits
                table = self.store.sql(query)
        shown = table.slice(0, MAX_ROWS)
        return _jsonable({"columns": table.column_names, "rows": [list(r.values()) for r in shown.to_pylist()],
                          "total_rows": table.num_rows, "truncated": table.num_rows > MAX_ROWS})

    def lineage(self, seq: int) -> dict[str, Any]:
        """The lineage rows of row `seq` (one per task)."""
        return self.sql(f"SELECT * FROM lineage WHERE seq = {int(seq)} ORDER BY task")

    def returns(self) -> dict[str, Any]:
        """Episode returns (RL) or per-group reward means (GRPO: `prompt_id` and `reward` fields), bounded."""
        fields = self.store.schema.fields
        if "prompt_id" in fields and "reward" in fields:
            res = self.sql("SELECT prompt_id AS grp, avg(reward) AS mean, count(reward) AS n FROM experience "
                           "WHERE reward IS NOT NULL GROUP BY 1 ORDER BY 1 DESC LIMIT 500")
            return {"kind": "group reward (mean per prompt)", "values": [r[1] for r in res["rows"]]}
        eps = self.store.episodes()
        eps = eps.filter(eps.column("complete")) if eps.num_rows else eps
        values = eps.column("return").to_pylist()[-500:] if eps.num_rows else []
        return _jsonable({"kind": "episode return (complete episodes)", "values": values})

    # ------------------------------------------------------------------ lifetime
    def authorized(self, header: str | None) -> bool:
        """Whether an `Authorization` header carries the token (always, without a token)."""
        if self.token is None:
            return True
        given = (header or "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), self.token.encode())

    def close(self) -> None:
        """Stop serving (idempotent); the store stays open."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.http.close()
        self._server.join(5.0)
        self._sampler.join(5.0)

    def __enter__(self) -> Inspector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Inspector({self.url!r})"


class _Handler(GuardedHandler):
    """The inspector's routes; every check of `arrowbuf.serving.http` first (module docstring)."""

    inspector: Inspector

    def _authorized(self) -> bool:
        """The token (before any body is read); False after a 401."""
        if self.inspector.authorized(self.headers.get("Authorization")):
            return True
        self.close_connection = True
        self.send_json(401, {"error": "Unauthenticated", "code": "UNAUTHENTICATED",
                             "message": "wrong or missing token: this inspector needs the store's token"})
        return False

    def _api(self, fn: Any) -> None:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - the page shows it (INTERNAL without details when unexpected)
            self.send_exception(exc, "inspector request")
            return
        self.send_json(200, result)

    def _not_found(self, path: str) -> None:
        self.send_json(404, {"error": "NotFound", "code": "NOT_FOUND", "message": f"no such page {path[:200]!r}"})

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        api = url.path.startswith("/api/")
        if not self.check_request(needs_origin=api):
            return
        ins = self.inspector
        if url.path in ("/", "/index.html"):
            self.send(200, PAGE.encode(), "text/html; charset=utf-8", csp=PAGE_CSP)
            return
        if url.path not in ("/api/overview", "/api/returns", "/api/lineage"):
            self._not_found(url.path)
            return
        if not self._authorized():
            return
        if url.path == "/api/overview":
            self._api(ins.overview)
        elif url.path == "/api/returns":
            self._api(ins.returns)
        else:
            q = parse_qs(url.query).get("seq", [""])[0]
            if not q.lstrip("-").isdigit() or len(q) > 20:
                self._api(lambda: (_ for _ in ()).throw(InvalidArgument(f"lineage: seq must be an integer, got "
                                                                        f"{q[:40]!r}")))
            else:
                self._api(lambda: ins.lineage(int(q)))

    def _refuse_body(self, length: int) -> None:
        """413 for a body over the limit. A body up to DRAIN_BODY is read and dropped first (at most 5 s), so the
        client, still sending, gets the answer rather than a reset connection; a larger one is not read at all."""
        self.close_connection = True
        if self.limits.max_request_bytes < length <= DRAIN_BODY:
            self.connection.settimeout(5.0)
            left = length
            try:
                while left > 0:
                    chunk = self.rfile.read(min(left, 64 << 10))
                    if not chunk:
                        break
                    left -= len(chunk)
            except OSError:
                return
        self.send_json(413, {"error": "InvalidArgument", "code": "INVALID_ARGUMENT",
                             "message": f"a query body is 1..{self.limits.max_request_bytes} bytes"})

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        if not self.check_request(needs_origin=True):
            return
        if url.path != "/api/sql":
            self.close_connection = True  # its body is never read
            self._not_found(url.path)
            return
        if not self._authorized():  # before a byte of the body is read
            return
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if ctype != "application/json":
            self.close_connection = True
            self.send_json(415, {"error": "InvalidArgument", "code": "INVALID_ARGUMENT",
                                 "message": "a query is POSTed as application/json: {\"query\": \"<SQL>\"}"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if not 0 < length <= self.limits.max_request_bytes:
            self._refuse_body(length)
            return
        body = self.rfile.read(length)

        def run() -> Any:
            check_json_depth(body, self.limits.max_json_depth, "sql")
            try:
                query = json.loads(body)["query"]
            except (ValueError, KeyError, TypeError, RecursionError):
                raise InvalidArgument('sql: the body is {"query": "<SQL>"}') from None
            return self.inspector.sql(query)

        self._api(run)


def _chunks(store: Observable, newest: int = 64) -> list[dict[str, Any]]:
    """The newest chunks of the chunk directory: slot, first_seq, rows, sealed, and where their columns live
    (`{tier: [columns]}`)."""
    table = store.chunks()
    rows = table.slice(max(0, table.num_rows - newest)).to_pylist()
    out = []
    for r in rows:
        tiers: dict[str, list[str]] = {}
        for k, v in r.items():
            if k.startswith("tier:"):
                tiers.setdefault(str(v), []).append(k[5:])
        out.append({"slot": r["slot"], "first_seq": r["first_seq"], "rows": r["rows"], "sealed": r["sealed"],
                    "tiers": tiers})
    return out


def _jsonable(obj: Any) -> Any:
    """Numbers, strings, lists and dicts only (numpy scalars, datetimes, NaN made plain)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Decimal):  # DuckDB's sum of integers
        return int(obj) if obj == obj.to_integral_value() else float(obj)
    if isinstance(obj, datetime):
        return obj.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + ("" if obj.tzinfo is None else " UTC")
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)
