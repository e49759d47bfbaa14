"""An extend sent in parts (protocol version 3): one batch larger than a Flight message may be, committed as one.

A batch over the server's `max_batch_bytes` is refused as one message. `RemoteStore.extend` cuts it instead into
row ranges of at most `part_bytes(max_batch_bytes)` each (`split_rows`: zero-copy slices, no copy on the client)
and sends them in one DoPut whose command names the number of parts and rows (`protocol.put_descriptor`). The
server (`receive`) reads exactly that many parts, each bounded like any DoPut batch, and the whole within
`ServerLimits.max_extend_bytes`, into one batch (`PartsAssembler`), and only then calls `store.extend` once:

- atomic as one extend: every row or none. A stream that ends early, carries more rows or parts than it declared,
  or breaks any bound stores nothing; the rows become visible together, with consecutive ids, acknowledged once.
- bounded memory: fixed-width columns (numbers, fixed-shape tensors) are copied from each received message into
  one preallocated array per column, and the message is dropped before the next is read, so the server holds the
  assembled batch plus one message (not every message and then a combined copy). Ragged and other columns are
  kept per part (copied out of the message when it also carries fixed-width columns, so the message can go) and
  concatenated once at the end.

With `ServerLimits.parts_into_ring` the server writes each part straight into the store's reserved ring rows instead
(`receive_into`, `arrowbuf.engine.pieces`), and says so in `describe`; the client then cuts any batch over twice
`PIPELINE_PART_BYTES` into parts of that size (`pipelined`), so the server's copy of one part overlaps the transfer of
the next instead of following the whole message, and each message lands in reused heap memory (see the constant).

The same in the other direction: a sample ticket with `part_bytes` (version 3) makes the server send a larger
sample as zero-copy slices of at most that size (`parts_stream`; the app_metadata rides on the first), and the
client (`assemble`) copies each message into the preallocated batch as it arrives, so neither side holds the
sample twice (one large message was: gRPC's received pieces and their contiguous copy).

Usage (what `RemoteStore.extend`, `RemoteStore.sample` and the server's DoPut and DoGet do)::

    ranges = split_rows(rb, part_bytes(max_batch_bytes))          # client: [(offset, rows), ...]
    batch = receive(reader, req, limits, check_open, moved)       # server: one pa.RecordBatch of req.rows rows
    stream = parts_stream(data, meta, req.part_bytes)             # server: a sample in bounded messages
    data, meta = assemble(reader, n)                              # client: the sample, whole
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.flight as flight

from ..errors import SchemaError
from ..schema.convert import arrow_to_numpy, numpy_to_arrow
from .heap import release_after
from .streams import bounded_batches

if TYPE_CHECKING:  # pragma: no cover
    from ..delivery.batch import SampleBatch
    from ..schema import ExperienceSchema
    from ..surface import ExtendSink
    from .limits import ServerLimits
    from .protocol import PutRequest


class PieceSampler(Protocol):
    """A store that gathers a sample piece by piece as a stream is read (`ExperienceStore.sample_pieces`)."""

    @property
    def schema(self) -> ExperienceSchema: ...

    def sample_pieces(self, n: int, rows: int, columns: Iterable[str] | None = None, timeout: float | None = None,
                      *, piece_bytes: int | None = None) -> Iterator[SampleBatch]: ...

#: The share of `max_batch_bytes` a part is cut to (headroom for the bytes a received message adds: validity
#: bitmaps rounded up, IPC padding).
PART_FILL = 0.9
#: The largest part sent whatever the server allows (DoPut parts, and the sample parts a client asks for). A receiver
#: holds a message twice while it arrives (gRPC's slices, then Arrow's one buffer) and gRPC reads the next one ahead,
#: so the part size sets the transient memory of both sides: with 64 MiB parts a 302 MB transfer peaked 200-370 MiB
#: above the payload on the receiving side, with 8 MiB parts 30-100 MiB (benchmarks/README.md, "Flight memory", with
#: the throughput of both).
MAX_PART_BYTES = 8 << 20
#: The part size of a batch sent to a server that writes parts straight into its ring (`ServerLimits.parts_into_ring`):
#: the server copies each part into the ring while the next one travels, so its copy hides behind the transfer
#: instead of following it, and a message this small is received into heap memory that is reused warm (no fresh
#: pages to fault in per message; the heap is trimmed once, when the stream ends). Measured server CPU per PUT of the
#: GRPO shape (218 MB, load 6): one message 360-400 ms, 32 MiB parts 250-275, 8 MiB 120-170, raw Flight's one
#: message 220-270; a trim every 16 MiB of parts took it to 250-260 (quiet), trimming at the end 150-170.
#: A batch of at most twice this goes whole.
PIPELINE_PART_BYTES = 8 << 20


def pipelined(nbytes: int, max_batch_bytes: int | None, into_ring: bool) -> int | None:
    """The part size to send a batch of `nbytes` in, or None to send it as one message: parts of at most
    `PIPELINE_PART_BYTES` (and `part_bytes(max_batch_bytes)`) when the server writes parts into its ring
    (`into_ring`) and the batch is more than twice that; else parts of `part_bytes(max_batch_bytes)` when it is over
    `max_batch_bytes`; else None."""
    if max_batch_bytes is None:
        return None
    if into_ring and nbytes > 2 * PIPELINE_PART_BYTES:
        return min(part_bytes(max_batch_bytes), PIPELINE_PART_BYTES)
    if nbytes > max_batch_bytes:
        return part_bytes(max_batch_bytes)
    return None


def part_bytes(max_batch_bytes: int) -> int:
    """The largest part a client sends to a server whose DoPut batches may have `max_batch_bytes`."""
    return max(1, min(int(max_batch_bytes * PART_FILL), MAX_PART_BYTES))


def split_rows(rb: pa.RecordBatch, limit: int) -> list[tuple[int, int]]:
    """Consecutive row ranges (offset, rows) of `rb`, each of at most `limit` bytes (`RecordBatch.nbytes` of the
    slice), covering every row once.

    Raises:
        SchemaError: one row alone is over `limit` (it cannot be sent in any part).
    """
    n = rb.num_rows
    total = rb.nbytes
    out: list[tuple[int, int]] = []
    start = 0
    guess = max(1, int(n * limit / total)) if total else n
    while start < n:
        take = min(guess, n - start)
        while rb.slice(start, take).nbytes > limit:
            if take == 1:
                raise SchemaError(f"row {start} alone is {rb.slice(start, 1).nbytes} bytes, over the {limit} bytes "
                                  "a part may carry; raise the server's max_batch_bytes")
            take = max(1, take // 2)
        out.append((start, take))
        start += take
    return out


def _dense(col: pa.Array) -> np.ndarray | None:
    """[rows, width] numpy view of a fixed-width column without nulls (numbers, fixed-size lists of numbers,
    fixed-shape tensors), or None."""
    storage = col.storage if isinstance(col, pa.ExtensionArray) else col
    t = storage.type
    if storage.null_count:
        return None
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return storage.to_numpy(zero_copy_only=True).reshape(len(storage), 1)
    if pa.types.is_fixed_size_list(t) and (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)):
        flat = storage.flatten()
        if flat.null_count:
            return None
        return flat.to_numpy(zero_copy_only=True).reshape(len(storage), t.list_size)
    return None


def _from_dense(values: np.ndarray, type_: pa.DataType) -> pa.Array:
    """The inverse of `_dense` (zero-copy)."""
    storage_type = type_.storage_type if isinstance(type_, pa.BaseExtensionType) else type_
    if pa.types.is_fixed_size_list(storage_type):
        storage: pa.Array = pa.FixedSizeListArray.from_arrays(numpy_to_arrow(values.reshape(-1)),
                                                              storage_type.list_size)
        storage = storage.cast(storage_type) if storage.type != storage_type else storage
    else:
        storage = numpy_to_arrow(values.reshape(-1), storage_type)
    return pa.ExtensionArray.from_storage(type_, storage) if isinstance(type_, pa.BaseExtensionType) else storage


#: Allocates an uninitialised array: (shape, dtype, tag) -> array (`OutputPool.empty`; default `np.empty`).
Empty = Callable[[tuple[int, ...], Any, str], np.ndarray]


def _fresh(shape: tuple[int, ...], dtype: npt.DTypeLike, tag: str) -> np.ndarray:
    return np.empty(shape, dtype)


#: Allocates an uninitialised 1-D array of at least `count` elements: (count, dtype, tag) -> array, of which the
#: caller uses the first `count` (`OutputPool.at_least`; default `np.empty`).
AtLeast = Callable[[int, Any, str], np.ndarray]


def _fresh_at_least(count: int, dtype: npt.DTypeLike, tag: str) -> np.ndarray:
    return np.empty(count, dtype)


#: How much more room than the rows so far suggest a list column's values get (the rows still to come may be longer
#: than the average so far). Room never written is never touched, so it costs address space, not memory.
RAGGED_HEADROOM = 1.25


def _list_view(col: pa.Array) -> tuple[np.ndarray, np.ndarray] | None:
    """(values, int64 offsets from 0) of a list column without nulls whose values are numbers without nulls (zero-copy
    views of the message), or None."""
    t = col.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or col.null_count:
        return None
    vt = t.value_type
    if not (pa.types.is_integer(vt) or pa.types.is_floating(vt)):
        return None
    offs = arrow_to_numpy(col.offsets).astype(np.int64)  # respects a slice
    first, last = int(offs[0]), int(offs[-1])
    if first < 0 or last > len(col.values) or (len(offs) > 1 and bool((np.diff(offs) < 0).any())):
        raise SchemaError("a sample in parts: a list column's offsets run backwards or past its values")
    child = col.values.slice(first, last - first)
    if child.null_count:
        return None
    return child.to_numpy(zero_copy_only=True), offs - first


class _RaggedColumn:
    """One list column of a stream in parts, copied as it arrives into one values array and one offsets array (no
    per-part pieces, no concatenation at the end: the column is held once, not twice).

    The values array is sized from the rows so far (`RAGGED_HEADROOM` over their average, for every row the stream
    may bring); when the rows run longer it is regrown (one copy of what came so far). Offsets that would overflow
    the column's offset type (list: int32) are refused like Arrow's own concatenation refuses them.
    """

    def __init__(self, type_: pa.DataType, rows: int, at_least: AtLeast, tag: str) -> None:
        self.type = type_
        self.rows = rows
        self._at_least = at_least
        self._tag = tag
        self._large = pa.types.is_large_list(type_)
        self.offsets = np.empty(rows + 1, np.int64 if self._large else np.int32)
        self.offsets[0] = 0
        self.values: np.ndarray | None = None
        self.used = 0

    def add(self, values: np.ndarray, offsets: np.ndarray, r0: int) -> None:
        """Append the rows [r0, r0 + len(offsets) - 1) (`offsets` from 0, `values` theirs)."""
        n = len(offsets) - 1
        need = self.used + len(values)
        if not self._large and need > np.iinfo(np.int32).max:
            raise SchemaError(f"a sample in parts: list column {self._tag!r} has more than 2**31 - 1 values; "
                              "sample fewer rows")
        if self.values is None or need > len(self.values):
            self._grow(need, r0 + n, values.dtype)
        assert self.values is not None
        self.values[self.used:need] = values
        self.offsets[r0 + 1:r0 + n + 1] = offsets[1:] + self.used
        self.used = need

    def _grow(self, need: int, rows_after: int, dtype: np.dtype) -> None:
        estimate = int(need / max(1, rows_after) * self.rows * RAGGED_HEADROOM) + 1
        size = max(need, estimate)
        if self.values is not None:
            size = max(size, int(len(self.values) * RAGGED_HEADROOM))
        if not self._large:
            size = min(size, int(np.iinfo(np.int32).max))
        grown = self._at_least(size, dtype, self._tag)
        if self.values is not None:
            grown[:self.used] = self.values[:self.used]
        self.values = grown

    def array(self, rows: int) -> pa.Array:
        """The first `rows` rows as one list array over these arrays (zero-copy)."""
        vt = self.type.value_type
        if self.values is None:  # no row yet
            values = numpy_to_arrow(np.empty(0, vt.to_pandas_dtype()), vt)
        else:
            values = pa.Array.from_buffers(vt, self.used, [None, pa.py_buffer(self.values[:self.used])])
        return pa.Array.from_buffers(self.type, rows, [None, pa.py_buffer(self.offsets[:rows + 1])],
                                     children=[values])


class PartsAssembler:
    """The parts of one extend, assembled into one batch of `rows` rows (see the module docstring).

    `empty` allocates the fixed-width columns' arrays (tagged with the column name): a client passes its
    `OutputPool`'s, so a sample's arrays are reused once the caller drops the previous batch (warm pages: the copy
    runs at memcpy speed instead of faulting fresh memory in). `at_least`, given, assembles list columns of numbers
    (without nulls) the same way, into one values array it allocates (`OutputPool.at_least`) and one offsets array
    (`_RaggedColumn`), instead of keeping a copy of each part and concatenating them at the end (which held the
    column twice).
    """

    def __init__(self, schema: pa.Schema, rows: int, empty: Empty = _fresh, at_least: AtLeast | None = None) -> None:
        self.schema = schema
        self.rows = int(rows)  # the most rows that may come (`batch` returns the rows that came)
        self._empty = empty
        self._at_least = at_least
        self.filled = 0
        self._dense: dict[str, np.ndarray] = {}
        self._ragged: dict[str, _RaggedColumn] = {}
        self._pieces: dict[str, list[pa.Array]] = {}

    def add(self, batch: pa.RecordBatch) -> None:
        """Copy the part's rows in (the caller has checked that they fit)."""
        r0, n = self.filled, batch.num_rows
        views = {name: (col, _dense(col)) for name, col in zip(batch.schema.names, batch.columns)}
        frees_message = any(v is not None for _, v in views.values()) or self._at_least is not None
        for name, (col, view) in views.items():
            if name in self._dense and view is not None:
                self._dense[name][r0:r0 + n] = view
                continue
            if name not in self._pieces and view is not None and r0 == 0:
                self._dense[name] = self._empty((self.rows, view.shape[1]), view.dtype, name)
                self._dense[name][:n] = view
                continue
            if self._at_least is not None and name not in self._pieces and (name in self._ragged or r0 == 0):
                listed = _list_view(col)
                if listed is not None:
                    if name not in self._ragged:
                        self._ragged[name] = _RaggedColumn(col.type, self.rows, self._at_least, name)
                    self._ragged[name].add(listed[0], listed[1], r0)
                    continue
            pieces = self._pieces.setdefault(name, [])
            if name in self._dense:  # nulls in a later part: the rows so far become a piece
                pieces.append(_from_dense(self._dense.pop(name)[:r0].copy(), col.type))
            if name in self._ragged:  # nulls in a later part: the rows so far become a piece (it keeps the arrays)
                pieces.append(self._ragged.pop(name).array(r0))
            # a piece copied out of the message, so that the message's memory can go
            pieces.append(pa.concat_arrays([col, col.slice(0, 0)]) if frees_message else col)
        self.filled += n

    def batch(self) -> pa.RecordBatch:
        """The assembled rows, in the stream's schema."""
        arrays = []
        for field in self.schema:
            if field.name in self._dense:
                arrays.append(_from_dense(self._dense[field.name][:self.filled], field.type))
            elif field.name in self._ragged:
                arrays.append(self._ragged[field.name].array(self.filled))
            else:
                pieces = self._pieces.get(field.name, [])
                arrays.append(pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces))
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


