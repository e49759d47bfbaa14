"""The per-call path of Flight sampling (issue 18): what the server puts on the wire and how it decodes tickets.

The fast paths (cached tensor types, cached sample tickets) must give exactly what the plain conversions give,
and every bound of a hostile ticket must hold on a cache hit as on a miss. Real servers on port 0.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.delivery.batch import SampleBatch
from arrowbuf.flight import protocol as P
from arrowbuf.flight import wire as W

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "schemas"


def mujoco_steps(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((n, 376), dtype=np.float32)
    term = np.zeros(n, bool)
    term[9::10] = True
    return {"obs": obs, "action": rng.standard_normal((n, 17), dtype=np.float32),
            "reward": rng.standard_normal(n, dtype=np.float32), "terminated": term, "truncated": np.zeros(n, bool),
            "next_obs": obs + 1}


# ---------------------------------------------------------------------------------------------------- wire batch
class TestWireBatch:
    @pytest.mark.parametrize("value", [
        np.arange(24, dtype=np.float32).reshape(4, 6),
        np.arange(48, dtype=np.uint8).reshape(4, 3, 4),
        np.arange(24, dtype=np.int64).reshape(4, 2, 3),
        np.arange(24, dtype=np.float64).reshape(4, 6)[:, ::2],            # not contiguous
        (np.arange(24) % 3 == 0).reshape(4, 6),                              # bool: bit-packed in Arrow
        np.zeros((0, 5), np.float32),                                        # empty
        np.arange(5, dtype=np.float32).reshape(1, 5),                        # one row
    ], ids=["f32", "u8-3d", "i64-3d", "strided", "bool", "empty", "one-row"])
    def test_tensor_column_equals_the_plain_conversion(self, value):
        got = W.wire_array(value)
        assert got.type == pa.fixed_shape_tensor(pa.from_numpy_dtype(value.dtype), value.shape[1:])
        assert len(got) == len(value)
        if len(value):  # from_numpy_ndarray refuses an empty array
            assert got.equals(pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(value)))
        flat = got.storage.flatten().to_numpy(zero_copy_only=False)
        assert np.array_equal(flat.reshape(value.shape), value)

    def test_the_same_layout_reuses_one_type(self):
        a = W.wire_array(np.zeros((3, 7), np.float32))
        b = W.wire_array(np.ones((5, 7), np.float32))
        assert a.type is b.type or a.type == b.type
        assert W.wire_array(np.zeros((3, 8), np.float32)).type != a.type

    def test_a_sample_goes_on_the_wire_as_its_record_batch(self):
        store = ab.ExperienceStore(SCHEMAS / "mujoco.yaml", capacity=256, seed=0)
        store.extend(mujoco_steps(100))
        batch = store.sample(32)
        data, meta = W.wire_batch(batch)
        assert data.equals(batch.data)
        assert data.schema == batch.data.schema
        indices, weights = P.decode_sample_meta(meta, 32)
        assert np.array_equal(indices, batch.indices) and weights is None

    def test_arrays_are_views_not_copies(self):
        value = np.arange(12, dtype=np.float32).reshape(3, 4)
        got = W.wire_array(value)
        assert got.storage.values.buffers()[1].address == value.__array_interface__["data"][0]


# ---------------------------------------------------------------------------------------------------- tickets
def sample_ticket(n: int = 4, **extra) -> bytes:
    return json.dumps({"v": 1, "kind": "sample", "n": n, **extra}).encode()


class TestTicketCache:
    def test_a_repeated_ticket_decodes_to_the_same_request(self):
        raw = sample_ticket(7, columns=["obs"], options={"n_step": 3, "gamma": 0.9})
        first = P.decode_ticket(raw)
        assert first == P.SampleRequest(7, None, ["obs"], None, {"n_step": 3, "gamma": 0.9})
        assert P.decode_ticket(raw) == first

    @pytest.mark.parametrize("raw", [
        sample_ticket(0), sample_ticket(-1), sample_ticket(2**63), sample_ticket(4, columns=[]),
        sample_ticket(4, timeout=-1), sample_ticket(4, options={"n_step": 0}), sample_ticket(4, typo=1),
        b"{not json", b'{"v": 9, "kind": "sample", "n": 4}',
    ])
    def test_a_bad_ticket_fails_every_time_and_is_never_kept(self, raw):
        for _ in range(3):
            with pytest.raises(ab.SchemaError):
                P.decode_ticket(raw)
        assert raw not in P._SAMPLE_TICKETS

    def test_the_cache_is_bounded_in_entries_and_ticket_size(self):
        for i in range(P.TICKET_CACHE_ENTRIES * 3):
            P.decode_ticket(sample_ticket(i + 1))
            assert len(P._SAMPLE_TICKETS) <= P.TICKET_CACHE_ENTRIES
        big = sample_ticket(3, columns=["c" * 1000, "d" * 1000])
        assert len(big) > P.TICKET_CACHE_BYTES
        assert P.decode_ticket(big).columns == ["c" * 1000, "d" * 1000]
        assert big not in P._SAMPLE_TICKETS

    def test_only_sample_tickets_are_kept(self):
        raw = json.dumps({"v": 1, "kind": "table"}).encode()
        assert isinstance(P.decode_ticket(raw), P.TableRequest)
        assert raw not in P._SAMPLE_TICKETS

    def test_server_bounds_hold_on_a_cache_hit(self, servers):
        """A ticket the cache holds is still checked against each server's own limits (max_batch_rows here)."""
        store = ab.ExperienceStore(SCHEMAS / "mujoco.yaml", capacity=256, seed=0)
        store.extend(mujoco_steps(50))
        roomy = servers(store, max_batch_rows=64)
        tight = servers(store, max_batch_rows=8)
        ticket = flight.Ticket(P.encode_ticket(P.SampleRequest(16)))
        with flight.FlightClient(roomy.location) as client:
            assert client.do_get(ticket).read_all().num_rows == 16
        with flight.FlightClient(tight.location) as client:
            with pytest.raises(flight.FlightError, match="max_batch_rows"):
                client.do_get(ticket).read_all()

    def test_a_shared_request_is_not_changed_by_sampling(self, servers):
        store = ab.ExperienceStore(SCHEMAS / "mujoco.yaml", capacity=256, seed=0)
        store.extend(mujoco_steps(50))
        server = servers(store)
        raw = P.encode_ticket(P.SampleRequest(4, None, ["reward", "obs"], None, {}))
        remote = ab.connect(server.location)
        try:
            for _ in range(3):
                batch = remote.sample(4, columns=["reward", "obs"])
                assert batch.columns == ["reward", "obs"]
            assert P.decode_ticket(raw).columns == ["reward", "obs"]
        finally:
            remote.close()


