"""The limits of every arrowbuf server, in one place: who may connect, how much runs at once, how large a request and
a reply may be, how long a connection may idle, what a request may make the server allocate, and what a client
sees when something fails.

Every server (`SERVERS`) declares which of these it uses; docs/security.md lists them with their defaults.

- **Bind policy** (`check_bind`): a server that takes a token refuses to start on an address beyond loopback without
  one, unless the caller says `allow_unauthenticated=True` (then it warns, as it does for the metrics endpoint,
  which has no token). The inspector also warns when its token would travel over plain HTTP beyond loopback.
- **Concurrency** (`CallGate`): calls, streams, queries and connections running at once, per kind; one past the
  limit is refused at once with `ResourceExhausted` (nothing queues: gRPC and `http.server` give every call a thread
  and nothing else caps them). One gate may be shared by two servers over one store: `arrowbuf serve --ui` hands the
  Flight server's gate to the inspector, so `max_concurrent_sql` bounds the queries of both together.
- **Sizes and times** (`NetLimits`): request bytes checked before bulk data is read, upload bytes per stream, reply
  bytes, idle and total timeouts, connections.
- **Allocation** (`ALLOCATION`): a request of b bytes makes a server allocate at most `multiple` x b, plus the
  bytes of the stored rows it names (each counted once), plus `per_row` bytes of bookkeeping per row it stores.
  Tests measure it for the tiny requests that used to break it (tests/test_serving_limits.py and the fuzzers).
- **Errors** (`public_error`): a client sees a class name, a status code and a message of at most
  `MAX_MESSAGE_CHARS`; an error nobody raised on purpose is `INTERNAL` with no details (those go to the server's
  log): never a traceback or a server path.

Usage loop (what a handler does)::

    gate = CallGate({"call": limits.max_concurrent_calls, "stream": limits.max_concurrent_streams})
    check_bind("tq.v2", host, token, allow_unauthenticated=False)       # once, before binding
    with gate.enter("call"):
        check_bytes(len(body), limits.max_request_bytes, "tq.v2 action body")
        ...                                                            # the work
    # on failure: public_error(exc) -> PublicError(name, code, message) to send
"""

from __future__ import annotations

import contextvars
import ipaddress
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Self

from ..errors import (
    ArrowbufError,
    InsertTimeout,
    InvalidArgument,
    LeaseError,
    MissingDependency,
    OutOfSpace,
    QueryTimeout,
    ResourceExhausted,
    SampleTimeout,
    SchemaError,
    ShardsLost,
    StoreClosed,
    StoreNotFound,
    Unauthenticated,
    Unavailable,
)

#: Longest error message sent to a client (messages may quote client values; the rest is cut).
MAX_MESSAGE_CHARS = 1000
#: Host names that always mean this machine.
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


class InsecureServerWarning(UserWarning):
    """A server was started where others can reach it without a token, or where its token travels in clear text."""


