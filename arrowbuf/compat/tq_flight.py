"""`arrowbuf.compat.transfer_queue` over Arrow Flight: one process holds the system (`tq.serve`), others join it
with `tq.init({"arrowbuf": {"location": server.location}})`.

Wire format, version `tq.v1` (everything a remote client sends is bounded and validated before bulk data is read):
- DoAction `tq.v1.<op>` with a JSON object body (at most `MAX_JSON` bytes) for the metadata calls (`get_meta`,
  `production_status`, `consumption_status`, `reset_consumption`, `clear_keys`, `clear_samples`,
  `clear_partition`, `kv_list`, `tags_of`, `key_indexes`, `keys_of`, `field_names`, `put_tags`); the result is one
  JSON object.
- DoPut with a JSON command descriptor `{"op": "put_keys"|"put_indexes", "partition_id", "keys"|"gidx",
  "kinds": {field: [kind, dtype, shape]}, "tags"}` and a stream of record batches whose columns are the fields
  (the Arrow types `tq_columns` gives them; checked against `kinds` before any value is read into the state). The
  samples a put creates are its keys, its ids, or the rows its batches carry (a put without fields sends no batch).
  The put result is one JSON object sent back as metadata.
- DoGet with a JSON ticket `{"op": "read", "partition_id", "gidx"|"keys", "fields"}`: one table of the fields, with
  the field kinds as JSON under the schema metadata key `tq.kinds`; each sample at most once per read.
- DoAction `tq.v1.limits`: the server's `TQLimits`.
Every request is bounded before the state is touched or bulk data read (`tq_limits.TQLimits`: calls and puts at
once, JSON size and depth, bytes and samples per put, reply bytes, partitions, field groups and tasks, idle and
total timeouts; docs/security.md). A token is required to bind beyond loopback. Errors cross as
`FlightServerError("tq.v1 error <Type>: <message>")` with the status detail `{"error", "code", "message"}` as
extra_info (never a traceback or a server path), and are raised again on the client as `KeyError`, `SchemaError`,
`InvalidArgument` or `ValueError`. Tags must be JSON values.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ..errors import InvalidArgument, ResourceExhausted, SchemaError
from ..flight.idle import OpenStreams
from ..flight.sockets import cut_server_connections
from ..serving.limits import CallGate, check_bind, check_bytes, public_error
from .tq_columns import FieldKind
from .tq_limits import TQLimits
from .tq_samplers import SAMPLERS, BaseSampler
from .tq_state import TQState

VERSION = "tq.v1"
MAX_JSON = TQLimits.max_request_bytes
MAX_IDS = 1 << 22
MAX_FIELDS = 4096
_ERR = re.compile(r"tq\.v1 error (KeyError|SchemaError|InvalidArgument|ValueError): (.*)", re.S)
_ERRORS: dict[str, type[Exception]] = {"KeyError": KeyError, "SchemaError": SchemaError,
                                       "InvalidArgument": InvalidArgument, "ValueError": ValueError}
#: The Flight error that carries each status code (the rest travel as FlightServerError).
_FLIGHT_ERRORS: dict[str, type[flight.FlightError]] = {
    "UNAUTHENTICATED": flight.FlightUnauthenticatedError, "UNAVAILABLE": flight.FlightUnavailableError,
    "TIMED_OUT": flight.FlightTimedOutError, "DEADLINE_EXCEEDED": flight.FlightTimedOutError,
    "INTERNAL": flight.FlightInternalError}
#: Seconds a new put waits for the slot of an idle put whose connection it cut.
_STREAM_SLOT_WAIT = 5.0

log = logging.getLogger("arrowbuf.compat")


def _str(obj: dict[str, Any], name: str, optional: bool = False) -> Any:
    v = obj.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v or len(v) > 1024:
        raise InvalidArgument(f"{name} must be a non-empty str of at most 1024 characters")
    return v


def _ids(obj: dict[str, Any], name: str) -> np.ndarray:
    v = obj.get(name)
    if not isinstance(v, list) or len(v) > MAX_IDS or not all(isinstance(i, int) and not isinstance(i, bool)
                                                               and 0 <= i < 2**62 for i in v):
        raise InvalidArgument(f"{name} must be a list of at most {MAX_IDS} non-negative ints")
    return np.asarray(v, dtype=np.int64)


def _strs(obj: dict[str, Any], name: str, optional: bool = False) -> Any:
    v = obj.get(name)
    if v is None and optional:
        return None
    if (not isinstance(v, list) or len(v) > MAX_IDS
            or not all(isinstance(s, str) and 0 < len(s) <= 1024 for s in v)):
        raise InvalidArgument(f"{name} must be a list of non-empty str")
    return v


def _tags(obj: dict[str, Any]) -> Any:
    v = obj.get("tags")
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, dict) or t is None for t in v):
        raise InvalidArgument("tags must be a list of JSON objects")
    return [t or {} for t in v]


def _kinds(obj: dict[str, Any]) -> dict[str, FieldKind]:
    v = obj.get("kinds", {})
    if not isinstance(v, dict) or len(v) > MAX_FIELDS:
        raise InvalidArgument(f"kinds must be an object of at most {MAX_FIELDS} fields")
    out = {}
    for name, k in v.items():
        if not isinstance(name, str) or not name or len(name) > 256:
            raise InvalidArgument(f"bad field name {name!r:.80}")
        out[name] = FieldKind.from_json(k)
    return out


def arrow_type(kind: FieldKind) -> pa.DataType:
    """The Arrow type a field of `kind` travels and is stored as."""
    value = pa.from_numpy_dtype(np.dtype(kind.dtype))
    if kind.kind != "dense":
        return pa.list_(value)
    if kind.shape:
        return pa.fixed_shape_tensor(value, list(kind.shape))
    return value


def sampler_spec(sampler: BaseSampler | None) -> Any:
    """A JSON spec of one of the shipped samplers (None for the system's default)."""
    if sampler is None:
        return None
    name = type(sampler).__name__
    if SAMPLERS.get(name) is not type(sampler):
        raise InvalidArgument(f"over Flight, get_meta takes one of the shipped samplers {sorted(SAMPLERS)}, "
                              f"got {name}")
    args = {k: getattr(sampler, k) for k in ("n_samples_per_prompt", "dp_size") if hasattr(sampler, k)}
    return {"name": name, "args": args}


class _AuthFactory(flight.ServerMiddlewareFactory):
    def __init__(self, token: str) -> None:
        super().__init__()
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info: Any, headers: dict[str, list[str]]) -> Any:
        got = (headers.get("authorization") or [""])[0]
        raw = got if isinstance(got, bytes) else str(got).encode()
        if not hmac.compare_digest(raw, self._expected):
            raise flight.FlightUnauthenticatedError("a wrong or missing token")
        return None