def test_sample_batch_round_trip_is_unchanged(servers):
    """remote.sample returns the columns, ids and arrays a local sample of the same rows holds."""
    store = ab.ExperienceStore(SCHEMAS / "mujoco.yaml", capacity=256, seed=0)
    steps = mujoco_steps(100)
    store.extend(steps)
    server = servers(store)
    remote = ab.connect(server.location)
    try:
        for n in (1, 3, 256):
            batch = remote.sample(n)
            assert isinstance(batch, SampleBatch) and len(batch) == n
            assert batch.columns == list(store.schema.resolve_columns(None))
            rows = batch.indices
            assert np.array_equal(batch["obs"], steps["obs"][rows])
            assert np.array_equal(batch["reward"], steps["reward"][rows])
            assert np.array_equal(batch["terminated"], steps["terminated"][rows])
            for name in ("obs", "action", "next_obs"):
                assert batch[name].flags.writeable and batch[name].flags.aligned
    finally:
        remote.close()


def test_update_priorities_on_a_uniform_store_is_an_invalid_request(servers):
    """A priority update to a store whose sampler has no priorities is the client's mistake: INVALID_ARGUMENT
    (InvalidArgument), never a generic server failure. (TestMalformedInput.test_actions found it by chance.)"""
    store = ab.ExperienceStore(SCHEMAS / "mujoco.yaml", capacity=256, seed=0)
    store.extend(mujoco_steps(20))
    server = servers(store)
    body = b'{"indices": [0, 0], "priorities": [0, 0]}'
    with flight.FlightClient(server.location) as client:
        with pytest.raises(flight.FlightError) as info:
            list(client.do_action(flight.Action("update_priorities", body)))
    detail = json.loads(info.value.extra_info)
    assert detail["error"] == "InvalidArgument" and detail["code"] == "INVALID_ARGUMENT", detail
    assert "no priorities" in detail["message"]
    with pytest.raises(ab.InvalidArgument, match="no priorities"):
        store.update_priorities([0], [1.0])


