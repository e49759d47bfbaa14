"""`LearnerSession`: a learner session over DoExchange (`RemoteStore.session()`): batches stream down, priority
updates go up, the server samples ahead."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from ..delivery.batch import SampleBatch
from ..errors import InvalidArgument, SchemaError, StoreClosed, Unavailable
from ..samplers import validate_priorities
from ..schema.inputs import IdsLike, ValuesLike
from . import protocol as P
from .calls import StreamSource, translate
from .messages import misalignment, sample_batch


class LearnerSession:
    """A learner session over DoExchange: batches stream down, priority updates go up.

    The client keeps `ahead` to `2 * ahead - 1` batch requests outstanding (asking `ahead` at a time) and the server
    keeps `prefetch` batches sampled ahead, so the next batch is usually on the wire while the learner computes.
    Batches already requested were sampled with the priorities of that moment (as in any asynchronous replay).
    An error for one request (an empty store,
    `SampleTimeout`) is raised by the `next()` it answers, once: the same error answering requests that were
    already in flight is not raised again. The session stays usable.

    Usage::

        with remote.session(256, prefetch=2) as session:
            for step, batch in zip(range(10_000), session):
                loss, priorities = learn(batch)
                session.update_priorities(batch.indices, priorities)
    """

    def __init__(self, remote: StreamSource, n: int, columns: list[str] | None = None, *, prefetch: int = 2,
                 ahead: int = 2, timeout: float | None = None, options: dict[str, Any] | None = None) -> None:
        if ahead < 1:
            raise InvalidArgument(f"ahead must be >= 1, got {ahead}")
        self.remote = remote
        self.n = int(n)
        self.ahead = int(ahead)
        cols = [columns] if isinstance(columns, str) else (list(columns) if columns is not None else None)
        self._form = remote.sample_meta
        req = P.SessionRequest(self.n, remote.name, cols, timeout, int(prefetch), dict(options or {}),
                               meta=self._form)
        client = remote.connection()
        with translate(unreachable=Unavailable):
            self._writer, self._reader = client.do_exchange(P.session_descriptor(req), options=remote.stream_options)
        self._pending = 0
        self._stale = 0  # replies still due to requests sent before the last error was raised
        self._closed = False
        # meta "columns": the padding the server puts before each body, and the one each outstanding request
        # gets ([replies still due, pad] per request message, in order), so a misaligned reply says what to ask
        self._pad = 0
        self._pad_changed = False
        self._sent: deque[list[int]] = deque()
        self._request(self.ahead)

    def _send(self, message: bytes) -> None:
        """Write one metadata message up. When the server has ended the session, a write can fail with a bare
        transport error (gRPC reports the broken stream before the call's status); the reason is then read from
        the stream's status and raised instead, so the caller always learns why."""
        with translate(unreachable=Unavailable):
            try:
                self._writer.write_metadata(pa.py_buffer(message))
            except flight.FlightError:
                raise
            except (pa.ArrowException, OSError) as exc:  # pyarrow raises a bare OSError for a broken stream
                self._raise_server_reason(exc)

    def _raise_server_reason(self, exc: BaseException) -> None:
        """Read what is left of the stream up to the server's status and raise that (translated by the caller's
        `translate`), or an in-band error the server sent before ending; `StoreClosed` if it ended cleanly."""
        self._closed = True
        last: BaseException | None = None
        while True:  # the server ended the call: what is left is finite, and its status ends it
            try:
                chunk = self._reader.read_chunk()  # the status, as a FlightError the caller translates
            except StopIteration:
                raise (last or StoreClosed(f"the server ended the session ({exc})")) from None
            if chunk.data is None:
                last = P.decode_error(chunk.app_metadata) or last

    def _request(self, count: int) -> None:
        msg = P.ExchangeMessage("sample", count=count, pad=self._pad if self._pad_changed else None)
        self._send(P.encode_exchange(msg))
        self._pad_changed = False
        self._pending += count
        self._sent.append([count, self._pad])

    def _replied(self, data: pa.RecordBatch | None) -> None:
        """One reply to a sample request arrived (a batch, or None for an in-band error)."""
        self._pending -= 1
        if not self._sent:
            return
        slot = self._sent[0]
        slot[0] -= 1
        if slot[0] <= 0:
            self._sent.popleft()
        if data is not None and self._form == "columns":
            again = P.realigning_pad(slot[1], misalignment(data))
            if again != self._pad:
                self._pad, self._pad_changed = again, True

    def __iter__(self) -> Iterator[SampleBatch]:
        return self

    def __next__(self) -> SampleBatch:
        if self._closed:
            raise StopIteration
        while True:
            if self._pending < self.ahead:  # ask `ahead` at a time: one small write per `ahead` batches
                self._request(self.ahead)
            with translate(unreachable=Unavailable):
                try:
                    chunk = self._reader.read_chunk()
                except StopIteration:
                    self._closed = True
                    raise StoreClosed("the server ended the session") from None
            if chunk.data is not None:
                self._replied(chunk.data)
                self._stale = max(0, self._stale - 1)
                return sample_batch(chunk.data, chunk.app_metadata, self._form)
            exc = P.decode_error(chunk.app_metadata)  # an in-band error
            if exc is None:
                raise SchemaError("the server sent a DoExchange message this client does not understand")
            if P.loads(chunk.app_metadata, "DoExchange error").get("op") == "sample":
                self._replied(None)
                if self._stale:  # the same failure again, for a request sent before it was raised
                    self._stale -= 1
                    continue
                self._stale = self._pending
            raise exc

    def update_priorities(self, indices: IdsLike, priorities: ValuesLike) -> None:
        """Send priorities up (asynchronously; an error comes back from a later `next()`)."""
        idx, pri = validate_priorities(indices, priorities)
        self._send(P.encode_priorities(idx, pri))

    def cancel(self) -> None:
        """Cancel the session from any thread: a `next()` blocked on the server returns with an error at once.
        Call `close()` afterwards (from the thread that iterates)."""
        with contextlib.suppress(Exception):
            self._reader.cancel()

    def close(self) -> None:
        """End the session; idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._writer.done_writing()
        with contextlib.suppress(Exception):
            while True:  # drain the batches already requested, so the server's writes complete
                self._reader.read_chunk()
        with contextlib.suppress(Exception):
            self._writer.close()

    def __enter__(self) -> LearnerSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["LearnerSession"]