#: Parts a client keeps unacknowledged when the server acknowledges each one (`protocol.PutRequest.window`): the
#: server's receive buffers hold at most about this many parts (gRPC otherwise reads ahead of a server that copies
#: parts slower than they arrive: measured up to about 190 MiB of a 218 MB GRPO extend held at once).
PUT_WINDOW_PARTS = 4

#: Called with the number of parts received so far, after each part is added (a windowed extend's progress).
OnPart = Callable[[int], None]


def receive(reader: flight.MetadataRecordBatchReader, req: PutRequest, limits: ServerLimits,
            check_open: Callable[[], None], moved: Callable[[], None], on_part: OnPart | None = None) -> pa.RecordBatch:
    """Read the `req.parts` parts of an extend (`req.rows` rows in all) from a DoPut stream into one batch.

    Raises:
        SchemaError: more rows than `max_batch_rows`, a part over `max_batch_bytes`, the parts together over
            `max_extend_bytes`, more or fewer parts or rows than declared, or a part with no rows. Nothing is stored.
    """
    assert req.rows is not None, "the descriptor's decoder requires rows with parts"
    assembler = PartsAssembler(reader.schema, req.rows)
    _read_parts(reader, req, limits, check_open, moved, assembler.add, on_part)
    return assembler.batch()