# ---------------------------------------------------------------------------------------------------- meta "columns"
def per_store(n: int = 100) -> ab.ExperienceStore:
    store = ab.ExperienceStore(SCHEMAS / "mujoco.yaml", capacity=256, seed=3,
                               sampler=ab.samplers.Prioritized(alpha=0.6, beta=0.4))
    ids = store.extend(mujoco_steps(n))
    store.update_priorities(ids, np.linspace(0.1, 5.0, n))
    return store


def do_get(location: str, **ticket) -> flight.FlightStreamChunk:
    with flight.FlightClient(location) as client:
        reader = client.do_get(flight.Ticket(json.dumps({"v": 1, "kind": "sample", **ticket}).encode()))
        chunk = reader.read_chunk()
        with pytest.raises(StopIteration):
            reader.read_chunk()
        return chunk


class TestSampleMetaColumns:
    def test_describe_offers_it_and_the_client_takes_it(self, servers):
        store = ab.ExperienceStore(SCHEMAS / "mujoco.yaml", capacity=256, seed=0)
        store.extend(mujoco_steps(20))
        server = servers(store)
        with flight.FlightClient(server.location) as client:
            info = json.loads(next(iter(client.do_action(flight.Action("describe", b"")))).body.to_pybytes())
        assert info["sample_meta"] == ["json", "columns"]
        remote = ab.connect(server.location)
        try:
            assert remote.sample_meta == "columns"
        finally:
            remote.close()

    def test_default_tickets_are_unchanged(self):
        assert b"meta" not in P.encode_ticket(P.SampleRequest(4, "s"))
        assert P.decode_ticket(P.encode_ticket(P.SampleRequest(4, "s"))).meta == "json"
        assert P.decode_ticket(P.encode_ticket(P.SampleRequest(4, "s", meta="columns"))).meta == "columns"

    def test_ids_and_weights_arrive_as_trailing_columns(self, servers):
        """The same seeded store sampled both ways gives the same rows, ids and weights; "columns" has no JSON."""
        a, b = per_store(), per_store()
        sa, sb = servers(a), servers(b)
        as_json = do_get(sa.location, n=16)
        as_cols = do_get(sb.location, n=16, meta="columns")
        assert as_cols.app_metadata is None or as_cols.app_metadata.size == 0
        names = as_cols.data.schema.names
        assert names[-2:] == [P.ID_COLUMN, P.WEIGHT_COLUMN]
        meta = json.loads(as_json.app_metadata.to_pybytes())
        assert as_cols.data.column(P.ID_COLUMN).to_pylist() == meta["indices"]
        assert np.allclose(as_cols.data.column(P.WEIGHT_COLUMN).to_numpy(), meta["weights"])
        assert as_cols.data.select(names[:-2]).equals(as_json.data)

    def test_no_weight_column_without_weights(self, servers):
        store = ab.ExperienceStore(SCHEMAS / "mujoco.yaml", capacity=256, seed=0)
        store.extend(mujoco_steps(20))
        chunk = do_get(servers(store).location, n=5, meta="columns", columns=["reward"])
        assert chunk.data.schema.names == ["reward", P.ID_COLUMN]
        assert chunk.data.column(P.ID_COLUMN).type == pa.int64()

    @pytest.mark.parametrize("meta", ["bogus", 1, True, [], {}, "COLUMNS"])
    def test_a_bad_meta_is_an_invalid_request(self, servers, meta):
        store = ab.ExperienceStore(SCHEMAS / "mujoco.yaml", capacity=256, seed=0)
        store.extend(mujoco_steps(20))
        server = servers(store)
        with pytest.raises(flight.FlightError) as info:
            do_get(server.location, n=2, meta=meta)
        assert json.loads(info.value.extra_info)["code"] == "INVALID_ARGUMENT"
        cmd = {"v": 1, "kind": "session", "n": 2, "meta": meta}
        with pytest.raises(ab.SchemaError, match="meta"):
            P.decode_session_descriptor(flight.FlightDescriptor.for_command(json.dumps(cmd).encode()))

    def test_remote_sample_is_the_same_either_way(self, servers):
        a, b = per_store(), per_store()
        ra, rb = ab.connect(servers(a).location), ab.connect(servers(b).location)
        try:
            ra.sample_meta = "json"  # as against a server that does not offer "columns"
            assert rb.sample_meta == "columns"
            for n in (1, 7, 64):
                x, y = ra.sample(n), rb.sample(n)
                assert x.columns == y.columns == list(a.schema.resolve_columns(None))
                assert np.array_equal(x.indices, y.indices) and x.indices.dtype == y.indices.dtype == np.int64
                assert np.array_equal(x.weights, y.weights) and y.weights.dtype == np.float32
                for name in x.columns:
                    assert np.array_equal(x[name], y[name])
                    assert y[name].flags.writeable and y[name].flags.aligned
                assert y.indices.flags.writeable and y.weights.flags.writeable
        finally:
            ra.close()
            rb.close()

    def test_a_session_delivers_columns_and_takes_priority_updates(self, servers):
        store = per_store()
        remote = ab.connect(servers(store).location)
        try:
            with remote.session(8, prefetch=2) as session:
                for _ in range(5):
                    batch = next(session)
                    assert len(batch) == 8 and batch.weights is not None
                    assert P.ID_COLUMN not in batch.columns and P.WEIGHT_COLUMN not in batch.columns
                    session.update_priorities(batch.indices, np.full(8, 0.5))
                next(session)  # the updates went up before this request: an error would come back here
        finally:
            remote.close()


