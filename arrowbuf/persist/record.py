"""One journal record's bytes (docs/format.md): an encapsulated Arrow IPC record-batch message of the journal's
record schema (lsn, kind, meta, payload, prev, crc32), encoded without copying its payload.

`prepare(kind, meta, payload)` builds a record but for its lsn, prev and (optionally) meta: the IPC header comes
from a per-(kind, meta width) template whose size-dependent fields (the payload's length, the offsets of the
buffers after it, the body's length) are patched with integer writes, and the payload stays a list of the
caller's buffers (`table_pieces`: a table's IPC stream as its schema message, its record batches' messages and the
end-of-stream marker, no stream writer, no joined copy). `seal` places it: the pieces for one `writev`, and the
record's crc32. The bytes written are exactly what `pyarrow.RecordBatch.serialize` of the same one-row batch gives
(checked at import against pyarrow for several payload sizes; if this pyarrow lays messages out differently the
template is not used and every record is serialized by pyarrow, as before: same bytes, one more copy).

The payload's pieces are read when the record is sealed and written: they must not change until then (the
journal writes a record before the call that appended it returns).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ..errors import InvalidArgument
from .crc import crc32

#: The journal format version (docs/format.md), in the segment schema's metadata.
FORMAT_VERSION = 2
_FIELDS = [("lsn", pa.int64()), ("kind", pa.string()), ("meta", pa.string()), ("payload", pa.binary()),
           ("prev", pa.uint32()), ("crc32", pa.uint32())]
RECORD_SCHEMA = pa.schema(_FIELDS, metadata={"arrowbuf.journal": str(FORMAT_VERSION)})
SCHEMA_BYTES = RECORD_SCHEMA.serialize().to_pybytes()
SCHEMA_CRC = crc32(SCHEMA_BYTES) & 0xFFFFFFFF
V1_SCHEMA_BYTES = pa.schema(_FIELDS).serialize().to_pybytes()  # version 1 (no metadata): refused
U32 = struct.Struct("<I")
ZERO4 = b"\0\0\0\0"
OFFS = struct.Struct("<ii")
_I64 = struct.Struct("<q")
_EOS = b"\xff\xff\xff\xff\0\0\0\0"
_ZEROS = bytes(8)
#: A record's payload is at most this many bytes (its binary column's int32 offsets).
MAX_PAYLOAD = (1 << 31) - 1


def pad8(n: int) -> int:
    return (n + 7) & ~7


@dataclass
class Prepared:
    """A record encoded but for its lsn, prev and (optionally) its meta (`prepare`, outside every lock); `seal`
    places it. The payload is checksummed already (not copied: `pieces` are the caller's buffers)."""

    head: Any      # the message's bytes before the payload: framing, metadata, lsn, kind, meta, payload offsets
    lsn_at: int    # the lsn's 8 bytes in `head` (the body's first buffer)
    meta_at: int   # the meta string's bytes in `head` (`meta_w` of them: JSON padded with spaces)
    meta_w: int
    pieces: list[Any]  # the payload's bytes and their padding to 8 (the message's bytes up to the prev slot)
    size: int      # the whole message's bytes
    crc: int       # CRC-32 of `pieces`


def _payload_pieces(payload: Any) -> tuple[list[Any], int]:
    """`payload` (bytes-like, a `pa.Buffer`, or a list of them: `table_pieces`) as a list of buffers, and its
    size."""
    parts = payload if isinstance(payload, list) else [payload]
    out = [p if isinstance(p, pa.Buffer) else memoryview(p).cast("B") for p in parts]
    return out, sum(p.size if isinstance(p, pa.Buffer) else len(p) for p in out)


def prepare(kind: str, meta: dict[str, Any], payload: Any = b"", meta_width: int = 0) -> Prepared:
    """Encode a record (an encapsulated Arrow IPC record-batch message) with lsn and prev left for `seal` (and its
    meta, when `meta_width` reserves room for a meta `seal` gets: JSON padded with spaces to that width).
    `payload`: bytes-like, or a list of buffers written one after the other (`table_pieces`)."""
    m = json.dumps(meta, separators=(",", ":")).encode()
    w = max(len(m), meta_width)
    pieces, size = _payload_pieces(payload)
    if size > MAX_PAYLOAD:
        raise InvalidArgument(f"a journal record holds at most 2 GiB; this one has {size} bytes: write smaller "
                              "batches")
    k = kind.encode()
    head = _TEMPLATES.head(k, w, size) if _TEMPLATES.ok else None
    if head is None:
        return _prepare_slow(k, m.ljust(w), pieces, size)
    lsn_at = 8 + int.from_bytes(head[4:8], "little")
    meta_at = lsn_at + 8 + 8 + pad8(len(k)) + 8
    head[meta_at:meta_at + w] = m.ljust(w)
    tail = _ZEROS[:pad8(size) - size]
    if tail:
        pieces.append(tail)
    crc = 0
    for p in pieces:
        crc = crc32(p, crc)
    return Prepared(head, lsn_at, meta_at, w, pieces, len(head) + pad8(size) + 16, crc)


def _prepare_slow(k: bytes, m: bytes, pieces: list[Any], size: int) -> Prepared:
    """`prepare` through pyarrow's serializer (a copy of the payload): when the templates do not apply."""
    body = pieces[0] if len(pieces) == 1 and isinstance(pieces[0], pa.Buffer) else \
        pa.py_buffer(b"".join(bytes(p) for p in pieces))
    batch = pa.RecordBatch.from_arrays([_I64_0, _one(pa.string(), k), _one(pa.string(), m),
                                        _one(pa.binary(), body), _U32_0, _U32_0], schema=RECORD_SCHEMA)
    view = memoryview(batch.serialize()).cast("B")
    lsn_at = 8 + int.from_bytes(view[4:8], "little")
    meta_at = lsn_at + 8 + 8 + pad8(len(k)) + 8
    p0 = meta_at + pad8(len(m)) + 8
    return Prepared(bytearray(view[:p0]), lsn_at, meta_at, len(m), [view[p0:-16]], len(view), crc32(view[p0:-16]))


def meta_bytes(p: Prepared, meta: dict[str, Any]) -> bytes:
    """`meta` as the JSON `seal` writes in the width `p` reserved for it.

    Raises:
        InvalidArgument: it does not fit.
    """
    b = json.dumps(meta, separators=(",", ":")).encode()
    if len(b) > p.meta_w:
        raise InvalidArgument(f"a journal record's meta grew past the {p.meta_w} bytes prepared for it")
    return b.ljust(p.meta_w)


def seal(p: Prepared, lsn: int, prev: int, meta: dict[str, Any] | bytes | None = None) -> tuple[list[Any], int]:
    """The pieces of a prepared record at `lsn` after the record whose crc32 is `prev` (in order, for one `writev`),
    and its crc32: CRC-32 of the payload's bytes (from its data buffer to the prev slot), continued over the bytes
    before them (framing, metadata, lsn, kind, meta, payload offsets), then prev and its padding: every byte of the
    record but the crc32 slot's 8. `meta`: the record's meta now (it must fit the width `prepare` reserved), or
    `meta_bytes` of it."""
    h = p.head
    if meta is not None:
        h[p.meta_at:p.meta_at + p.meta_w] = meta if isinstance(meta, bytes) else meta_bytes(p, meta)
    _I64.pack_into(h, p.lsn_at, lsn)
    prev_b = U32.pack(prev) + ZERO4
    crc = crc32(prev_b, crc32(h, p.crc))
    return [h, *p.pieces, prev_b + U32.pack(crc) + ZERO4], crc


def encode(lsn: int, kind: str, meta: dict[str, Any], payload: Any = b"", prev: int = 0) -> bytes:
    """One whole record as bytes (tests, tools; the journal writes `prepare` + `seal` without joining)."""
    pieces, _ = seal(prepare(kind, meta, payload), lsn, prev)
    return b"".join(bytes(memoryview(x).cast("B")) for x in pieces)


def record_crc(view: memoryview, off: int, total: int) -> int:
    """The crc32 the record in bytes [off, off + total) of a segment should carry (`seal`); -1 when its layout
    cannot be a record's."""
    end = off + total
    lsn_at = off + 8 + int.from_bytes(view[off + 4:off + 8], "little")
    if lsn_at + 40 > end - 16:
        return -1
    k0, k1 = OFFS.unpack_from(view, lsn_at + 8)
    mo = lsn_at + 16 + pad8(k1)
    if k0 != 0 or k1 < 0 or mo + 8 > end - 16:
        return -1
    m0, m1 = OFFS.unpack_from(view, mo)
    p0 = mo + 8 + pad8(m1) + 8
    if m0 != 0 or m1 < 0 or p0 > end - 16:
        return -1
    crc = crc32(view[off:p0], crc32(view[p0:end - 16]))
    return crc32(view[end - 16:end - 8], crc) & 0xFFFFFFFF


def _one(type_: pa.DataType, value: Any) -> pa.Array:
    """A one-value string or binary array over `value`'s bytes (zero-copy; pa.array costs ~10 us)."""
    data = value if isinstance(value, pa.Buffer) else pa.py_buffer(value)
    return pa.Array.from_buffers(type_, 1, [None, pa.py_buffer(OFFS.pack(0, data.size)), data])


_I64_0 = pa.array([0], pa.int64())
_U32_0 = pa.array([0], pa.uint32())


def _serialized(k: bytes, m: bytes, size: int) -> bytes:
    """pyarrow's own bytes of a record (lsn 0, prev 0, crc32 0) with a payload of `size` zero bytes."""
    batch = pa.RecordBatch.from_arrays([_I64_0, _one(pa.string(), k), _one(pa.string(), m),
                                        _one(pa.binary(), bytes(size)), _U32_0, _U32_0], schema=RECORD_SCHEMA)
    return batch.serialize().to_pybytes()


class _Templates:
    """Per (kind, meta width): a record's header bytes for a payload of 8 bytes, and where its payload-size
    dependent 64-bit fields are (found by comparing pyarrow's messages for payloads of 8, 9 and 16 bytes: a field
    that grows by 1 from 8 to 9 is the payload's length, one that grows by 8 a later buffer's offset or the body's
    length). `head(k, w, size)` patches a copy for `size`; None when the layout is not the one understood."""

    def __init__(self) -> None:
        self._cache: dict[tuple[bytes, int], tuple[bytes, list[tuple[int, int]], list[tuple[int, int]]] | None] = {}
        self.ok = True

    def _learn(self, k: bytes, w: int) -> tuple[bytes, list[tuple[int, int]], list[tuple[int, int]]] | None:
        m = b" " * w
        a, b, c = (_serialized(k, m, s) for s in (8, 9, 16))
        mlen = int.from_bytes(a[4:8], "little")
        if len(b) != len(c) or len(a) + 8 != len(c) or a[:8] != b[:8] or a[:8] != c[:8]:
            return None
        exact: list[tuple[int, int]] = []   # (position, value at size 0): value = base + size
        padded: list[tuple[int, int]] = []  # value = base + pad8(size)
        for pos in range(8, 8 + mlen - 7):
            va, vb, vc = (_I64.unpack_from(x, pos)[0] for x in (a, b, c))
            if va == vb == vc:
                continue
            if pos % 8:
                continue  # a byte of an aligned field (the fields found below cover it)
            if vb - va == 1 and vc - va == 8:
                exact.append((pos, va - 8))
            elif vb - va == 8 and vc - va == 8:
                padded.append((pos, va - 8))
            else:
                return None
        head = a[:8 + mlen]
        p0 = 8 + mlen + 8 + 8 + pad8(len(k)) + 8 + pad8(w) + 8  # lsn, kind offsets and bytes, meta's, payload's
        for s in (0, 1, 7, 8, 9, 100, 4095, 65537):  # the patched header is pyarrow's, for every size class
            want = _serialized(k, m, s)
            got = self._patch(head, exact, padded, s)
            if bytes(got) != want[:8 + mlen] or want[8 + mlen:p0 - 4] != a[8 + mlen:p0 - 4] or \
                    want[p0 - 4:p0] != U32.pack(s) or len(want) != p0 + pad8(s) + 16:
                return None
        return a[:p0], exact, padded

    @staticmethod
    def _patch(head: bytes, exact: list[tuple[int, int]], padded: list[tuple[int, int]], size: int) -> bytearray:
        h = bytearray(head)
        for pos, base in exact:
            _I64.pack_into(h, pos, base + size)
        for pos, base in padded:
            _I64.pack_into(h, pos, base + pad8(size))
        return h

    def head(self, k: bytes, w: int, size: int) -> bytearray | None:
        """The bytes of a record's message before its payload (lsn 0, meta spaces) for a payload of `size`."""
        key = (k, w)
        if key in self._cache:
            t = self._cache[key]
        else:
            if len(self._cache) > 256:
                self._cache.clear()
            t = self._cache[key] = self._learn(k, w)
        if t is None:
            return None
        h = self._patch(t[0], t[1], t[2], size)
        U32.pack_into(h, len(h) - 4, size)  # the payload's end offset (int32)
        return h


_TEMPLATES = _Templates()
if _TEMPLATES.head(b"batch", 80, 3) is None:  # pragma: no cover - a pyarrow that lays messages out differently
    _TEMPLATES.ok = False


def _check_layout() -> None:
    """The body starts with lsn (8 bytes) and ends with prev (4 + 4 padding), crc32 (4 + 4): what `seal` and the
    reader rely on."""
    probe = pa.record_batch([pa.array([-2], pa.int64()), pa.array(["k"]), pa.array(["{}"]), pa.array([b"xyz"]),
                             pa.array([7], pa.uint32()), pa.array([9], pa.uint32())], schema=RECORD_SCHEMA)
    raw = probe.serialize().to_pybytes()
    lsn_at = 8 + int.from_bytes(raw[4:8], "little")
    meta_at = lsn_at + 8 + 8 + 8 + 8  # lsn, kind offsets, "k" padded to 8, meta offsets
    if raw[lsn_at:lsn_at + 8] != _I64.pack(-2) or raw[-16:] != U32.pack(7) + ZERO4 + U32.pack(9) + ZERO4 or \
            raw[meta_at:meta_at + 2] != b"{}" or raw[meta_at + 16:meta_at + 19] != b"xyz":
        raise ImportError("arrowbuf.persist.record: this pyarrow lays out IPC bodies differently than the journal "
                          "format expects")  # pragma: no cover


_check_layout()


def table_bytes(table: pa.Table | pa.RecordBatch) -> pa.Buffer:
    """A table as an Arrow IPC stream (a record's payload), in one buffer."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write(table)
    return sink.getvalue()


_SCHEMAS: list[tuple[pa.Schema, pa.Buffer]] = []  # newest first (hashing a schema costs more than comparing it)


#: A table of at least this many bytes is cut into pieces without a copy (`table_pieces`).
ZERO_COPY_MIN = 1 << 20


class _Pieces:
    """A write-only file for `pyarrow.PythonFile` that keeps what it is given: pyarrow hands a body buffer over as
    a `pa.Buffer` over the column's own memory (no copy), the framing and metadata as small `bytes`."""

    closed = False

    def __init__(self) -> None:
        self.parts: list[Any] = []

    def write(self, data: Any) -> int:
        self.parts.append(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def table_pieces(table: pa.Table | pa.RecordBatch) -> list[Any]:
    """A table as an Arrow IPC stream (a record's payload) in pieces: the schema's message (cached per schema),
    each record batch's message, the end-of-stream marker; the same bytes as `table_bytes`, one copy of the
    data (pyarrow's `serialize`, the GIL released) instead of a stream writer's and its Python calls. A table of
    `ZERO_COPY_MIN` bytes or more (frames: 7.2 MB a batch of 256) goes through a stream writer into `_Pieces`
    instead: its body pieces are the columns' own buffers, no copy (~15 us against ~200-900 us for 7.2 MB; the
    ~25 Python calls cost more than a copy of a small table). The pieces then hold the table's memory: the caller
    leaves it unchanged until the record is written (as for every payload)."""
    if table.get_total_buffer_size() >= ZERO_COPY_MIN:  # (`nbytes` walks slices: ~15 us for a GRPO batch)
        sink = _Pieces()
        with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), table.schema) as w:
            w.write(table)
        return sink.parts
    schema = table.schema
    head = next((h for known, h in _SCHEMAS if known.equals(schema, check_metadata=True)), None)
    if head is None:
        head = schema.serialize()
        _SCHEMAS.insert(0, (schema, head))
        del _SCHEMAS[8:]
    batches = table.to_batches() if isinstance(table, pa.Table) else [table]
    return [head, *(b.serialize() for b in batches), _EOS]


def payload_table(payload: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(payload)).read_all()


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's `sync_file_range` (Linux), or None where it is not available."""
    try:
        import ctypes
        import ctypes.util

        from ..tiers.libc import libc

        f = libc().sync_file_range
        f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        f.restype = ctypes.c_int
        return f
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None


_SYNC_FILE_RANGE = _libc_sync_file_range()


def start_writeback(fd: int) -> bool:
    """Start writing `fd`'s dirty pages to the disk and return at once (`sync_file_range(SYNC_FILE_RANGE_WRITE)`:
    no wait, no durability by itself): an `fdatasync` later then mostly waits for I/O already under way. False where
    the call is not available or fails (nothing is started; the later `fdatasync` does it all, as without it)."""
    if _SYNC_FILE_RANGE is None:
        return False
    return _SYNC_FILE_RANGE(fd, 0, 0, 2) == 0  # SYNC_FILE_RANGE_WRITE, the whole file (only dirty pages matter)