def receive_into(reader: flight.MetadataRecordBatchReader, req: PutRequest, limits: ServerLimits,
                 check_open: Callable[[], None], moved: Callable[[], None],
                 sink: ExtendSink, on_part: OnPart | None = None) -> np.ndarray:
    """Read the parts of an extend like `receive`, each copied straight into the store's reserved rows by `sink` (an
    `arrowbuf.engine.pieces.ExtendInPieces`: one copy, no assembled batch), then commit them as one extend.

    Returns:
        The rows' ids (consecutive).

    Raises:
        SchemaError: as `receive`, or a part that does not match the store's schema; the stream breaking or the
            server closing (their own errors). In every case the sink is aborted: nothing is stored, nothing stays
            reserved.
    """
    try:
        _read_parts(reader, req, limits, check_open, moved, sink.write, on_part)
        return np.asarray(sink.commit(), dtype=np.int64)
    except BaseException:
        sink.abort()
        raise


def _read_parts(reader: flight.MetadataRecordBatchReader, req: PutRequest, limits: ServerLimits,
                check_open: Callable[[], None], moved: Callable[[], None],
                add: Callable[[pa.RecordBatch], None], on_part: OnPart | None = None) -> None:
    """The parts of an extend, each bounded (rows, bytes, the running total) before `add` sees it, and the count of
    parts and rows checked at the end (see `receive`); `on_part(k)` after the k-th part is added."""
    assert req.parts is not None and req.rows is not None, "the descriptor's decoder requires both with parts"
    limits.check_rows(req.rows, "an extend in parts")
    k = total = filled = 0
    try:
        for i, part in bounded_batches(reader, limits, check_open, moved, "an extend's part"):
            if i >= req.parts:
                raise SchemaError(f"an extend in parts: more than the {req.parts} parts declared; nothing stored")
            if part.num_rows == 0 or filled + part.num_rows > req.rows:
                raise SchemaError(f"an extend in parts: part {i} brings {part.num_rows} rows, after "
                                  f"{filled} of the {req.rows} declared; nothing stored")
            total += part.nbytes
            if total > limits.max_extend_bytes:
                raise SchemaError(f"an extend in parts of more than {total} bytes is over this server's "
                                  f"max_extend_bytes {limits.max_extend_bytes}; send smaller extends")
            add(part)
            filled += part.num_rows
            del part  # the message goes before the next one is read
            k = i + 1
            if on_part is not None:
                on_part(k)
            if k == req.parts:
                break
    finally:
        # the parts' heap pieces back to the OS once, when the stream ends (heap.py); not after a windowed extend:
        # its client kept at most `window` parts unacknowledged, so the pieces it freed are a few parts' worth, and
        # the next extend reuses them warm (a trim made each fixed 302 MB extend fault them in again: server CPU
        # per PUT 225-277 -> 192-220 ms without it, peak PSS unchanged, 3 interleaved pairs)
        if req.window is None:
            release_after(total)
    if k != req.parts or filled != req.rows:
        raise SchemaError(f"an extend in parts ended after {k} of {req.parts} parts ({filled} of "
                          f"{req.rows} rows); nothing stored")