class TestSplitSampleColumns:
    """What a client accepts from a server in meta "columns" (a hostile or broken server gets a SchemaError)."""

    def batch(self, **cols) -> pa.RecordBatch:
        return pa.RecordBatch.from_pydict(cols)

    def test_ids_only_and_ids_with_weights(self):
        keep, ids, w = P.split_sample_columns(self.batch(x=[1.0, 2.0], **{P.ID_COLUMN: pa.array([4, 5], pa.int64())}))
        assert keep == 1 and ids.tolist() == [4, 5] and w is None
        keep, ids, w = P.split_sample_columns(self.batch(x=[1.0, 2.0], **{
            P.ID_COLUMN: pa.array([4, 5], pa.int64()), P.WEIGHT_COLUMN: pa.array([1, .5], pa.float32())}))
        assert keep == 1 and ids.tolist() == [4, 5] and w.tolist() == [1.0, 0.5]

    def test_a_field_named_like_the_id_column_is_kept_as_data(self):
        keep, ids, _ = P.split_sample_columns(pa.RecordBatch.from_arrays(
            [pa.array([1, 2], pa.int64()), pa.array([7, 8], pa.int64())], names=[P.ID_COLUMN, P.ID_COLUMN]))
        assert keep == 1 and ids.tolist() == [7, 8]

    @pytest.mark.parametrize("cols", [
        {"x": [1.0]},
        {P.ID_COLUMN: pa.array([1], pa.int32())},
        {P.ID_COLUMN: pa.array([None], pa.int64())},
        {P.ID_COLUMN: pa.array([1], pa.int64()), P.WEIGHT_COLUMN: pa.array([1.0], pa.float64())},
        {P.ID_COLUMN: pa.array([1], pa.int64()), P.WEIGHT_COLUMN: pa.array([None], pa.float32())},
        {P.WEIGHT_COLUMN: pa.array([1.0], pa.float32())},
    ], ids=["no-ids", "int32-ids", "null-ids", "f64-weights", "null-weights", "weights-only"])
    def test_malformed_trailing_columns_are_refused(self, cols):
        with pytest.raises(ab.SchemaError):
            P.split_sample_columns(self.batch(**cols))


