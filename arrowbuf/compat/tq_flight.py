"""`arrowbuf.compat.transfer_queue` over Arrow Flight: one process holds the system (`tq.serve`), others join it
with `tq.init({"arrowbuf": {"location": server.location}})`.

Wire format, version `tq.v1` (everything a remote client sends is bounded and validated before bulk data is read):
- DoAction `tq.v1.<op>` with a JSON object body (at most `MAX_JSON` bytes) for the metadata calls (`get_meta`,
  `production_status`, `consumption_status`, `reset_consumption`, `clear_keys`, `clear_samples`,
  `clear_partition`, `kv_list`, `tags_of`, `key_indexes`, `keys_of`, `field_names`, `put_tags`); the result is one
  JSON object.
- DoPut with a JSON command descriptor `{"op": "put_keys"|"put_indexes", "partition_id", "keys"|"gidx"|"count",
  "kinds": {field: [kind, dtype, shape]}, "tags"}` and a stream of record batches whose columns are the fields
  (the Arrow types `tq_columns` gives them; checked against `kinds` before any value is read into the state). The
  put result is one JSON object sent back as metadata.
- DoGet with a JSON ticket `{"op": "read", "partition_id", "gidx"|"keys", "fields"}`: one table of the fields, with
  the field kinds as JSON under the schema metadata key `tq.kinds`.
Errors cross as `FlightServerError("tq.v1 error <Type>: <message>")` and are raised again on the client as
`KeyError`, `SchemaError`, `InvalidArgument` or `ValueError`. Tags must be JSON values.
"""

from __future__ import annotations

import hmac
import json
import re
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ..errors import InvalidArgument, SchemaError
from .tq_columns import FieldKind
from .tq_samplers import SAMPLERS, BaseSampler
from .tq_state import TQState

VERSION = "tq.v1"
MAX_JSON = 1 << 20
MAX_IDS = 1 << 22
MAX_PUT_BYTES = 16 << 30
MAX_FIELDS = 4096
_ERR = re.compile(r"tq\.v1 error (KeyError|SchemaError|InvalidArgument|ValueError): (.*)", re.S)
_ERRORS: dict[str, type[Exception]] = {"KeyError": KeyError, "SchemaError": SchemaError,
                                       "InvalidArgument": InvalidArgument, "ValueError": ValueError}


def _loads(raw: bytes, what: str) -> dict[str, Any]:
    if len(raw) > MAX_JSON:
        raise InvalidArgument(f"{what}: {len(raw)} bytes of JSON (at most {MAX_JSON})")
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"{what}: not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise InvalidArgument(f"{what}: expected a JSON object")
    return obj


def _str(obj: dict[str, Any], name: str, optional: bool = False) -> Any:
    v = obj.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v or len(v) > 1024:
        raise InvalidArgument(f"{name} must be a non-empty str of at most 1024 characters")
    return v


def _ids(obj: dict[str, Any], name: str) -> np.ndarray:
    v = obj.get(name)
    if not isinstance(v, list) or len(v) > MAX_IDS or not all(isinstance(i, int) and 0 <= i < 2**62 for i in v):
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
            raise InvalidArgument(f"bad field name {name!r}")
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
        got = (headers.get("authorization") or [""])[0].encode()
        if not hmac.compare_digest(got, self._expected):
            raise flight.FlightUnauthenticatedError("a wrong or missing token")
        return None


