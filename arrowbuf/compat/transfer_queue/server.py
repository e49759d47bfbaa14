"""The server side of `tq.v2` (`wire`): a `TQState` served over Arrow Flight, every request bounded and validated
before bulk data is read."""

from __future__ import annotations

import hmac
import json
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ...errors import InvalidArgument, SchemaError
from .columns import FieldKind, FieldValues
from .state import TQState
from .wire import ACTIONS, ERRORS, MAX_FIELDS, MAX_IDS, MAX_JSON, MAX_PUT_BYTES, VERSION, arrow_type


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


def _json_dict(obj: dict[str, Any], name: str, optional: bool = True) -> Any:
    v = obj.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, dict):
        raise InvalidArgument(f"{name} must be a JSON object")
    return v


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


def _shapes(obj: dict[str, Any], kinds: dict[str, FieldKind], rows: int) -> dict[str, list[tuple[int, ...]]]:
    v = obj.get("shapes") or {}
    if not isinstance(v, dict):
        raise InvalidArgument("shapes must be an object")
    out = {}
    for name, shapes in v.items():
        if name not in kinds or kinds[name].kind != "tensor":
            raise InvalidArgument(f"shapes given for {name!r}, which is no tensor field of this put")
        if (not isinstance(shapes, list) or len(shapes) != rows
                or not all(isinstance(s, list) and len(s) <= 16
                           and all(isinstance(d, int) and 0 <= d < 2**40 for d in s) for s in shapes)):
            raise InvalidArgument(f"shapes of {name!r} must be {rows} lists of at most 16 non-negative ints")
        out[name] = [tuple(s) for s in shapes]
    return out


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
        name = type(e).__name__
        if name not in ERRORS:
            for base in type(e).__mro__:  # the nearest type the client knows
                if base.__name__ in ERRORS:
                    name = base.__name__
                    break
            else:
                name = "ValueError"
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        return flight.FlightServerError(f"{VERSION} error {name}: {msg}")

    def do_action(self, context: Any, action: Any) -> Any:
        try:
            kind = action.type
            if not kind.startswith(VERSION + ".") or kind[len(VERSION) + 1:] not in ACTIONS:
                raise InvalidArgument(f"unknown action {kind!r} (this server speaks {VERSION}: {list(ACTIONS)})")
            body = _loads(action.body.to_pybytes() if action.body is not None else b"{}", kind)
            result = self._act(kind[len(VERSION) + 1:], body)
        except (KeyError, ValueError, TypeError, AssertionError, RuntimeError) as e:
            raise self._fail(e) from None
        return [flight.Result(json.dumps({"result": result}).encode())]

    def _act(self, op: str, b: dict[str, Any]) -> Any:
        s = self.state
        if op == "list_partitions":
            return s.list_partitions()
        if op == "kv_list":
            return s.kv_list(_str(b, "partition_id", optional=True))
        if op == "set_custom_meta":
            per = _json_dict(b, "custom_meta", optional=False)
            out: dict[str, dict[int, dict[str, Any]]] = {}
            for pid, pairs in per.items():
                if not isinstance(pairs, list) or not all(
                        isinstance(x, list) and len(x) == 2 and isinstance(x[0], int) and isinstance(x[1], dict)
                        for x in pairs):
                    raise InvalidArgument("custom_meta must map partition ids to [global index, object] pairs")
                out[str(pid)] = {int(g): m for g, m in pairs}
            s.set_custom_meta(out)
            return None
        if op == "clear_samples":
            gidx = _ids(b, "gidx").tolist()
            return s.clear_samples(_strs(b, "partition_ids"), gidx)
        pid = _str(b, "partition_id")
        if op == "get_meta":
            n = b.get("batch_size")
            if n is not None and (not isinstance(n, int) or not 0 <= n <= MAX_IDS):
                raise InvalidArgument(f"batch_size must be an int in [0, {MAX_IDS}]")
            return s.get_meta(pid, _strs(b, "data_fields"), n, b.get("mode", "fetch"),
                              _str(b, "task_name", optional=True), b.get("sampler"),
                              _json_dict(b, "sampling_config"))
        if op == "kv_retrieve_meta":
            return s.kv_retrieve_meta(pid, _strs(b, "keys"), bool(b.get("create", False)))
        if op == "kv_retrieve_keys":
            return s.kv_retrieve_keys(pid, _ids(b, "gidx").tolist())
        if op == "production_status":
            return s.production_status(pid, _strs(b, "data_fields"))
        if op == "consumption_status":
            return s.consumption_status(pid, _str(b, "task_name"))
        if op == "reset_consumption":
            return s.reset_consumption(pid, _str(b, "task_name", optional=True))
        if op == "clear_partition":
            return s.clear_partition(pid)
        if op == "snapshot":
            return s.snapshot(pid)
        if op == "field_kinds":
            return s.field_kinds(pid)
        raise InvalidArgument(f"unknown action {VERSION}.{op}")

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        try:
            b = _loads(descriptor.command, "put")
            op = b.get("op")
            if op not in ("put", "kv_put"):
                raise InvalidArgument(f"put: unknown op {op!r}")
            pid = _str(b, "partition_id")
            keys = _strs(b, "keys") if op == "kv_put" else None
            gidx = _ids(b, "gidx").tolist() if keys is None else []
            tags = b.get("tags")
            if keys is not None and tags is not None and (
                    not isinstance(tags, list) or not all(isinstance(t, dict) or t is None for t in tags)):
                raise InvalidArgument("tags must be a list of JSON objects")
            rows = len(gidx) if keys is None else len(keys)
            kinds = _kinds(b)
            shapes = _shapes(b, kinds, rows)
            schema = _json_dict(b, "schema") or {}
            got = reader.schema
            for f, k in kinds.items():
                if f not in got.names:
                    raise SchemaError(f"put: no column for field {f!r}; nothing was written")
                t = got.field(f).type
                ragged = pa.types.is_list(t) or pa.types.is_large_list(t)
                if (f in shapes) != (ragged and k.kind == "tensor"):
                    raise SchemaError(f"put: field {f!r} of type {t} needs per-sample shapes exactly when it is a "
                                      "ragged tensor; nothing was written")
                shape = tuple(t.shape) if isinstance(t, pa.FixedShapeTensorType) else ()
                want = arrow_type(k, ragged, shape)
                if not (t.equals(want) or (pa.types.is_large_list(t) and ragged)):
                    raise SchemaError(f"put: field {f!r} travels as {t}, its kind {k.to_json()} as {want}; nothing "
                                      "was written")
            if len(got.names) != len(kinds):
                raise SchemaError(f"put: columns {got.names} for fields {sorted(kinds)}; nothing was written")
            batches, size = [], 0
            for chunk in reader:
                size += chunk.data.nbytes
                if size > MAX_PUT_BYTES:
                    raise InvalidArgument(f"put: more than {MAX_PUT_BYTES} bytes in one put")
                batches.append(chunk.data)
            table = pa.Table.from_batches(batches, schema=got)
            if kinds and table.num_rows != rows:
                raise SchemaError(f"put: {table.num_rows} rows for {rows} samples; nothing was written")
            values = {f: FieldValues.from_arrow(k, table.column(f), shapes.get(f)) for f, k in kinds.items()}
            result: Any = None
            if keys is None:
                self.state.put(pid, gidx, values, schema)
            else:
                result = self.state.kv_put(pid, keys, values, schema, tags)
        except (KeyError, ValueError, TypeError, AssertionError, RuntimeError) as e:
            raise self._fail(e) from None
        writer.write(pa.py_buffer(json.dumps({"result": result}).encode()))

    def do_get(self, context: Any, ticket: Any) -> Any:
        try:
            b = _loads(ticket.ticket, "get")
            if b.get("op") != "read":
                raise InvalidArgument(f"get: unknown op {b.get('op')!r}")
            pid = _str(b, "partition_id")
            fields = _strs(b, "fields")
            values = self.state.read(pid, _ids(b, "gidx").tolist(), fields)
        except (KeyError, ValueError, TypeError, AssertionError, RuntimeError) as e:
            raise self._fail(e) from None
        meta = {b"tq.kinds": json.dumps({f: v.kind.to_json() for f, v in values.items()}).encode(),
                b"tq.shapes": json.dumps({f: [list(x) for x in v.sample_shapes()] for f, v in values.items()
                                          if v.ragged}).encode()}
        table = pa.table([values[f].to_arrow() for f in fields], names=fields) if fields else pa.table({})
        return flight.RecordBatchStream(table.replace_schema_metadata(meta))
