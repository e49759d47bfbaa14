"""The bounded streams of a Flight server's handlers: the batches of a DoPut (each checked against the server's row
and byte limits before the store sees it), the update stream (DoPut kind "update": each batch one atomic
`store.update`), and the batches of a `table` ticket (cut short with an error when the server closes).
`arrowbuf.flight.server` dispatches to them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from ..errors import SchemaError, StoreClosed
from . import protocol as P


# DoPut kind "update": each batch is one atomic store.update.
def put_update(store: Any, reader: flight.MetadataRecordBatchReader, writer: flight.FlightMetadataWriter,
                limits: Any, check_open: Callable[[], None], moved: Callable[[], None]) -> None:
    """Apply an update stream (see `arrowbuf.flight.protocol`): the stream's schema is checked before any batch is
    read, each batch is bounded like a DoPut batch, then written with `store.update` and acknowledged."""
    from ..schema.update import check_update_types

    check_update_types(store.schema, reader.schema, P.UPDATE_ID_COLUMN, "DoPut update")
    for k, batch in bounded_batches(reader, limits, check_open, moved, "update batch"):
        ids = batch.column(P.UPDATE_ID_COLUMN)
        values = {n: batch.column(n) for n in batch.schema.names if n != P.UPDATE_ID_COLUMN}
        written = int(store.update(ids, values))
        writer.write(pa.py_buffer(P.encode_update_ack(k, written, batch.num_rows - written)))


def bounded_batches(reader: flight.MetadataRecordBatchReader, limits: Any, check_open: Callable[[], None],
                     moved: Callable[[], None], what: str) -> Iterator[tuple[int, pa.RecordBatch]]:
    """The data batches of a DoPut stream, numbered from 0, each checked against the server's row and byte limits
    (and the server still open) before the caller touches the store; metadata-only messages are skipped. `moved` is
    called after each message (the stream is not idle)."""
    k = 0
    while True:
        try:
            chunk = reader.read_chunk()
        except StopIteration:
            return
        moved()
        batch = chunk.data
        if batch is None:  # a metadata-only message carries nothing to store
            continue
        check_open()
        limits.check_rows(batch.num_rows, f"{what} {k}")
        if batch.nbytes > limits.max_batch_bytes:
            raise SchemaError(f"{what} {k} of {batch.nbytes} bytes is over this server's max_batch_bytes "
                              f"{limits.max_batch_bytes}; split it into smaller batches")
        yield k, batch
        del chunk, batch  # the message goes before the next one is read (the caller drops its own reference)
        k += 1


def table_batches(batches: Iterable[pa.RecordBatch], done: Callable[[], None],
             closing: Callable[[], bool]) -> Iterator[pa.RecordBatch]:
    """The batches of a `table` stream, then `done()`; a server closing ends the stream with `StoreClosed`."""
    try:
        for batch in batches:
            if closing():  # an error, not a short stream: the reader must not take it for the whole table
                raise StoreClosed("the server is shutting down; the table stream was cut short")
            yield batch
    finally:
        done()
