"""A windowed extend in parts (protocol 3, `"window": W` in the DoPut command): the server acknowledges each part
once it is added (`{"v":3,"received":k}`), then commits and answers as before; `RemoteStore.extend` keeps at most
`parts.PUT_WINDOW_PARTS` parts unacknowledged, so the server never buffers more than that ahead of its copy (gRPC
otherwise reads ahead of a server that copies slower than parts arrive). Real servers on port 0."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.flight import client as C
from arrowbuf.flight import protocol as P
from arrowbuf.flight.parts import split_rows

SCHEMA = {"name": "w", "fields": {"obs": {"dtype": "float32", "shape": [256]}, "done": {"dtype": "bool"}}}


def _batch(n: int, start: int = 0) -> dict:
    return {"obs": np.repeat(np.arange(start, start + n, dtype=np.float32)[:, None], 256, axis=1),
            "done": np.ones(n, bool)}


@pytest.mark.parametrize("into_ring", [True, False])
def test_the_server_acknowledges_each_part_in_lock_step(servers, into_ring):
    """With window 1 a client may send part k+1 only after the progress of part k: the server answers each part
    as it is added, then the final acknowledgement; the rows are one extend."""
    store = ab.ExperienceStore(SCHEMA, capacity=1000)
    server = servers(store, parts_into_ring=into_ring)
    remote = ab.connect(server.location)
    rb = remote.to_batch(_batch(600))
    remote.close()
    ranges = split_rows(rb, 64 << 10)
    assert len(ranges) > 3
    desc = P.put_descriptor(None, parts=len(ranges), rows=rb.num_rows, window=1)
    with flight.FlightClient(server.location) as client:
        writer, reader = client.do_put(desc, rb.schema)
        for k, (offset, rows) in enumerate(ranges):
            writer.write_batch(rb.slice(offset, rows))
            assert P.decode_progress(reader.read()) == k + 1  # before the next part is sent
        ack = P.decode_ack(reader.read())
        writer.done_writing()
        writer.close()
    assert (ack["first_seq"], ack["rows"]) == (0, 600) and len(store) == 600
    np.testing.assert_array_equal(store.to_table().column("obs").combine_chunks().storage.flatten()
                                  .to_numpy()[::256], np.arange(600, dtype=np.float32))


def test_a_client_extends_with_a_window_and_gets_the_same_rows(servers, monkeypatch):
    monkeypatch.setattr(C, "PUT_WINDOW_PARTS", 2)
    store = ab.ExperienceStore(SCHEMA, capacity=4000)
    server = servers(store, max_batch_bytes=256 << 10)
    remote = ab.connect(server.location)
    try:
        assert remote.put_window
        sent = []
        real = P.put_descriptor

        def spy(*args, **kw):
            sent.append(kw.get("window"))
            return real(*args, **kw)

        monkeypatch.setattr(P, "put_descriptor", spy)
        ids = remote.extend(_batch(3000))
        assert sent == [2]  # many parts: windowed
        np.testing.assert_array_equal(ids, np.arange(3000))
        assert len(store) == 3000
    finally:
        remote.close()


@settings(max_examples=80, deadline=None)
@given(st.one_of(st.integers(-3, 2000), st.text(max_size=4), st.none(), st.booleans(), st.floats()),
       st.booleans())
def test_fuzzed_windows_decode_or_are_refused_cleanly(window, parts):
    obj = {"v": 3, "kind": "extend", "window": window}
    if parts:
        obj.update(parts=3, rows=10)
    try:
        req = P.decode_put_descriptor(flight.FlightDescriptor.for_command(json.dumps(obj).encode()))
    except ab.SchemaError:
        return
    assert req.window is None or (parts and 1 <= req.window <= P.MAX_PUT_WINDOW)


@pytest.mark.parametrize("raw", [b'{"v":3,"received":0}', b'{"v":3,"received":9}', b'{"v":3,"received":"x"}',
                                 b'{"v":1,"batch":0,"first_seq":0,"rows":5}', None])
def test_a_client_refuses_progress_that_does_not_move_forward_within_the_parts(raw):
    with pytest.raises(ab.SchemaError):
        C._progress(pa.py_buffer(raw) if raw else None, 2, 5)
    assert C._progress(pa.py_buffer(b'{"v":3,"received":3}'), 2, 5) == 3


@pytest.mark.parametrize("window", [None, 2])
def test_only_an_unwindowed_extend_in_parts_trims_the_heap_at_its_end(servers, monkeypatch, window):
    """An extend in parts without a window may have had many parts buffered by gRPC: their freed heap goes back to
    the OS at the end (`heap.release_after`). A windowed one had at most `window` parts in flight: what it freed is
    kept for the next extend to reuse warm (no trim)."""
    from arrowbuf.flight import parts

    trims: list[int] = []
    monkeypatch.setattr(parts, "release_after", trims.append)
    store = ab.ExperienceStore(SCHEMA, capacity=1000)
    server = servers(store)
    rb = ab.connect(server.location).to_batch(_batch(600))
    ranges = split_rows(rb, 64 << 10)
    desc = P.put_descriptor(None, parts=len(ranges), rows=rb.num_rows, window=window)
    with flight.FlightClient(server.location) as client:
        writer, reader = client.do_put(desc, rb.schema)
        for k, (offset, rows) in enumerate(ranges):
            writer.write_batch(rb.slice(offset, rows))
            if window is not None and k + 1 >= window:
                assert P.decode_progress(reader.read()) == k + 2 - window
        ack = reader.read()
        while window is not None and P.decode_progress(ack) is not None:
            ack = reader.read()
        writer.done_writing()
        writer.close()
    assert P.decode_ack(ack)["rows"] == 600 and len(store) == 600
    assert len(trims) == (0 if window is not None else 1)
