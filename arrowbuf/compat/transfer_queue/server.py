"""The server side of `tq.v2` (`wire`): a `TQState` served over Arrow Flight.

Every request is bounded before the state is touched or bulk data read (`limits.TQLimits`: calls and puts at once,
JSON size and depth, bytes and samples per put, reply bytes, partitions, field groups and tasks, idle and total
timeouts; docs/security.md). A token is required to bind beyond loopback. Errors cross as
`FlightServerError("tq.v2 error <Type>: <message>")` with the status detail `{"error", "code", "message"}` as
extra_info (never a traceback or a server path; an error nobody raised on purpose is INTERNAL, without details, and
logged here).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hmac
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ...errors import InvalidArgument, ResourceExhausted, SchemaError
from ...flight.idle import OpenStreams, acquire_stream_slot
from ...flight.sockets import cut_server_connections
from ...schema.dtypes import is_logical, physical_dtype
from ...serving.limits import CallGate, check_bind, check_bytes, error_code, public_error
from .columns import TEXT_KINDS, FieldKind, FieldValues, ValuesSpec
from .limits import TQLimits
from .state import PutPlan, TQState
from .wire import ACTIONS, ERRORS, MAX_FIELDS, VERSION, arrow_type, chunk_rows

#: The Flight error that carries each status code (the rest travel as FlightServerError).
_FLIGHT_ERRORS: dict[str, type[flight.FlightError]] = {
    "UNAUTHENTICATED": flight.FlightUnauthenticatedError, "UNAVAILABLE": flight.FlightUnavailableError,
    "TIMED_OUT": flight.FlightTimedOutError, "DEADLINE_EXCEEDED": flight.FlightTimedOutError,
    "INTERNAL": flight.FlightInternalError}
#: Seconds a new put waits for the slot of an idle put whose connection it cut.

log = logging.getLogger("arrowbuf.compat")


def _str(obj: dict[str, Any], name: str) -> str:
    v = obj.get(name)
    if not isinstance(v, str) or not v or len(v) > 1024:
        raise InvalidArgument(f"{name} must be a non-empty str of at most 1024 characters")
    return v


def _opt_str(obj: dict[str, Any], name: str) -> str | None:
    return None if obj.get(name) is None else _str(obj, name)


def _ids(obj: dict[str, Any], name: str, limits: TQLimits) -> np.ndarray:
    v = obj.get(name)
    if not isinstance(v, list) or len(v) > limits.max_ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**62 for i in v):
        raise InvalidArgument(f"{name} must be a list of at most {limits.max_ids} non-negative ints")
    return np.asarray(v, dtype=np.int64)


def _strs(obj: dict[str, Any], name: str, limits: TQLimits) -> list[str]:
    v = obj.get(name)
    if (not isinstance(v, list) or len(v) > limits.max_ids
            or not all(isinstance(s, str) and 0 < len(s) <= 1024 for s in v)):
        raise InvalidArgument(f"{name} must be a list of at most {limits.max_ids} non-empty str")
    return v


def _json_dict(obj: dict[str, Any], name: str) -> dict[str, Any]:
    v = obj.get(name)
    if not isinstance(v, dict):
        raise InvalidArgument(f"{name} must be a JSON object")
    return v


def _opt_json_dict(obj: dict[str, Any], name: str) -> dict[str, Any] | None:
    return None if obj.get(name) is None else _json_dict(obj, name)


def _tags(obj: dict[str, Any], limits: TQLimits) -> list[dict[str, Any] | None] | None:
    v = obj.get("tags")
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > limits.max_ids or not all(isinstance(t, dict) or t is None for t in v):
        raise InvalidArgument("tags must be a list of JSON objects")
    return v


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


def _per_tensor_field(obj: dict[str, Any], key: str, kinds: dict[str, FieldKind]) -> dict[str, Any]:
    """`obj[key]`: an object keyed by tensor fields of the put (`kinds`), or empty."""
    v = obj.get(key) or {}
    if not isinstance(v, dict):
        raise InvalidArgument(f"{key} must be an object")
    for name in v:
        if name not in kinds or kinds[name].kind != "tensor":
            raise InvalidArgument(f"{key} given for {str(name)[:80]!r}, which is no tensor field of this put")
    return v


def _is_shape(s: object) -> bool:
    """A sample shape as JSON: a list of at most 16 non-negative ints."""
    return isinstance(s, list) and len(s) <= 16 and all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in s)


def _shapes(obj: dict[str, Any], kinds: dict[str, FieldKind], rows: int) -> dict[str, list[tuple[int, ...]]]:
    """Each sample's shape of the ragged tensor fields of a put."""
    out = {}
    for name, shapes in _per_tensor_field(obj, "shapes", kinds).items():
        if not isinstance(shapes, list) or len(shapes) != rows or not all(_is_shape(s) for s in shapes):
            raise InvalidArgument(f"shapes of {str(name)[:80]!r} must be {rows} lists of at most 16 non-negative ints")
        out[name] = [tuple(s) for s in shapes]
    return out