# ---------------------------------------------------------------------------------------------------- bind policy
def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback name or address (only this machine can connect)."""
    host = str(host).strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(server: str, host: str, token: str | None, *, allow_unauthenticated: bool = False,
               takes_token: bool = True, plain_http: bool = False, stacklevel: int = 3) -> None:
    """The bind policy, before a server binds `host` (module docstring).

    Args:
        server: the server's name in messages ("Flight", "tq.v2", "inspector", "metrics").
        host: the address it binds.
        token: its token (None: none).
        allow_unauthenticated: bind beyond loopback without a token anyway (a warning; a trusted network only).
        takes_token: False for a server that has no token at all (metrics): beyond loopback it warns.
        plain_http: the token travels in clear text on every request (the inspector): beyond loopback it warns.

    Raises:
        InvalidArgument: a server that takes a token, beyond loopback, without one and without
            `allow_unauthenticated`.
    """
    if is_loopback(host):
        return
    if not takes_token:
        warnings.warn(f"{server} served on {host}: anyone who can reach the port reads it (it has no token); keep "
                      "it on a trusted network, or bind 127.0.0.1", InsecureServerWarning, stacklevel=stacklevel)
        return
    if token is None:
        if not allow_unauthenticated:
            raise InvalidArgument(f"{server}: binding {host} without a token would let anyone who can reach the port "
                                  "read and write everything it serves; pass a token (and use TLS or a trusted "
                                  "network), bind 127.0.0.1, or pass allow_unauthenticated=True to accept that")
        warnings.warn(f"{server} serving on {host} without a token: anyone who can reach the port can read and write "
                      "everything it serves (allow_unauthenticated=True); pass a token", InsecureServerWarning,
                      stacklevel=stacklevel)
    elif plain_http:
        warnings.warn(f"{server} on {host} speaks plain HTTP: its token crosses the network in clear text with "
                      "every request (the page polls every second); use it on a trusted network, behind a TLS "
                      "proxy, or bind 127.0.0.1 and tunnel (ssh -L)", InsecureServerWarning, stacklevel=stacklevel)


# ---------------------------------------------------------------------------------------------------- the limits
@dataclass(frozen=True)
class NetLimits:
    """The bounds shared by the tq.v2 server, the inspector and the metrics endpoint (the Flight server's own
    `arrowbuf.flight.limits.ServerLimits` names the same bounds after its verbs). `SERVERS` says which one uses which.

    Attributes:
        max_concurrent_calls: calls (RPCs, HTTP requests) running at once; one more is refused at once.
        max_concurrent_streams: uploads open at once (each may buffer up to `max_upload_bytes`).
        max_connections: HTTP connections open at once; one more is answered 503 and closed, without a thread.
        max_request_bytes: one request's JSON (a ticket, an action body, a put descriptor, an HTTP body), checked
            before it is parsed.
        max_json_depth: nesting of that JSON (deeper is refused before it is parsed: no RecursionError).
        max_upload_bytes: bulk data one upload stream may make the server buffer (checked per message, before the
            next is read).
        max_reply_bytes: one reply.
        max_concurrent_sql: SQL queries running at once (the inspector; shared with a Flight server's gate).
        idle_timeout: seconds a connection or stream may send nothing before it is cut (HTTP: per read).
        request_timeout: seconds one HTTP connection, or one upload stream, may last in all.
        shutdown_timeout: seconds `close()` waits for calls in progress.
    """

    max_concurrent_calls: int = 32
    max_concurrent_streams: int = 8
    max_connections: int = 32
    max_request_bytes: int = 1 << 20
    max_json_depth: int = 64
    max_upload_bytes: int = 256 << 20
    max_reply_bytes: int = 256 << 20
    max_concurrent_sql: int = 2
    idle_timeout: float = 10.0
    request_timeout: float = 60.0
    shutdown_timeout: float = 2.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("float", float):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e6:
                    raise InvalidArgument(f"{f.name} must be a number of seconds in (0, 1e6], got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{f.name} must be a positive integer, got {value!r}")

    def with_overrides(self, **overrides: Any) -> Self:
        """A copy with some limits changed; unknown names are an error."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise InvalidArgument(f"unknown limit(s) {unknown}; expected some of {sorted(known)}")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def describe(self) -> dict[str, Any]:
        """The limits as JSON-ready values."""
        return asdict(self)


def check_bytes(n: int, limit: int, what: str) -> None:
    """`ResourceExhausted` when `n` bytes are over `limit` (checked before the bytes are read or parsed)."""
    if n > limit:
        raise ResourceExhausted(f"{what}: {n} bytes is over this server's limit of {limit} bytes; send less")


def check_json_depth(raw: bytes | str, limit: int, what: str) -> None:
    """`InvalidArgument` when JSON text nests deeper than `limit` (counted on the text, before it is parsed, so a
    deep document costs no recursion; brackets inside strings count too, which only errs on the safe side)."""
    text = bytes(raw) if isinstance(raw, (bytes, bytearray)) else str(raw).encode("utf-8", "replace")
    if text.count(b"[") + text.count(b"{") <= limit:
        return
    depth = 0
    for c in text.translate(None, _NOT_BRACKETS):
        depth += 1 if c in (0x5B, 0x7B) else -1
        if depth > limit:
            raise InvalidArgument(f"{what}: JSON nested deeper than {limit} levels")


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


#: What a request may make a server allocate (module docstring): `multiple` x its bytes, plus the stored rows it
#: names (each once), plus `per_row` bytes of bookkeeping per row it stores. Measured by the tests named in
#: docs/security.md; `min_request` is the smallest request the server reads (framing included).
@dataclass(frozen=True)
class AllocationRule:
    multiple: int
    per_row: int

    def bound(self, request_bytes: int, named_bytes: int = 0, rows: int = 0) -> int:
        """The most a request of `request_bytes` naming `named_bytes` of stored rows and storing `rows` may
        allocate."""
        return self.multiple * request_bytes + named_bytes + self.per_row * rows


# ---------------------------------------------------------------------------------------------------- servers
@dataclass(frozen=True)
class ServerSpec:
    """What one kind of server uses of this module (docs/security.md renders the same table)."""

    name: str
    transport: str
    takes_token: bool
    limits: tuple[str, ...]
    allocation: AllocationRule


SERVERS: dict[str, ServerSpec] = {
    "flight": ServerSpec("flight", "gRPC (Arrow Flight)", True, (
        "max_concurrent_calls", "max_concurrent_streams", "max_batch_bytes", "max_batch_rows", "max_extend_bytes",
        "max_prefetch_bytes", "max_concurrent_sql", "max_table_streams", "stream_idle_timeout", "max_timeout",
        "shutdown_timeout", "max_leases_per_client", "sql_limits", "max_json_bytes"),
        AllocationRule(multiple=4, per_row=160)),
    "tq.v2": ServerSpec("tq.v2", "gRPC (Arrow Flight)", True, (
        "max_concurrent_calls", "max_concurrent_streams", "max_request_bytes", "max_json_depth",
        "max_upload_bytes", "max_reply_bytes", "idle_timeout", "request_timeout", "shutdown_timeout",
        "max_partitions", "max_groups", "max_tasks", "max_task_chars", "max_ids", "max_put_rows"),
        AllocationRule(multiple=128, per_row=160)),
    "inspector": ServerSpec("inspector", "HTTP", True, (
        "max_connections", "max_request_bytes", "max_json_depth", "max_concurrent_sql", "idle_timeout",
        "request_timeout"), AllocationRule(multiple=16, per_row=0)),
    "metrics": ServerSpec("metrics", "HTTP", False, ("max_connections", "idle_timeout", "request_timeout"),
                          AllocationRule(multiple=16, per_row=0)),
}


# ---------------------------------------------------------------------------------------------------- gate
#: The kinds of slot a `CallGate` counts, with what they are (for error messages).
KINDS = {
    "call": "calls (all verbs; streams count until their handler returns)",
    "sql": "sql queries",
    "table": "table streams",
    "stream": "uploads and learner sessions (DoPut, DoExchange)",
    "connection": "connections",
}


class CallGate:
    """Counts running calls per kind and refuses one past its limit (see the module docstring).

    Usage::

        gate = CallGate({"call": 64, "sql": 2})
        with gate.enter("call"), gate.enter("sql"):
            ...                                  # the work
        gate.wait_idle(timeout=5.0)              # True once no call runs (tests, shutdown)
    """

    def __init__(self, limits: Mapping[str, int]) -> None:
        for kind, limit in limits.items():
            if kind not in KINDS:
                raise InvalidArgument(f"unknown call kind {kind!r}; expected one of {sorted(KINDS)}")
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                raise InvalidArgument(f"the limit of {KINDS[kind]} must be a positive integer, got {limit!r}")
        self.limits = dict(limits)
        self._running = dict.fromkeys(self.limits, 0)
        self._cond = threading.Condition()

    @contextmanager
    def enter(self, kind: str) -> Iterator[None]:
        """Count one call of `kind` while the block runs; `ResourceExhausted` when the limit is reached."""
        self.acquire(kind)
        try:
            yield
        finally:
            self.release(kind)

    def acquire(self, kind: str, wait: float = 0.0) -> None:
        """Take a slot of `kind` (pair it with `release`), waiting up to `wait` seconds for one to free;
        `ResourceExhausted` when none is free."""
        with self._cond:
            limit = self.limits[kind]
            end = time.monotonic() + wait
            while self._running[kind] >= limit and (left := end - time.monotonic()) > 0:
                self._cond.wait(left)
            if self._running[kind] >= limit:
                raise ResourceExhausted(f"this server runs {limit} {KINDS[kind]} at most and all are busy; "
                                        "retry later")
            self._running[kind] += 1
            self._cond.notify_all()

    def try_acquire(self, kind: str) -> bool:
        """Take a slot of `kind` if one is free now (True), else False."""
        try:
            self.acquire(kind)
        except ResourceExhausted:
            return False
        return True

    def release(self, kind: str) -> None:
        with self._cond:
            self._running[kind] -= 1
            self._cond.notify_all()

    def running(self) -> dict[str, int]:
        """Calls running now, per kind."""
        with self._cond:
            return dict(self._running)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no call of any kind runs; False if `timeout` seconds passed first."""
        return self.wait_for(lambda running: not any(running.values()), timeout)

    def wait_for(self, predicate: Callable[[dict[str, int]], bool], timeout: float | None = None) -> bool:
        """Block until `predicate(running calls per kind)` holds; False if `timeout` seconds passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not predicate(self._running):
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True


# ---------------------------------------------------------------------------------------------------- errors
#: Status code per error class, most specific first: every server's table (the Flight protocol's,
#: `arrowbuf.flight.protocol.errors.ERRORS`, is built from it).
CODES: tuple[tuple[type[BaseException], str], ...] = (
    (Unauthenticated, "UNAUTHENTICATED"),
    (SchemaError, "INVALID_ARGUMENT"),
    (LeaseError, "FAILED_PRECONDITION"),
    (InvalidArgument, "INVALID_ARGUMENT"),
    (SampleTimeout, "TIMED_OUT"),
    (InsertTimeout, "TIMED_OUT"),
    (QueryTimeout, "DEADLINE_EXCEEDED"),
    (ResourceExhausted, "RESOURCE_EXHAUSTED"),
    (StoreNotFound, "NOT_FOUND"),
    (ShardsLost, "UNAVAILABLE"),
    (StoreClosed, "UNAVAILABLE"),
    (Unavailable, "UNAVAILABLE"),
    (OutOfSpace, "RESOURCE_EXHAUSTED"),
    (MissingDependency, "UNIMPLEMENTED"),
    (ArrowbufError, "FAILED"),
    (KeyError, "NOT_FOUND"),
    (ValueError, "INVALID_ARGUMENT"),
    (TypeError, "INVALID_ARGUMENT"),
)
#: The HTTP status of each code (the inspector and the metrics endpoint).
HTTP_STATUS = {"UNAUTHENTICATED": 401, "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 409, "TIMED_OUT": 504,
               "DEADLINE_EXCEEDED": 504, "RESOURCE_EXHAUSTED": 429, "NOT_FOUND": 404, "UNAVAILABLE": 503,
               "UNIMPLEMENTED": 501, "FAILED": 400, "INTERNAL": 500}
INTERNAL_MESSAGE = "internal server error (the details are in the server's log)"


@dataclass(frozen=True)
class PublicError:
    """What a client is told of an error: its class name, a status code, a bounded message."""

    name: str
    code: str
    message: str

    @property
    def expected(self) -> bool:
        """False for an error nobody raised on purpose (INTERNAL): log it where the server runs."""
        return self.code != "INTERNAL"

    def json(self) -> dict[str, str]:
        return {"error": self.name, "code": self.code, "message": self.message}


def bounded_message(text: str) -> str:
    """An error message as a client gets it: at most `MAX_MESSAGE_CHARS` (messages may quote client values)."""
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return text[:MAX_MESSAGE_CHARS] + f"... ({len(text) - MAX_MESSAGE_CHARS} more characters)"


def error_code(exc: BaseException) -> str | None:
    """The status code of an error raised on purpose or by bad input, or None for anything else."""
    if isinstance(exc, RecursionError):  # a RuntimeError that bad input may provoke deep inside a library
        return None
    for cls, code in CODES:
        if isinstance(exc, cls):
            return code
    return None


def public_error(exc: BaseException) -> PublicError:
    """What a client may see of `exc` (module docstring): INTERNAL and no details for an unexpected error."""
    code = error_code(exc)
    if code is None:
        return PublicError("Internal", "INTERNAL", INTERNAL_MESSAGE)
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], str) else str(exc)
    text = bounded_message(text)
    name = next(c.__name__ for c in type(exc).__mro__ if c.__module__ in ("arrowbuf.errors", "builtins"))
    return PublicError(name, code, text)


#: Open leases one client may hold while a server caps it (None: no cap; see `client_cap`).
_CLIENT_CAP: contextvars.ContextVar[int | None] = contextvars.ContextVar("arrowbuf_lease_client_cap", default=None)


@contextmanager
def client_cap(limit: int | None) -> Iterator[None]:
    """Within the block, the caller (`identity.current()`) may hold at most `limit` open leases of a store; one
    more is refused with `ResourceExhausted` (a server wraps the store calls it makes for a client in this)."""
    token = _CLIENT_CAP.set(limit)
    try:
        yield
    finally:
        _CLIENT_CAP.reset(token)


def current_client_cap() -> int | None:
    """The cap `client_cap` set for this context (None: none)."""
    return _CLIENT_CAP.get()


__all__ = ["CODES", "HTTP_STATUS", "INTERNAL_MESSAGE", "KINDS", "MAX_MESSAGE_CHARS", "SERVERS",
           "AllocationRule", "CallGate", "InsecureServerWarning", "NetLimits", "PublicError", "ServerSpec",
           "check_bind", "check_bytes", "check_json_depth", "client_cap", "current_client_cap", "error_code",
           "is_loopback", "public_error"]