# ---------------------------------------------------------------------------------------------------- padding
class TestPadding:
    """meta "columns" leaves app_metadata free: a few pad bytes move the received body onto an 8-byte boundary, so
    the client uses the arrays in place instead of copying misaligned ones."""

    @pytest.mark.parametrize("pad", range(0, 9))
    @pytest.mark.parametrize("misaligned", range(0, 8))
    def test_realigning_pad_moves_the_body_by_what_it_is_off(self, pad, misaligned):
        def shift(p):
            return p + 2 if p else 0  # tag, one length byte, the bytes

        new = P.realigning_pad(pad, misaligned)
        assert 0 <= new <= 8
        assert (shift(pad) - misaligned - shift(new)) % 8 == 0
        if misaligned == 0:
            assert new == pad or shift(new) % 8 == shift(pad) % 8

    @pytest.mark.parametrize("ticket", [
        {"n": 2, "pad": 3},                                  # pad without meta "columns"
        {"n": 2, "meta": "json", "pad": 1},
        {"n": 2, "meta": "columns", "pad": P.MAX_PAD + 1},
        {"n": 2, "meta": "columns", "pad": -1},
        {"n": 2, "meta": "columns", "pad": 1.5},
        {"n": 2, "meta": "columns", "pad": "1"},
    ])
    def test_a_bad_pad_is_an_invalid_request(self, servers, ticket):
        store = ab.ExperienceStore(SCHEMAS / "mujoco.yaml", capacity=256, seed=0)
        store.extend(mujoco_steps(20))
        with pytest.raises(flight.FlightError) as info:
            do_get(servers(store).location, **ticket)
        assert json.loads(info.value.extra_info)["code"] == "INVALID_ARGUMENT"

    @pytest.mark.parametrize("raw", [b'{"op": "sample", "pad": 64}', b'{"op": "sample", "pad": -2}',
                                     b'{"op": "sample", "pad": true}'])
    def test_a_bad_session_pad_is_refused(self, raw):
        with pytest.raises(ab.SchemaError, match="pad"):
            P.decode_exchange(raw)

    def test_pad_bytes_are_app_metadata_and_the_batch_is_unchanged(self, servers):
        store = ab.ExperienceStore(SCHEMAS / "mujoco.yaml", capacity=256, seed=0)
        store.extend(mujoco_steps(20))
        location = servers(store).location
        plain = do_get(location, n=4, meta="columns", columns=["reward"])
        padded = do_get(location, n=4, meta="columns", columns=["reward"], pad=5)
        assert padded.app_metadata.to_pybytes() == b"     "
        assert padded.data.schema == plain.data.schema

    def test_a_json_session_refuses_a_pad(self, servers):
        store = ab.ExperienceStore(SCHEMAS / "mujoco.yaml", capacity=256, seed=0)
        store.extend(mujoco_steps(20))
        cmd = {"v": 1, "kind": "session", "n": 2}
        with flight.FlightClient(servers(store).location) as client:
            writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(json.dumps(cmd).encode()))
            with pytest.raises(flight.FlightError, match="pad") as info:
                writer.write_metadata(pa.py_buffer(b'{"op": "sample", "count": 1, "pad": 2}'))
                writer.done_writing()
                reader.read_all()
            assert json.loads(info.value.extra_info)["code"] == "INVALID_ARGUMENT"
            with contextlib.suppress(flight.FlightError):
                writer.close()

    def test_the_client_converges_to_aligned_bodies(self, servers):
        """A large reply (gRPC hands it over in pieces that Arrow joins into one buffer): after the first reply
        the client asks for the pad that aligns the body, and later replies arrive aligned, for DoGet and for
        a session."""
        from arrowbuf.flight import messages as C

        store = ab.ExperienceStore(SCHEMAS / "mujoco.yaml", capacity=4096, seed=0)
        store.extend(mujoco_steps(2048))
        remote = ab.connect(servers(store, max_batch_rows=4096).location)
        try:
            offsets = []
            for _ in range(4):
                key = C.request_key(2048, None, None, {})
                pad = remote._pads.get(key, 0)
                raw = P.encode_ticket(P.SampleRequest(2048, remote.name, None, None, {}, meta="columns", pad=pad))
                with flight.FlightClient(remote.location) as client:
                    offsets.append(C.misalignment(client.do_get(flight.Ticket(raw)).read_chunk().data))
                remote.sample(2048)
            assert 0 in offsets[1:], offsets
            with remote.session(2048, prefetch=1) as session:
                for _ in range(6):
                    batch = next(session)
                for name in ("obs", "action", "reward", "next_obs"):
                    assert batch[name].flags.aligned and batch[name].flags.writeable
        finally:
            remote.close()