def _text_lengths(obj: dict[str, Any], kinds: dict[str, FieldKind]) -> dict[str, int]:
    """The bytes of the longest sample of each text field of a shared-memory put's plan (`max_len`): its arena in
    shared memory is sized by it (a sample longer than it said fails the writer's own write, before anything is
    written)."""
    raw = obj.get("max_len")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidArgument("max_len must be an object: text field -> bytes of its longest sample")
    out = {}
    for name, v in raw.items():
        k = kinds.get(name)
        if k is None or k.kind not in TEXT_KINDS:
            raise InvalidArgument(f"max_len names {str(name)[:80]!r}, not a text field of the put")
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**40:
            raise InvalidArgument(f"max_len of {str(name)[:80]!r} must be an int of bytes in [0, 2**40)")
        out[name] = v
    return out


def _dense(obj: dict[str, Any], kinds: dict[str, FieldKind]) -> dict[str, tuple[int, ...]]:
    """The one sample shape of each dense tensor field of a shared-memory put's plan."""
    out = {}
    for name, shape in _per_tensor_field(obj, "dense", kinds).items():
        if not _is_shape(shape):
            raise InvalidArgument(f"dense shape of {str(name)[:80]!r} must be a list of at most 16 non-negative ints")
        out[name] = tuple(shape)
    return out


@dataclass
class _PutCommand:
    """A put's command (a DoPut's descriptor, a shared-memory plan's body), checked: for samples `gidx` (a put) or
    `keys` with `tags` (a KV put), `rows` of them; the fields' kinds, each ragged tensor field's per-sample shapes,
    and the fields the writer gave as nested tensors."""

    op: str
    partition_id: str
    keys: list[str] | None
    gidx: list[int]
    tags: list[dict[str, Any] | None] | None
    rows: int
    kinds: dict[str, FieldKind]
    shapes: dict[str, list[tuple[int, ...]]]
    nested: list[str]

    @classmethod
    def parse(cls, b: dict[str, Any], lim: TQLimits, what: str) -> _PutCommand:
        op = b.get("op")
        if op not in ("put", "kv_put"):
            raise InvalidArgument(f"{what}: unknown op {str(op)[:80]!r}")
        pid = _str(b, "partition_id")
        keys = _strs(b, "keys", lim) if op == "kv_put" else None
        gidx = _ids(b, "gidx", lim).tolist() if keys is None else []
        tags = _tags(b, lim) if keys is not None else None
        rows = len(gidx) if keys is None else len(keys)
        lim.check_put_rows(rows)
        kinds = _kinds(b)
        return cls(op, pid, keys, gidx, tags, rows, kinds, _shapes(b, kinds, rows),
                   _strs(b, "nested", lim) if b.get("nested") is not None else [])


class _AuthFactory(flight.ServerMiddlewareFactory):
    def __init__(self, token: str) -> None:
        super().__init__()
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info: flight.CallInfo, headers: dict[str, list[str]]) -> flight.ServerMiddleware | None:
        got = (headers.get("authorization") or [""])[0]
        raw = got if isinstance(got, bytes) else str(got).encode()
        if not hmac.compare_digest(raw, self._expected):
            raise flight.FlightUnauthenticatedError("a wrong or missing token")
        return None