class TQServer(flight.FlightServerBase):
    """Serves a `TQState` over Flight (see the module docstring); a context manager, `close()` is idempotent."""

    def __init__(self, state: TQState, location: str = "grpc://127.0.0.1:0", token: str | None = None) -> None:
        middleware = {"auth": _AuthFactory(token)} if token else None
        super().__init__(location, middleware=middleware)
        self.state = state
        host = location.split("://", 1)[-1].rsplit(":", 1)[0]
        # the address clients dial: the bound host (loopback when it binds every interface)
        self.location = f"grpc://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}"
        self._samplers: dict[str, BaseSampler] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self.serve, name="arrowbuf-tq-flight", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.shutdown()
            self._thread.join(10)

    def __enter__(self) -> TQServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ calls
    @staticmethod
    def _fail(e: Exception) -> Exception:
        name = "SchemaError" if isinstance(e, SchemaError) else type(e).__name__
        if isinstance(e, InvalidArgument) and not isinstance(e, SchemaError):
            name = "InvalidArgument"
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        if name not in _ERRORS:
            name, msg = "ValueError", f"{type(e).__name__}: {msg}"
        return flight.FlightServerError(f"{VERSION} error {name}: {msg}")

    def _sampler(self, spec: Any) -> BaseSampler | None:
        if spec is None:
            return None
        if (not isinstance(spec, dict) or spec.get("name") not in SAMPLERS or not isinstance(spec.get("args"), dict)
                or not all(k in ("n_samples_per_prompt", "dp_size") and isinstance(v, int) and 0 < v < 1 << 20
                           for k, v in spec["args"].items())):
            raise InvalidArgument(f"bad sampler spec {spec!r}")
        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            if key not in self._samplers:
                self._samplers[key] = SAMPLERS[spec["name"]](**spec["args"])
            return self._samplers[key]

    def do_action(self, context: Any, action: Any) -> Any:
        try:
            kind = action.type
            if not kind.startswith(VERSION + "."):
                raise InvalidArgument(f"unknown action {kind!r} (this server speaks {VERSION})")
            body = _loads(action.body.to_pybytes() if action.body is not None else b"{}", kind)
            result = self._act(kind[len(VERSION) + 1:], body)
        except (KeyError, ValueError) as e:
            raise self._fail(e) from None
        return [flight.Result(json.dumps(result).encode())]

    def _act(self, op: str, b: dict[str, Any]) -> Any:
        s = self.state
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
            if not isinstance(n, int) or not 0 <= n <= MAX_IDS:
                raise InvalidArgument(f"batch_size must be an int in [0, {MAX_IDS}]")
            mode = b.get("mode", "fetch")
            task = _str(b, "task_name", optional=True)
            return s.get_meta(pid, fields, n, mode, task, self._sampler(b.get("sampler")), cfg).tolist()
        if op == "production_status":
            idx, st = s.production_status(pid, _strs(b, "data_fields"))
            return [idx.tolist(), st.tolist()]
        if op == "consumption_status":
            idx, st = s.consumption_status(pid, _str(b, "task_name"))
            return [idx.tolist(), st.tolist()]
        if op == "reset_consumption":
            return s.reset_consumption(pid, _str(b, "task_name", optional=True))
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
            return s.tags_of(pid, _ids(b, "gidx"))
        if op == "key_indexes":
            with s.lock:
                gidx, _ = s.partition(pid).plan_keys(_strs(b, "keys"), create=False)
            return gidx.tolist()
        if op == "field_names":
            with s.lock:
                return sorted(s.partition(pid).group_of)
        if op == "keys_of":
            return s.keys_of(pid, _ids(b, "gidx"))
        if op == "field_kinds":
            return {f: k.to_json() for f, k in s.field_kinds(pid).items()}
        if op == "put_tags":
            return s.put_indexes(pid, _ids(b, "gidx"), 0, {}, {}, _tags(b)).tolist()
        raise InvalidArgument(f"unknown action {VERSION}.{op}")

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        try:
            b = _loads(descriptor.command, "put")
            pid = _str(b, "partition_id")
            kinds = _kinds(b)
            expected = pa.schema([pa.field(f, arrow_type(k)) for f, k in kinds.items()])
            got = reader.schema
            if not got.remove_metadata().equals(expected):
                raise SchemaError(f"put: the columns {got.remove_metadata()} do not match the field kinds "
                                  f"{expected}; nothing was written")
            batches, size = [], 0
            for chunk in reader:
                size += chunk.data.nbytes
                if size > MAX_PUT_BYTES:
                    raise InvalidArgument(f"put: more than {MAX_PUT_BYTES} bytes in one put")
                batches.append(chunk.data)
            table = pa.Table.from_batches(batches, schema=got)
            cols = {f: table.column(f).combine_chunks() for f in kinds}
            tags = _tags(b)
            if b.get("op") == "put_keys":
                keys = _strs(b, "keys")
                if table.num_rows != len(keys) and kinds:
                    raise SchemaError(f"put: {table.num_rows} rows for {len(keys)} keys; nothing was written")
                gidx, stored = self.state.put_keys(pid, keys, kinds, cols, tags)
                result: Any = {"gidx": gidx.tolist(), "fields": stored}
            elif b.get("op") == "put_indexes":
                gidx_in = None if b.get("gidx") is None else _ids(b, "gidx")
                count = table.num_rows if gidx_in is None else len(gidx_in)
                if kinds and table.num_rows != count:
                    raise SchemaError(f"put: {table.num_rows} rows for {count} samples; nothing was written")
                result = {"gidx": self.state.put_indexes(pid, gidx_in, count, kinds, cols, tags).tolist()}
            else:
                raise InvalidArgument(f"put: unknown op {b.get('op')!r}")
        except (KeyError, ValueError) as e:
            raise self._fail(e) from None
        writer.write(pa.py_buffer(json.dumps(result).encode()))

    def do_get(self, context: Any, ticket: Any) -> Any:
        try:
            b = _loads(ticket.ticket, "get")
            if b.get("op") != "read":
                raise InvalidArgument(f"get: unknown op {b.get('op')!r}")
            pid = _str(b, "partition_id")
            fields = _strs(b, "fields", optional=True)
            if b.get("keys") is not None:
                with self.state.lock:
                    gidx, _ = self.state.partition(pid).plan_keys(_strs(b, "keys"), create=False)
            else:
                gidx = _ids(b, "gidx")
            cols, kinds = self.state.read(pid, gidx, fields)
        except (KeyError, ValueError) as e:
            raise self._fail(e) from None
        meta = {b"tq.kinds": json.dumps({f: k.to_json() for f, k in kinds.items()}).encode(),
                b"tq.rows": str(len(gidx)).encode()}
        table = pa.table({f: cols[f] for f in kinds}) if kinds else pa.table({})
        return flight.RecordBatchStream(table.replace_schema_metadata(meta))


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