@pytest.mark.parametrize("value", [
    np.arange(5, dtype=np.float32), np.arange(5, dtype=np.int64), np.arange(5, dtype=np.uint8),
    np.arange(5, dtype=np.float16), np.arange(10, dtype=np.float64)[::2], np.arange(5, dtype=">i4"),
    np.array([True, False, True]), np.zeros(0, np.float32),
], ids=["f32", "i64", "u8", "f16", "strided", "byteswapped", "bool", "empty"])
def test_scalar_column_equals_pa_array(value):
    if not value.dtype.isnative:
        with pytest.raises(pa.ArrowNotImplementedError):  # as pa.array: the server never gathers such columns
            W.wire_array(value)
        return
    got = W.wire_array(value)
    assert got.equals(pa.array(value)) and got.type == pa.array(value).type


# ---------------------------------------------------------------------------------------------------- fuzz
_values = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8) \
    | st.sampled_from(["json", "columns"]) | st.lists(st.integers(), max_size=2)
_MAPPED = {"SchemaError", "InvalidArgument", "SampleTimeout"}


@settings(max_examples=30, deadline=None, derandomize=True)
@given(meta=_values, pad=_values, session_pad=_values, n=st.integers(-2, 70))
def test_meta_and_pad_of_any_value_answer_with_data_or_a_mapped_error(meta, pad, session_pad, n):
    """Tickets and session messages with any meta/pad values: a batch or INVALID_ARGUMENT-like error, never
    INTERNAL, and the server still serves."""
    store = ab.ExperienceStore(SCHEMAS / "mujoco.yaml", capacity=256, seed=0)
    store.extend(mujoco_steps(30))

    def mapped(call):
        try:
            call()
        except flight.FlightError as exc:
            detail = json.loads(exc.extra_info)
            assert detail["error"] in _MAPPED and detail["code"] != "INTERNAL", detail

    with ab.serve(store, max_batch_rows=64, shutdown_timeout=1.0) as server:
        ticket = {"v": 1, "kind": "sample", "n": n, "meta": meta, "pad": pad}
        with flight.FlightClient(server.location) as client:
            mapped(lambda: client.do_get(flight.Ticket(json.dumps(ticket).encode())).read_all())
            cmd = {"v": 1, "kind": "session", "n": 2, "meta": meta}

            def exchange():
                writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(json.dumps(cmd).encode()))
                try:
                    writer.write_metadata(pa.py_buffer(json.dumps({"op": "sample", "count": 1,
                                                                   "pad": session_pad}).encode()))
                    writer.done_writing()
                    reader.read_all()
                finally:
                    with contextlib.suppress(pa.ArrowException):
                        writer.close()

            mapped(exchange)
        remote = ab.connect(server.location)
        try:
            assert len(remote.sample(3)) == 3
        finally:
            remote.close()