def _fail(e: BaseException) -> flight.FlightError:
    """The Flight error a client sees for `e`: `tq.v2 error <Name>: <message>` (Name: the nearest type the client
    knows, `wire.ERRORS`) with the status detail `{"error", "code", "message"}` as extra_info; INTERNAL and no
    details for an error nobody raised on purpose (logged here), never a traceback or a server path."""
    err = public_error(e)
    if error_code(e) is None:
        log.error("%s: unexpected error", VERSION, exc_info=e)
        name = err.name
    else:
        name = next((c.__name__ for c in type(e).__mro__ if c.__name__ in ERRORS), err.name)
    cls = _FLIGHT_ERRORS.get(err.code, flight.FlightServerError)
    detail = {**err.json(), "error": name}
    return cls(f"{VERSION} error {name}: {err.message}", extra_info=json.dumps(detail).encode())


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
                 limits: TQLimits | None = None, allow_unauthenticated: bool = False, **overrides: float) -> None:
        if limits is not None and not isinstance(limits, TQLimits):
            raise InvalidArgument(f"limits must be a TQLimits, got {type(limits).__name__}")
        self.limits: TQLimits = (limits or TQLimits()).with_overrides(**overrides)
        if token is not None and (not isinstance(token, str) or not token):
            raise InvalidArgument("token must be a non-empty string (or None for no authentication)")
        host = str(location).split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
        check_bind(f"{VERSION} server", host or "0.0.0.0", token, allow_unauthenticated=allow_unauthenticated,
                   stacklevel=3)
        middleware = {"auth": _AuthFactory(token)} if token else None
        super().__init__(location, middleware=middleware)
        self.state = state
        # the address clients dial: the bound host (loopback when it binds every interface)
        shown = "127.0.0.1" if host in ("0.0.0.0", "", "::") else (f"[{host}]" if ":" in host else host)
        self.location = f"grpc://{shown}:{self.port}"
        self.calls = CallGate({"call": self.limits.max_concurrent_calls, "stream": self.limits.max_concurrent_streams})
        self.streams = OpenStreams()
        self._shm_plans: dict[str, PutPlan] = {}  # open shared-memory puts by their handle (`_shm`)
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
    def _call(self, context: flight.ServerCallContext, stream: bool = False) -> Iterator[None]:
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
    def _stream_slot(self, context: flight.ServerCallContext) -> Iterator[None]:
        """A put's slot; when every one is taken, the connections of puts idle for `idle_timeout` are cut first."""
        acquire_stream_slot(self.calls, self.streams, self.port, self.limits.idle_timeout, f"{VERSION} {self.location}")
        try:
            with self.streams.open(context.peer()):
                yield
        finally:
            self.calls.release("stream")

    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> list[flight.Result]:
        with self._call(context):
            kind = action.type
            if not isinstance(kind, str) or not kind.startswith(VERSION + ".") or kind[len(VERSION) + 1:] not in (
                    *ACTIONS, "limits"):
                raise InvalidArgument(f"unknown action {str(kind)[:80]!r} (this server speaks {VERSION}: "
                                      f"{[*ACTIONS, 'limits']})")
            body = action.body
            check_bytes(0 if body is None else body.size, self.limits.max_request_bytes, kind[:80])
            b = self.limits.loads(body.to_pybytes() if body is not None else b"{}", kind[:80])
            raw = json.dumps({"result": self._act(kind[len(VERSION) + 1:], b)}).encode()
            self.limits.check_reply(len(raw), kind[:80])
        return [flight.Result(raw)]

    def _act(self, op: str, b: dict[str, Any]) -> object:
        s, lim = self.state, self.limits
        if op == "limits":
            return lim.describe()
        if op.startswith("shm_"):
            return self._shm(op, b)
        if op == "list_partitions":
            return s.list_partitions()
        if op == "kv_list":
            return s.kv_list(_opt_str(b, "partition_id"))
        if op == "set_custom_meta":
            per = _json_dict(b, "custom_meta")
            out: dict[str, dict[int, dict[str, Any]]] = {}
            for pid, pairs in per.items():
                if not isinstance(pairs, list) or len(pairs) > lim.max_ids or not all(
                        isinstance(x, list) and len(x) == 2 and isinstance(x[0], int) and isinstance(x[1], dict)
                        for x in pairs):
                    raise InvalidArgument("custom_meta must map partition ids to [global index, object] pairs")
                out[str(pid)[:1024]] = {int(g): m for g, m in pairs}
            s.set_custom_meta(out)
            return None
        if op == "clear_samples":
            gidx = _ids(b, "gidx", lim)
            s.clear_samples(_strs(b, "partition_ids", lim), gidx.tolist())
            return None
        pid = _str(b, "partition_id")
        if op == "get_meta":
            n = b.get("batch_size")
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= lim.max_ids):
                raise InvalidArgument(f"batch_size must be an int in [0, {lim.max_ids}]")
            task = _opt_str(b, "task_name")
            lim.check_task(task)
            mode = b.get("mode", "fetch")
            with s.lock:
                if mode == "insert":
                    lim.check_new_partition(s, pid)
                    lim.check_put_rows(n or 0)
                lim.check_new_task(s, pid, task)
            return s.get_meta(pid, _strs(b, "data_fields", lim), n, mode, task, b.get("sampler"),
                              _opt_json_dict(b, "sampling_config"))
        if op == "kv_retrieve_meta":
            keys = _strs(b, "keys", lim)
            if len(set(keys)) != len(keys):  # the reply repeats each key's custom metadata: a key once per request
                raise InvalidArgument("kv_retrieve_meta: the request names a key more than once; a reply holds each "
                                      "sample once (ask for the distinct keys)")
            create = bool(b.get("create", False))
            if create:
                with s.lock:
                    lim.check_new_partition(s, pid)
            return s.kv_retrieve_meta(pid, keys, create)
        if op == "kv_retrieve_keys":
            gidx = _ids(b, "gidx", lim)
            lim.check_read(gidx, "kv_retrieve_keys")
            return s.kv_retrieve_keys(pid, gidx.tolist())
        if op == "production_status":
            return s.production_status(pid, _strs(b, "data_fields", lim))
        if op == "consumption_status":
            task = _str(b, "task_name")
            lim.check_task(task)
            return s.consumption_status(pid, task)
        if op == "reset_consumption":
            task = _opt_str(b, "task_name")
            lim.check_task(task)
            return s.reset_consumption(pid, task)
        if op == "clear_partition":
            s.clear_partition(pid)
            return None
        if op == "snapshot":
            return s.snapshot(pid)
        if op == "field_kinds":
            return s.field_kinds(pid)
        raise InvalidArgument(f"unknown action {VERSION}.{op[:80]}")

    # ------------------------------------------------------------------ shared memory (clients of the node)
    def _shm(self, op: str, b: dict[str, Any]) -> object:
        """The shared-memory put and read of a client on this node (`remote`): the client writes or reads the rows
        of a field group's shared store itself; the server plans, commits and locates. A state without shared
        memory (or a group that got none) answers `{"shm": None}` and the client goes over DoPut/DoGet."""
        s, lim = self.state, self.limits
        if op == "shm_abort":
            plan = self._shm_plans.pop(_str(b, "plan"), None)
            if plan is not None:
                s.abort_put(plan)
            return None
        if op == "shm_commit":
            plan = self._shm_plans.pop(_str(b, "plan"), None)
            if plan is None:
                raise InvalidArgument("shm_commit: no such put plan open (committed, aborted or expired); nothing "
                                      "was registered")
            with s.lock:
                try:
                    rows = _ids(b, "rows", lim)
                    stores = plan.partition.stores
                    if s.partitions.get(plan.partition_id) is not plan.partition or plan.group >= len(stores):
                        raise ValueError(f"partition {plan.partition_id!r} was cleared while the put was written; "
                                         "nothing was registered")
                    group = stores[plan.group]
                    lo, hi = group.store.index.lo - group.base, group.store.index.hi - group.base
                    if len(rows) != plan.n or (len(rows) and (int(rows.min()) < lo or int(rows.max()) >= hi)):
                        raise InvalidArgument(f"shm_commit: {len(rows)} rows for {plan.n} samples, or rows outside "
                                              f"the group's [{lo}, {hi}); nothing was registered")
                except BaseException:
                    s.abort_put(plan)
                    raise
                result = s.commit_put(plan, rows)
            return result if plan.keys is not None else None
        if not s.shared_memory:  # "off": the client stops asking (a group without a shared store is only this one)
            return {"shm": None, "off": True}
        pid = _str(b, "partition_id")
        if op == "shm_locate":
            fields = _strs(b, "fields", lim)
            gidx = _ids(b, "gidx", lim)
            lim.check_read(gidx)
            located = s.locate(pid, gidx.tolist(), fields)
            groups = s.groups_of(pid, located)
            if any(g.shm is None for g in groups.values()):
                return {"shm": None}
            return {"shm": {str(k): g.describe() for k, g in groups.items()},
                    "fields": {f: [[k, pos.tolist(), rows.tolist()] for k, pos, rows in where]
                               for f, where in located.items()}}
        # shm_plan
        c = _PutCommand.parse(b, lim, "shm_plan")
        kinds, shapes, rows_n = c.kinds, c.shapes, c.rows
        if not kinds:
            raise InvalidArgument("shm_plan: a put without fields goes over DoPut")
        dense = _dense(b, kinds)
        for f, k in kinds.items():
            if k.kind == "tensor" and (f in dense) == (f in shapes):
                raise SchemaError(f"shm_plan: tensor field {f[:80]!r} needs one shape (dense) or per-sample shapes "
                                  "(ragged), not both or neither")
        lengths = _text_lengths(b, kinds)
        specs = {f: ValuesSpec(k, rows_n, dense.get(f), shapes.get(f), lengths.get(f)) for f, k in kinds.items()}
        # a plan carries no values, but its group's store is reserved in /dev/shm at once: its samples may take what
        # a DoPut could carry (the state's shm_budget bounds every group's store together)
        planned = sum(physical_dtype(k.dtype).itemsize * (rows_n * math.prod(dense[f]) if f in dense
                                                         else sum(math.prod(x) for x in shapes.get(f, ())))
                      for f, k in kinds.items() if k.kind == "tensor") + rows_n * sum(lengths.values())
        if planned > lim.max_upload_bytes:
            raise ResourceExhausted(f"shm_plan: its samples take {planned} bytes, over this server's max_upload_bytes "
                                    f"({lim.max_upload_bytes}), what one put may carry; split the put")
        with s.lock:
            if len(self._shm_plans) >= lim.max_concurrent_streams:
                self._expire_shm_plans()
            if len(self._shm_plans) >= lim.max_concurrent_streams:
                # every slot held (writers mid-put, or plans a client abandoned until they expire): this put goes
                # over DoPut, which has slots of its own, rather than fail
                return {"shm": None, "busy": len(self._shm_plans)}
            plan = self._plan(c.op, c.partition_id, specs, c.nested, rows_n, c.gidx, c.keys, c.tags)
            group = plan.partition.stores[plan.group]
            if group.shm is None:  # /dev/shm had no room for it: its rows go over DoPut
                s.abort_put(plan)
                return {"shm": None}
            handle = f"{plan.id}.{secrets.token_hex(8)}"
            self._shm_plans[handle] = plan
            return {"shm": group.describe(), "plan": handle}

    def _expire_shm_plans(self) -> None:
        """Forget the handles of plans the state expired (a client that died between plan and commit)."""
        for handle, plan in list(self._shm_plans.items()):
            if not self.state.is_open(plan):
                self._shm_plans.pop(handle, None)

    def do_put(self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor,
               reader: flight.MetadataRecordBatchReader, writer: flight.FlightMetadataWriter) -> None:
        with self._call(context, stream=True):
            lim = self.limits
            raw = descriptor.command
            b = lim.loads(raw if isinstance(raw, bytes) else b"", "put")
            c = _PutCommand.parse(b, lim, "put")
            op, pid, keys, gidx, tags, rows = c.op, c.partition_id, c.keys, c.gidx, c.tags, c.rows
            kinds, shapes, nested = c.kinds, c.shapes, c.nested
            got = reader.schema
            for f, k in kinds.items():
                if f not in got.names:
                    raise SchemaError(f"put: no column for field {f[:80]!r}; nothing was written")
                t = got.field(f).type
                ragged = pa.types.is_list(t) or pa.types.is_large_list(t)
                if (f in shapes) != (ragged and k.kind == "tensor"):
                    raise SchemaError(f"put: field {f[:80]!r} of type {str(t)[:80]} needs per-sample shapes exactly "
                                      "when it is a ragged tensor; nothing was written")
                shape = tuple(t.shape) if isinstance(t, pa.FixedShapeTensorType) or is_logical(t) else ()
                want = arrow_type(k, ragged, shape)
                if not (t.equals(want) or (pa.types.is_large_list(t) and ragged)):
                    raise SchemaError(f"put: field {f[:80]!r} travels as {str(t)[:80]}, its kind {k.to_json()} as "
                                      f"{str(want)[:80]}; nothing was written")
            if len(got.names) != len(kinds):
                raise SchemaError(f"put: {len(got.names)} columns for {len(kinds)} fields; nothing was written")
            names = list(kinds)
            seen = {"bytes": 0, "rows": 0}
            started = time.monotonic()
            plan = None
            rows_written: list[np.ndarray] = []

            def values_of(data: pa.RecordBatch, at: int) -> dict[str, FieldValues]:
                return {f: FieldValues.from_arrow(kinds[f], data.column(f),
                                                  None if f not in shapes else shapes[f][at:at + data.num_rows])
                        for f in names}

            def write(data: pa.RecordBatch, at: int) -> np.ndarray:
                """Message `data` (its first row the put's `at`) into the plan's group."""
                assert plan is not None
                written = self.state.write_batch(plan, data)  # (the types were checked against kinds above)
                if written is not None:  # the group takes the message as it is: no conversion
                    return written
                return self.state.write_plan(plan, values_of(data, at))

            # each message is checked, then written into the plan's field group (the state lock is held only to
            # plan and to commit): a put's values are never all held at once. From the second message on, one
            # message is written on a thread of the put's own while the next one is received and decoded: the two
            # copies of each byte (gRPC's into Arrow, ours into the group) no longer take turns
            writer_pool: cf.ThreadPoolExecutor | None = None
            in_flight: cf.Future[np.ndarray] | None = None
            try:
                for chunk in reader:
                    self.streams.touch()
                    if chunk.data is None:
                        continue
                    if not kinds:
                        raise InvalidArgument("put: a put without fields carries no record batches")
                    lim.check_put_message(chunk.data, seen, started, time.monotonic())
                    if seen["rows"] > rows:
                        raise SchemaError(f"put: more than {rows} rows for {rows} samples; nothing was written")
                    at = seen["rows"] - chunk.data.num_rows
                    if plan is None:
                        values = values_of(chunk.data, at)
                        plan = self._plan(op, pid, self._specs(values, kinds, shapes, rows), nested, rows, gidx,
                                          keys, tags)
                        if chunk.data.num_rows:
                            rows_written.append(self.state.write_plan(plan, values))
                        continue
                    if not chunk.data.num_rows:
                        continue
                    if in_flight is not None:
                        rows_written.append(in_flight.result())
                    if writer_pool is None:
                        writer_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="arrowbuf-tq-put")
                    in_flight = writer_pool.submit(write, chunk.data, at)
                if in_flight is not None:
                    rows_written.append(in_flight.result())
                    in_flight = None
                if kinds:
                    lim.check_put_total(seen)
                if kinds and seen["rows"] != rows:
                    raise SchemaError(f"put: {seen['rows']} rows for {rows} samples; nothing was written")
                if plan is None:  # no record batch: a put of no fields (keys and tags) or of no samples
                    empty = got.empty_table()
                    plan = self._plan(op, pid, self._specs({f: FieldValues.from_arrow(kinds[f], empty.column(f), [])
                                                            for f in names}, kinds, shapes, rows),
                                      nested, rows, gidx, keys, tags)
            except BaseException:
                if in_flight is not None:  # no write runs into the group once the plan is aborted
                    cf.wait([in_flight])
                if plan is not None:
                    self.state.abort_put(plan)
                raise
            finally:
                if writer_pool is not None:
                    writer_pool.shutdown(wait=True)
            result = self.state.commit_put(plan, np.concatenate(rows_written) if rows_written
                                           else np.empty(0, dtype=np.int64))
            writer.write(pa.py_buffer(json.dumps({"result": result if keys is not None else None}).encode()))

    @staticmethod
    def _specs(values: dict[str, FieldValues], kinds: dict[str, FieldKind], shapes: dict[str, list[tuple[int, ...]]],
               rows: int) -> dict[str, ValuesSpec]:
        """The whole put's specs from its first message's `values`: `rows` samples, the shapes the command sent."""
        dense = {f: v.dense for f, v in values.items()}
        return {f: ValuesSpec(k, rows, None if (d := dense[f]) is None else tuple(d.shape[1:]), shapes.get(f))
                for f, k in kinds.items()}

    def _plan(self, op: str, pid: str, specs: dict[str, ValuesSpec], nested: list[str], rows: int, gidx: list[int],
              keys: list[str] | None, tags: list[dict[str, Any] | None] | None) -> PutPlan:
        """The state's plan of a put of `specs`, checked against the limits on partitions and groups."""
        with self.state.lock:
            self.limits.check_new_partition(self.state, pid)
            self.limits.check_new_group(self.state, pid, specs)
            if keys is None:
                return self.state.plan_put(pid, specs, nested, rows, gidx=gidx)
            return self.state.plan_put(pid, specs, nested, rows, keys=keys, tags=tags)

    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> flight.RecordBatchStream:
        with self._call(context):
            lim = self.limits
            b = lim.loads(ticket.ticket, "get")
            if b.get("op") != "read":
                raise InvalidArgument(f"get: unknown op {str(b.get('op'))[:80]!r}")
            pid = _str(b, "partition_id")
            fields = _strs(b, "fields", lim)
            gidx = _ids(b, "gidx", lim)
            lim.check_read(gidx)
            values = self.state.read(pid, gidx.tolist(), fields)
            meta = {b"tq.kinds": json.dumps({f: v.kind.to_json() for f, v in values.items()}).encode(),
                    b"tq.shapes": json.dumps({f: [list(x) for x in v.sample_shapes()] for f, v in values.items()
                                              if v.ragged}).encode()}
            table = pa.table([values[f].to_arrow() for f in fields], names=fields) if fields else pa.table({})
            lim.check_reply(table.nbytes + len(meta[b"tq.shapes"]), "read")
        # several messages: the client copies each into place as the next arrives (one message of a whole reply
        # is received before any of it is used)
        table = pa.Table.from_batches(table.to_batches(max_chunksize=chunk_rows(table)), table.schema)
        return flight.RecordBatchStream(table.replace_schema_metadata(meta))

    # the verbs tq.v2 does not speak: a clean refusal, never a traceback
    def list_flights(self, context: flight.ServerCallContext, criteria: bytes) -> Iterator[flight.FlightInfo]:
        with self._call(context):
            raise InvalidArgument(f"this server speaks {VERSION} (DoAction, DoPut, DoGet); it lists no flights")

    def get_flight_info(self, context: flight.ServerCallContext,
                        descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
        with self._call(context):
            raise InvalidArgument(f"this server speaks {VERSION} (DoAction, DoPut, DoGet); it has no flight info")

    def do_exchange(self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor,
                    reader: flight.MetadataRecordBatchReader, writer: flight.MetadataRecordBatchWriter) -> None:
        with self._call(context):
            raise InvalidArgument(f"this server speaks {VERSION} (DoAction, DoPut, DoGet); no DoExchange")

    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        return [(f"{VERSION}.{op}", "") for op in (*ACTIONS, "limits")]
