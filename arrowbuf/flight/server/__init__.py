"""The arrowbuf Flight server: one or more named stores behind Arrow Flight.

Usage::

    with ab.serve(store, "grpc://127.0.0.1:0", token="s3cret") as server:
        print(server.location)          # grpc://127.0.0.1:<port>
        server.wait()                   # serve until close() (from a signal handler or another thread)

One server per process: the handlers are Python and hold the GIL while they parse requests, sample and commit
(gathers and Flight I/O release it). To use more cores, run several processes, each with its own store and server
(`arrowbuf serve` per shard, or `arrowbuf.ray.ShardedStore`), and let learners sample from all of them.

The dispatch of every Flight verb lives here; the verbs' bounded decoding is in protocol.py, the limits in limits.py,
session prefetch in prefetch.py, the socket cut-off in sockets.py, the bounded upload and table streams in
server_streams.py, what a server is built from (its stores, location, TLS, token check) in server_config.py.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, TypeGuard

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ...errors import (
    ArrowbufError,
    InvalidArgument,
    SchemaError,
    StoreClosed,
    StoreNotFound,
    Unavailable,
)
from ...observe import identity
from ...observe.timings import Timings
from ...query.sql import serving as sql_serving
from ...schema import ExperienceSchema
from ...serving.limits import check_bind, client_cap
from ...surface import Bounded, PieceSink, StoreSurface, TableStream
from .. import protocol as P
from ..heap import release_after
from ..idle import OpenStreams, acquire_stream_slot
from ..limits import CallGate, ServerLimits
from ..parts import parts_stream, pieces_stream
from ..parts import receive as receive_parts
from ..parts import receive_into as receive_parts_into
from ..prefetch import Prefetcher
from ..sockets import cut_server_connections
from ..streams import bounded_batches, put_update, table_batches
from ..wire import WIRE_OPTIONS, one_batch_stream, wire_batch
from .config import Stores, TlsLike, TokenMiddlewareFactory, named_stores, parse_location, read_tls

if TYPE_CHECKING:  # pragma: no cover
    from ...delivery.batch import SampleBatch
    from ...observe.metrics import MetricsEndpoint
    from ..parts import PieceSampler

log = logging.getLogger("arrowbuf.flight")

DEFAULT_MAX_BATCH_ROWS = ServerLimits.max_batch_rows
DEFAULT_PREFETCH_BYTES = ServerLimits.max_prefetch_bytes
#: Longest single sleep of `StoreServer.wait` (how late a signal handler that another thread received may run).
_WAIT_SLICE = 0.2
#: Seconds a new upload or session waits for the slot of an idle stream whose connection it had cut.


def serve(store_or_stores: Stores, location: str = "grpc://127.0.0.1:0", token: str | None = None,
          tls: TlsLike | None = None, *, limits: ServerLimits | None = None,
          checkpoint_root: str | os.PathLike[str] | None = None,
          metrics: str | None = None, allow_unauthenticated: bool = False, **overrides: object) -> StoreServer:
    """Serve one or more stores over Arrow Flight.

    Args:
        store_or_stores: a store (anything that implements `ab.StoreSurface`: an `ExperienceStore`, a shard
            adapter, ...), a list of stores (named by `store.name`) or a dict name -> store.
        location: `grpc://host:port`; port 0 picks a free port (see `server.location`). Binds 127.0.0.1 by default;
            pass `grpc://0.0.0.0:<port>` to accept other machines (then a token is required, and use TLS).
        token: bearer token every call must carry (`authorization: Bearer <token>`); None accepts every caller, and
            then only a loopback address may be bound (unless `allow_unauthenticated`).
        tls: `(certificate, private_key)` as PEM bytes/str or file paths; the server then speaks `grpc+tls`.
        limits: the bounds of every request (`ServerLimits`; safe defaults). docs/security.md lists them.
        checkpoint_root: a directory under which the `checkpoint` action may write (a client names a relative
            path; anything outside, `..`, absolute paths and links are refused); None: no remote checkpoints.
        metrics: "HOST:PORT" to serve Prometheus metrics of the stores and of this server at
            `http://HOST:PORT/metrics` (`server.metrics_url`; port 0 picks one; needs `arrowbuf[metrics]`).
            docs/observability.md lists them.
        allow_unauthenticated: bind an address beyond loopback without a token anyway (a warning; only on a
            network where everyone who can reach the port may read and write the stores).
        **overrides: single limits by name, e.g. `max_batch_rows=50_000`, `shutdown_timeout=1.0`,
            `sql_limits=ab.SqlLimits(timeout=5.0)`, `max_concurrent_calls=32` (see `ServerLimits`).

    Returns:
        A running `StoreServer` (a context manager).
    """
    return StoreServer(store_or_stores, location, token=token, tls=tls, limits=limits,
                       checkpoint_root=checkpoint_root, metrics=metrics,
                       allow_unauthenticated=allow_unauthenticated, **overrides)


class StoreServer:
    """A running Flight server over named stores; see `serve`.

    Attributes:
        stores: name -> store.
        location: the bound location, e.g. `grpc://127.0.0.1:41234` (`grpc+tls://...` with TLS).
        limits: the `ServerLimits` it enforces (and states in the `describe` action).
        calls: the `CallGate` counting the calls running now.
        timings: latency histograms and error counts per Flight verb (`arrowbuf.observe.timings`).
        metrics_url: `http://host:port/metrics` when started with `metrics=`, else None.
    """

    def __init__(self, store_or_stores: Stores, location: str = "grpc://127.0.0.1:0", *, token: str | None = None,
                 tls: TlsLike | None = None, limits: ServerLimits | None = None,
                 checkpoint_root: str | os.PathLike[str] | None = None,
                 metrics: str | None = None, allow_unauthenticated: bool = False, **overrides: object) -> None:
        self.stores = named_stores(store_or_stores)
        self.timings = Timings()
        self.metrics_url: str | None = None
        self._metrics: MetricsEndpoint | None = None
        self.checkpoint_root = None if checkpoint_root is None else os.fspath(checkpoint_root)
        if limits is not None and not isinstance(limits, ServerLimits):
            raise InvalidArgument(f"limits must be a ServerLimits, got {type(limits).__name__}")
        self.limits = (limits or ServerLimits()).with_overrides(**overrides)
        self.calls = CallGate({"call": self.limits.max_concurrent_calls, "sql": self.limits.max_concurrent_sql,
                               "table": self.limits.max_table_streams,
                               "stream": self.limits.stream_slots})
        self.streams = OpenStreams()
        # an extend in parts goes straight into a store's ring (`ServerLimits.parts_into_ring` and a store that takes
        # pieces: `ab.PieceSink`): decided once per store, here; `describe` tells clients
        self._into_ring = {id(s): self.limits.parts_into_ring and isinstance(s, PieceSink) and s.takes_pieces
                           for s in self.stores.values()}
        self.max_batch_rows = self.limits.max_batch_rows
        self.shutdown_timeout = float(self.limits.shutdown_timeout)
        if token is not None and (not isinstance(token, str) or not token):
            raise InvalidArgument("token must be a non-empty string (or None for no authentication)")
        scheme, host, port = parse_location(location, tls is not None)
        certs = [flight.CertKeyPair(*read_tls(tls))] if tls is not None else None
        check_bind("Flight server", host, token, allow_unauthenticated=allow_unauthenticated, stacklevel=4)
        middleware = {"auth": TokenMiddlewareFactory(token)} if token is not None else None
        self._closing = threading.Event()
        self._closed = threading.Event()
        self._stopped = threading.Event()  # set when the Flight server's shutdown completed
        self._close_lock = threading.Lock()
        self._shutdown_thread: threading.Thread | None = None
        self._service = _FlightService(self, f"{scheme}://{host}:{port}", certs, middleware)
        self._host = host if ":" not in host else f"[{host}]"
        self._scheme = scheme
        self.port: int = self._service.port
        self.location = f"{scheme}://{self._host}:{self.port}"
        # pyarrow's own exit hook waits for every call with no deadline; this one (registered later, so run
        # first) closes the server the bounded way. It holds the server weakly, so it does not keep it alive.
        self._close_at_exit = _exit_hook(weakref.ref(self))
        atexit.register(self._close_at_exit)
        if metrics is not None:  # Prometheus /metrics of the stores and this server (arrowbuf.observe.metrics)
            from ...observe.metrics import MetricsEndpoint

            try:
                self._metrics = MetricsEndpoint.start(metrics, stores=lambda: self.stores, servers=[self])
            except BaseException:
                self.close()
                raise
            self.metrics_url = self._metrics.url

    def __repr__(self) -> str:
        state = "closed" if self._closed.is_set() else "serving"
        return f"StoreServer({self.location!r}, stores={sorted(self.stores)}, {state})"

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server is closed (by `close()` from another thread or a signal handler); False if
        `timeout` seconds passed first.

        It wakes every `_WAIT_SLICE` seconds. The kernel may hand a process's SIGTERM to any of its threads (gRPC's,
        Arrow's); Python then only flags it and runs the handler in the main thread at its next bytecode, and a main
        thread blocked in one long lock wait never gets there: the handler that would call `close()` never ran."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = _WAIT_SLICE if deadline is None else min(_WAIT_SLICE, deadline - time.monotonic())
            if self._closed.wait(max(left, 0.0)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no call runs in a handler (streams already handed to gRPC do not count); False on timeout."""
        return self.calls.wait_idle(timeout)

    def close(self) -> None:
        """Stop serving; idempotent. Returns within about twice `shutdown_timeout` seconds.

        Calls in progress get `shutdown_timeout` seconds to end. A call stalled by its client (a learner session or
        a `table` stream that it does not read, an open DoPut that sends nothing) cannot hold the server: after
        that, the server's client connections are cut (`arrowbuf.flight.sockets`), which cancels their calls, and
        the Flight server stops (`stopped` turns True). The interpreter's exit closes a server still open the same
        way, so a process embedding a server exits.
        """
        with self._close_lock:
            if self._closing.is_set():
                thread = self._shutdown_thread
            else:
                self._closing.set()
                self._service.stop_prefetching()
                thread = threading.Thread(target=self._shutdown, name="arrowbuf-flight-shutdown", daemon=True)
                self._shutdown_thread = thread
                thread.start()
        if thread is not None:
            thread.join(self.shutdown_timeout)
            if thread.is_alive():
                cut = cut_server_connections(self.port)
                log.warning("%s: calls still open after %.1fs; cut %d client connection(s)", self.location,
                            self.shutdown_timeout, cut)
                thread.join(self.shutdown_timeout)
            if thread.is_alive():
                log.warning("%s: calls still open after cutting their connections; they end when their waits end",
                            self.location)
        if self._metrics is not None:
            self._metrics.close()
        self._closed.set()

    @property
    def stopped(self) -> bool:
        """True once every call ended and the Flight server stopped.

        After `close()` it is False only while a handler still finishes what it was doing when its connection was
        cut (a sample or a commit in progress), or while a sample waits in the store for data or its rate limiter,
        up to that request's own timeout (at most `max_timeout`).
        """
        return self._stopped.is_set()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Block until the Flight server stopped (see `stopped`); False if `timeout` seconds passed first."""
        return self._stopped.wait(timeout)

    def _shutdown(self) -> None:
        try:
            self._service.shutdown()
        except Exception:  # pragma: no cover - shutdown of a broken server
            log.exception("Flight server shutdown failed")
        self._stopped.set()
        atexit.unregister(self._close_at_exit)

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers for the service
    def into_ring(self, store: StoreSurface) -> TypeGuard[PieceSink]:
        """Whether an extend in parts goes straight into `store`'s ring (decided when the server started)."""
        return self._into_ring.get(id(store), False)

    def store(self, name: str | None) -> StoreSurface:
        if name is None:
            if len(self.stores) == 1:
                return next(iter(self.stores.values()))
            raise SchemaError(f"this server holds the stores {sorted(self.stores)}; name one with \"store\"")
        try:
            return self.stores[name]
        except KeyError:
            raise StoreNotFound(f"no store {name!r:.80} on this server; it holds {sorted(self.stores)}") from None

    @contextlib.contextmanager
    def stream_slot(self, context: flight.ServerCallContext) -> Iterator[None]:
        """Hold a stream slot (and record the stream in `streams`) while an upload or session runs; when every
        slot is taken, cut the connections of idle streams first (`arrowbuf.flight.idle`)."""
        acquire_stream_slot(self.calls, self.streams, self.port, self.limits.stream_idle_timeout, self.location)
        try:
            with self.streams.open(context.peer()):
                yield
        finally:
            self.calls.release("stream")

    def check_open(self) -> None:
        if self._closing.is_set():
            raise StoreClosed(f"the server at {self.location} is shutting down")

    def sample_options(self, store: StoreSurface) -> list[str]:
        """The sampler options (`protocol.SAMPLE_OPTIONS`) that `store.sample` takes (`describe` states them)."""
        return [o for o in P.SAMPLE_OPTIONS if _takes_keyword(store.sample, o)]

    def check_sample_options(self, store: StoreSurface, options: Mapping[str, Any], what: str) -> None:
        """Refuse an option this store's `sample` does not take (`shard_info` is a Ray shard server's only)."""
        if not options:
            return
        taken = self.sample_options(store)
        for name in options:
            if name not in taken:
                only = " (only the Flight servers of Ray shards take it)" if name == "shard_info" else ""
                raise InvalidArgument(f"{what}: the store {_name_of(self, store)!r} takes no sample option "
                                      f"{name!r}{only}; it takes {taken}")