def _fail(e: BaseException) -> flight.FlightError:
    """The Flight error a client sees for `e`: `tq.v1 error <Name>: <message>` with the status detail
    `{"error", "code", "message"}` as extra_info; INTERNAL and no details for an error nobody raised on purpose (it
    is logged here), never a traceback or a server path (`arrowbuf.serving.limits.public_error`)."""
    err = public_error(e)
    if not err.expected:
        log.error("tq.v1: unexpected error", exc_info=e)
    cls = _FLIGHT_ERRORS.get(err.code, flight.FlightServerError)
    return cls(f"{VERSION} error {err.name}: {err.message}", extra_info=json.dumps(err.json()).encode())


class TQServer(flight.FlightServerBase):
    """Serves a `TQState` over Flight (see the module docstring); a context manager, `close()` is idempotent.

    Args:
        state: the system to serve.
        location: `grpc://host:port` (port 0 picks one). Beyond loopback a token is required.
        token: the bearer token every call must carry (None: none; loopback only).
        limits: the bounds of every request (`TQLimits`; docs/security.md lists them), or single limits as keywords.
        allow_unauthenticated: bind beyond loopback without a token anyway (warned; a trusted network only).

    Attributes:
        limits: the `TQLimits` enforced. calls: the `CallGate` counting calls and put streams running now.
    """

    def __init__(self, state: TQState, location: str = "grpc://127.0.0.1:0", token: str | None = None, *,
                 limits: TQLimits | None = None, allow_unauthenticated: bool = False, **overrides: Any) -> None:
        if limits is not None and not isinstance(limits, TQLimits):
            raise InvalidArgument(f"limits must be a TQLimits, got {type(limits).__name__}")
        self.limits: TQLimits = (limits or TQLimits()).with_overrides(**overrides)
        if token is not None and (not isinstance(token, str) or not token):
            raise InvalidArgument("token must be a non-empty string (or None for no authentication)")
        host = str(location).split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
        check_bind("tq.v1 server", host or "0.0.0.0", token, allow_unauthenticated=allow_unauthenticated,
                   stacklevel=3)
        middleware = {"auth": _AuthFactory(token)} if token else None
        super().__init__(location, middleware=middleware)
        self.state = state
        # the address clients dial: the bound host (loopback when it binds every interface)
        shown = "127.0.0.1" if host in ("0.0.0.0", "", "::") else (f"[{host}]" if ":" in host else host)
        self.location = f"grpc://{shown}:{self.port}"
        self.calls = CallGate({"call": self.limits.max_concurrent_calls, "stream": self.limits.max_concurrent_streams})
        self.streams = OpenStreams()
        self._samplers: dict[str, BaseSampler] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self.serve, name="arrowbuf-tq-flight", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            done = threading.Thread(target=self.shutdown, name="arrowbuf-tq-shutdown", daemon=True)
            done.start()
            done.join(self.limits.shutdown_timeout)
            if done.is_alive():  # calls held open by their clients: cut their connections (their calls end)
                cut_server_connections(self.port)
                done.join(10)
            self._thread.join(10)

    def __enter__(self) -> TQServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ calls
    @contextlib.contextmanager
    def _call(self, context: Any, stream: bool = False) -> Iterator[None]:
        """A call's slot (and a put's stream slot); every error leaves as `_fail` says."""
        try:
            with contextlib.ExitStack() as slots:
                if stream:
                    slots.enter_context(self._stream_slot(context))
                slots.enter_context(self.calls.enter("call"))
                yield
        except flight.FlightError:
            raise
        except Exception as e:  # noqa: BLE001 - every error reaches the client mapped, never with a traceback
            raise _fail(e) from None

    @contextlib.contextmanager
    def _stream_slot(self, context: Any) -> Iterator[None]:
        """A put's slot; when every one is taken, the connections of puts idle for `idle_timeout` are cut first."""
        try:
            self.calls.acquire("stream")
        except ResourceExhausted:
            idle = self.streams.idle_peers(self.limits.idle_timeout)
            if not idle:
                raise
            cut = cut_server_connections(self.port, idle)
            log.warning("tq.v1 %s: every put slot taken; cut %d connection(s) idle for %gs or more", self.location,
                        cut, self.limits.idle_timeout)
            self.calls.acquire("stream", wait=_STREAM_SLOT_WAIT)
        try:
            with self.streams.open(context.peer()):
                yield
        finally:
            self.calls.release("stream")

    def _sampler(self, spec: Any) -> BaseSampler | None:
        if spec is None:
            return None
        if (not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or spec.get("name") not in SAMPLERS
                or not isinstance(spec.get("args"), dict)
                or not all(k in ("n_samples_per_prompt", "dp_size") and isinstance(v, int) and 0 < v < 1 << 20
                           for k, v in spec["args"].items())):
            raise InvalidArgument(f"bad sampler spec {str(spec)[:200]}")
        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            if key not in self._samplers:
                if len(self._samplers) >= len(SAMPLERS) * 64:  # (name, args) pairs a client may make us keep
                    raise ResourceExhausted("too many distinct sampler specs on this server")
                self._samplers[key] = SAMPLERS[spec["name"]](**spec["args"])
            return self._samplers[key]

    def _key_indexes(self, pid: str, keys: list[str]) -> np.ndarray:
        self.limits.check_ids(len(keys), "keys")
        with self.state.lock:
            gidx, _ = self.state.partition(pid).plan_keys(keys, create=False)
        return gidx

    def do_action(self, context: Any, action: Any) -> Any:
        with self._call(context):
            kind = action.type
            if not isinstance(kind, str) or not kind.startswith(VERSION + "."):
                raise InvalidArgument(f"unknown action {str(kind)[:80]!r} (this server speaks {VERSION})")
            body = action.body
            check_bytes(0 if body is None else body.size, self.limits.max_request_bytes, kind[:80])
            b = self.limits.loads(body.to_pybytes() if body is not None else b"{}", kind[:80])
            raw = json.dumps(self._act(kind[len(VERSION) + 1:], b)).encode()
            self.limits.check_reply(len(raw), kind[:80])
        return [flight.Result(raw)]

    def _act(self, op: str, b: dict[str, Any]) -> Any:
        s, lim = self.state, self.limits
        if op == "limits":
            return lim.describe()
        if op == "kv_list":
            return s.kv_list(_str(b, "partition_id", optional=True))
        pid = _str(b, "partition_id")
        if op == "get_meta":
            fields = _strs(b, "data_fields")
            cfg = b.get("sampling_config") or {}
            if not isinstance(cfg, dict) or not all(k in ("dp_rank", "batch_index") and isinstance(v, int)
                                                    for k, v in cfg.items()):
                raise InvalidArgument("sampling_config takes dp_rank and batch_index (ints)")
            n = b.get("batch_size")
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= lim.max_ids:
                raise InvalidArgument(f"batch_size must be an int in [0, {lim.max_ids}]")
            mode = b.get("mode", "fetch")
            task = _str(b, "task_name", optional=True)
            lim.check_task(task)
            sampler = self._sampler(b.get("sampler"))
            with s.lock:
                lim.check_new_task(s, pid, task)
                return s.get_meta(pid, fields, n, mode, task, sampler, cfg).tolist()
        if op == "production_status":
            idx, st = s.production_status(pid, _strs(b, "data_fields"))
            return [idx.tolist(), st.tolist()]
        if op == "consumption_status":
            task = _str(b, "task_name")
            lim.check_task(task)
            idx, st = s.consumption_status(pid, task)
            return [idx.tolist(), st.tolist()]
        if op == "reset_consumption":
            task = _str(b, "task_name", optional=True)
            lim.check_task(task)
            return s.reset_consumption(pid, task)
        if op == "clear_keys":
            s.clear_keys(pid, _strs(b, "keys"))
            return None
        if op == "clear_samples":
            s.clear_samples(pid, _ids(b, "gidx"))
            return None
        if op == "clear_partition":
            s.clear_partition(pid)
            return None
        if op == "tags_of":
            gidx = _ids(b, "gidx")
            lim.check_read(gidx, "tags_of")
            return s.tags_of(pid, gidx)
        if op == "key_indexes":
            return self._key_indexes(pid, _strs(b, "keys")).tolist()
        if op == "field_names":
            with s.lock:
                return sorted(s.partition(pid).group_of)
        if op == "keys_of":
            gidx = _ids(b, "gidx")
            lim.check_read(gidx, "keys_of")
            return s.keys_of(pid, gidx)
        if op == "field_kinds":
            return {f: k.to_json() for f, k in s.field_kinds(pid).items()}
        if op == "put_tags":
            gidx, tags = _ids(b, "gidx"), _tags(b)
            lim.check_ids(len(gidx), "put_tags")
            return s.put_indexes(pid, gidx, 0, {}, {}, tags).tolist()
        raise InvalidArgument(f"unknown action {VERSION}.{op[:80]}")

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        with self._call(context, stream=True):
            lim = self.limits
            raw = descriptor.command
            b = lim.loads(raw if isinstance(raw, bytes) else b"", "put")
            pid = _str(b, "partition_id")
            op = b.get("op")
            if op not in ("put_keys", "put_indexes"):
                raise InvalidArgument(f"put: unknown op {str(op)[:80]!r}")
            kinds = _kinds(b)
            keys = _strs(b, "keys") if op == "put_keys" else None
            gidx_in = None if op == "put_keys" or b.get("gidx") is None else _ids(b, "gidx")
            tags = _tags(b)
            for named in (keys, gidx_in, tags):
                if named is not None:
                    lim.check_ids(len(named), "put")
            expected = pa.schema([pa.field(f, arrow_type(k)) for f, k in kinds.items()])
            got = reader.schema
            if not got.remove_metadata().equals(expected):
                raise SchemaError(f"put: the columns {str(got.remove_metadata())[:300]} do not match the field kinds "
                                  f"{str(expected)[:300]}; nothing was written")
            batches = []
            seen = {"bytes": 0, "rows": 0}
            started = time.monotonic()
            for chunk in reader:  # one message at a time: every bound checked before the next is read
                self.streams.touch()
                if chunk.data is None:
                    continue
                if not kinds:
                    raise InvalidArgument("put: a put without fields carries no record batches (its samples "
                                          "come from keys or ids, never from a batch's length)")
                lim.check_put_message(chunk.data, seen, started, time.monotonic())
                batches.append(chunk.data)
            lim.check_put_total(seen)
            table = pa.Table.from_batches(batches, schema=got)
            cols = {f: table.column(f).combine_chunks() for f in kinds}
            if op == "put_keys":
                assert keys is not None
                if table.num_rows != len(keys) and kinds:
                    raise SchemaError(f"put: {table.num_rows} rows for {len(keys)} keys; nothing was written")
                with self.state.lock:
                    lim.check_new_partition(self.state, pid)
                    lim.check_new_group(self.state, pid, list(cols))
                    gidx, stored = self.state.put_keys(pid, keys, kinds, cols, tags)
                result: Any = {"gidx": gidx.tolist(), "fields": stored}
            else:
                count = table.num_rows if gidx_in is None else len(gidx_in)
                if kinds and table.num_rows != count:
                    raise SchemaError(f"put: {table.num_rows} rows for {count} samples; nothing was written")
                with self.state.lock:
                    if gidx_in is None:
                        lim.check_new_partition(self.state, pid)
                    lim.check_new_group(self.state, pid, list(cols))
                    result = {"gidx": self.state.put_indexes(pid, gidx_in, count, kinds, cols, tags).tolist()}
            writer.write(pa.py_buffer(json.dumps(result).encode()))

    def do_get(self, context: Any, ticket: Any) -> Any:
        with self._call(context):
            lim = self.limits
            b = lim.loads(ticket.ticket, "get")
            if b.get("op") != "read":
                raise InvalidArgument(f"get: unknown op {str(b.get('op'))[:80]!r}")
            pid = _str(b, "partition_id")
            fields = _strs(b, "fields", optional=True)
            if b.get("keys") is not None:
                keys = _strs(b, "keys")
                lim.check_ids(len(keys), "read")
                gidx = self._key_indexes(pid, keys)
            else:
                gidx = _ids(b, "gidx")
            lim.check_read(gidx)
            cols, kinds = self.state.read(pid, gidx, fields)
            meta = {b"tq.kinds": json.dumps({f: k.to_json() for f, k in kinds.items()}).encode(),
                    b"tq.rows": str(len(gidx)).encode()}
            table = pa.table({f: cols[f] for f in kinds}) if kinds else pa.table({})
            lim.check_reply(table.nbytes, "read")
        return flight.RecordBatchStream(table.replace_schema_metadata(meta))

    # the verbs tq.v1 does not speak: a clean refusal, never a traceback
    def list_flights(self, context: Any, criteria: Any) -> Any:
        with self._call(context):
            raise InvalidArgument(f"this server speaks {VERSION} (DoAction, DoPut, DoGet); it lists no flights")

    def get_flight_info(self, context: Any, descriptor: Any) -> Any:
        with self._call(context):
            raise InvalidArgument(f"this server speaks {VERSION} (DoAction, DoPut, DoGet); it has no flight info")

    def do_exchange(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        with self._call(context):
            raise InvalidArgument(f"this server speaks {VERSION} (DoAction, DoPut, DoGet); no DoExchange")

    def list_actions(self, context: Any) -> Any:
        return [(f"{VERSION}.{op}", "") for op in ACTIONS]


#: The DoAction operations of tq.v1 (after the `tq.v1.` prefix).
ACTIONS = ("get_meta", "production_status", "consumption_status", "reset_consumption", "clear_keys", "clear_samples",
           "clear_partition", "kv_list", "tags_of", "key_indexes", "keys_of", "field_names", "field_kinds",
           "put_tags", "limits")


class RemoteBackend:
    """The client side: the calls `TransferQueueClient` makes, over Flight."""

    def __init__(self, location: str, token: str | None = None) -> None:
        self.location = location
        self._headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._client = flight.FlightClient(location)
        self._options = flight.FlightCallOptions(headers=self._headers)

    def _raise(self, e: Exception) -> None:
        m = _ERR.search(str(e))
        if m is None:
            raise e
        msg = m.group(2).split("\n")[0].split(". Detail:")[0]
        raise _ERRORS[m.group(1)](msg) from None

    def _act(self, op: str, **body: Any) -> Any:
        try:
            out = list(self._client.do_action(flight.Action(f"{VERSION}.{op}", json.dumps(body).encode()),
                                              self._options))
        except flight.FlightError as e:
            self._raise(e)
        return json.loads(out[0].body.to_pybytes())

    def _put(self, command: dict[str, Any], kinds: dict[str, FieldKind], cols: dict[str, Any], n: int) -> Any:
        command["kinds"] = {f: k.to_json() for f, k in kinds.items()}
        schema = pa.schema([pa.field(f, arrow_type(k)) for f, k in kinds.items()])
        table = pa.table({f: cols[f] for f in kinds}, schema=schema) if kinds else pa.table({})
        try:
            writer, reader = self._client.do_put(flight.FlightDescriptor.for_command(json.dumps(command).encode()),
                                                 table.schema, self._options)
            with writer:
                if table.num_columns:
                    writer.write_table(table)
                writer.done_writing()
                buf = reader.read()
        except flight.FlightError as e:
            self._raise(e)
        return json.loads(buf.to_pybytes())

    def put_keys(self, partition_id: str, keys: list[str], kinds: dict[str, FieldKind], cols: dict[str, Any],
                 tags: list[dict[str, Any]] | None) -> tuple[np.ndarray, list[str]]:
        out = self._put({"op": "put_keys", "partition_id": partition_id, "keys": keys, "tags": tags}, kinds, cols,
                        len(keys))
        return np.asarray(out["gidx"], dtype=np.int64), list(out["fields"])

    def put_indexes(self, partition_id: str, gidx: np.ndarray | None, count: int, kinds: dict[str, FieldKind],
                    cols: dict[str, Any], tags: list[dict[str, Any]] | None = None) -> np.ndarray:
        if not kinds and gidx is not None:
            return np.asarray(self._act("put_tags", partition_id=partition_id, gidx=gidx.tolist(), tags=tags))
        out = self._put({"op": "put_indexes", "partition_id": partition_id,
                         "gidx": None if gidx is None else gidx.tolist(), "tags": tags}, kinds, cols, count)
        return np.asarray(out["gidx"], dtype=np.int64)

    def read(self, partition_id: str, gidx: np.ndarray, fields: list[str] | None
             ) -> tuple[dict[str, Any], dict[str, FieldKind]]:
        ticket = {"op": "read", "partition_id": partition_id, "gidx": gidx.tolist(), "fields": fields}
        try:
            table = self._client.do_get(flight.Ticket(json.dumps(ticket).encode()), self._options).read_all()
        except flight.FlightError as e:
            self._raise(e)
        raw = json.loads((table.schema.metadata or {}).get(b"tq.kinds", b"{}"))
        kinds = {f: FieldKind.from_json(k) for f, k in raw.items()}
        return {f: table.column(f) for f in kinds}, kinds

    def key_indexes(self, partition_id: str, keys: list[str]) -> np.ndarray:
        return np.asarray(self._act("key_indexes", partition_id=partition_id, keys=keys), dtype=np.int64)

    def get_meta(self, partition_id: str, data_fields: list[str], batch_size: int, mode: str,
                 task_name: str | None, sampler: BaseSampler | None, sampling_config: dict[str, Any]) -> np.ndarray:
        cfg = {k: v for k, v in sampling_config.items() if k in ("dp_rank", "batch_index")}
        return np.asarray(self._act("get_meta", partition_id=partition_id, data_fields=data_fields,
                                    batch_size=batch_size, mode=mode, task_name=task_name,
                                    sampler=sampler_spec(sampler), sampling_config=cfg), dtype=np.int64)

    def production_status(self, partition_id: str, data_fields: list[str]) -> tuple[np.ndarray, np.ndarray]:
        idx, st = self._act("production_status", partition_id=partition_id, data_fields=data_fields)
        return np.asarray(idx, dtype=np.int64), np.asarray(st, dtype=np.int8)

    def consumption_status(self, partition_id: str, task_name: str) -> tuple[np.ndarray, np.ndarray]:
        idx, st = self._act("consumption_status", partition_id=partition_id, task_name=task_name)
        return np.asarray(idx, dtype=np.int64), np.asarray(st, dtype=np.int8)

    def reset_consumption(self, partition_id: str, task_name: str | None) -> bool:
        return bool(self._act("reset_consumption", partition_id=partition_id, task_name=task_name))

    def clear_keys(self, partition_id: str, keys: list[str]) -> None:
        self._act("clear_keys", partition_id=partition_id, keys=keys)

    def clear_samples(self, partition_id: str, gidx: np.ndarray) -> None:
        self._act("clear_samples", partition_id=partition_id, gidx=gidx.tolist())

    def clear_partition(self, partition_id: str) -> None:
        self._act("clear_partition", partition_id=partition_id)

    def kv_list(self, partition_id: str | None) -> dict[str, dict[str, Any]]:
        return dict(self._act("kv_list", partition_id=partition_id))

    def tags_of(self, partition_id: str, gidx: np.ndarray) -> list[dict[str, Any]]:
        return list(self._act("tags_of", partition_id=partition_id, gidx=np.asarray(gidx).tolist()))

    def field_names(self, partition_id: str) -> list[str]:
        return list(self._act("field_names", partition_id=partition_id))

    def field_kinds(self, partition_id: str) -> dict[str, FieldKind]:
        raw = self._act("field_kinds", partition_id=partition_id)
        if not isinstance(raw, dict):
            raise SchemaError("field_kinds: the server sent no mapping")
        return {str(f): FieldKind.from_json(k) for f, k in raw.items()}

    def keys_of(self, partition_id: str, gidx: np.ndarray) -> list[str | None]:
        return list(self._act("keys_of", partition_id=partition_id, gidx=np.asarray(gidx).tolist()))

    def close_client(self) -> None:
        self._client.close()
