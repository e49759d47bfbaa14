"""The server side of `tq.v1` (`wire`): a `TQState` served over Arrow Flight, every request bounded and validated
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
from .columns import FieldKind
from .samplers import SAMPLERS, BaseSampler
from .state import TQState
from .wire import ERRORS, MAX_FIELDS, MAX_IDS, MAX_JSON, MAX_PUT_BYTES, VERSION, arrow_type


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
        if name not in ERRORS:
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

