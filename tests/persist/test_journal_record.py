"""A journal record's bytes (arrowbuf.persist.record): the template encoder writes exactly what pyarrow's own
serializer writes for the same record (the on-disk format is unchanged), for any kind, meta width and payload size,
and for payloads given as a table's IPC stream in pieces; pyarrow reads the records back."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arrowbuf.persist import journal as jr
from arrowbuf.persist import record as rc


def joined(pieces):
    return b"".join(bytes(memoryview(p).cast("B")) for p in pieces)


def pyarrow_bytes(kind, meta_b, payload, lsn, prev):
    """The record as pyarrow serializes it (the reference), sealed as the journal seals it."""
    slow = rc._prepare_slow(kind.encode(), meta_b, [memoryview(payload)], len(payload))
    return joined(rc.seal(slow, lsn, prev)[0])


def test_templates_in_use():
    assert rc._TEMPLATES.ok  # this pyarrow's layout is the one the templates understand: no copy of payloads


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(["batch", "consumed", "x", "policy_version", "end", "a" * 17]),
       width=st.integers(0, 140), size=st.one_of(st.integers(0, 70), st.integers(0, 300_000)),
       lsn=st.integers(0, 2 ** 62), prev=st.integers(0, 2 ** 32 - 1), split=st.integers(0, 4))
def test_template_bytes_are_pyarrows(kind, width, size, lsn, prev, split):
    payload = os.urandom(size)
    meta = {"first": lsn, "n": size}
    m = rc.json.dumps(meta, separators=(",", ":")).encode()
    cuts = sorted({0, size, *(size * i // (split + 1) for i in range(1, split + 1))})
    pieces = [payload[a:b] for a, b in zip(cuts, cuts[1:])] if split else payload
    p = rc.prepare(kind, {"first": 0}, pieces, meta_width=max(width, len(m)))
    got = joined(rc.seal(p, lsn, prev, meta)[0])
    assert len(got) == p.size
    assert got == pyarrow_bytes(kind, m.ljust(max(width, len(m))), payload, lsn, prev)
    batch = pa.ipc.read_record_batch(pa.ipc.read_message(pa.py_buffer(got)), jr.RECORD_SCHEMA)
    assert batch.column("payload")[0].as_py() == payload
    assert batch.column("lsn")[0].as_py() == lsn and batch.column("prev")[0].as_py() == prev
    assert rc.record_crc(memoryview(got), 0, len(got)) == batch.column("crc32")[0].as_py()


def test_table_pieces_are_the_stream():
    t = pa.table({"a": pa.array(np.arange(10)), "r": pa.array([[1, 2], [], [3]] * 3 + [None], pa.list_(pa.int32())),
                  "f": pa.array(np.ones(10, np.float32))})
    sliced = t.slice(3, 5)  # ragged columns with a non-zero offset
    for table in (t, sliced, t.to_batches()[0]):
        assert joined(rc.table_pieces(table)) == rc.table_bytes(table).to_pybytes()
        assert rc.payload_table(joined(rc.table_pieces(table))).equals(pa.table(table) if isinstance(
            table, pa.RecordBatch) else table)
    # a schema that differs only in metadata is serialized with its own metadata (the cache compares it)
    meta = t.replace_schema_metadata({"k": "v"})
    assert rc.payload_table(joined(rc.table_pieces(meta))).schema.metadata == {b"k": b"v"}
    assert rc.payload_table(joined(rc.table_pieces(t))).schema.metadata is None


def test_large_table_pieces_are_the_stream_without_a_copy():
    """A table of `ZERO_COPY_MIN` bytes or more: the same bytes, its body pieces the columns' own buffers."""
    obs = np.random.default_rng(0).integers(0, 255, (40, 64, 64), dtype=np.uint8)
    t = pa.table({"obs": pa.FixedSizeListArray.from_arrays(pa.array(obs.reshape(-1)), 64 * 64),
                  "r": pa.array([[1, 2], [], [3]] * 13 + [None], pa.list_(pa.int32()))})
    assert t.nbytes < rc.ZERO_COPY_MIN
    big = pa.concat_tables([t] * 8)
    assert big.nbytes >= rc.ZERO_COPY_MIN
    for table in (big, big.combine_chunks(), big.combine_chunks().slice(7, 200)):
        pieces = rc.table_pieces(table)
        assert joined(pieces) == rc.table_bytes(table).to_pybytes()
        assert rc.payload_table(joined(pieces)).equals(table)
    one = big.combine_chunks()
    addr = one.column("obs").chunk(0).values.buffers()[1].address
    assert any(isinstance(p, pa.Buffer) and p.address == addr for p in rc.table_pieces(one))  # not copied


def test_oversized_payload_refused_before_copying():
    big = pa.allocate_buffer(1 << 20)
    with pytest.raises(Exception, match="at most 2 GiB"):
        rc.prepare("batch", {}, [big] * 2049)


def test_segment_of_piece_records_reads_back(tmp_path):
    j = jr.Journal(str(tmp_path), "os")
    t = pa.table({"x": pa.array([[1, 2, 3], [4]], pa.list_(pa.int32()))})
    for i in range(5):
        j.append("batch", {"first": 2 * i, "n": 2}, rc.table_pieces(t))
    j.append("consumed", {"task": "t"}, np.arange(3, dtype=np.int64).tobytes())
    j.close()
    recs, torn, nxt = jr.read_segments(str(tmp_path), 0)
    assert torn is None and nxt == 6 and [r.kind for r in recs] == ["batch"] * 5 + ["consumed"]
    assert all(jr.payload_table(r.payload).equals(t) for r in recs[:5])
    for _, path in jr.segments(str(tmp_path)):  # pyarrow reads a segment like any Arrow stream
        assert pa.ipc.open_stream(path).read_all().num_rows == 6
