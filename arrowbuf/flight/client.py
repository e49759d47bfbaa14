"""The arrowbuf Flight client: a remote store with the local store's surface.

Usage::

    remote = ab.connect("grpc://127.0.0.1:41234", token="s3cret",      # store= names one of several stores
                        timeout=30.0)                                  # every call's default deadline (seconds)
    ids = remote.extend(batch)                # one DoPut, atomic; the new rows' ids (np.ndarray[int64])
    with remote.writer(max_in_flight=8) as w:  # a stream of batches, credit-based backpressure
        for batch in rollouts:
            w.send(batch)                      # pipelined (extend waits and returns the ids)
    batch = remote.sample(256)                # DoGet: SampleBatch with indices and weights
    with remote.session(256, prefetch=2) as s:  # DoExchange: a learner session, batches pipelined
        for batch in s:
            s.update_priorities(batch.indices, new_priorities)
    len(remote); remote.stats(); remote.to_table(); remote.sql("SELECT count(*) FROM experience")

A `RemoteStore` implements `ab.StoreSurface`. It pickles by address (send it to subprocesses and Ray actors) and
reconnects by itself after the server restarts: a call that finds the server unreachable retries on a fresh
connection for `reconnect_timeout` seconds (never past the call's deadline), then raises `ab.Unavailable`. That
includes `extend`: a batch whose call failed because the server went away is sent again to the restarted server (each
batch still lands entirely or not at all). Open writers and sessions do not reconnect; they raise `ab.Unavailable`
and a new one can be opened. `ab.StoreClosed` means this client itself was closed.

Deadlines: every unary call (append, extend, sample, update_priorities, len, stats, to_table, sql, episodes) has a
deadline, `rpc_timeout=` per call or the client's `timeout` (from `connect`); one that passes raises
`ab.DeadlineExceeded` (an `Unavailable` and a `TimeoutError`), and the call is not retried. `sample`'s own `timeout`
is how long the server may wait for data, so the default deadline of a sample is the client's `timeout` plus that
wait. Streams (`writer`, `session`) live as long as their user keeps them and have no overall deadline.

Sampled arrays are zero-copy views of the received Flight message. That memory was received for the batch alone (no
store or other reader shares it), so the arrays are writable and `batch.to_torch()` hands them to torch without a copy.

How batches become messages and received samples become `SampleBatch`es is arrowbuf/flight/messages.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Literal, TypeVar, overload

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ..delivery.batch import SampleBatch
from ..errors import DeadlineExceeded, InvalidArgument, LeaseError, SchemaError, StoreClosed, Unavailable
from ..ring.outpool import OutputPool
from ..samplers import validate_priorities
from ..samplers.admission import check_admission
from ..schema import ExperienceSchema, load_schema
from ..store.pending import PendingWrite
from . import protocol as P
from .calls import Unreachable, check_timeout, translate
from .messages import MAX_PADS, ack_ids, misalignment, record_batch, request_key, sample_batch, table_to_batch
from .parts import MAX_PART_BYTES, PUT_WINDOW_PARTS, assemble, pipelined, split_rows
from .session import LearnerSession
from .writer import RemoteWriter

T = TypeVar("T")


class _Default:
    def __repr__(self) -> str:
        return "<the client's timeout>"


#: `rpc_timeout` not given: the client's `timeout` applies (None is a valid value: no deadline).

#: gRPC channel arguments of every client connection. gRPC's bandwidth-delay probe grows a stream's receive window
#: with the link's measured bandwidth; on loopback it grew far enough that gRPC buffered a large part of a DoGet's
#: reply ahead of the reader copying it into its batch (a reader's peak 60-100 MiB higher for a 302 MB sample,
#: benchmarks/README.md "Flight memory"). A fixed 16 MiB window bounds what a stream buffers ahead of its reader and
#: still fills a link of 16 MiB per round trip (16 GB/s at 1 ms).
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16 << 20))

_DEFAULT: Any = _Default()


def connect(location: str, token: str | None = None, store: str | None = None, *,
            tls_root_certs: bytes | str | None = None, disable_server_verification: bool = False,
            reconnect_timeout: float = 10.0, timeout: float | None = None) -> RemoteStore:
    """Connect to a store served by `ab.serve` (or `arrowbuf serve`).

    Args:
        location: the server's location, e.g. `server.location` (`grpc://...` or `grpc+tls://...`).
        token: the bearer token, if the server needs one.
        store: the store's name; may be omitted when the server holds one store.
        tls_root_certs: PEM certificate(s) (bytes, str or a file path) that sign the server's certificate.
        disable_server_verification: accept any server certificate (testing only).
        reconnect_timeout: seconds a call keeps trying to reach a server that went away.
        timeout: the default deadline of every call in seconds (None: no deadline); a call's `rpc_timeout=`
            overrides it. Also bounds this connect.

    Raises:
        StoreNotFound: the server has no store of that name.
        Unauthenticated: a wrong or missing token.
        Unavailable: the server cannot be reached within `reconnect_timeout`.
        DeadlineExceeded: the server did not answer within `timeout`.
        InvalidArgument: `location` is no Flight location (no scheme, or http:// ...).
    """
    from .location import check_location, raise_if_refused

    raise_if_refused(check_location(location), timeout=min(2.0, reconnect_timeout) if reconnect_timeout else 2.0)
    return RemoteStore(location, token, store, tls_root_certs=tls_root_certs,
                       disable_server_verification=disable_server_verification,
                       reconnect_timeout=reconnect_timeout, timeout=timeout)


def _progress(raw: Any, received: int, parts: int) -> int:
    """The parts a windowed extend's server has received, from its next progress message (which must move forward
    and stay within the `parts` sent)."""
    got = P.decode_progress(raw)
    if got is None or not received < got <= parts:
        raise SchemaError(f"an extend in parts: expected the server's progress past {received} of {parts} parts, "
                          f"got {bytes(raw or b'')[:80]!r}")
    return got


def into_ring_of(info: dict[str, Any], protocols: tuple[int, ...]) -> bool:
    """Whether a server's `describe` answer says it writes an extend in parts straight into the store's ring: only a
    JSON `true` from a server that speaks parts (protocol 3); anything else (absent, malformed) reads as False."""
    return info.get("parts_into_ring") is True and P.PARTS_VERSION in protocols


class RemoteStore:
    """A store on a Flight server, with the local `ExperienceStore` surface. Build one with `ab.connect`.

    Attributes:
        location: the server's location.
        name: the store's name on the server.
        schema: the store's `ExperienceSchema`.
        capacity: the store's capacity in rows.
        max_batch_rows: the largest batch the server accepts or serves.
        max_batch_bytes: the largest DoPut message the server accepts; `extend` cuts a larger batch into parts
            (protocol 3) and the server commits them as one extend (None: the server does not say).
        protocols: the wire protocol versions the server speaks (`describe`; [1, 2] for servers before version 3).
        parts_into_ring: the server writes an extend in parts straight into this store's ring (`describe`): a
            batch over 2 x `parts.PIPELINE_PART_BYTES` goes in parts then, so the server's copy of each part
            overlaps the transfer of the next (`parts.pipelined`).
        part_bytes: the largest message a sample comes in from a server that speaks protocol 3 (default 8 MiB,
            at least `protocol.MIN_PART_BYTES`): a larger sample comes in several, assembled here as they arrive.
        timeout: the default deadline of every call in seconds, or None.
        sample_meta: how sampled batches carry their ids and weights (`protocol.SAMPLE_META`): "columns" where the
            server offers it (no JSON per batch), else "json".
    """

    #: Capability: serves a fixed batch size through a learner session (`session`); `ab.Loader` uses it.
    learner_sessions: ClassVar[bool] = True


    def __init__(self, location: str, token: str | None = None, store: str | None = None, *,
                 tls_root_certs: bytes | str | None = None, disable_server_verification: bool = False,
                 reconnect_timeout: float = 10.0, timeout: float | None = None) -> None:
        self.location = str(location)
        self._token = token
        self._tls_root_certs = _pem_or_none(tls_root_certs)
        self._disable_verification = disable_server_verification
        self.reconnect_timeout = float(reconnect_timeout)
        self.timeout = check_timeout(timeout, "timeout")
        self._lock = threading.Lock()
        self._client: flight.FlightClient | None = None
        # calls in flight per Flight client (by id), and clients closed while calls used them: a FlightClient must
        # not be closed under a call on another thread (pyarrow crashes), so the last such call closes it
        self._users: dict[int, int] = {}
        self._retired: dict[int, flight.FlightClient] = {}
        self._closed = False
        self._closing = threading.Event()  # set by close(): ends a reconnect back-off at once
        self._headers = [(P.AUTH_HEADER.encode(), f"Bearer {token}".encode())] if token is not None else []
        self.stream_options = flight.FlightCallOptions(headers=self._headers)  # streams: no overall deadline
        self._requested = store
        self.name: str = store or ""
        self.schema: ExperienceSchema
        self.capacity: int | None = None
        self.max_batch_rows: int = 0
        self.max_batch_bytes: int | None = None
        self.protocols: tuple[int, ...] = (1, 2)
        self.part_bytes = MAX_PART_BYTES
        self.parts_into_ring = False
        self.put_window = False
        self.sample_meta = "json"
        self._pads: dict[tuple[Any, ...], int] = {}  # sample request -> app_metadata padding that aligns its body
        # a sample in parts is copied into these arrays; reused once the caller drops the batch (ring/outpool.py)
        self._outputs = OutputPool()
        self._describe()

    # ------------------------------------------------------------------ connection
    def connection(self) -> flight.FlightClient:
        """The Flight client of this store's connection, opened on first use.

        Raises:
            StoreClosed: this client is closed.
        """
        with self._lock:
            return self._connection_locked()

    def _connection_locked(self) -> flight.FlightClient:
        """`connection()` with `_lock` held by the caller."""
        if self._closed:
            raise StoreClosed(f"the client for {self.location} is closed")
        if self._client is None:
            kwargs: dict[str, Any] = {}
            if self._tls_root_certs is not None:
                kwargs["tls_root_certs"] = self._tls_root_certs
            if self._disable_verification:
                kwargs["disable_server_verification"] = True
            self._client = flight.FlightClient(self.location, generic_options=list(CHANNEL_OPTIONS), **kwargs)
        return self._client

    def _acquire(self) -> flight.FlightClient:
        """`connection()` for one call: the client is not closed (by `close()` or a reconnect) until `_release`."""
        with self._lock:
            client = self._connection_locked()
            self._users[id(client)] = self._users.get(id(client), 0) + 1
            return client

    def _release(self, client: flight.FlightClient) -> None:
        """The end of a call `_acquire` began; the last call on a retired client closes it."""
        with self._lock:
            left = self._users.get(id(client), 1) - 1
            if left:
                self._users[id(client)] = left
                return
            self._users.pop(id(client), None)
            retired = self._retired.pop(id(client), None)
        if retired is not None:
            with contextlib.suppress(Exception):
                retired.close()

    def _retire(self, client: flight.FlightClient) -> None:
        """Close `client` now, or when the last call using it ends (closing it under a call crashes pyarrow)."""
        with self._lock:
            if self._users.get(id(client)):
                self._retired[id(client)] = client
                return
        with contextlib.suppress(Exception):
            client.close()

    def _drop(self, client: flight.FlightClient) -> None:
        with self._lock:
            if self._client is client:
                self._client = None
        self._retire(client)

    def _deadline(self, rpc_timeout: float | None | object, wait: float | None = None) -> float | None:
        """Seconds the call may take: `rpc_timeout` when given, else the client's `timeout` plus `wait` (the time
        the server may wait on purpose, e.g. a sample's own timeout)."""
        if rpc_timeout is not _DEFAULT:
            return check_timeout(rpc_timeout, "rpc_timeout")
        if self.timeout is None:
            return None
        return self.timeout + (wait if wait is not None and wait > 0 else 0.0)

    def _call(self, fn: Callable[[flight.FlightClient, flight.FlightCallOptions], T], seconds: float | None = None,
              *, retry: bool = True) -> T:
        """Run one call within `seconds` (None: no deadline), translating errors; on an unreachable server
        reconnect and retry, for at most `reconnect_timeout` seconds and never past the deadline.

        Raises:
            DeadlineExceeded: the deadline passed (the call is not retried: the server may have acted on it).
            Unavailable: the server could not be reached.
        """
        start = time.monotonic()
        end = None if seconds is None else start + seconds
        give_up = start + self.reconnect_timeout if retry else start
        if end is not None:
            give_up = min(give_up, end)
        delay = 0.02
        while True:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise DeadlineExceeded(f"the call to {self.location} did not complete within its deadline of "
                                       f"{seconds:g}s; pass a larger rpc_timeout= (or timeout= to ab.connect)")
            client = self._acquire()
            options = (self.stream_options if left is None
                       else flight.FlightCallOptions(headers=self._headers, timeout=left))
            try:
                with translate(seconds=seconds):
                    return fn(client, options)
            except Exception as exc:
                if self._closing.is_set():  # close() from another thread during the call
                    raise StoreClosed(f"the client for {self.location} was closed during the call") from None
                if not isinstance(exc, Unreachable):
                    raise
                self._drop(client)
                reason = exc
            finally:
                self._release(client)
            now = time.monotonic()
            if now >= give_up:
                raise Unavailable(f"the server at {self.location} cannot be reached: {reason}; is it running "
                                  f"and listening there? (tried for {now - start:.1f}s, reconnect_timeout="
                                  f"{self.reconnect_timeout:g})") from None
            if self._closing.wait(min(delay, give_up - now)):  # back off while the server restarts
                raise StoreClosed(f"the client for {self.location} was closed") from None
            delay = min(delay * 2, 0.5)

    def _describe(self) -> None:
        info = self._action("describe")
        self.name = info["store"]
        self.schema = load_schema(info["schema"])
        self.capacity = info.get("capacity")
        self.max_batch_rows = int(info["max_batch_rows"])
        limits = info.get("limits")
        size = limits.get("max_batch_bytes") if isinstance(limits, dict) else None
        self.max_batch_bytes = int(size) if isinstance(size, int) and size > 0 else None
        versions = info.get("protocols")
        if isinstance(versions, list) and all(isinstance(v, int) for v in versions):
            self.protocols = tuple(versions)
        self.parts_into_ring = into_ring_of(info, self.protocols)
        # the server acknowledges each part of an extend in parts: at most PUT_WINDOW_PARTS are sent ahead of it
        self.put_window = info.get("put_window") is True and P.PARTS_VERSION in self.protocols
        # ids and weights as Arrow columns where the server speaks it (protocol.SAMPLE_META); JSON otherwise
        offered = info.get("sample_meta")
        self.sample_meta = "columns" if isinstance(offered, list) and "columns" in offered else "json"

    def _action(self, type_: str, rpc_timeout: float | None | object = _DEFAULT, **body: Any) -> Any:
        action = P.encode_action(type_, self._requested if type_ == "describe" else self.name, **body)

        def call(client: flight.FlightClient, options: flight.FlightCallOptions) -> Any:
            results = list(client.do_action(action, options=options))
            return P.loads(results[0].body, f"{type_} result") if results else None

        return self._call(call, self._deadline(rpc_timeout))

    # ------------------------------------------------------------------ writing
    def append(self, step: dict[str, Any], *, timeout: float | None = None,
               rpc_timeout: float | None | object = _DEFAULT) -> int:
        """Add one step (a dict of scalars and arrays). Returns the new row's id."""
        cols, n = self.schema.validate_batch(step, single=True)
        return int(self._put(record_batch(self.schema, cols), timeout, rpc_timeout)[0])

    @overload
    def extend(self, batch: Any, *, timeout: float | None = None, rpc_timeout: float | None | object = _DEFAULT,
               wait: Literal[True] = True) -> np.ndarray: ...
    @overload
    def extend(self, batch: Any, *, timeout: float | None = None, rpc_timeout: float | None | object = _DEFAULT,
               wait: Literal[False]) -> PendingWrite: ...

    def extend(self, batch: Any, *, timeout: float | None = None, rpc_timeout: float | None | object = _DEFAULT,
               wait: bool = True) -> Any:
        """Add many steps (dict of arrays, `pa.RecordBatch` or `pa.Table`) in one atomic DoPut.

        A batch over the server's `max_batch_bytes` goes in parts of one stream (zero-copy slices, protocol 3) that
        the server commits as one extend: atomic all the same (every row or none, consecutive ids).

        Args:
            batch: the steps.
            timeout: seconds the server's rate limiter may hold the insert back.
            rpc_timeout: this call's deadline (default: the client's `timeout` plus `timeout`).
            wait: False returns a `PendingWrite` (the local store's `extend(..., wait=False)` surface) that is
                durable at once: over Flight the server acknowledges a DoPut once it is durable, so this call
                still waits for that (no pipelining over Flight yet; the same code runs on both).

        Returns:
            The new rows' ids, a 1-D `np.ndarray[int64]` in row order (from the acknowledgement's committed range).

        Raises:
            SchemaError: bad input (nothing stored); a batch over `max_batch_bytes` for a server that cannot take
                one in parts (protocol < 3).
            InsertTimeout: the server's rate limiter held the insert back past `timeout` seconds.
            DeadlineExceeded: no acknowledgement within the deadline (the batch may or may not be stored).
        """
        rb = self.to_batch(batch)
        if rb.num_rows == 0:  # validated, and nothing to store
            ids = np.empty(0, dtype=np.int64)
        elif (limit := pipelined(rb.nbytes, self.max_batch_bytes, self.parts_into_ring)) is not None:
            ids = self._put_parts(rb, limit, timeout, rpc_timeout)
        else:
            ids = self._put(rb, timeout, rpc_timeout)
        return ids if wait else PendingWrite(ids)

    def _put_parts(self, rb: pa.RecordBatch, limit: int, timeout: float | None,
                   rpc_timeout: float | None | object) -> np.ndarray:
        """One extend in parts of at most `limit` bytes (`arrowbuf.flight.parts`): one DoPut of zero-copy slices,
        one acknowledgement."""
        assert self.max_batch_bytes is not None
        if P.PARTS_VERSION not in self.protocols:
            raise SchemaError(f"a batch of {rb.nbytes} bytes is over this server's max_batch_bytes "
                              f"{self.max_batch_bytes}, and the server (protocol versions {list(self.protocols)}) "
                              f"cannot take one in parts (protocol {P.PARTS_VERSION}); split it, or upgrade the "
                              "server")
        ranges = split_rows(rb, limit)
        window = PUT_WINDOW_PARTS if self.put_window and len(ranges) > PUT_WINDOW_PARTS else None
        descriptor = P.put_descriptor(self.name, timeout, parts=len(ranges), rows=rb.num_rows, window=window)

        def call(client: flight.FlightClient, options: flight.FlightCallOptions) -> dict[str, Any]:
            writer, reader = client.do_put(descriptor, rb.schema, options=options)
            try:
                received = 0
                for k, (offset, rows) in enumerate(ranges):
                    while window is not None and k - received >= window:  # the server is `window` parts behind
                        received = _progress(reader.read(), received, len(ranges))
                    writer.write_batch(rb.slice(offset, rows))
                ack = reader.read()
                while window is not None and P.decode_progress(ack) is not None:  # progress, then the final ack
                    ack = reader.read()
                writer.done_writing()
            finally:
                writer.close()
            return P.decode_ack(ack)

        ack = self._call(call, self._deadline(rpc_timeout, timeout))
        return ack_ids(ack, rb.num_rows)

    def to_batch(self, batch: Any) -> pa.RecordBatch:
        """`batch` as one record batch to send: a dict of arrays is validated against the schema and converted
        here; a `pa.RecordBatch` goes as it is and a `pa.Table` is combined into one (the server validates both).

        Raises:
            SchemaError: a dict that does not match the schema, or more rows than the server's `max_batch_rows`.
        """
        if isinstance(batch, pa.RecordBatch):
            rb = batch
        elif isinstance(batch, pa.Table):
            rb = table_to_batch(batch)
        else:
            cols, _ = self.schema.validate_batch(batch)
            rb = record_batch(self.schema, cols)
        if rb.num_rows > self.max_batch_rows:
            raise SchemaError(f"a batch of {rb.num_rows} rows is over the server's max_batch_rows "
                              f"{self.max_batch_rows}; split it, or stream pieces through writer()")
        return rb

    def _put(self, rb: pa.RecordBatch, timeout: float | None, rpc_timeout: float | None | object) -> np.ndarray:
        ack = self._put_one(P.put_descriptor(self.name, timeout), rb, P.decode_ack,
                            self._deadline(rpc_timeout, timeout))
        return ack_ids(ack, rb.num_rows)

    def _put_one(self, descriptor: flight.FlightDescriptor, rb: pa.RecordBatch,
                 decode: Callable[[Any], dict[str, Any]], deadline: float | None) -> dict[str, Any]:
        """One DoPut of one batch: write it, read the one acknowledgement, decode it (with the client's retries)."""

        def call(client: flight.FlightClient, options: flight.FlightCallOptions) -> dict[str, Any]:
            writer, reader = client.do_put(descriptor, rb.schema, options=options)
            try:
                writer.write_batch(rb)
                ack = reader.read()
                writer.done_writing()
            finally:
                writer.close()
            return decode(ack)

        return self._call(call, deadline)

    def writer(self, max_in_flight: int = 8, *, timeout: float | None = None) -> RemoteWriter:
        """A streaming writer over one DoPut; see `RemoteWriter`."""
        return RemoteWriter(self, max_in_flight=max_in_flight, timeout=timeout)

    # ------------------------------------------------------------------ sampling
    def sample(self, n: int, columns: Iterable[str] | None = None, timeout: float | None = None, *,
               rpc_timeout: float | None | object = _DEFAULT, **options: Any) -> SampleBatch:
        """Sample `n` items (one DoGet). Arrays are zero-copy, writable views of the received message (the batch's own).

        Args:
            n: batch size.
            columns: columns to gather (default: every field).
            timeout: seconds the server may wait for data (an empty store, a rate limiter); None: do not wait.
            rpc_timeout: this call's deadline (default: the client's `timeout` plus `timeout`).
            **options: sampler options, e.g. `n_step=3, gamma=0.99`.

        Raises:
            SampleTimeout: the server had nothing to serve within `timeout`.
            DeadlineExceeded: no answer within the deadline.
        """
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise InvalidArgument(f"n must be a positive number of items, got {n!r}")
        if n > self.max_batch_rows:
            raise SchemaError(f"sample({n}) is over the server's max_batch_rows {self.max_batch_rows}")
        cols = [columns] if isinstance(columns, str) else (list(columns) if columns is not None else None)
        form = self.sample_meta
        key = request_key(int(n), cols, timeout, options) if form == "columns" else None
        pad = self._pads.get(key, 0) if key is not None else 0
        parts = self.part_bytes if P.PARTS_VERSION in self.protocols else None  # a large sample, bounded messages
        ticket = flight.Ticket(P.encode_ticket(P.SampleRequest(int(n), self.name, cols, timeout, options,
                                                               meta=form, pad=pad, part_bytes=parts)))

        def call(client: flight.FlightClient, call_options: flight.FlightCallOptions) -> Any:
            return assemble(client.do_get(ticket, options=call_options), int(n), self._outputs.empty,
                            self._outputs.at_least)

        data, meta = self._call(call, self._deadline(rpc_timeout, timeout))
        if key is not None:  # ask for the body on an 8-byte boundary next time (see protocol.realigning_pad)
            again = P.realigning_pad(pad, misalignment(data))
            if again != pad:
                if len(self._pads) >= MAX_PADS:
                    self._pads.clear()
                self._pads[key] = again
        return sample_batch(data, meta, form)

    # ------------------------------------------------------------------ consumption per task
    def consume(self, task: str, n: int, *, require: Iterable[str] | None = None, timeout: float | None = 0.0,
                max_staleness: int | None = None, where: str | None = None, max_tokens: int | None = None,
                lease: float | None = None, rpc_timeout: float | None | object = _DEFAULT,
                admission: str | None = None) -> SampleBatch:
        """`ExperienceStore.consume` over one DoGet (ticket kind "consume"); the same arguments and errors.

        Each row is delivered once per task across every client of the store. Without `lease=` a reply lost on
        the way is lost for the task (at most once; a call cancelled while it waits consumes nothing). With
        `lease=` the rows stay in flight on the server until `ack` (or `batch.ack()`), `nack` or expiry: a
        consumer that dies or loses the reply has them delivered again after the lease (at least once).
        """
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise InvalidArgument(f"consume: n must be a positive number of rows, got {n!r}")
        if n > self.max_batch_rows:
            raise SchemaError(f"consume({n}) is over the server's max_batch_rows {self.max_batch_rows}")
        req_fields = [require] if isinstance(require, str) else (list(require) if require is not None else None)
        wait = None if timeout is None or (timeout == 0 and not isinstance(timeout, bool)) else \
            check_timeout(timeout, "consume: timeout")
        if lease is not None and (not isinstance(lease, (int, float)) or isinstance(lease, bool)
                                  or not 0 < lease <= P.MAX_LEASE_S):
            raise InvalidArgument(f"consume: lease must be a number of seconds in (0, {P.MAX_LEASE_S:.0f}], got "
                                  f"{lease!r}")
        ticket = flight.Ticket(P.encode_ticket(P.ConsumeRequest(
            task, int(n), self.name, req_fields, wait, max_staleness, where, max_tokens,
            None if lease is None else float(lease), admission=check_admission(admission))))

        def call(client: flight.FlightClient, call_options: flight.FlightCallOptions) -> Any:
            reader = client.do_get(ticket, options=call_options)
            chunk = reader.read_chunk()
            with contextlib.suppress(StopIteration):
                reader.read_chunk()
            return chunk

        # not retried after a lost connection: the server may have marked the rows consumed
        chunk = self._call(call, self._deadline(rpc_timeout, wait), retry=False)
        batch = sample_batch(chunk.data, chunk.app_metadata)
        batch.lease = P.decode_lease_meta(chunk.app_metadata)
        if batch.lease is not None:
            batch.owner = self
        return batch

    def ack(self, lease: str) -> int:
        """`ExperienceStore.ack` on the server's store (the action "ack"); returns the rows.

        Raises:
            LeaseError: the lease is not open on the server (acked or nacked already, expired, unknown).
        """
        return int(self._action("ack", v=P.LLM_VERSION, lease=_lease_id(lease))["rows"])

    def nack(self, lease: str) -> int:
        """`ExperienceStore.nack` on the server's store (the action "nack"); returns the rows."""
        return int(self._action("nack", v=P.LLM_VERSION, lease=_lease_id(lease))["rows"])

    def add_task(self, name: str) -> None:
        """Declare a consuming task on the server's store (`ExperienceStore.add_task`)."""
        self._action("add_task", v=P.LLM_VERSION, task=name)

    @property
    def tasks(self) -> list[str]:
        """The store's consuming tasks."""
        return list(self.stats().get("tasks", []))

    @property
    def policy_version(self) -> int:
        """The store's current policy version (settable: the `set_policy_version` action)."""
        return int(self._action("policy_version", v=P.LLM_VERSION)["policy_version"])

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise InvalidArgument(f"policy_version must be a non-negative integer, got {value!r}")
        self._action("set_policy_version", v=P.LLM_VERSION, policy_version=int(value))

    def session(self, n: int, columns: list[str] | None = None, *, prefetch: int = 2, ahead: int = 2,
                timeout: float | None = None, **options: Any) -> LearnerSession:
        """A learner session over DoExchange; see `LearnerSession`."""
        return LearnerSession(self, n, columns, prefetch=prefetch, ahead=ahead, timeout=timeout, options=options)

    def update_priorities(self, indices: Any, priorities: Any, *,
                          rpc_timeout: float | None | object = _DEFAULT) -> int:
        """Set priorities of sampled items; returns how many ids were still live."""
        idx, pri = validate_priorities(indices, priorities)
        return int(self._action("update_priorities", rpc_timeout, indices=idx, priorities=pri)["applied"])

    # ------------------------------------------------------------------ fields filled later
    def update(self, ids: Any, values: dict[str, Any], *, rpc_timeout: float | None | object = _DEFAULT) -> int:
        """Fill fields declared `later: true` of stored rows (one DoPut of kind "update"; see `ExperienceStore.update`
        and `arrowbuf.engine.update`). Validated here first, and again by the server; atomic on the server.

        Returns:
            The number of rows written (ids of evicted rows are skipped and counted in `stats()["update_skipped"]`).

        Raises:
            SchemaError: an unknown field, a field not filled later, a wrong dtype, shape or length; nothing written.
            InvalidArgument: an id the store never issued, or an id given twice; nothing written.
            DeadlineExceeded: no acknowledgement within the deadline (the update may or may not be applied; it can
                be sent again: an update overwrites).
        """
        from ..schema.update import update_ids, validate_update

        seqs = update_ids(ids)
        single = isinstance(ids, (int, np.integer)) and not isinstance(ids, bool)
        cols = validate_update(self.schema, seqs, values, single)
        if len(seqs) > self.max_batch_rows:
            raise SchemaError(f"an update of {len(seqs)} ids is over the server's max_batch_rows "
                              f"{self.max_batch_rows}; split it")
        if len(seqs) == 0:
            return 0
        rb = record_batch(self.schema, {P.UPDATE_ID_COLUMN: seqs, **cols})
        ack = self._put_one(P.update_descriptor(self.name), rb, P.decode_update_ack, self._deadline(rpc_timeout))
        return int(ack["rows"])

    # ------------------------------------------------------------------ inspection
    def __len__(self) -> int:
        return int(self._action("len", _DEFAULT)["len"])

    def checkpoint(self, path: str, keep: int | None = None, *,
                   rpc_timeout: float | None | object = _DEFAULT) -> dict[str, Any]:
        """Checkpoint the served store on the server, into `path`: a relative name under the checkpoint root the
        server was started with (`ab.serve(..., checkpoint_root=DIR)`); see `ExperienceStore.checkpoint`.

        Args:
            path: e.g. "run-7/latest" (no absolute path, no `..`, no link below the root).
            keep: keep the newest `keep` checkpoints in that directory (None: all).

        Returns:
            The checkpoint summary (generation, rows, files written and reused, bytes, path).

        Raises:
            InvalidArgument: a path outside the root, or a server started without `checkpoint_root`.
        """
        body: dict[str, Any] = {"path": path}
        if keep is not None:
            body["keep"] = keep
        return dict(self._action("checkpoint", rpc_timeout, **body))

    def stats(self, *, rpc_timeout: float | None | object = _DEFAULT) -> dict[str, Any]:
        """The store's `stats()`, plus a `server` entry."""
        return dict(self._action("stats", rpc_timeout))

    def _table(self, req: P.TableRequest, rpc_timeout: float | None | object) -> pa.Table:
        ticket = flight.Ticket(P.encode_ticket(req))
        return self._call(lambda client, options: client.do_get(ticket, options=options).read_all(),
                          self._deadline(rpc_timeout))

    def to_table(self, columns: list[str] | None = None, *,
                 rpc_timeout: float | None | object = _DEFAULT) -> pa.Table:
        """A snapshot of the live rows, oldest first."""
        return self._table(P.TableRequest("table", self.name, list(columns) if columns is not None else None),
                           rpc_timeout)

    def to_pandas(self, columns: list[str] | None = None) -> Any:
        """The stored rows as a pandas DataFrame (`to_table`, converted here; needs pandas)."""
        from ..query.frames import table_to_pandas

        return table_to_pandas(self.to_table(columns))

    def to_polars(self, columns: list[str] | None = None) -> Any:
        """The stored rows as a Polars DataFrame (`to_table`, converted here; needs `arrowbuf[query]`)."""
        from ..query.frames import table_to_polars

        return table_to_polars(self.to_table(columns))

    def sql(self, query: str, *, rpc_timeout: float | None | object = _DEFAULT) -> pa.Table:
        """DuckDB SQL over the live rows, run on the server; the store is the table `experience`."""
        return self._table(P.TableRequest("sql", self.name, query=query), rpc_timeout)

    def episodes(self, *, rpc_timeout: float | None | object = _DEFAULT) -> pa.Table:
        """The episode summary: episode_id, length, return, first_seq, last_seq, complete."""
        return self._table(P.TableRequest("episodes", self.name), rpc_timeout)

    # ------------------------------------------------------------------ lifetime
    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._closed

    def close(self) -> None:
        """Close the connection; idempotent. The store on the server is untouched.

        A call on another thread that is waiting to reconnect ends at once with `StoreClosed`; one already talking to
        the server keeps the connection until it ends (its deadline bounds it: `timeout=` / `rpc_timeout=`), and the
        connection is closed then: closing pyarrow's Flight client under a call crashes the process."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._closing.set()
            client, self._client = self._client, None
        if client is not None:
            self._retire(client)  # at once, or by the last call still using it

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        # by address: the unpickled copy opens its own connection (note: the token travels with the pickle)
        return (_reconnect, (self.location, self._token, self.name, self._tls_root_certs,
                             self._disable_verification, self.reconnect_timeout, self.timeout))

    def __repr__(self) -> str:
        return f"RemoteStore({self.location!r}, store={self.name!r}{', closed' if self._closed else ''})"


def _reconnect(location: str, token: str | None, store: str, tls_root_certs: bytes | None,
               disable_server_verification: bool, reconnect_timeout: float,
               timeout: float | None = None) -> RemoteStore:
    return RemoteStore(location, token, store, tls_root_certs=tls_root_certs,
                       disable_server_verification=disable_server_verification, reconnect_timeout=reconnect_timeout,
                       timeout=timeout)


def _pem_or_none(value: bytes | str | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if "-----BEGIN" in value:
        return value.encode()
    with open(value, "rb") as fh:
        return fh.read()


def _lease_id(value: Any) -> str:
    """A lease id as the wire takes it (checked here too, so a bad one is a clear local error)."""
    if not isinstance(value, str) or P.LEASE_ID.fullmatch(value) is None:
        raise LeaseError(f"{value!r:.80} is not a lease id; pass batch.lease of a batch consumed with lease=")
    return value


__all__ = ["LearnerSession", "RemoteStore", "RemoteWriter", "connect"]
