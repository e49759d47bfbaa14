r"""The arrowbuf Flight wire format (protocol version 1): the one module that defines what crosses the wire.

docs/flight-protocol.md is the reader's version of this module, with a worked example per verb. Everything is
UTF-8 JSON objects so that any Flight client (C++, Java, Rust, Go) can speak it:

- DoGet: ticket `{"v":1,"kind":"sample","store":s,"n":256,"columns":null,"timeout":null,"options":{}}` returns
  one batch with app_metadata `{"v":1,"indices":[..],"weights":[..] or null}` (with `"meta":"columns"`: trailing
  columns `arrowbuf.id` and `arrowbuf.weight` instead, see `SAMPLE_META`); kinds "table", "episodes" and "sql"
  return a table (a snapshot).
- DoPut: descriptor path `[store]` or command `{"v":1,"kind":"extend","store":s,"timeout":t}`; one ack per batch,
  `{"v":1,"batch":k,"first_seq":f,"rows":n}`. Version 2: command `{"v":2,"kind":"update","store":s}` fills fields
  of stored rows (`store.update`): batches of an `id` column and later fields; ack `{"v":2,"batch":k,"rows":n,
  "skipped":m}`.
- DoExchange: descriptor command `{"v":1,"kind":"session","store":s,"n":256,...}`; up, metadata messages
  `{"op":"sample","count":k}` and `{"op":"update_priorities",...}`; down, batches with sample metadata or in-band
  errors.
- DoAction: a type in `ACTIONS`, body `{"v":1,"store":s,...}` (may be empty); one JSON result.
- Version 2 also adds DoGet kind "consume" (`{"v":2,"kind":"consume","task":t,"n":256,...}`: rows a task has not
  consumed, reply as a sample) and the actions "set_policy_version", "policy_version", "add_task" (body "v": 2).
  A consume ticket may carry "lease": seconds; the reply's metadata then names the lease ("lease": id) and the
  actions "ack" / "nack" (body `{"v":2,"lease":id}`) end it.
- ListFlights / GetFlightInfo / GetSchema: descriptor path `[store]` (`[store, "input"]`: the schema a writer sends).

Errors: every error a server raises on purpose is a Flight error whose `extra_info` (Arrow's binary status detail)
is `{"v":1,"error":<class>,"code":<status>,"message":<text>}`; `ERRORS` is the one table, in both directions.

Three parts live in their own modules, re-exported here (import them from this module): the consume verbs and lease
actions (`arrowbuf.flight.protocol.consume`), the error table (`arrowbuf.flight.protocol.errors`) and the sample
metadata in columns (`arrowbuf.flight.protocol.meta`). They import nothing from this module (the consume decoders
get the field reader passed in), so the wire format forms no import cycle.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ...errors import SchemaError
from .consume import CONSUME_ACTIONS as CONSUME_ACTIONS
from .consume import LEASE_ID as LEASE_ID
from .consume import MAX_LEASE_S as MAX_LEASE_S
from .consume import MAX_TASK_CHARS as MAX_TASK_CHARS
from .consume import MAX_TOKENS as MAX_TOKENS
from .consume import MAX_WHERE_CHARS as MAX_WHERE_CHARS
from .consume import ConsumeRequest as ConsumeRequest
from .consume import decode_consume, decode_consume_action, encode_consume
from .errors import ERRORS as ERRORS
from .errors import MAX_MESSAGE_CHARS as MAX_MESSAGE_CHARS
from .errors import ErrorMapping as ErrorMapping
from .errors import decode_error as decode_error
from .errors import error_mapping as error_mapping
from .errors import error_message as error_message
from .errors import from_flight_error as from_flight_error
from .meta import (
    ID_COLUMN,
    MAX_PAD,
    SAMPLE_META,
    WEIGHT_COLUMN,
    pad_metadata,
    realigning_pad,
    split_sample_columns,
)

#: The version of the base verbs; requests may omit "v" (meaning this version), and replies to them carry it.
PROTOCOL_VERSION = 1
#: Version 2 (the LLM post-training path) adds verbs: DoPut kind "update". Their requests and replies
#: carry "v": 2, so a version-1 server refuses them with "protocol version 2 is not supported"; the base verbs are
#: unchanged, so version-1 clients keep working against a version-2 server.
LLM_VERSION = 2
#: Version 3 adds an extend sent in parts: DoPut command `{"v":3,"kind":"extend","store":s,"parts":k,"rows":r}`
#: followed by exactly k record batches (each within `max_batch_bytes`) holding r rows in all; the server commits them
#: as one extend, atomically, after the last part, and acknowledges once (`{"v":1,"batch":0,"first_seq":f,
#: "rows":r}`). A sample ticket may carry "part_bytes" (with "v": 3): a sample larger than that comes as several
#: record batches of at most that size (the app_metadata on the first), which the client assembles. A version-1/2
#: server refuses either ("protocol version 3 is not supported"); `describe` lists the versions a server speaks under
#: "protocols" (absent: [1, 2]).
PARTS_VERSION = 3
#: Smallest record batch a version-3 sample ticket may ask a large sample to be cut into (`part_bytes`).
MIN_PART_BYTES = 1 << 20
SUPPORTED_VERSIONS = (1, 2, 3)
#: The header that carries the bearer token: `authorization: Bearer <token>`.
AUTH_HEADER = "authorization"
#: Largest JSON request accepted (tickets, actions, descriptors, exchange messages): bounds server memory.
MAX_JSON_BYTES = 16 << 20
#: Most batches one DoExchange `sample` request may ask for.
MAX_REQUEST_COUNT = 1024
#: Most batches a session may prefetch on the server (also bounded in bytes by the server).
MAX_PREFETCH = 16
#: Longest wait a request may ask for, in seconds (about 11 days).
MAX_TIMEOUT = 1e6

TICKET_KINDS = ("sample", "table", "episodes", "sql", "consume")
#: Sampler options a sample request or session may carry, and what each must be (unknown keys are an error;
#: the server bounds them further, e.g. n_step by its max_n_step, stated in `describe`).
SAMPLE_OPTIONS: dict[str, str] = {"n_step": "a positive integer", "gamma": "a number in [0, 1]",
                                  # a Ray shard's sampling-mass columns (arrowbuf.ray.handle asks every shard for them)
                                  "shard_info": "a boolean"}
#: DoAction types and what they do (ListActions returns this).
ACTIONS: dict[str, str] = {
    "describe": 'the store: {"store", "schema" (the schema dict), "capacity", "max_batch_rows", "protocol", "stores"}',
    "stats": "the store's stats() as JSON",
    "len": 'rows stored now: {"len": n}',
    "update_priorities": 'body {"indices": [...], "priorities": [...]}; returns {"applied": k}',
    # only under the server's checkpoint_root; `path` is a relative name (arrowbuf.persist.remote)
    "checkpoint": 'body {"path": "run-7", "keep": k (optional)}; writes under the server\'s checkpoint root; '
                  'returns the checkpoint summary',
    # the store's policy version and consuming tasks
    "set_policy_version": 'body {"policy_version": k}; sets the store\'s policy version; returns {"policy_version": k}',
    "policy_version": 'returns {"policy_version": k}, the store\'s current policy version',
    "add_task": 'body {"task": name}; declares a consuming task; returns {"tasks": [...]}',
    # leases of consume tickets with "lease": seconds (arrowbuf.engine.leases)
    "ack": 'body {"lease": id}; the lease\'s rows are consumed for good by its task; returns {"rows": k}',
    "nack": 'body {"lease": id}; the lease\'s rows go back to its task\'s queue now; returns {"rows": k}',
}


# ---------------------------------------------------------------------------------------------------- errors
# The table (ERRORS) and the decoding side are in arrowbuf.flight.protocol.errors; the encoding side is here.
def error_info(exc: BaseException) -> bytes:
    """The JSON status detail of an error (`extra_info` and in-band exchange errors)."""
    m = error_mapping(exc)
    if m is None:  # unexpected: the client sees an ArrowbufError with status INTERNAL, not the server's internals
        return _dumps({"v": PROTOCOL_VERSION, "error": "ArrowbufError", "code": "INTERNAL",
                       "message": f"internal server error ({type(exc).__name__}); see the server log"})
    return _dumps({"v": PROTOCOL_VERSION, "error": m.cls.__name__, "code": m.code, "message": error_message(exc)})


def to_flight_error(exc: BaseException) -> flight.FlightError:
    """The Flight error a server raises for `exc` (unexpected exceptions become Internal, message withheld)."""
    m = error_mapping(exc)
    if m is None:
        return flight.FlightInternalError("internal server error; see the server log", extra_info=error_info(exc))
    return m.flight_error(error_message(exc), extra_info=error_info(exc))


# ---------------------------------------------------------------------------------------------------- parsing
def _dumps(obj: dict[str, Any]) -> bytes:
    try:
        return json.dumps(obj, separators=(",", ":"), default=_json_default, allow_nan=False).encode()
    except ValueError:  # NaN or infinity somewhere (e.g. in stats): strict JSON has no such numbers, send null
        return json.dumps(_finite(obj), separators=(",", ":"), default=_json_default, allow_nan=False).encode()


def _finite(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, np.ndarray):
        return _finite(value.tolist())
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def dumps(obj: dict[str, Any]) -> bytes:
    """JSON bytes as this protocol writes them (numpy scalars allowed)."""
    return _dumps(obj)


def loads(raw: bytes | pa.Buffer | None, where: str, *, allow_empty: bool = False) -> dict[str, Any]:
    """Parse a JSON object from the wire; `SchemaError` saying where and what was wrong."""
    if raw is None:
        raw = b""
    if isinstance(raw, pa.Buffer):
        raw = raw.to_pybytes()
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise SchemaError(f"{where}: expected JSON bytes, got {type(raw).__name__}")
    raw = bytes(raw)
    if len(raw) > MAX_JSON_BYTES:
        raise SchemaError(f"{where}: {len(raw)} bytes is over the {MAX_JSON_BYTES}-byte limit")
    if not raw.strip():
        if allow_empty:
            return {}
        raise SchemaError(f"{where}: empty; expected a JSON object (see docs/flight-protocol.md)")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SchemaError(f"{where}: not valid UTF-8 JSON ({type(exc).__name__}); expected a JSON object") from None
    if not isinstance(obj, dict):
        raise SchemaError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    version = obj.get("v", PROTOCOL_VERSION)
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise SchemaError(f"{where}: protocol version {version!r} is not supported; this server speaks "
                          f"{list(SUPPORTED_VERSIONS)}")
    return obj


class _Fields:
    """Typed access to a request object; unknown keys are an error (they are usually typos)."""

    def __init__(self, obj: dict[str, Any], where: str) -> None:
        self.obj, self.where, self.used = obj, where, {"v"}

    def get(self, key: str, kind: str, default: Any = None, required: bool = False) -> Any:
        self.used.add(key)
        if key not in self.obj or self.obj[key] is None:
            if required:
                raise SchemaError(f"{self.where}: missing {key!r} ({kind})")
            return default
        value = self.obj[key]
        check = _CHECKS[kind]
        if not check(value):
            raise SchemaError(f"{self.where}: {key!r:.80} must be {kind}, got {value!r:.80}")
        return value

    def options(self) -> dict[str, Any]:
        """The "options" object of a sample request, each option checked against `SAMPLE_OPTIONS`."""
        raw = self.get("options", "an object", default={})
        where = f"{self.where} options"
        unknown = sorted(str(k)[:80] for k in raw if k not in SAMPLE_OPTIONS)
        if unknown:
            raise SchemaError(f"{where}: unknown option(s) {unknown}; expected some of {sorted(SAMPLE_OPTIONS)}")
        opts = _Fields(raw, where)
        return {k: v for k in raw if (v := opts.get(k, SAMPLE_OPTIONS[k])) is not None}

    def done(self) -> None:
        extra = sorted(set(self.obj) - self.used)
        if extra:
            shown = [k[:80] for k in extra[:10]]
            raise SchemaError(f"{self.where}: unknown key(s) {shown}; expected {sorted(self.used - {'v'})}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_int64(v: Any) -> bool:
    return _is_int(v) and -(2**63) <= v < 2**63


_CHECKS = {
    "a string": lambda v: isinstance(v, str),
    "a positive integer": lambda v: _is_int64(v) and v > 0,
    "a non-negative integer": lambda v: _is_int64(v) and v >= 0,
    "a number of seconds in [0, 1e6]": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    and math.isfinite(v) and 0 <= v <= MAX_TIMEOUT,
    "a number of seconds in (0, 86400]": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    and math.isfinite(v) and 0 < v <= MAX_LEASE_S,
    "a lease id": lambda v: isinstance(v, str) and LEASE_ID.fullmatch(v) is not None,
    "a list of column names": lambda v: isinstance(v, list) and 0 < len(v) <= 4096
    and all(isinstance(c, str) and 0 < len(c) <= 1024 for c in v),
    "a number in [0, 1]": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    and 0 <= v <= 1,
    "an object": lambda v: isinstance(v, dict),
    "a boolean": lambda v: isinstance(v, bool),
    "a list of int64 integers": lambda v: isinstance(v, list) and all(_is_int64(x) for x in v),
    "a list of numbers": lambda v: isinstance(v, list)
    and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v),
}


# ---------------------------------------------------------------------------------------------------- tickets
@dataclass(frozen=True)
class SampleRequest:
    """DoGet kind "sample": sample `n` items (`timeout` seconds to wait; None does not wait)."""

    n: int
    store: str | None = None
    columns: list[str] | None = None
    timeout: float | None = None
    options: dict[str, Any] = field(default_factory=dict)
    kind: str = "sample"
    meta: str = "json"
    pad: int = 0
    part_bytes: int | None = None  # version 3: a larger batch comes as several record batches of at most this size


@dataclass(frozen=True)
class TableRequest:
    """DoGet kinds "table" (the live rows), "episodes" (the episode summary) and "sql" (DuckDB over `experience`)."""

    kind: str
    store: str | None = None
    columns: list[str] | None = None
    query: str | None = None


def encode_ticket(req: SampleRequest | TableRequest | ConsumeRequest) -> bytes:
    if isinstance(req, ConsumeRequest):
        return _dumps(_encode_consume(req))
    obj: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": req.kind}
    if req.store is not None:
        obj["store"] = req.store
    if isinstance(req, SampleRequest):
        obj.update(n=req.n, columns=req.columns, timeout=req.timeout, options=req.options)
        if req.meta != "json":  # a default ticket stays byte for byte what it was
            obj["meta"] = req.meta
        if req.pad:
            obj["pad"] = req.pad
        if req.part_bytes is not None:
            obj["v"], obj["part_bytes"] = PARTS_VERSION, int(req.part_bytes)
    else:
        if req.columns is not None:
            obj["columns"] = req.columns
        if req.query is not None:
            obj["query"] = req.query
    return _dumps(obj)


#: Sample tickets already decoded, by their bytes: a learner sends the same ticket on every call, and decoding it
#: (JSON and every check) is a measurable part of a small DoGet. Bounded: at most `TICKET_CACHE_ENTRIES` tickets of
#: at most `TICKET_CACHE_BYTES` bytes each; only tickets that decoded without error are kept.
_SAMPLE_TICKETS: dict[bytes, SampleRequest] = {}
TICKET_CACHE_ENTRIES = 64
TICKET_CACHE_BYTES = 1024


def decode_ticket(raw: bytes | pa.Buffer) -> SampleRequest | TableRequest | ConsumeRequest:
    """The request a DoGet ticket carries (`SchemaError` when it is malformed or breaks a bound).

    A decoded sample request may be shared by later calls with the same ticket: treat it (and its `columns` list
    and `options` dict) as read-only.
    """
    key = raw if isinstance(raw, bytes) and len(raw) <= TICKET_CACHE_BYTES else None
    if key is not None:
        hit = _SAMPLE_TICKETS.get(key)
        if hit is not None:
            return hit
    req = _decode_ticket(raw)
    if key is not None and isinstance(req, SampleRequest):
        if len(_SAMPLE_TICKETS) >= TICKET_CACHE_ENTRIES:
            _SAMPLE_TICKETS.clear()  # many different tickets: not a learner's loop; start over
        _SAMPLE_TICKETS[key] = req
    return req


def _decode_ticket(raw: bytes | pa.Buffer) -> SampleRequest | TableRequest | ConsumeRequest:
    obj = loads(raw, "ticket")
    f = _Fields(obj, "ticket")
    kind = f.get("kind", "a string", required=True)
    if kind not in TICKET_KINDS:
        raise SchemaError(f"ticket: unknown kind {kind!r}; expected one of {list(TICKET_KINDS)}")
    store = f.get("store", "a string")
    req: SampleRequest | TableRequest | ConsumeRequest
    if kind == "consume":
        req = _decode_consume(f, store)
    elif kind == "sample":
        meta = _sample_meta(f, "ticket")
        part_bytes = f.get("part_bytes", "a positive integer")
        if part_bytes is not None and (obj.get("v", PROTOCOL_VERSION) < PARTS_VERSION or part_bytes < MIN_PART_BYTES):
            raise SchemaError(f"ticket: part_bytes needs protocol version {PARTS_VERSION} and at least "
                              f"{MIN_PART_BYTES} bytes, got {part_bytes!r:.40} with version {obj.get('v')!r:.20}")
        req = SampleRequest(n=f.get("n", "a positive integer", required=True), store=store,
                            columns=f.get("columns", "a list of column names"),
                            timeout=f.get("timeout", "a number of seconds in [0, 1e6]"),
                            options=f.options(), meta=meta, pad=_pad(f, meta, "ticket"), part_bytes=part_bytes)
    elif kind == "table":
        req = TableRequest(kind, store, columns=f.get("columns", "a list of column names"))
    elif kind == "sql":
        req = TableRequest(kind, store, query=f.get("query", "a string", required=True))
    else:
        req = TableRequest(kind, store)
    f.done()
    return req


# ---------------------------------------------------------------------------------------------------- descriptors
@dataclass(frozen=True)
class PutRequest:
    """DoPut: write into `store`; `timeout` seconds an insert may wait on the rate limiter."""

    store: str | None = None
    timeout: float | None = None
    kind: str = "extend"
    parts: int | None = None  # version 3: the extend comes in this many record batches, committed as one
    rows: int | None = None  # version 3: rows in all parts
    window: int | None = None  # version 3, with parts: each part received is acknowledged (`encode_progress`); the
    # client keeps at most this many parts unacknowledged, so the server never buffers more than that


@dataclass(frozen=True)
class SessionRequest:
    """DoExchange: a learner session sampling `n` items per batch, `prefetch` batches kept ready on the server."""

    n: int
    store: str | None = None
    columns: list[str] | None = None
    timeout: float | None = None
    prefetch: int = 2
    options: dict[str, Any] = field(default_factory=dict)
    kind: str = "session"
    meta: str = "json"


def store_descriptor(store: str) -> flight.FlightDescriptor:
    """The path descriptor naming a store (ListFlights, GetFlightInfo, GetSchema, DoPut)."""
    return flight.FlightDescriptor.for_path(store)


#: The most parts a client may keep unacknowledged in a windowed extend in parts (`PutRequest.window`).
MAX_PUT_WINDOW = 1024


def put_descriptor(store: str | None, timeout: float | None = None, parts: int | None = None,
                   rows: int | None = None, window: int | None = None) -> flight.FlightDescriptor:
    """The DoPut command of an extend; with `parts` and `rows`, an extend in parts (version 3); with `window`, one
    whose parts the server acknowledges as they are received."""
    obj: dict[str, Any] = {"v": PROTOCOL_VERSION if parts is None else PARTS_VERSION, "kind": "extend"}
    if store is not None:
        obj["store"] = store
    if timeout is not None:
        obj["timeout"] = timeout
    if parts is not None:
        obj["parts"], obj["rows"] = int(parts), int(rows if rows is not None else 0)
        if window is not None:
            obj["window"] = int(window)
    return flight.FlightDescriptor.for_command(_dumps(obj))


def session_descriptor(req: SessionRequest) -> flight.FlightDescriptor:
    obj: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": "session", "n": req.n, "columns": req.columns,
                           "timeout": req.timeout, "prefetch": req.prefetch, "options": req.options}
    if req.store is not None:
        obj["store"] = req.store
    if req.meta != "json":
        obj["meta"] = req.meta
    return flight.FlightDescriptor.for_command(_dumps(obj))


def _path(descriptor: flight.FlightDescriptor, where: str) -> list[str]:
    try:
        parts = [p.decode("utf-8") if isinstance(p, bytes) else str(p) for p in descriptor.path]
    except UnicodeDecodeError:
        raise SchemaError(f"{where}: descriptor path is not UTF-8") from None
    if not 1 <= len(parts) <= 2 or not all(parts):
        raise SchemaError(f"{where}: expected the path [store] or [store, \"input\"], got {parts!r:.120}")
    return parts


def decode_path(descriptor: flight.FlightDescriptor, where: str) -> tuple[str, str]:
    """(store, view) of a path descriptor; view is "stored" or "input"."""
    if descriptor.descriptor_type != flight.DescriptorType.PATH:
        raise SchemaError(f"{where}: expected a path descriptor [store]")
    parts = _path(descriptor, where)
    if len(parts) == 2 and parts[1] != "input":
        raise SchemaError(f"{where}: path [store, {parts[1]!r:.80}]: the second element can only be \"input\"")
    return parts[0], "input" if len(parts) == 2 else "stored"


def decode_put_descriptor(descriptor: flight.FlightDescriptor) -> PutRequest:
    if descriptor.descriptor_type == flight.DescriptorType.PATH:
        store, view = decode_path(descriptor, "DoPut descriptor")
        if view != "stored":
            raise SchemaError("DoPut descriptor: write to the path [store]")
        return PutRequest(store=store)
    obj = loads(descriptor.command, "DoPut descriptor command")
    f = _Fields(obj, "DoPut descriptor command")
    kind = f.get("kind", "a string", default="extend")
    if kind not in PUT_KINDS:
        raise SchemaError(f"DoPut descriptor command: kind must be one of {list(PUT_KINDS)}, got {kind!r:.80}")
    if kind == "update":
        return decode_update_command(f)
    parts, rows = f.get("parts", "a positive integer"), f.get("rows", "a positive integer")
    if (parts is None) != (rows is None):
        raise SchemaError("DoPut descriptor command: an extend in parts names both \"parts\" and \"rows\"")
    if parts is not None:
        if f.obj.get("v", PROTOCOL_VERSION) < PARTS_VERSION:
            raise SchemaError(f"DoPut descriptor command: an extend in parts needs protocol version {PARTS_VERSION}; "
                              f"send \"v\": {PARTS_VERSION}")
        if parts > rows:
            raise SchemaError(f"DoPut descriptor command: {parts} parts cannot hold {rows} rows (a part holds at "
                              "least one row)")
    window = f.get("window", "a positive integer")
    if window is not None and (parts is None or window > MAX_PUT_WINDOW):
        raise SchemaError(f"DoPut descriptor command: window is for an extend in parts, at most {MAX_PUT_WINDOW} "
                          f"parts, got {window!r:.40}")
    req = PutRequest(store=f.get("store", "a string"),
                     timeout=f.get("timeout", "a number of seconds in [0, 1e6]"), parts=parts, rows=rows,
                     window=window)
    f.done()
    return req


def decode_session_descriptor(descriptor: flight.FlightDescriptor) -> SessionRequest:
    if descriptor.descriptor_type != flight.DescriptorType.CMD:
        raise SchemaError("DoExchange descriptor: expected a command {\"kind\": \"session\", \"n\": ...}")
    obj = loads(descriptor.command, "DoExchange descriptor command")
    f = _Fields(obj, "DoExchange descriptor command")
    kind = f.get("kind", "a string", default="session")
    if kind != "session":
        raise SchemaError(f"DoExchange descriptor command: kind must be \"session\", got {kind!r}")
    prefetch = f.get("prefetch", "a non-negative integer", default=2)
    if prefetch > MAX_PREFETCH:
        raise SchemaError(f"DoExchange descriptor command: prefetch {prefetch} is over the limit {MAX_PREFETCH}")
    req = SessionRequest(n=f.get("n", "a positive integer", required=True), store=f.get("store", "a string"),
                         columns=f.get("columns", "a list of column names"),
                         timeout=f.get("timeout", "a number of seconds in [0, 1e6]"), prefetch=prefetch,
                         options=f.options(), meta=_sample_meta(f, "DoExchange descriptor command"))
    f.done()
    return req


# ---------------------------------------------------------------------------------------------------- update
# DoPut kind "update": fill fields declared `later: true` of stored rows. The stream's
# schema is an `id` column (int64: the ids extend/append returned) and one column per field to fill (their types as
# in the store's input schema); each batch is one atomic `store.update` and gets one ack.

#: DoPut descriptor kinds.
PUT_KINDS = ("extend", "update")
#: The column of an update stream that carries the rows' ids.
UPDATE_ID_COLUMN = "id"


def update_descriptor(store: str | None) -> flight.FlightDescriptor:
    """The DoPut descriptor of an update stream into `store`."""
    obj: dict[str, Any] = {"v": LLM_VERSION, "kind": "update"}
    if store is not None:
        obj["store"] = store
    return flight.FlightDescriptor.for_command(_dumps(obj))


def decode_update_command(f: _Fields) -> PutRequest:
    """The rest of a DoPut command of kind "update" (needs version 2)."""
    version = f.obj.get("v", PROTOCOL_VERSION)
    if version < LLM_VERSION:
        raise SchemaError(f"DoPut descriptor command: kind \"update\" needs protocol version {LLM_VERSION}; send "
                          f"\"v\": {LLM_VERSION}")
    req = PutRequest(store=f.get("store", "a string"), kind="update")
    f.done()
    return req


def encode_update_ack(batch: int, rows: int, skipped: int) -> bytes:
    """Update acknowledgement of batch `batch`: `rows` rows written, `skipped` ids whose row was evicted."""
    return _dumps({"v": LLM_VERSION, "batch": batch, "rows": int(rows), "skipped": int(skipped)})


def decode_update_ack(raw: bytes | pa.Buffer | None) -> dict[str, int]:
    obj = loads(raw, "update acknowledgement")
    if not all(_is_int(obj.get(k)) for k in ("batch", "rows", "skipped")):
        raise SchemaError(f"update acknowledgement: expected batch, rows and skipped, got {obj!r:.120}")
    return obj


# ---------------------------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class ActionRequest:
    type: str
    store: str | None = None
    indices: list[int] | None = None
    priorities: list[float] | None = None
    path: str | None = None   # checkpoint: a name relative to the server's checkpoint root
    keep: int | None = None
    task: str | None = None            # add_task
    policy_version: int | None = None  # set_policy_version
    lease: str | None = None           # ack, nack


def encode_action(type_: str, store: str | None, **body: Any) -> flight.Action:
    obj: dict[str, Any] = {"v": PROTOCOL_VERSION}
    if store is not None:
        obj["store"] = store
    obj.update(body)
    return flight.Action(type_, _dumps(obj))


def decode_action(action: flight.Action) -> ActionRequest:
    type_ = action.type
    if type_ not in ACTIONS:
        raise SchemaError(f"action {type_!r:.80} is not supported; expected one of {sorted(ACTIONS)}")
    where = f"action {type_!r} body"
    obj = loads(action.body, where, allow_empty=True)
    f = _Fields(obj, where)
    store = f.get("store", "a string")
    if type_ == "update_priorities":
        indices = f.get("indices", "a list of int64 integers", required=True)
        priorities = f.get("priorities", "a list of numbers", required=True)
        f.done()
        return ActionRequest(type_, store, indices, priorities)
    if type_ in CONSUME_ACTIONS:
        return _decode_consume_action(type_, f, store)
    if type_ == "checkpoint":
        path = f.get("path", "a string", required=True)
        keep = f.get("keep", "a positive integer")
        f.done()
        return ActionRequest(type_, store, path=path, keep=keep)
    f.done()
    return ActionRequest(type_, store)


# ---------------------------------------------------------------------------------------------------- consume
# DoGet kind "consume" and the actions set_policy_version, policy_version, add_task, ack, nack: their fields and
# bounds are in arrowbuf.flight.protocol.consume; the version gate is here.
def _needs_llm_version(f: _Fields, what: str) -> None:
    """Consume verbs are version 2 (as DoPut kind "update"): a version-1 request for them is refused."""
    if f.obj.get("v", PROTOCOL_VERSION) < LLM_VERSION:
        raise SchemaError(f"{what} needs protocol version {LLM_VERSION}; send \"v\": {LLM_VERSION}")


def _encode_consume(req: ConsumeRequest) -> dict[str, Any]:
    return {"v": LLM_VERSION, **encode_consume(req)}


def _decode_consume(f: _Fields, store: str | None) -> ConsumeRequest:
    _needs_llm_version(f, 'ticket kind "consume"')
    return decode_consume(f, store)


def _decode_consume_action(type_: str, f: _Fields, store: str | None) -> ActionRequest:
    _needs_llm_version(f, f"action {type_!r}")
    return ActionRequest(type_, store, **decode_consume_action(type_, f))


# ---------------------------------------------------------------------------------------------------- metadata
# The request keys "meta" and "pad" (SAMPLE_META, MAX_PAD: arrowbuf.flight.protocol.meta) and the JSON metadata.
def _sample_meta(f: _Fields, where: str) -> str:
    meta = f.get("meta", "a string", default="json")
    if meta not in SAMPLE_META:
        raise SchemaError(f"{where}: meta must be one of {list(SAMPLE_META)}, got {meta!r:.80}")
    return str(meta)


def _pad(f: _Fields, meta: str, where: str) -> int:
    pad = f.get("pad", "a non-negative integer", default=0)
    if pad > MAX_PAD:
        raise SchemaError(f"{where}: pad {pad} is over the limit {MAX_PAD}")
    if pad and meta != "columns":
        raise SchemaError(f"{where}: pad is for meta \"columns\" only (its app_metadata carries nothing else)")
    return int(pad)


def encode_sample_meta(indices: np.ndarray, weights: np.ndarray | None, lease: str | None = None) -> bytes:
    """app_metadata of a sampled batch: the ids of its items (for priority updates) and their IS weights; a consumed
    batch under a lease also names it ("lease")."""
    w = None if weights is None else np.asarray(weights, dtype=np.float64).tolist()
    obj: dict[str, Any] = {"v": PROTOCOL_VERSION, "indices": np.asarray(indices, dtype=np.int64).tolist(),
                           "weights": w}
    if lease is not None:
        obj["lease"] = lease
    return _dumps(obj)


def decode_lease_meta(raw: bytes | pa.Buffer | None) -> str | None:
    """The lease a consumed batch's app_metadata names (None: none); checked like an ack's lease id."""
    if raw is None:
        return None
    lease = loads(raw, "consume metadata").get("lease")
    if lease is not None and not (isinstance(lease, str) and LEASE_ID.fullmatch(lease)):
        raise SchemaError(f"consume metadata: 'lease' must be a lease id, got {lease!r:.80}")
    return lease


def decode_sample_meta(raw: bytes | pa.Buffer | None, rows: int) -> tuple[np.ndarray, np.ndarray | None]:
    obj = loads(raw, "sample metadata")
    idx = obj.get("indices")
    if not isinstance(idx, list) or len(idx) != rows:
        raise SchemaError(f"sample metadata: expected {rows} indices")
    w = obj.get("weights")
    weights = None if w is None else np.asarray(w, dtype=np.float32)
    return np.asarray(idx, dtype=np.int64), weights


def encode_ack(batch: int, first_seq: int, rows: int) -> bytes:
    """DoPut acknowledgement of batch number `batch` (0-based): rows [first_seq, first_seq + rows) are committed."""
    return _dumps({"v": PROTOCOL_VERSION, "batch": batch, "first_seq": int(first_seq), "rows": int(rows)})


def encode_progress(received: int) -> bytes:
    """The acknowledgement of the first `received` parts of a windowed extend in parts (nothing committed yet)."""
    return _dumps({"v": PARTS_VERSION, "received": int(received)})


def decode_progress(raw: bytes | pa.Buffer | None) -> int | None:
    """The parts a progress message acknowledges, or None when `raw` is not one (the final acknowledgement)."""
    obj = loads(raw, "DoPut acknowledgement")
    received = obj.get("received")
    if received is None:
        return None
    if not _is_int(received) or received < 1:
        raise SchemaError(f"DoPut progress: expected a positive count of parts received, got {received!r:.40}")
    return int(received)


def decode_ack(raw: bytes | pa.Buffer | None) -> dict[str, int]:
    obj = loads(raw, "DoPut acknowledgement")
    if not all(_is_int(obj.get(k)) for k in ("batch", "first_seq", "rows")):
        raise SchemaError(f"DoPut acknowledgement: expected batch, first_seq and rows, got {obj!r:.120}")
    return obj


# ---------------------------------------------------------------------------------------------------- exchange
@dataclass(frozen=True)
class ExchangeMessage:
    """An upstream DoExchange message: ask for `count` batches, or update priorities."""

    op: str
    count: int = 1
    indices: list[int] | None = None
    priorities: list[float] | None = None
    path: str | None = None   # checkpoint: a name relative to the server's checkpoint root
    keep: int | None = None
    pad: int | None = None    # sample (meta "columns"): app_metadata bytes of the batches sent from now on


def encode_exchange(msg: ExchangeMessage) -> bytes:
    if msg.op == "sample":
        if msg.pad is not None:
            return _dumps({"op": "sample", "count": msg.count, "pad": msg.pad})
        return _dumps({"op": "sample", "count": msg.count})
    return _dumps({"op": msg.op, "indices": msg.indices, "priorities": msg.priorities})


def encode_priorities(indices: Any, priorities: Any) -> bytes:
    return _dumps({"op": "update_priorities", "indices": np.asarray(indices, dtype=np.int64).reshape(-1).tolist(),
                   "priorities": np.asarray(priorities, dtype=np.float64).reshape(-1).tolist()})


def decode_exchange(raw: bytes | pa.Buffer | None) -> ExchangeMessage:
    where = "DoExchange message"
    f = _Fields(loads(raw, where), where)
    op = f.get("op", "a string", required=True)
    if op == "sample":
        count = f.get("count", "a positive integer", default=1)
        if count > MAX_REQUEST_COUNT:
            raise SchemaError(f"{where}: count {count} is over the limit {MAX_REQUEST_COUNT}")
        pad = f.get("pad", "a non-negative integer")
        if pad is not None and pad > MAX_PAD:
            raise SchemaError(f"{where}: pad {pad} is over the limit {MAX_PAD}")
        f.done()
        return ExchangeMessage("sample", count=count, pad=pad)
    if op == "update_priorities":
        msg = ExchangeMessage(op, indices=f.get("indices", "a list of int64 integers", required=True),
                              priorities=f.get("priorities", "a list of numbers", required=True))
        f.done()
        return msg
    raise SchemaError(f"{where}: unknown op {op!r:.80}; expected \"sample\" or \"update_priorities\"")


def encode_exchange_error(op: str, exc: BaseException) -> bytes:
    """An in-band DoExchange error: the reply to one `sample` request (or a failed priority update)."""
    obj = json.loads(error_info(exc))
    obj["op"] = op
    return _dumps(obj)


__all__ = [
    "ACTIONS", "AUTH_HEADER", "ERRORS", "ID_COLUMN", "LLM_VERSION", "MAX_PAD", "PROTOCOL_VERSION", "PUT_KINDS",
    "SAMPLE_META", "PARTS_VERSION", "SUPPORTED_VERSIONS", "WEIGHT_COLUMN", "pad_metadata", "realigning_pad",
    "split_sample_columns",
    "UPDATE_ID_COLUMN", "ActionRequest", "ErrorMapping", "decode_update_ack", "decode_update_command",
    "encode_update_ack", "update_descriptor",
    "ExchangeMessage", "PutRequest", "SampleRequest", "SessionRequest", "TableRequest", "decode_ack",
    "decode_action", "decode_error", "decode_exchange", "decode_path", "decode_put_descriptor",
    "decode_sample_meta", "decode_session_descriptor", "decode_ticket", "dumps", "encode_ack", "encode_action",
    "encode_exchange", "encode_exchange_error", "encode_priorities", "encode_sample_meta", "encode_ticket",
    "error_info", "error_mapping", "error_message", "from_flight_error", "loads", "put_descriptor",
    "session_descriptor", "store_descriptor", "to_flight_error",
]