def parts_stream(data: pa.RecordBatch, meta: pa.Buffer | None, limit: int) -> flight.FlightDataStream:
    """A sample as record batches of at most `limit` bytes (zero-copy slices), `meta` on the first."""
    from .wire import WIRE_OPTIONS

    ranges = split_rows(data, limit)

    def gen() -> Iterator[pa.RecordBatch | tuple[pa.RecordBatch, pa.Buffer]]:
        for k, (offset, rows) in enumerate(ranges):
            piece = data.slice(offset, rows)
            yield (piece, meta) if k == 0 and meta is not None else piece

    return flight.GeneratorStream(data.schema, gen(), WIRE_OPTIONS)


#: A sample the server streams in parts from a store that gathers it in pieces (`ExperienceStore.sample_pieces`) is
#: gathered about this many bytes at a time, so the server holds one or two pieces of its output (the one being cut
#: into messages, and the last one gRPC may still be sending) instead of the whole sample.
SAMPLE_PIECE_BYTES = 16 << 20
#: Items of the first piece (its bytes per item size the rest).
FIRST_PIECE_ROWS = 64


def pieces_stream(store: PieceSampler, n: int, columns: list[str] | None, timeout: float | None,
                  options: dict[str, Any], meta: pa.Buffer | None, limit: int) -> flight.FlightDataStream:
    """A sample of `n` items from `store` sent in messages of at most `limit` bytes (ids and weights as trailing
    columns: `wire_batch(..., "columns")`), gathered piece by piece as the stream is read (`store.sample_pieces`):
    the server holds about `SAMPLE_PIECE_BYTES` of the sample's output instead of all of it. The items are selected
    and the first piece gathered here, so errors of the selection (a timeout, bad options) are raised before the
    stream starts; `meta` rides on the first message. A sample that fits one message (by the first piece's bytes
    per item) goes as one: the first piece and the rest, joined (at most `limit` bytes copied)."""
    from .wire import WIRE_OPTIONS, one_batch_stream, wire_batch

    pieces = store.sample_pieces(n, min(n, FIRST_PIECE_ROWS), columns, timeout, piece_bytes=SAMPLE_PIECE_BYTES,
                                 **options)
    first, _ = wire_batch(next(pieces), "columns")
    schema = first.schema

    def conform(batch: pa.RecordBatch) -> pa.RecordBatch:
        return batch if batch.schema.equals(schema) else batch.cast(schema)

    if first.num_rows < n and first.nbytes * n <= limit * first.num_rows:  # small: the rest is one more piece
        rest = [conform(wire_batch(p, "columns")[0]) for p in pieces]
        first = pa.concat_batches([first, *rest]) if sum(b.nbytes for b in rest) + first.nbytes <= limit else first
        if first.num_rows < n:  # the estimate was short: send what came, in parts
            head = [first, *rest]
            return flight.GeneratorStream(schema, _messages(iter(head), meta, limit), WIRE_OPTIONS)
    if first.num_rows == n and first.nbytes <= limit:
        for _ in pieces:  # none left: the sampler's on_sampled runs at the end
            pass
        return one_batch_stream(first, meta)

    def batches() -> Iterator[pa.RecordBatch]:
        yield first
        for piece in pieces:
            yield conform(wire_batch(piece, "columns")[0])

    return flight.GeneratorStream(schema, _messages(batches(), meta, limit), WIRE_OPTIONS)


