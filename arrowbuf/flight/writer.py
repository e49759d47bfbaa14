"""`RemoteWriter`: batches streamed into a remote store over one DoPut (`RemoteStore.writer()`).

It implements the writer surface (`arrowbuf.surface.WriterSurface`): `extend` and `append` wait for their
acknowledgement and return ids, `send` pipelines under a credit of `max_in_flight` batches, `flush` waits for all.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ..errors import InvalidArgument, StoreClosed, Unavailable
from . import protocol as P
from .calls import StreamSource, translate
from .messages import record_batch

if TYPE_CHECKING:  # pragma: no cover
    from ..schema.inputs import BatchLike


class RemoteWriter:
    """Streams batches into a remote store over one DoPut, each batch atomic and acknowledged.

    `send` streams a batch without waiting for it: at most `max_in_flight` batches are unacknowledged, and the next
    `send` waits for an ack first, so a slow store slows the writer (credit-based backpressure) instead of queueing
    without bound; `flush` waits for every ack. `extend` and `append` send and wait for their own acknowledgement, and
    return the rows' ids (the writer surface, `ab.surface.WriterSurface`, as a Ray `ShardWriter` does). A batch whose
    columns differ from the stream's starts a new stream. The writer does not reconnect: after an error, batches not yet
    acknowledged may or may not be stored (each one entirely or not at all).

    Usage::

        with remote.writer(max_in_flight=8) as w:
            for batch in rollouts:
                w.send(batch)           # pipelined; w.extend(batch) would wait and return the ids
        w.first_seqs        # the first seq of each batch, in order
    """

    def __init__(self, remote: StreamSource, max_in_flight: int = 8, timeout: float | None = None) -> None:
        if max_in_flight < 1:
            raise InvalidArgument(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.remote = remote
        self.max_in_flight = int(max_in_flight)
        self.timeout = timeout
        self.first_seqs: list[int] = []
        self.rows = 0
        self._stream: tuple[Any, Any, pa.Schema] | None = None
        self._in_flight = 0
        self._closed = False

    def append(self, step: dict[str, Any]) -> int:
        """Write one step and wait for it; returns its id."""
        cols, _ = self.remote.schema.validate_batch(step, single=True)
        return int(self._write_and_wait(record_batch(self.remote.schema, cols))[0])

    def extend(self, batch: BatchLike) -> np.ndarray:
        """Write a batch and wait for its acknowledgement; returns its rows' ids (`np.ndarray[int64]`, row order)."""
        return self._write_and_wait(self.remote.to_batch(batch))

    def send(self, batch: BatchLike) -> None:
        """Send a batch; returns once it is on its way (at most `max_in_flight` unacknowledged; `flush` waits)."""
        self._write(self.remote.to_batch(batch))

    def _write_and_wait(self, rb: pa.RecordBatch) -> np.ndarray:
        if rb.num_rows == 0:
            return np.empty(0, dtype=np.int64)
        self._write(rb)
        self.flush()  # this batch is the last one acknowledged
        return self.first_seqs[-1] + np.arange(rb.num_rows, dtype=np.int64)  # a batch's ids are a range

    def _write(self, rb: pa.RecordBatch) -> None:
        if self._closed:
            raise StoreClosed("this writer is closed")
        if self._stream is not None and self._stream[2] != rb.schema:
            self._finish()
        if self._stream is None:
            client = self.remote.connection()
            with translate(unreachable=Unavailable):
                writer, reader = client.do_put(P.put_descriptor(self.remote.name, self.timeout), rb.schema,
                                               options=self.remote.stream_options)
            self._stream = (writer, reader, rb.schema)
        while self._in_flight >= self.max_in_flight:
            self._read_ack()
        with translate(unreachable=Unavailable):
            try:
                self._stream[0].write_batch(rb)
            except flight.FlightError:
                raise
            except pa.ArrowException:  # the server ended the stream (an error): its status comes with the close
                self._abort()
                raise
        self._in_flight += 1

    def _read_ack(self) -> None:
        assert self._stream is not None
        with translate(unreachable=Unavailable):
            try:
                ack = self._stream[1].read()
            except flight.FlightError:
                self._stream = None  # the server ended the stream: batches still in flight on it are not stored
                self._in_flight = 0
                raise
            if ack is None:
                self._abort()
                raise StoreClosed("the server ended the DoPut stream without acknowledging every batch")
        info = P.decode_ack(ack)
        self.first_seqs.append(info["first_seq"])
        self.rows += info["rows"]
        self._in_flight -= 1

    def _abort(self) -> None:
        stream, self._stream = self._stream, None
        self._in_flight = 0
        if stream is not None:
            with translate(unreachable=Unavailable):
                stream[0].close()

    def _finish(self) -> None:
        while self._in_flight:
            self._read_ack()
        stream, self._stream = self._stream, None
        if stream is not None:
            with translate(unreachable=Unavailable):
                stream[0].done_writing()
                stream[0].close()

    def flush(self) -> int:
        """Wait until every batch sent is acknowledged; returns the rows committed by this writer so far."""
        if self._stream is not None:
            while self._in_flight:
                self._read_ack()
        return self.rows

    def close(self) -> None:
        """Flush and end the stream; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finish()

    def abort(self) -> None:
        """Drop the stream now, without waiting for acknowledgements (batches not acknowledged may or may not be
        stored, each entirely or not at all); the writer is closed. Idempotent. (layout: for ShardWriter re-routes)"""
        self._closed = True
        self._abort()

    def __enter__(self) -> RemoteWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._closed = True
            with contextlib.suppress(Exception):
                self._abort()


__all__ = ["RemoteWriter"]
