"""An extend in parts over Flight (protocol 3, issue 28): a batch over the server's max_batch_bytes goes in one
`extend` call, is committed as one extend (every row or none, consecutive ids), and a hostile or broken stream of
parts stores nothing. Real servers on port 0."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.flight import protocol as P
from arrowbuf.flight.parts import PartsAssembler, split_rows

SCHEMA = {"name": "big", "fields": {
    "obs": {"dtype": "float32", "shape": [64, 4]},
    "toks": {"dtype": "int32", "ragged": True},
    "r": {"dtype": "float32", "later": True},
    "done": {"dtype": "bool"}}}
MIB = 1 << 20


def _batch(n: int, seed: int = 0, start: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    i = np.arange(start, start + n)
    return {"obs": rng.standard_normal((n, 64, 4), dtype=np.float32),
            "toks": [np.full(int(k) % 300, int(k), np.int32) for k in i], "done": np.ones(n, bool),
            "r": np.ma.masked_array(i.astype(np.float32), mask=i % 3 == 0)}


def _stored(store) -> dict:
    t = store.to_table()
    obs = t.column("obs").combine_chunks().storage.flatten().to_numpy().reshape(-1, 64, 4)
    return {"obs": obs, "toks": t.column("toks").to_pylist(), "r": t.column("r").to_pylist()}


def _detail(exc: flight.FlightError) -> dict:
    return json.loads(exc.extra_info)


def test_a_batch_over_max_batch_bytes_goes_in_one_extend_and_lands_whole(servers):
    store = ab.ExperienceStore(SCHEMA, capacity=8192)
    server = servers(store, max_batch_bytes=MIB)
    remote = ab.connect(server.location)
    try:
        assert remote.max_batch_bytes == MIB and P.PARTS_VERSION in remote.protocols
        batch = _batch(3000)
        rb = remote.to_batch(batch)
        assert rb.nbytes > 3 * MIB  # several parts
        ids = remote.extend(batch)
        np.testing.assert_array_equal(ids, np.arange(3000))
        got = _stored(store)
        np.testing.assert_array_equal(got["obs"], batch["obs"])
        assert got["toks"] == [list(x) for x in batch["toks"]]
        assert got["r"] == [None if m else float(v) for v, m in zip(batch["r"].data, batch["r"].mask)]
        ids2 = remote.extend(_batch(10, start=3000))  # a small batch still goes as one message
        np.testing.assert_array_equal(ids2, np.arange(3000, 3010))
    finally:
        remote.close()


def _raw_put(server, parts: list[pa.RecordBatch], declared_parts: int, rows: int, schema: pa.Schema,
             v: int = 3) -> None:
    client = flight.FlightClient(server.location)
    cmd = {"v": v, "kind": "extend", "parts": declared_parts, "rows": rows}
    try:
        writer, reader = client.do_put(flight.FlightDescriptor.for_command(json.dumps(cmd).encode()), schema,
                                       options=flight.FlightCallOptions(timeout=30))
        try:
            for p in parts:
                writer.write_batch(p)
            writer.done_writing()
            reader.read()
        finally:
            writer.close()
    finally:
        client.close()


@pytest.mark.parametrize("case", ["short", "extra part", "too many rows", "too few rows", "empty part", "v2",
                                  "over max_extend_bytes", "part over max_batch_bytes", "parts > rows"])
def test_a_broken_or_hostile_stream_of_parts_stores_nothing(servers, case):
    store = ab.ExperienceStore(SCHEMA, capacity=8192)
    server = servers(store, max_batch_bytes=MIB, max_extend_bytes=2 * MIB)
    remote = ab.connect(server.location)
    try:
        rb = remote.to_batch(_batch(400))
        ranges = split_rows(rb, MIB // 4)
        parts = [rb.slice(o, n) for o, n in ranges]
        assert len(parts) >= 3
        declared, rows, v = len(parts), rb.num_rows, 3
        if case == "short":
            parts = parts[:-1]
        elif case == "extra part":
            declared -= 1
        elif case == "too many rows":
            rows -= 1
        elif case == "too few rows":
            rows += 1
        elif case == "empty part":
            parts.insert(1, rb.slice(0, 0))
            declared += 1
        elif case == "v2":
            v = 2
        elif case == "over max_extend_bytes":
            big = remote.to_batch(_batch(2000))
            parts = [big.slice(o, n) for o, n in split_rows(big, MIB // 2)]
            declared, rows = len(parts), big.num_rows
        elif case == "part over max_batch_bytes":
            big = remote.to_batch(_batch(1000))
            assert big.nbytes > MIB
            parts, declared, rows = [big], 1, big.num_rows
        elif case == "parts > rows":
            declared = rows + 1
        with pytest.raises(flight.FlightError) as info:
            _raw_put(server, parts, declared, rows, rb.schema, v)
        assert _detail(info.value)["code"] == "INVALID_ARGUMENT", _detail(info.value)
        assert len(store) == 0  # nothing stored
        np.testing.assert_array_equal(remote.extend(_batch(5)), np.arange(5))  # the server still takes extends
    finally:
        remote.close()


def test_a_server_without_parts_gets_a_clear_error_not_a_broken_stream(servers):
    store = ab.ExperienceStore(SCHEMA, capacity=8192)
    server = servers(store, max_batch_bytes=MIB)
    remote = ab.connect(server.location)
    try:
        remote.protocols = (1, 2)  # what the client learns from a server before protocol 3 (no "protocols")
        with pytest.raises(ab.SchemaError, match="protocol versions \\[1, 2\\].*in parts"):
            remote.extend(_batch(3000))
        assert len(store) == 0
    finally:
        remote.close()


def test_split_rows_bounds_every_part_and_refuses_a_row_too_large():
    rb = pa.RecordBatch.from_pydict({"x": pa.array([list(range(k)) for k in (1, 500, 3, 2000, 7, 7, 7)],
                                                   type=pa.list_(pa.int64()))})
    ranges = split_rows(rb, 20000)
    assert sum(n for _, n in ranges) == rb.num_rows and [o for o, _ in ranges] == list(
        np.cumsum([0] + [n for _, n in ranges])[:-1])
    assert all(rb.slice(o, n).nbytes <= 20000 for o, n in ranges) and len(ranges) >= 2
    with pytest.raises(ab.SchemaError, match="alone"):
        split_rows(rb, 10000)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.sets(st.integers(0, 300), max_size=20))
def test_assembled_parts_equal_the_batch(cuts, null_rows):
    """Fixed-width columns are assembled into preallocated arrays; nulls in a later part switch a column to pieces;
    ragged columns are concatenated: the result equals the batch cut into those parts."""
    n = sum(cuts)
    rng = np.random.default_rng(n)
    mask = np.array([i in null_rows for i in range(n)])
    rb = pa.RecordBatch.from_pydict({
        "t": pa.FixedShapeTensorArray.from_numpy_ndarray(rng.standard_normal((n, 2, 3)).astype(np.float32)),
        "x": pa.array(rng.integers(0, 9, n), mask=mask if mask.any() else None),
        "l": pa.array([list(range(int(k) % 5)) for k in range(n)], type=pa.list_(pa.int32())),
        "b": pa.array(rng.random(n) < 0.5)})
    asm = PartsAssembler(rb.schema, n)
    offset = 0
    for c in cuts:
        asm.add(rb.slice(offset, c))
        offset += c
    assert asm.batch().equals(rb)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "kind", "store", "timeout", "parts", "rows", "x"]),
                       st.one_of(st.integers(-3, 10**6), st.text(max_size=5), st.none(), st.booleans()),
                       max_size=7))
def test_fuzzed_put_commands_decode_or_are_refused_cleanly(obj):
    desc = flight.FlightDescriptor.for_command(json.dumps(obj).encode())
    try:
        req = P.decode_put_descriptor(desc)
    except ab.SchemaError:
        return
    if req.parts is not None:
        assert obj.get("v") == 3 and 1 <= req.parts <= req.rows


# ------------------------------------------------------------------------------------------------ samples in parts
def _sample_ticket(n: int, **extra) -> flight.Ticket:
    return flight.Ticket(json.dumps({"v": 1, "kind": "sample", "n": n, **extra}).encode())


def test_a_large_sample_comes_in_bounded_messages_and_is_assembled_whole(servers):
    store = ab.ExperienceStore(SCHEMA, capacity=8192, seed=0)
    batch = _batch(3000)
    store.extend(batch)
    server = servers(store)
    remote = ab.connect(server.location)
    client = flight.FlightClient(server.location)
    try:
        # on the wire: a version-3 ticket with part_bytes gets several batches, each within it
        got = list(client.do_get(_sample_ticket(2000, v=3, part_bytes=P.MIN_PART_BYTES)))
        assert len(got) >= 3 and all(c.data.nbytes <= P.MIN_PART_BYTES for c in got)
        assert sum(c.data.num_rows for c in got) == 2000
        # a ticket without it (any older client) gets one message, as before
        assert len(list(client.do_get(_sample_ticket(2000)))) == 1
        remote.part_bytes = P.MIN_PART_BYTES
        for form in ("columns", "json"):
            remote.sample_meta = form
            b = remote.sample(2000)
            assert len(b) == 2000
            d = b.to_numpy()
            np.testing.assert_array_equal(d["obs"], batch["obs"][b.indices])
            assert [list(x) for x in d["toks"]] == [list(batch["toks"][i]) for i in b.indices]
            assert d["obs"].flags.writeable  # the assembled batch is the batch's own memory
    finally:
        client.close()
        remote.close()


def test_samples_in_parts_reuse_a_dropped_batch_and_never_overwrite_a_kept_one(servers):
    store = ab.ExperienceStore(SCHEMA, capacity=8192, seed=0)
    batch = _batch(3000)
    store.extend(batch)
    server = servers(store)
    remote = ab.connect(server.location)
    try:
        remote.part_bytes = P.MIN_PART_BYTES  # every sample of 2000 rows comes in several messages
        kept = remote.sample(2000)
        kept_obs = kept.to_numpy()["obs"]
        want = batch["obs"][kept.indices].copy()
        address = None
        for _ in range(4):  # the kept batch keeps its memory; dropped ones hand theirs to the next sample
            b = remote.sample(2000)
            obs = b.to_numpy()["obs"]
            np.testing.assert_array_equal(obs, batch["obs"][b.indices])
            assert not np.shares_memory(obs, kept_obs)
            if address is not None:
                assert obs.ctypes.data == address  # warm memory, no fresh pages per sample
            address = obs.ctypes.data
            del b, obs
        np.testing.assert_array_equal(kept_obs, want)
    finally:
        remote.close()


@pytest.mark.parametrize("extra", [{"v": 3, "part_bytes": 1024}, {"v": 2, "part_bytes": 1 << 20},
                                   {"v": 3, "part_bytes": -1}, {"v": 3, "part_bytes": "x"}])
def test_bad_part_bytes_in_a_ticket_is_refused(servers, extra):
    store = ab.ExperienceStore(SCHEMA, capacity=64)
    store.extend(_batch(10))
    server = servers(store)
    client = flight.FlightClient(server.location)
    try:
        with pytest.raises(flight.FlightError) as info:
            client.do_get(_sample_ticket(5, **extra)).read_all()
        assert _detail(info.value)["code"] == "INVALID_ARGUMENT"
    finally:
        client.close()


class _TwoBatches(flight.FlightServerBase):
    """A server that answers any DoGet with 10 rows in two batches (what a hostile or buggy server might send)."""

    def do_get(self, context, ticket):
        rb = pa.RecordBatch.from_pydict({"x": np.arange(10)})
        return flight.GeneratorStream(rb.schema, iter([rb.slice(0, 5), rb.slice(5, 5)]))


def test_assemble_refuses_more_rows_than_asked():
    """A client bounds what a server may send it: more rows than it asked for fail."""
    from arrowbuf.flight.parts import assemble

    server = _TwoBatches("grpc://127.0.0.1:0")
    client = flight.FlightClient(f"grpc://127.0.0.1:{server.port}")
    try:
        data, _ = assemble(client.do_get(flight.Ticket(b"x")), 10)
        assert data.equals(pa.RecordBatch.from_pydict({"x": np.arange(10)}))
        with pytest.raises(ab.SchemaError, match="more than the 8 rows"):
            assemble(client.do_get(flight.Ticket(b"x")), 8)
    finally:
        client.close()
        server.shutdown()