def _messages(batches: Iterable[pa.RecordBatch], meta: pa.Buffer | None,
              limit: int) -> Iterator[pa.RecordBatch | tuple[pa.RecordBatch, pa.Buffer | None]]:
    """Each batch of `batches` as zero-copy slices of at most `limit` bytes, `meta` on the first; a batch is dropped
    before the next is asked for (gathered)."""
    sent_meta = meta is None
    for batch in batches:
        for offset, rows in split_rows(batch, limit):
            piece = batch.slice(offset, rows)
            yield piece if sent_meta else (piece, meta)
            sent_meta = True
        del batch


def assemble(reader: flight.FlightStreamReader, rows: int, empty: Empty = _fresh,
             at_least: AtLeast = _fresh_at_least) -> tuple[pa.RecordBatch, pa.Buffer | None]:
    """Read a sample's messages from a DoGet `reader` into one batch (at most `rows` rows, the app_metadata of the
    first message): one message is returned as it is; more are copied into one preallocated batch as they arrive
    (its fixed-width columns allocated by `empty`, its list columns of numbers into values arrays allocated by
    `at_least`, see `PartsAssembler`): the sample is held once, plus about one message.

    Raises:
        SchemaError: the stream brought more than `rows` rows, or no batch.
    """
    first = reader.read_chunk()
    meta = first.app_metadata
    try:
        second = reader.read_chunk()
    except StopIteration:
        return first.data, meta
    if first.data is None or second.data is None:
        raise SchemaError("a sample in parts: a message without a batch")
    asm = PartsAssembler(first.data.schema, rows, empty, at_least)
    size = first.data.nbytes + second.data.nbytes
    for chunk in (first, second):
        _add_checked(asm, chunk.data, rows)
    del first, second, chunk
    try:
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                break
            if chunk.data is None:
                raise SchemaError("a sample in parts: a message without a batch")
            _add_checked(asm, chunk.data, rows)
            size += chunk.data.nbytes
            del chunk
    finally:
        release_after(size)  # the messages' heap pieces back to the OS once, when the stream ends (heap.py)
    return asm.batch(), meta


def _add_checked(asm: PartsAssembler, part: pa.RecordBatch, rows: int) -> None:
    if asm.filled + part.num_rows > rows:
        raise SchemaError(f"a sample in parts brought more than the {rows} rows asked for")
    asm.add(part)


__all__ = ["FIRST_PIECE_ROWS", "MAX_PART_BYTES", "PART_FILL", "PIPELINE_PART_BYTES", "PUT_WINDOW_PARTS",
           "RAGGED_HEADROOM",
           "SAMPLE_PIECE_BYTES", "PartsAssembler", "assemble", "part_bytes", "parts_stream", "pieces_stream",
           "pipelined", "receive", "receive_into", "split_rows"]
