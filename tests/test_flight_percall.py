"""The per-call path of Flight sampling (issue 18): what the server puts on the wire and how it decodes tickets.

The fast paths (cached tensor types, cached sample tickets) must give exactly what the plain conversions give,
and every bound of a hostile ticket must hold on a cache hit as on a miss. Real servers on port 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

import arrowbuf as ab
from arrowbuf.batch import SampleBatch
from arrowbuf.flight import protocol as P
from arrowbuf.flight import server as S

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "schemas"


@pytest.fixture
def servers():
    """Start servers through `start(...)`; every one is closed at teardown, even when the test fails."""
    started: list[ab.flight.StoreServer] = []

    def start(stores, **kw):
        kw.setdefault("shutdown_timeout", 1.0)
        server = ab.serve(stores, **kw)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


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
        got = S._wire_array(value)
        assert got.type == pa.fixed_shape_tensor(pa.from_numpy_dtype(value.dtype), value.shape[1:])
        assert len(got) == len(value)
        if len(value):  # from_numpy_ndarray refuses an empty array
            assert got.equals(pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(value)))
        flat = got.storage.flatten().to_numpy(zero_copy_only=False)
        assert np.array_equal(flat.reshape(value.shape), value)

    def test_the_same_layout_reuses_one_type(self):
        a = S._wire_array(np.zeros((3, 7), np.float32))
        b = S._wire_array(np.ones((5, 7), np.float32))
        assert a.type is b.type or a.type == b.type
        assert S._wire_array(np.zeros((3, 8), np.float32)).type != a.type

    def test_a_sample_goes_on_the_wire_as_its_record_batch(self):
        store = ab.ExperienceStore(SCHEMAS / "mujoco.yaml", capacity=256, seed=0)
        store.extend(mujoco_steps(100))
        batch = store.sample(32)
        data, meta = S._wire_batch(batch)
        assert data.equals(batch.data)
        assert data.schema == batch.data.schema
        indices, weights = P.decode_sample_meta(meta, 32)
        assert np.array_equal(indices, batch.indices) and weights is None

    def test_arrays_are_views_not_copies(self):
        value = np.arange(12, dtype=np.float32).reshape(3, 4)
        got = S._wire_array(value)
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