# ---------------------------------------------------------------------------------------------------- service
#: Verbs whose call lasts as long as the client keeps it open (they take a "stream" slot too).
_STREAM_VERBS = frozenset({"DoPut", "DoExchange"})


def _handler(verb: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Translate every exception a handler raises into the protocol's Flight error (`protocol.ERRORS`)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(self: _FlightService, *args: Any) -> Any:
            t0 = time.perf_counter()
            outcome: str | None = None
            try:
                with contextlib.ExitStack() as slots:
                    if verb in _STREAM_VERBS:  # held open by the client: capped below the calls (see ServerLimits)
                        slots.enter_context(self.owner.stream_slot(args[0]))
                    slots.enter_context(self.owner.calls.enter("call"))
                    # lineage names the client as the writer or consumer of what this call does
                    slots.enter_context(identity.acting_as(f"flight:{args[0].peer()}"))
                    slots.enter_context(client_cap(self.owner.limits.max_leases_per_client))
                    return fn(self, *args)
            except flight.FlightError:
                outcome = "FlightError"
                raise
            except Exception as exc:  # noqa: BLE001 - every error goes back to the client, mapped
                mapping = P.error_mapping(exc)
                outcome = type(exc).__name__ if mapping is None else mapping.cls.__name__
                if isinstance(exc, pa.ArrowException) and mapping is None:
                    log.warning("%s ended: %s", verb, exc)  # typically the client went away mid-stream
                elif mapping is None:
                    log.exception("unexpected error in %s", verb)
                raise P.to_flight_error(exc) from None
            finally:  # the handler's time (a stream handed to gRPC is sent after it returns)
                self.owner.timings.record(verb, time.perf_counter() - t0, outcome)

        inner.__name__ = fn.__name__
        inner.__doc__ = fn.__doc__
        return inner

    return wrap


def _compiled_get_schema() -> Callable[..., Any]:
    source = ("def get_schema(self, context, descriptor):\n"
              "    result = self._get_schema(context, descriptor)\n"
              "    if isinstance(result, BaseException):\n"
              "        raise result\n"
              "    return result\n")
    namespace: dict[str, Any] = {}
    exec(compile(source, "<arrowbuf>", "exec"), namespace)  # noqa: S102 - a fixed source, see get_schema below
    return namespace["get_schema"]


_GET_SCHEMA = _compiled_get_schema()


class _NoTraceback:
    """Mixed into a GetSchema error: pyarrow formats the detail of an error raised in get_schema with
    `traceback.format_exception`, and falls back to the bare exception type when formatting fails. Reading
    `__notes__` (which that formatting does) raises, so the client gets the message without a traceback."""

    @property
    def __notes__(self) -> NoReturn:
        raise RuntimeError("no traceback for clients")


_UNTRACEABLE: dict[type, type] = {}


def _untraceable(exc: flight.FlightError) -> BaseException:
    """`exc` (same type family, message and extra_info) as an error whose traceback is never formatted."""
    cls = type(exc)
    kind = _UNTRACEABLE.get(cls)
    if kind is None:
        kind = _UNTRACEABLE.setdefault(cls, type(cls.__name__, (_NoTraceback, cls), {}))
    out = kind(str(exc), getattr(exc, "extra_info", None))
    return out.with_traceback(None)


class _FlightService(flight.FlightServerBase):
    """The Flight methods; each parses its request with `protocol` and calls the store."""

    def __init__(self, owner: StoreServer, location: str, certs: list[Any] | None,
                 middleware: dict[str, Any] | None) -> None:
        super().__init__(location, tls_certificates=certs, middleware=middleware)
        self.owner = owner
        self._sessions = 0
        self._prefetchers: set[Prefetcher] = set()
        self._lock = threading.Lock()

    def stop_prefetching(self) -> None:
        """Wake every session's prefetch thread so it sees the server closing (close() calls this)."""
        with self._lock:
            prefetchers = list(self._prefetchers)
        for p in prefetchers:
            p.wake()

    # ------------------------------------------------------------------ metadata verbs
    def _info(self, name: str, store: StoreSurface) -> flight.FlightInfo:
        n = len(store)
        ticket = P.encode_ticket(P.TableRequest("table", name))
        return flight.FlightInfo(store.schema.to_arrow(), P.store_descriptor(name),
                                 [flight.FlightEndpoint(ticket, [])], n, n * store.schema.row_bytes)

    @_handler("ListFlights")
    def list_flights(self, context: flight.ServerCallContext, criteria: bytes) -> Iterable[flight.FlightInfo]:
        self.owner.check_open()
        return [self._info(name, store) for name, store in self.owner.stores.items()]

    @_handler("GetFlightInfo")
    def get_flight_info(self, context: flight.ServerCallContext,
                        descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
        name, view = P.decode_path(descriptor, "GetFlightInfo descriptor")
        return self._info(name, self.owner.store(name))

    # pyarrow sends the client the Python traceback of an error raised in get_schema (its GetSchema callback does
    # not translate FlightError, unlike every other verb's): the method that raises is compiled under a name that
    # is no server path, and the error it raises carries no other frame
    get_schema = _GET_SCHEMA

    def _get_schema(self, context: flight.ServerCallContext,
                    descriptor: flight.FlightDescriptor) -> flight.SchemaResult | BaseException:
        try:
            return self._schema_result(context, descriptor)
        except flight.FlightError as exc:
            return _untraceable(exc)

    @_handler("GetSchema")
    def _schema_result(self, context: flight.ServerCallContext,
                       descriptor: flight.FlightDescriptor) -> flight.SchemaResult:
        name, view = P.decode_path(descriptor, "GetSchema descriptor")
        schema = self.owner.store(name).schema
        return flight.SchemaResult(schema.input_schema() if view == "input" else schema.to_arrow())

    # ------------------------------------------------------------------ DoGet
    @_handler("DoGet")
    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> flight.FlightDataStream:
        self.owner.check_open()
        req = P.decode_ticket(ticket.ticket)
        store = self.owner.store(req.store)
        if isinstance(req, P.ConsumeRequest):
            return self._consume(store, req, context)
        if isinstance(req, P.SampleRequest):
            self.owner.limits.check_sample(req.n, req.timeout, req.options, "sample")
            self.owner.check_sample_options(store, req.options, "sample")
            columns = None if req.columns is None else list(req.columns)  # the request may be shared: a copy
            if req.part_bytes is not None and req.meta == "columns" and _in_pieces(store, columns, req.n,
                                                                                   req.part_bytes, req.options):
                # protocol 3, ids per message: gathered piece by piece as the stream goes (parts.pieces_stream)
                return pieces_stream(store, req.n, columns, req.timeout, req.options, P.pad_metadata(req.pad),
                                     req.part_bytes)
            data, meta = wire_batch(_sample(store, req.n, columns, req.timeout, req.options), req.meta)
            meta = meta if req.meta == "json" else P.pad_metadata(req.pad)
            if req.part_bytes is not None and data.nbytes > req.part_bytes:  # protocol 3: bounded messages
                return parts_stream(data, meta, req.part_bytes)
            return one_batch_stream(data, meta)
        if req.kind == "table":
            return self._table_stream(store, req.columns)
        if req.kind == "episodes":
            table = store.episodes()
        else:
            table = self._sql(store, req.query or "", context)
        return flight.RecordBatchStream(table, WIRE_OPTIONS)

    def _consume(self, store: StoreSurface, req: P.ConsumeRequest,
                 context: flight.ServerCallContext) -> flight.FlightDataStream:
        """The `consume` ticket: bounded like a sample, then `store.consume`.

        A call whose client went away (cancelled: killed, timed out, disconnected) consumes nothing: while it waits
        the store polls the call's cancellation (`query.sql.serving`'s `cancelled`, every 0.2 s) and stops; the rows
        are taken under a lease (the client's, or a guard lease when it asked for none), and if the call is
        cancelled once they are gathered, the lease is nacked (the rows go back to the task's queue, in order).
        Without a client lease the guard is acked just before the reply is sent, so a reply lost after that point is
        lost for the task (at most once); a client lease stays in flight until acked or expired, whatever happens to
        the reply or the client (at least once)."""
        self.owner.limits.check_sample(req.n, req.timeout, {}, "consume")
        # --- hardening: the where= predicate runs in the SQL sandbox under this server's sql_limits, each run
        # holding a max_concurrent_sql slot (not the whole wait), and stops when the client goes away
        with sql_serving(self.owner.limits.sql_limits, gate=lambda: self.owner.calls.enter("sql"),
                         cancelled=context.is_cancelled):
            extra: dict[str, Any] = {"lease": req.lease if req.lease is not None else _GUARD_LEASE_S}
            if req.admission:
                extra["admission"] = req.admission
            batch = store.consume(req.task, req.n, require=req.require, timeout=req.timeout or 0.0,
                                  max_staleness=req.max_staleness, where=req.where, max_tokens=req.max_tokens,
                                  **extra)
        if batch.lease is not None:
            if context.is_cancelled():  # nobody will read the reply: the rows go back now
                store.nack(batch.lease)
                raise P.to_flight_error(Unavailable("the consume call was cancelled by its client; nothing was "
                                                    "consumed"))
            if req.lease is None:  # the guard: final now, as a consume without a lease always was
                store.ack(batch.lease)
                batch.lease = None
        return one_batch_stream(*wire_batch(batch))

    def _table_stream(self, store: StoreSurface, columns: list[str] | None) -> flight.FlightDataStream:
        """The `table` ticket: a consistent snapshot of the store, streamed one chunk at a time.

        `store.iter_table` copies one chunk when the stream needs it (each row as committed, nothing newer than the
        request; rows evicted before the stream reached them are skipped, never sent torn), so a stream holds about
        one chunk of memory however slowly its client reads; at most `max_table_streams` run at once (a stream holds
        its slot until it is sent, fails or its client goes). A store without `iter_table` (a store-like class that
        has only the `StoreSurface`) is sent from one `to_table` copy.
        """
        gate = self.owner.calls
        gate.acquire("table")
        try:
            stored = store.schema.to_arrow()
            names = stored.names if columns is None else columns
            unknown = [n for n in names if n not in stored.names]
            if unknown:
                raise SchemaError(f"table: unknown stored column(s) {unknown}; expected some of {stored.names}")
            schema = pa.schema([stored.field(n) for n in names], metadata=stored.metadata)
            source = store.iter_table(columns) if isinstance(store, TableStream) else \
                store.to_table(columns).to_batches()
        except BaseException:
            gate.release("table")
            raise
        batches = table_batches(source, lambda: gate.release("table"), lambda: self.owner.closed)
        first = next(batches, None)  # started now: a generator that never started would never run its `finally`
        return flight.GeneratorStream(schema, batches if first is None else itertools.chain([first], batches),
                                      WIRE_OPTIONS)

    def _sql(self, store: StoreSurface, query: str, context: flight.ServerCallContext) -> pa.Table:
        """The `sql` ticket: the sandbox of `arrowbuf.query.sql` with this server's limits; stops when the client
        goes."""
        from ...query.frames import run_sql

        with self.owner.calls.enter("sql"):
            return run_sql(store, query, self.owner.limits.sql_limits, cancelled=context.is_cancelled)

    # ------------------------------------------------------------------ DoPut
    @_handler("DoPut")
    def do_put(self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor,
               reader: flight.MetadataRecordBatchReader,
               writer: flight.FlightMetadataWriter) -> None:
        self.owner.check_open()
        req = P.decode_put_descriptor(descriptor)
        limits = self.owner.limits
        limits.check_timeout(req.timeout, "DoPut")
        store = self.owner.store(req.store)
        if req.kind == "update":  # fill later fields of stored rows
            return put_update(store, reader, writer, limits, self.owner.check_open, self.owner.streams.touch)
        # the stream's schema message comes first: names, types and shapes are checked before any batch is read
        store.schema.check_input_types(reader.schema, "DoPut")
        kwargs = {"timeout": req.timeout} if req.timeout is not None else {}
        if req.parts is not None:  # one extend in parts (protocol 3), committed once
            assert req.rows is not None, "the decoder requires rows with parts"
            sink = store.begin_extend(req.rows, reader.schema.names) if self.owner.into_ring(store) else None
            # a windowed extend: each part acknowledged once added, so the client sends only a few ahead
            on_part = None if req.window is None else (lambda k: writer.write(pa.py_buffer(P.encode_progress(k))))
            if sink is not None:  # each part copied straight into the ring's reserved rows (store/pieces.py)
                ids = receive_parts_into(reader, req, limits, self.owner.check_open, self.owner.streams.touch, sink,
                                         on_part)
                writer.write(pa.py_buffer(P.encode_ack(0, int(ids[0]) if len(ids) else 0, len(ids))))
                return
            # a store that takes such a batch only whole (durable, ragged, tiered, tasks): assembled, then extended
            whole = receive_parts(reader, req, limits, self.owner.check_open, self.owner.streams.touch, on_part)
            ids = np.asarray(store.extend(whole, **kwargs), dtype=np.int64).reshape(-1)
            writer.write(pa.py_buffer(P.encode_ack(0, int(ids[0]) if len(ids) else 0, whole.num_rows)))
            release_after(whole.nbytes)
            return
        for k, batch in bounded_batches(reader, limits, self.owner.check_open, self.owner.streams.touch, "batch"):
            # the whole batch is in memory here: a client that dies mid-message never reaches this line
            # --- contracts: extend returns the rows' ids (StoreSurface); the ack carries the committed range
            ids = np.asarray(store.extend(batch, **kwargs), dtype=np.int64).reshape(-1)
            first = int(ids[0]) if len(ids) else 0
            writer.write(pa.py_buffer(P.encode_ack(k, first, batch.num_rows)))
            release_after(batch.nbytes)  # flightmem: the receive's freed gRPC pieces back to the OS (heap.py)

    # ------------------------------------------------------------------ DoExchange
    @_handler("DoExchange")
    def do_exchange(self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor,
                    reader: flight.MetadataRecordBatchReader,
                    writer: flight.MetadataRecordBatchWriter) -> None:
        self.owner.check_open()
        req = P.decode_session_descriptor(descriptor)
        store = self.owner.store(req.store)
        self.owner.limits.check_sample(req.n, req.timeout, req.options, "session")
        self.owner.check_sample_options(store, req.options, "session")
        columns = store.schema.resolve_columns(req.columns)
        row_bytes = _row_bytes(store.schema, columns) * req.n
        depth = min(req.prefetch, self.owner.limits.max_prefetch_bytes // row_bytes)

        # every field: the store's default (its own check of an explicit list of every column cost ~18% of a
        # mujoco batch-256 draw)
        draw_columns = None if req.columns is None else columns

        def draw(timeout: float | None) -> tuple[pa.RecordBatch, pa.Buffer | None]:
            # the whole batch is made ready here, so the session's thread only writes it (without the GIL)
            return wire_batch(_sample(store, req.n, draw_columns, timeout, req.options), req.meta)

        prefetcher = Prefetcher(draw, depth, self.owner._closing)
        with self._lock:
            self._sessions += 1
            self._prefetchers.add(prefetcher)
        begun: pa.Schema | None = None
        pad: pa.Buffer | None = None  # meta "columns": the app_metadata bytes the client asked for (alignment)
        try:
            while True:
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    break
                self.owner.streams.touch()
                if chunk.data is not None:
                    raise SchemaError("DoExchange: a learner session sends metadata messages only, not batches")
                msg = P.decode_exchange(chunk.app_metadata)
                if msg.op == "update_priorities":
                    assert msg.indices is not None and msg.priorities is not None, "required by the decoder"
                    try:
                        store.update_priorities(msg.indices, msg.priorities)
                    except (ArrowbufError, ValueError, TypeError) as exc:
                        writer.write_metadata(pa.py_buffer(P.encode_exchange_error("update_priorities", exc)))
                    continue
                if msg.pad is not None:
                    if req.meta != "columns":
                        raise SchemaError("DoExchange: pad is for a session with meta \"columns\" only")
                    pad = P.pad_metadata(msg.pad)
                for _ in range(msg.count):
                    self.owner.check_open()
                    try:
                        data, meta = prefetcher.get(req.timeout)
                    except (ArrowbufError, ValueError, TypeError) as exc:
                        writer.write_metadata(pa.py_buffer(P.encode_exchange_error("sample", exc)))
                        continue
                    if begun is None:  # the first batch fixes the stream's schema (sampler options may add columns)
                        begun = data.schema
                        writer.begin(begun, WIRE_OPTIONS)
                    elif data.schema != begun:
                        data = pa.RecordBatch.from_arrays(data.columns, schema=begun)
                    if meta is None:
                        meta = pad
                    if meta is None:
                        writer.write_batch(data)
                    else:
                        writer.write_with_metadata(data, meta)
                    self.owner.streams.touch()
        finally:
            prefetcher.close()
            with self._lock:
                self._sessions -= 1
                self._prefetchers.discard(prefetcher)

    # ------------------------------------------------------------------ DoAction
    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        return list(P.ACTIONS.items())

    @_handler("DoAction")
    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> list[bytes]:
        self.owner.check_open()
        req = P.decode_action(action)
        store = self.owner.store(req.store)
        if req.type == "describe":
            out: dict[str, Any] = {"v": P.PROTOCOL_VERSION, "store": _name_of(self.owner, store),
                                   "schema": store.schema.to_dict(),
                                   "capacity": store.capacity if isinstance(store, Bounded) else None,
                                   "max_batch_rows": self.owner.limits.max_batch_rows, "protocol": P.PROTOCOL_VERSION,
                                   "protocols": list(P.SUPPORTED_VERSIONS),
                                   "stores": sorted(self.owner.stores), "limits": self.owner.limits.describe(),
                                   "sample_options": self.owner.sample_options(store),
                                   "sample_meta": list(P.SAMPLE_META),
                                   "parts_into_ring": self.owner.into_ring(store), "put_window": True}
        elif req.type == "stats":
            out = dict(store.stats())
            with self._lock:
                out["server"] = {"location": self.owner.location, "sessions": self._sessions,
                                 "running": self.owner.calls.running()}
        elif req.type == "len":
            out = {"len": len(store)}
        elif req.type == "checkpoint":  # only under the server's root
            from ...persist.remote import checkpoint_under_root

            out = checkpoint_under_root(store, self.owner.checkpoint_root, req.path or "", req.keep)
        elif req.type in P.CONSUME_ACTIONS:
            if req.type == "add_task":  # --- hardening: each task costs ring-sized memory and holds eviction
                self.owner.limits.check_add_task(len(store.tasks), "add_task")
            out = _consume_action(store, req, self.owner.limits, self._lock)
        else:  # update_priorities
            assert req.indices is not None and req.priorities is not None, "required by the decoder"
            out = {"applied": int(store.update_priorities(req.indices, req.priorities))}
        return [P.dumps(out)]


# ---------------------------------------------------------------------------------------------------- helpers
#: The lease a consume without one is served under until its reply is built (see `_FlightService._consume`): seconds.
_GUARD_LEASE_S = 300.0

def _consume_action(store: StoreSurface, req: P.ActionRequest, limits: ServerLimits,
                    lock: threading.Lock) -> dict[str, Any]:
    """The actions set_policy_version (checked against the current version under `lock`: two clients cannot both
    pass the monotonic check and then move it back), policy_version and add_task."""
    if req.type == "set_policy_version":
        assert req.policy_version is not None
        with lock:
            limits.check_policy_version(int(store.policy_version), req.policy_version, "set_policy_version")
            store.policy_version = req.policy_version
    elif req.type == "add_task":
        assert req.task is not None, "required by the decoder"
        store.add_task(req.task)
        return {"tasks": list(store.tasks)}
    elif req.type in ("ack", "nack"):  # the id was checked by the decoder (a short plain string)
        assert req.lease is not None, "required by the decoder"
        return {"rows": int(store.ack(req.lease) if req.type == "ack" else store.nack(req.lease))}
    return {"policy_version": int(store.policy_version)}


def _sample(store: StoreSurface, n: int, columns: list[str] | None, timeout: float | None,
            options: dict[str, Any]) -> SampleBatch:
    return store.sample(n, columns=columns, timeout=timeout, **options)


def _in_pieces(store: StoreSurface, columns: list[str] | None, n: int, part_bytes: int,
               options: Mapping[str, Any]) -> TypeGuard[PieceSampler]:
    """Whether a sample asked for in messages of `part_bytes` is gathered piece by piece (`parts.pieces_stream`): a
    store that can (`sample_pieces`), unless the sample is fixed-width (no ragged column) and fits one message by the
    schema's row bytes, which goes whole as before (one gather, one message, no piece to size)."""
    # the store's own method (a class attribute: a wrapper that forwards other names, like a Ray shard's backend,
    # must sample in its own way, e.g. with global ids), taking every option of the request
    if not _samples_in_pieces(store):
        return False
    if not all(_takes_keyword(store.sample_pieces, o) for o in options):
        return False
    schema = store.schema
    try:
        names = schema.resolve_columns(columns)
        ragged = any(schema.spec_of(c).ragged for c in names if c in schema.fields or c in schema.derived)
    except Exception:  # noqa: BLE001 - an unknown column: the sample itself says so, on the usual path
        return False
    return ragged or n * _row_bytes(schema, names) > part_bytes


def _samples_in_pieces(store: StoreSurface) -> TypeGuard[PieceSampler]:
    return callable(getattr(type(store), "sample_pieces", None))


def _row_bytes(schema: ExperienceSchema, columns: list[str]) -> int:
    total = 0
    for c in columns:
        total += schema.spec_of(c).row_bytes if c in schema.fields or c in schema.derived else 8
    return max(1, total)


#: How long the interpreter's exit waits, after `close()`, for handlers to finish what they were doing when their
#: connections were cut: the interpreter aborts (a fatal error) when it finalizes while a gRPC thread runs Python.
EXIT_DRAIN_TIMEOUT = 30.0


def _exit_hook(ref: weakref.ReferenceType[StoreServer]) -> Callable[[], None]:
    """An `atexit` hook that closes the server `ref` names, if it still exists, and waits for it to stop."""

    def close_at_exit() -> None:
        server = ref()
        if server is not None:
            server.close()
            if not server.wait_stopped(EXIT_DRAIN_TIMEOUT):
                log.warning("%s: calls still running at exit after %.0fs", server.location, EXIT_DRAIN_TIMEOUT)

    return close_at_exit


def _takes_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether `fn` accepts the keyword argument `name` (by name, or through `**kwargs`)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: let the call decide
        return True
    if name in params:
        return params[name].kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _name_of(owner: StoreServer, store: StoreSurface) -> str:
    return next(n for n, s in owner.stores.items() if s is store)


__all__ = ["StoreServer", "serve"]
