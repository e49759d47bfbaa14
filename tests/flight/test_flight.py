"""The Flight service: real servers on port 0, real subprocesses, property-based malformed input.

Every server a test starts is registered with the `servers` fixture, which closes it even when the test fails.
The `TestPlainFlightClient` class speaks the protocol with a bare `pyarrow.flight.FlightClient`, following
docs/flight-protocol.md only (the any-language check).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import pickle
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.flight import protocol as P

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "schemas"
PY = sys.executable


# ---------------------------------------------------------------------------------------------------- helpers
def cartpole_batch(n: int, *, start: int = 0, end_every: int = 10) -> dict[str, np.ndarray]:
    """n CartPole steps; obs[:, 0] holds a running id so rows can be recognised after a round trip."""
    ids = np.arange(start, start + n, dtype=np.float32)
    obs = np.stack([ids, ids * 2, ids * 3, ids * 4], axis=1).astype(np.float32)
    term = (np.arange(start, start + n) % end_every) == end_every - 1
    return {"obs": obs, "action": (np.arange(n) % 2).astype(np.int64), "reward": np.ones(n, np.float32),
            "terminated": term, "truncated": np.zeros(n, bool), "policy_version": np.zeros(n, np.int64),
            "next_obs": obs + 0.5}


def atari_batch(n: int, value: int = 1) -> dict[str, np.ndarray]:
    obs = np.full((n, 4, 84, 84), value, dtype=np.uint8)
    term = np.zeros(n, bool)
    term[-1] = True
    return {"obs": obs, "action": np.full(n, value, np.int64), "reward": np.zeros(n, np.float32),
            "terminated": term, "truncated": np.zeros(n, bool), "next_obs": obs}


def cartpole_store(capacity: int = 1000, **kw) -> ab.ExperienceStore:
    return ab.ExperienceStore(SCHEMAS / "cartpole.yaml", capacity=capacity, seed=0, **kw)


def bearer(token: str) -> flight.FlightCallOptions:
    return flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())])


def status_detail(exc: flight.FlightError) -> dict:
    """The protocol's JSON status detail carried in extra_info."""
    return json.loads(exc.extra_info)


@pytest.fixture
def served(servers):
    store = cartpole_store()
    store.extend(cartpole_batch(100))
    server = servers(store)
    remote = ab.connect(server.location)
    yield store, server, remote
    remote.close()


# ---------------------------------------------------------------------------------------------------- ab.connect
class TestRemoteStore:
    def test_describe_and_len(self, served):
        store, server, remote = served
        assert remote.name == "cartpole"
        assert remote.schema.to_dict() == store.schema.to_dict()
        assert remote.capacity == store.capacity
        assert len(remote) == 100

    def test_append_and_extend_return_the_rows_ids(self, served):
        store, _, remote = served
        one = {k: v[0] for k, v in cartpole_batch(1, start=100).items()}
        first = remote.append(one)
        assert type(first) is int and first == 100
        ids = [remote.extend(cartpole_batch(5, start=101)),
               remote.extend(pa.RecordBatch.from_pydict(_arrow_cols(store, cartpole_batch(3, start=106))))]
        table = pa.Table.from_batches([pa.RecordBatch.from_pydict(_arrow_cols(store, cartpole_batch(4, start=109)))])
        ids.append(remote.extend(table))
        for got, n in zip(ids, (5, 3, 4)):
            assert isinstance(got, np.ndarray) and got.dtype == np.int64 and got.shape == (n,)
        all_ids = np.concatenate([[first], *ids])
        assert len(store) == len(remote) == 113
        seq = remote.to_table(["seq"]).column("seq").to_numpy()
        np.testing.assert_array_equal(all_ids, seq[100:])  # the ids are the rows' seqs, in row order
        obs = store.to_table(["obs"]).column("obs").combine_chunks().to_numpy_ndarray()
        np.testing.assert_array_equal(obs[:, 0], np.arange(113, dtype=np.float32))
        empty = remote.extend({k: v[:0] for k, v in cartpole_batch(2).items()})
        assert empty.dtype == np.int64 and empty.shape == (0,) and len(store) == 113

    def test_sample_rows_match_the_store(self, served):
        store, _, remote = served
        batch = remote.sample(64)
        assert isinstance(batch, ab.SampleBatch) and len(batch) == 64
        assert batch.weights is None
        arrays = batch.to_numpy()
        assert arrays["obs"].shape == (64, 4) and arrays["obs"].dtype == np.float32
        np.testing.assert_array_equal(arrays["obs"][:, 0], batch.indices.astype(np.float32))  # row id == seq
        end = arrays["terminated"]  # next_obs is the next step's obs, or the final observation given at the end
        np.testing.assert_array_equal(arrays["next_obs"][~end, 0], batch.indices[~end].astype(np.float32) + 1)
        np.testing.assert_array_equal(arrays["next_obs"][end], arrays["obs"][end] + 0.5)
        sub = remote.sample(8, columns=["reward", "seq"])
        assert sub.columns == ["reward", "seq"]
        np.testing.assert_array_equal(sub.to_numpy()["seq"], sub.indices)
        assert batch.data.num_rows == 64

    def test_update_priorities_and_weights(self, servers):
        store = cartpole_store(sampler=ab.samplers.Prioritized(alpha=1.0, beta=1.0))
        store.extend(cartpole_batch(50))
        remote = ab.connect(servers(store).location)
        batch = remote.sample(32)
        assert batch.weights is not None and batch.weights.dtype == np.float32 and batch.weights.max() <= 1
        assert remote.update_priorities(batch.indices, np.full(32, 5.0)) == 32
        with pytest.raises(ValueError):
            remote.update_priorities([1, 2], [1.0])
        remote.close()

    def test_stats_to_table_sql_episodes(self, served):
        store, server, remote = served
        stats = remote.stats()
        assert stats["size"] == 100 and stats["capacity"] == 1000 and stats["server"]["location"] == server.location
        assert remote.to_table().equals(store.to_table())
        assert remote.to_table(["seq", "reward"]).column_names == ["seq", "reward"]
        assert remote.episodes().equals(store.episodes())
        got = remote.sql("SELECT episode_id, sum(reward) AS r FROM experience GROUP BY 1 ORDER BY 1")
        assert got.column("r").to_pylist() == [10.0] * 10

    def test_sql_cannot_touch_server_files(self, served):
        _, _, remote = served
        with pytest.raises(ab.InvalidArgument, match="sql"):
            remote.sql("SELECT * FROM read_csv('/etc/passwd')")
        with pytest.raises(ab.InvalidArgument):
            remote.sql("SELEC nonsense")

    def test_writer_streams_with_bounded_in_flight_batches(self, served):
        store, _, remote = served
        with remote.writer(max_in_flight=2) as w:
            for i in range(10):
                w.send(cartpole_batch(7, start=100 + 7 * i))
                assert w._in_flight <= 2
        assert w.first_seqs == [100 + 7 * i for i in range(10)]
        assert w.rows == 70 and len(store) == 170

    def test_a_slow_store_holds_the_writer_back(self, servers):
        class GatedStore(ab.ExperienceStore):
            """Commits only while the gate is open: a store that cannot keep up."""

            gate = threading.Event()

            def extend(self, batch, **kw):
                self.gate.wait(30)
                return super().extend(batch, **kw)

        store = GatedStore(SCHEMAS / "cartpole.yaml", capacity=1000)
        remote = ab.connect(servers(store).location)
        sent = []
        done = threading.Event()

        def write():
            with remote.writer(max_in_flight=2) as w:
                for i in range(6):
                    w.send(cartpole_batch(5, start=5 * i))
                    sent.append(i)
            done.set()

        threading.Thread(target=write, daemon=True).start()
        assert not done.wait(0.5)  # credit spent: the writer waits for acks instead of queueing
        assert len(sent) <= 2 and len(store) == 0  # at most max_in_flight batches went out unacknowledged
        GatedStore.gate.set()
        assert done.wait(30)
        assert sent == list(range(6)) and len(store) == 30
        remote.close()

    def test_writer_error_keeps_earlier_batches(self, served):
        store, _, remote = served
        w = remote.writer(max_in_flight=4)
        w.extend(cartpole_batch(5, start=100))
        bad = pa.RecordBatch.from_pydict({**_arrow_cols(store, cartpole_batch(2)),
                                          "action": pa.array([0.5, 1.5])})  # float actions: rejected
        with pytest.raises(ab.SchemaError, match="action"):
            w.extend(bad)
            w.flush()
        assert len(store) == 105

    def test_session_streams_batches_and_priorities(self, servers):
        store = cartpole_store(sampler=ab.samplers.Prioritized())
        store.extend(cartpole_batch(100))
        remote = ab.connect(servers(store).location)
        with remote.session(16, prefetch=2, ahead=3) as session:
            for _, batch in zip(range(6), session):
                assert len(batch) == 16 and batch.weights is not None
                np.testing.assert_array_equal(batch.to_numpy()["obs"][:, 0], batch.indices.astype(np.float32))
                session.update_priorities(batch.indices, np.linspace(0.1, 2, 16))
        assert store.stats()["priority_updates_ignored"] == 0
        remote.close()

    def test_session_reports_errors_in_band_and_stays_usable(self, servers):
        store = cartpole_store()
        remote = ab.connect(servers(store).location)
        with remote.session(4, columns=["obs"]) as session:
            with pytest.raises(ab.SampleTimeout):
                next(session)
            store.extend(cartpole_batch(20))
            got = [next(session) for _ in range(3)]
            assert all(b.columns == ["obs"] for b in got)
            session.update_priorities([0], [1.0])  # uniform sampler: no priorities, reported in band
            with pytest.raises(ab.ArrowbufError, match="no priorities"):
                for _ in range(5):
                    next(session)
            assert len(next(session)) == 4
        remote.close()

    def test_errors_map_to_arrowbuf_exceptions(self, servers):
        store = cartpole_store()
        server = servers(store, max_batch_rows=50)
        remote = ab.connect(server.location)
        with pytest.raises(ab.SampleTimeout):
            remote.sample(4)
        with pytest.raises(ab.SchemaError, match="missing field"):
            remote.extend({"obs": np.zeros((2, 4), np.float32)})
        with pytest.raises(ab.SchemaError, match="max_batch_rows"):
            remote.extend(cartpole_batch(51))
        with pytest.raises(ab.SchemaError, match="unknown column"):
            store.extend(cartpole_batch(10))
            remote.sample(2, columns=["nope"])
        with pytest.raises(ab.InvalidArgument):  # an unknown option is a bad request (SAMPLE_OPTIONS)
            remote.sample(2, no_such_option=1)
        with pytest.raises(ab.StoreNotFound):
            ab.connect(server.location, store="other")
        assert len(store) == 10
        remote.close()

    def test_insert_timeout_from_the_rate_limiter(self, servers):
        limiter = ab.rate_limiters.SampleToInsertRatio(samples_per_insert=1.0, min_size=1, error_buffer=5.0)
        store = cartpole_store(rate_limiter=limiter)
        remote = ab.connect(servers(store).location)
        remote.extend(cartpole_batch(5))
        with pytest.raises(ab.InsertTimeout):
            for i in range(10):
                remote.extend(cartpole_batch(5, start=5 * (i + 1)), timeout=0.05)
        remote.close()

    def test_several_stores_on_one_server(self, servers):
        a, b = cartpole_store(), ab.ExperienceStore(SCHEMAS / "mujoco.yaml", capacity=100, name="mj")
        server = servers({"cp": a, "mj": b})
        with pytest.raises(ab.SchemaError, match="name one"):
            ab.connect(server.location)
        cp = ab.connect(server.location, store="cp")
        cp.extend(cartpole_batch(3))
        assert len(a) == 3 and len(b) == 0 and cp.name == "cp"
        assert ab.connect(server.location, store="mj").schema.name == "mujoco"
        names = sorted(i.descriptor.path[0].decode() for i in flight.FlightClient(server.location).list_flights())
        assert names == ["cp", "mj"]

    def test_close_is_idempotent_and_never_hangs_on_a_stalled_client(self, servers):
        store = cartpole_store()
        server = servers(store, shutdown_timeout=0.3)
        client = flight.FlightClient(server.location)
        writer, reader = client.do_put(flight.FlightDescriptor.for_path("cartpole"),
                                       store.schema.input_schema())
        writer.write_batch(pa.RecordBatch.from_pydict(_arrow_cols(store, cartpole_batch(2))))
        assert P.decode_ack(reader.read())["rows"] == 2  # the call is open and now sends nothing
        done = threading.Event()
        threading.Thread(target=lambda: (server.close(), done.set()), daemon=True).start()
        assert done.wait(30), "close() hung on a stalled client"
        server.close()
        assert server.closed
        client.close()

    def test_a_loader_reads_from_a_remote_store(self, served):
        _, _, remote = served
        with ab.Loader(remote, batch_size=16, prefetch=2) as loader:
            batches = [b for _, b in zip(range(3), loader)]
        assert [len(b.indices) for b in batches] == [16, 16, 16]

    def test_closed_client_raises_store_closed(self, served):
        _, _, remote = served
        remote.close()
        remote.close()
        with pytest.raises(ab.StoreClosed):
            len(remote)


class _HungServer(flight.FlightServerBase):
    """A real Flight server whose actions hang until `release` is set (a wedged store process)."""

    def __init__(self) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.release = threading.Event()
        self.entered = threading.Event()

    def do_action(self, context, action):
        self.entered.set()
        self.release.wait(30)
        return []


class TestUnavailableAndDeadlines:
    def _serve_in_a_process(self, procs):
        args = [PY, "-m", "arrowbuf.cli", "serve", "--schema", str(SCHEMAS / "cartpole.yaml"), "--capacity", "100",
                "--port", "0"]
        p = procs(args)
        line = p.stdout.readline().decode()
        assert " at grpc://127.0.0.1:" in line, p.stderr.read().decode()
        return p, line.split(" at ")[1].strip()

    def test_a_killed_server_is_unavailable_and_a_closed_client_is_closed(self, procs):
        p, location = self._serve_in_a_process(procs)
        remote = ab.connect(location, reconnect_timeout=0.1)  # each call below tries that long before Unavailable
        ids = remote.extend(cartpole_batch(4))
        np.testing.assert_array_equal(ids, remote.to_table(["seq"]).column("seq").to_numpy())
        writer = remote.writer(max_in_flight=2)
        writer.extend(cartpole_batch(3))
        assert writer.flush() == 3
        session = remote.session(2)
        p.kill()
        p.wait(10)
        with pytest.raises(ab.Unavailable):  # streams do not reconnect: they say the server is gone
            for _ in range(5):
                writer.extend(cartpole_batch(3))
        with pytest.raises(ab.Unavailable):
            next(session)
        session.close()
        with contextlib.suppress(ab.Unavailable):
            writer.close()
        for call in (lambda: len(remote), lambda: remote.sample(1), lambda: remote.extend(cartpole_batch(2)),
                     lambda: remote.stats(), lambda: remote.to_table()):
            with pytest.raises(ab.Unavailable) as info:
                call()
            assert not isinstance(info.value, ab.StoreClosed) and isinstance(info.value, ConnectionError)
            assert location in str(info.value)
        with pytest.raises(ab.Unavailable):
            ab.connect(location, reconnect_timeout=0.1)
        remote.close()
        with pytest.raises(ab.StoreClosed):
            len(remote)

    def test_close_ends_a_call_in_progress_or_in_its_reconnect_back_off(self, servers):
        server = servers(cartpole_store())
        remote = ab.connect(server.location, reconnect_timeout=60)
        server.close()
        raised: list[BaseException] = []

        def call() -> None:
            try:
                len(remote)
            except BaseException as exc:  # noqa: BLE001 - recorded for the assert below
                raised.append(exc)

        t = threading.Thread(target=call)
        t.start()
        remote.close()
        t.join(30)
        assert not t.is_alive()
        assert len(raised) == 1 and isinstance(raised[0], ab.StoreClosed)

    def test_a_hung_server_hits_the_deadline(self):
        hung = _HungServer()
        try:
            with pytest.raises(ab.DeadlineExceeded) as info:
                ab.connect(f"grpc://127.0.0.1:{hung.port}", timeout=0.3)
            assert isinstance(info.value, TimeoutError) and isinstance(info.value, ab.Unavailable)
            assert hung.entered.is_set()  # it reached the server: a deadline, not a refused connection
        finally:
            hung.release.set()
            hung.shutdown()

    def test_a_per_call_deadline_bounds_a_waiting_sample(self, servers):
        store = cartpole_store()  # empty: a sample waits for data up to its own timeout
        server = servers(store)
        remote = ab.connect(server.location, timeout=5.0)
        with pytest.raises(ab.DeadlineExceeded, match="rpc_timeout"):
            remote.sample(1, timeout=30.0, rpc_timeout=0.3)
        with pytest.raises(ab.SampleTimeout):  # the default deadline covers the sample's own wait
            remote.sample(1, timeout=0.2)
        remote.extend(cartpole_batch(3))
        assert len(remote.sample(2, timeout=1.0, rpc_timeout=10.0)) == 2
        assert remote.to_table(rpc_timeout=10.0).num_rows == 3 and len(remote) == 3
        with pytest.raises(ab.InvalidArgument):
            remote.stats(rpc_timeout=-1)
        with pytest.raises(ab.InvalidArgument):
            ab.connect(server.location, timeout=0)
        assert pickle.loads(pickle.dumps(remote)).timeout == 5.0
        store.close()  # releases the sample still waiting on the server
        remote.close()


def _arrow_cols(store, cols: dict[str, np.ndarray]) -> dict[str, pa.Array]:
    out = {}
    for k, v in cols.items():
        out[k] = pa.FixedShapeTensorArray.from_numpy_ndarray(v) if v.ndim > 1 else pa.array(v)
    return out


# ---------------------------------------------------------------------------------------------------- plain client
class TestPlainFlightClient:
    """The protocol through a bare FlightClient, using docs/flight-protocol.md only."""

    @pytest.fixture
    def setup(self, servers):
        store = ab.ExperienceStore(SCHEMAS / "cartpole.yaml", capacity=1000, seed=1,
                                   sampler=ab.samplers.Prioritized())
        store.extend(cartpole_batch(40))
        server = servers(store, token="s3cret")
        client = flight.FlightClient(server.location)
        yield store, client, bearer("s3cret")
        client.close()

    def test_list_flights_info_and_schemas(self, setup):
        store, client, opts = setup
        infos = list(client.list_flights(options=opts))
        assert [i.descriptor.path for i in infos] == [[b"cartpole"]]
        info = client.get_flight_info(flight.FlightDescriptor.for_path("cartpole"), options=opts)
        assert info.total_records == 40 and info.schema.names[-3:] == ["episode_id", "step", "seq"]
        table = client.do_get(info.endpoints[0].ticket, options=opts).read_all()
        assert table.num_rows == 40
        stored = client.get_schema(flight.FlightDescriptor.for_path("cartpole"), options=opts).schema
        assert stored.equals(store.schema.to_arrow())
        writer_schema = client.get_schema(flight.FlightDescriptor.for_path("cartpole", "input"), options=opts).schema
        assert writer_schema.names == ["obs", "action", "reward", "terminated", "truncated", "policy_version",
                                       "next_obs"]

    def test_do_put_with_acks(self, setup):
        store, client, opts = setup
        schema = client.get_schema(flight.FlightDescriptor.for_path("cartpole", "input"), options=opts).schema
        writer, reader = client.do_put(flight.FlightDescriptor.for_path("cartpole"), schema, options=opts)
        acks = []
        for i in range(3):
            cols = cartpole_batch(10, start=40 + 10 * i)
            writer.write_batch(pa.RecordBatch.from_pydict(_arrow_cols(store, cols), schema=schema))
            acks.append(json.loads(reader.read().to_pybytes()))
        writer.done_writing()
        writer.close()
        assert acks == [{"v": 1, "batch": i, "first_seq": 40 + 10 * i, "rows": 10} for i in range(3)]
        # a command descriptor with options; tensors as plain fixed-size lists, as other languages send them
        cmd = flight.FlightDescriptor.for_command(json.dumps({"v": 1, "kind": "extend", "store": "cartpole",
                                                              "timeout": 1.0}).encode())
        cols = cartpole_batch(2, start=70)
        arrays = {k: (pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1]) if v.ndim > 1
                      else pa.array(v)) for k, v in cols.items()}
        rb = pa.RecordBatch.from_pydict(arrays)
        writer, reader = client.do_put(cmd, rb.schema, options=opts)
        writer.write_batch(rb)
        assert json.loads(reader.read().to_pybytes())["first_seq"] == 70
        writer.done_writing()
        writer.close()
        assert len(store) == 72

    def test_do_get_sample_and_tables(self, setup):
        store, client, opts = setup
        ticket = {"v": 1, "kind": "sample", "store": "cartpole", "n": 8, "columns": ["obs", "reward"]}
        reader = client.do_get(flight.Ticket(json.dumps(ticket).encode()), options=opts)
        chunk = reader.read_chunk()
        meta = json.loads(chunk.app_metadata.to_pybytes())
        assert chunk.data.schema.names == ["obs", "reward"] and chunk.data.num_rows == 8
        assert len(meta["indices"]) == 8 and len(meta["weights"]) == 8
        obs = chunk.data.column("obs").to_numpy_ndarray()
        np.testing.assert_array_equal(obs[:, 0], np.asarray(meta["indices"], np.float32))
        for t, expect in [({"kind": "table", "columns": ["seq"]}, 40), ({"kind": "episodes"}, 4),
                          ({"kind": "sql", "query": "SELECT count(*) AS n FROM experience"}, 1)]:
            got = client.do_get(flight.Ticket(json.dumps(t).encode()), options=opts).read_all()
            assert got.num_rows == expect

    def test_do_exchange_session(self, setup):
        store, client, opts = setup
        cmd = {"v": 1, "kind": "session", "store": "cartpole", "n": 4, "prefetch": 2}
        writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(json.dumps(cmd).encode()),
                                            options=opts)
        writer.write_metadata(pa.py_buffer(b'{"op": "sample", "count": 3}'))
        got = []
        for _ in range(3):
            chunk = reader.read_chunk()
            meta = json.loads(chunk.app_metadata.to_pybytes())
            got.append(meta["indices"])
            assert chunk.data.num_rows == 4
        update = {"op": "update_priorities", "indices": got[0], "priorities": [2.0] * 4}
        writer.write_metadata(pa.py_buffer(json.dumps(update).encode()))
        writer.write_metadata(pa.py_buffer(b'{"op": "update_priorities", "indices": [1], "priorities": [-1]}'))
        error = reader.read_chunk()
        assert error.data is None
        assert json.loads(error.app_metadata.to_pybytes())["code"] == "INVALID_ARGUMENT"
        writer.done_writing()
        with pytest.raises(StopIteration):
            reader.read_chunk()
        writer.close()

    def test_do_action(self, setup):
        store, client, opts = setup
        types = {a.type for a in client.list_actions(options=opts)}
        assert {"describe", "stats", "len", "update_priorities"} <= types

        def act(type_, body=b""):
            return json.loads(next(iter(client.do_action(flight.Action(type_, body), options=opts))).body.to_pybytes())

        assert act("len") == {"len": 40}
        assert act("stats")["size"] == 40
        described = act("describe", b'{"v": 1, "store": "cartpole"}')
        assert ab.load_schema(described["schema"]).to_dict() == store.schema.to_dict()
        assert act("update_priorities", json.dumps({"indices": [0, 1], "priorities": [3.0, 4.0]}).encode()) == \
            {"applied": 2}

    def test_errors_carry_the_status_detail(self, setup):
        _, client, opts = setup
        with pytest.raises(flight.FlightServerError) as info:
            client.do_get(flight.Ticket(b'{"kind": "sample", "n": -1}'), options=opts).read_all()
        assert status_detail(info.value)["error"] == "SchemaError"
        assert status_detail(info.value)["code"] == "INVALID_ARGUMENT"
        with pytest.raises(flight.FlightServerError) as info:
            client.do_get(flight.Ticket(b'{"kind": "table", "store": "nope"}'), options=opts).read_all()
        assert status_detail(info.value)["code"] == "NOT_FOUND"


# ---------------------------------------------------------------------------------------------------- security
class TestSecurity:
    def test_every_verb_needs_the_token(self, servers):
        store = cartpole_store()
        store.extend(cartpole_batch(10))
        server = servers(store, token="right")
        client = flight.FlightClient(server.location)
        rb = pa.RecordBatch.from_pydict(_arrow_cols(store, cartpole_batch(3)))
        sample = flight.Ticket(P.encode_ticket(P.SampleRequest(2)))
        session = P.session_descriptor(P.SessionRequest(2))
        calls = {
            "list_flights": lambda o: list(client.list_flights(options=o)),
            "get_flight_info": lambda o: client.get_flight_info(flight.FlightDescriptor.for_path("cartpole"),
                                                                options=o),
            "get_schema": lambda o: client.get_schema(flight.FlightDescriptor.for_path("cartpole"), options=o),
            "do_get": lambda o: client.do_get(sample, options=o).read_all(),
            "list_actions": lambda o: list(client.list_actions(options=o)),
            "do_action": lambda o: list(client.do_action(flight.Action("len", b""), options=o)),
            "do_put": lambda o: _put_one(client, rb, o),
            "do_exchange": lambda o: _exchange_one(client, session, o),
        }
        for name, call in calls.items():
            for opts in (flight.FlightCallOptions(), bearer("wrong"), bearer("")):
                if name == "get_schema":  # pyarrow's client drops the status detail of GetSchema errors
                    with pytest.raises(OSError, match="Unauthenticated"):
                        call(opts)
                    continue
                with pytest.raises(flight.FlightUnauthenticatedError) as info:
                    call(opts)
                assert status_detail(info.value)["error"] == "Unauthenticated", name
            call(bearer("right"))
        assert len(store) == 13  # only the authenticated DoPut stored anything
        with pytest.raises(ab.Unauthenticated):
            ab.connect(server.location)
        with pytest.raises(ab.Unauthenticated):
            ab.connect(server.location, token="wrong")
        assert len(ab.connect(server.location, token="right")) == 13
        client.close()

    def test_tls_with_a_self_signed_certificate(self, servers, tmp_path):
        cert, key = _self_signed()
        store = cartpole_store()
        server = servers(store, tls=(cert, key), token="t")
        assert server.location.startswith("grpc+tls://127.0.0.1:")
        remote = ab.connect(server.location, token="t", tls_root_certs=cert)
        remote.extend(cartpole_batch(5))
        assert len(remote.sample(3)) == 3 and len(store) == 5
        (tmp_path / "ca.pem").write_bytes(cert)
        assert len(ab.connect(server.location, token="t", tls_root_certs=str(tmp_path / "ca.pem"))) == 5
        with pytest.raises(ab.Unavailable):  # an untrusted certificate: no connection
            ab.connect(server.location, token="t", reconnect_timeout=0.2)
        plain = flight.FlightClient(server.location.replace("grpc+tls", "grpc"))
        with pytest.raises(flight.FlightUnavailableError):
            list(plain.do_action(flight.Action("len", b""), options=bearer("t")))
        plain.close()
        remote.close()

    def test_binds_loopback_by_default(self, servers):
        server = servers(cartpole_store())
        assert server.location.startswith("grpc://127.0.0.1:")


def _put_one(client, rb, opts, descriptor=None):
    descriptor = descriptor or flight.FlightDescriptor.for_path("cartpole")
    writer, reader = client.do_put(descriptor, rb.schema, options=opts)
    try:
        writer.write_batch(rb)
        writer.done_writing()
        reader.read()
    finally:
        writer.close()


def _exchange_one(client, descriptor, opts, rows=2):
    """One sample over a session; `rows=None` accepts any batch size (a generated descriptor may be a valid
    session request of its own size, e.g. {"n": 1})."""
    writer, reader = client.do_exchange(descriptor, options=opts)
    try:
        writer.write_metadata(pa.py_buffer(b'{"op": "sample"}'))
        got = reader.read_chunk().data.num_rows
        assert got == rows if rows is not None else got >= 1
        writer.done_writing()
    finally:
        writer.close()


def _self_signed() -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


# ---------------------------------------------------------------------------------------------------- malformed input
@pytest.fixture(scope="module")
def target():
    """One server for the property tests; it must keep serving through every malformed request."""
    store = cartpole_store()
    store.extend(cartpole_batch(50))
    server = ab.serve(store, max_batch_rows=64, shutdown_timeout=1.0)
    client = flight.FlightClient(server.location)
    try:
        yield store, server, client
    finally:
        client.close()
        server.close()


ACCEPTABLE = {"SchemaError", "InvalidArgument", "StoreNotFound", "ValueError", "TypeError", "SampleTimeout"}
json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                           | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
ticket_keys = st.sampled_from(["v", "kind", "store", "n", "columns", "timeout", "options", "query", "extra"])
ticket_objects = st.dictionaries(ticket_keys, json_values | st.sampled_from(
    ["sample", "table", "sql", "episodes", "cartpole", 3, ["obs"], 1]), max_size=6)
raw_requests = st.binary(max_size=64) | ticket_objects.map(lambda d: json.dumps(d).encode())
numbers = st.integers(-2**70, 2**70) | st.floats()
priority_bodies = st.fixed_dictionaries(
    {"indices": st.lists(numbers, max_size=4), "priorities": st.lists(numbers, max_size=4)},
    optional={"store": st.sampled_from(["cartpole", "x"]), "v": st.sampled_from([1, 2, True])},
).map(lambda d: json.dumps(d).encode())
sample_tickets = st.fixed_dictionaries(
    {"kind": st.just("sample"), "n": numbers},
    optional={"timeout": numbers, "columns": st.lists(st.sampled_from(["obs", "seq", "x"])),
              "options": st.dictionaries(st.text(max_size=4), numbers, max_size=2)},
).map(lambda d: json.dumps(d).encode())
PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _still_serving(target) -> None:
    store, server, client = target
    n = len(store)
    remote = ab.connect(server.location)
    remote.extend(cartpole_batch(1))
    assert len(remote.sample(3)) == 3 and len(store) == n + 1
    remote.close()


def _expect_mapped(call, *, detail: bool = True) -> None:
    """The call succeeds or fails with one of the protocol's invalid-request errors: never an internal error.

    `detail=False` for GetSchema: pyarrow (both ends) sends and reads its errors without the status detail.
    """
    try:
        call()
    except pa.ArrowException as exc:
        if not detail:
            assert "internal server error" not in str(exc)
            return
        assert isinstance(exc, flight.FlightError), exc
        detail = status_detail(exc)
        assert detail["error"] in ACCEPTABLE, detail
        assert detail["code"] != "INTERNAL"


class TestMalformedInput:
    @PROPS
    @given(raw=raw_requests | sample_tickets)
    def test_tickets(self, target, raw):
        _expect_mapped(lambda: target[2].do_get(flight.Ticket(raw)).read_all())

    @PROPS
    @given(type_=st.sampled_from(["describe", "stats", "len", "update_priorities"]) | st.text(max_size=12),
           body=raw_requests | priority_bodies | st.dictionaries(
               st.sampled_from(["store", "indices", "priorities", "x"]), json_values, max_size=3
           ).map(lambda d: json.dumps(d).encode()))
    def test_actions(self, target, type_, body):
        _expect_mapped(lambda: list(target[2].do_action(flight.Action(type_, body))))

    @PROPS
    @given(path=st.lists(st.text(max_size=8), max_size=3), command=raw_requests, use_path=st.booleans())
    @example(path=[], command=b'{"n":1}', use_path=False)  # a valid session of its own size (found by a CI-like run)
    def test_descriptors(self, target, path, command, use_path):
        store, _, client = target
        d = flight.FlightDescriptor.for_path(*path) if use_path else flight.FlightDescriptor.for_command(command)
        n = len(store)
        rb = pa.RecordBatch.from_pydict({"reward": pa.array([1.0], pa.float32())})
        _expect_mapped(lambda: client.get_flight_info(d))
        _expect_mapped(lambda: client.get_schema(d), detail=False)
        _expect_mapped(lambda: _put_one(client, rb, flight.FlightCallOptions(), d))  # a batch missing fields
        _expect_mapped(lambda: _exchange_one(client, d, flight.FlightCallOptions(), rows=None))
        assert len(store) == n

    @PROPS
    @given(data=st.data())
    def test_batches(self, target, data):
        store, _, client = target
        cols = cartpole_batch(3)
        arrays = _arrow_cols(store, cols)
        name = data.draw(st.sampled_from(sorted(arrays) + ["bogus"]))
        kind = data.draw(st.sampled_from(["drop", "string", "float", "nulls", "shape", "rows"]))
        if kind == "drop" and name in arrays:
            arrays.pop(name)
        elif kind == "string":
            arrays[name] = pa.array(["x"] * 3)
        elif kind == "float":
            arrays[name] = pa.array([0.5] * 3)
        elif kind == "nulls":
            arrays[name] = pa.array([None] * 3, pa.float32())
        elif kind == "shape":
            arrays[name] = pa.FixedShapeTensorArray.from_numpy_ndarray(np.zeros((3, 3, 2), np.float32))
        else:
            arrays = _arrow_cols(store, cartpole_batch(65))  # over max_batch_rows
        rb = pa.RecordBatch.from_pydict(arrays)
        n = len(store)
        before = store.to_table(["seq"]).column("seq").to_pylist()[-1]
        _expect_mapped(lambda: _put_one(client, rb, flight.FlightCallOptions()))
        if len(store) != n:  # only a batch the schema accepts may land, and then entirely
            assert len(store) == n + rb.num_rows
            assert store.to_table(["seq"]).column("seq").to_pylist()[-1] == before + rb.num_rows

    @PROPS
    @given(messages=st.lists(raw_requests | priority_bodies.map(lambda b: b[:-1] + b', "op": "update_priorities"}'),
                             min_size=1, max_size=3))
    def test_exchange_messages(self, target, messages):
        store, _, client = target
        descriptor = P.session_descriptor(P.SessionRequest(2, prefetch=1))

        def session():
            writer, reader = client.do_exchange(descriptor)
            try:
                for m in messages:
                    writer.write_metadata(pa.py_buffer(m))
                writer.done_writing()
                for _ in reader:
                    pass
            finally:
                writer.close()

        _expect_mapped(session)

    def test_server_still_serves_after_all_that(self, target):
        _still_serving(target)


# ---------------------------------------------------------------------------------------------------- processes
KILLED_WRITER = r"""
import sys, numpy as np, arrowbuf as ab
remote = ab.connect(sys.argv[1])
obs = np.full((2400, 4, 84, 84), 7, np.uint8)     # ~68 MB: far more than goes through before the kill
big = {"obs": obs, "action": np.full(2400, 7, np.int64), "reward": np.zeros(2400, np.float32),
       "terminated": np.zeros(2400, bool), "truncated": np.zeros(2400, bool)}
small = {k: v[:5] for k, v in big.items()}
w = remote.writer(max_in_flight=4)
w.extend(small)
w.flush()
print("acked", flush=True)
print("sending", flush=True)
w.extend(big)
w.flush()
print("sent", flush=True)
"""

PICKLED_CLIENT = r"""
import pickle, sys, numpy as np
remote = pickle.loads(sys.stdin.buffer.read())
n = 6
obs = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
first = remote.extend({"obs": obs, "action": np.zeros(n, np.int64), "reward": np.ones(n, np.float32),
                       "terminated": np.zeros(n, bool), "truncated": np.zeros(n, bool),
                       "policy_version": np.zeros(n, np.int64)})
print(first[0], len(remote), len(remote.sample(4)), flush=True)
"""


class TestProcesses:
    def test_a_client_killed_mid_doput_leaves_no_partial_batch(self, servers, procs):
        store = ab.ExperienceStore(SCHEMAS / "atari.yaml", capacity=4000, seed=0)
        server = servers(store)
        p = procs([PY, "-c", KILLED_WRITER, server.location])
        assert p.stdout.readline().strip() == b"acked", p.stderr.read().decode()
        assert len(store) == 5
        assert p.stdout.readline().strip() == b"sending"
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        assert len(store) == 5  # the acked batch only: nothing of the batch in transit
        assert store.to_table(["seq"]).column("seq").to_pylist() == list(range(5))
        remote = ab.connect(server.location)  # the server goes on serving everyone else
        remote.extend(atari_batch(3, value=9))
        assert len(store) == 8 and len(remote.sample(2, columns=["action"])) == 2
        remote.close()

    def test_pickled_client_works_in_a_subprocess(self, served, procs):
        store, _, remote = served
        p = procs([PY, "-c", PICKLED_CLIENT], stdin=subprocess.PIPE)
        out, err = p.communicate(pickle.dumps(remote), timeout=60)
        assert p.returncode == 0, err.decode()
        assert out.split() == [b"100", b"106", b"4"]
        assert len(store) == 106

    def test_server_restart_and_reconnect(self, servers):
        server = servers(cartpole_store())
        port = server.port
        remote = ab.connect(server.location, reconnect_timeout=10)
        remote.extend(cartpole_batch(5))
        server.close()
        with pytest.raises(ab.Unavailable):
            ab.connect(server.location, reconnect_timeout=0.1)
        fresh = cartpole_store()
        fresh.extend(cartpole_batch(7))
        servers(fresh, location=f"grpc://127.0.0.1:{port}")
        assert len(remote) == 7  # the old client reconnects to the new server by itself
        remote.extend(cartpole_batch(2, start=7))
        assert len(fresh) == 9 and len(remote.sample(3)) == 3
        remote.close()

    def test_cli_serve_shuts_down_cleanly_on_sigterm(self, procs, tmp_path):
        token_file = tmp_path / "token"
        token_file.write_text("tok\n")
        args = [PY, "-m", "arrowbuf.cli", "serve", "--schema", str(SCHEMAS / "cartpole.yaml"), "--capacity", "100",
                "--token-file", str(token_file)]
        p = procs(args + ["--port", "0"])
        line = p.stdout.readline().decode()
        assert "serving store 'cartpole' at grpc://127.0.0.1:" in line, p.stderr.read().decode()
        location = line.split(" at ")[1].strip()
        remote = ab.connect(location, token="tok", reconnect_timeout=20)
        remote.extend(cartpole_batch(4))
        assert len(remote) == 4
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 0
        q = procs(args + ["--port", location.rsplit(":", 1)[1]])  # the same address again
        assert b"serving" in q.stdout.readline()
        assert len(remote) == 0  # a new, empty store behind the same address
        q.send_signal(signal.SIGINT)
        assert q.wait(20) == 0
        remote.close()


def test_both_writers_return_the_rows_ids_from_extend(servers):
    """The writer surface: `extend` and `append` wait and return ids, `send` pipelines (as a Ray ShardWriter does)."""
    store = cartpole_store()
    with ab.connect(servers(store).location) as remote, remote.writer(max_in_flight=2) as w:
        ids = w.extend(cartpole_batch(4))
        assert ids.dtype == np.int64 and ids.tolist() == [0, 1, 2, 3]
        step = {k: v[0] for k, v in cartpole_batch(1, start=4).items()}
        assert w.append(step) == 4
        w.send(cartpole_batch(3, start=5))
        assert w.flush() == 8 and len(store) == 8
        np.testing.assert_array_equal(store.to_table(["seq"]).column("seq").to_numpy()[:4], ids)


def test_a_bool_tensor_field_samples_over_flight():
    """pyarrow's to_numpy_ndarray refuses bool tensors; a sample over Flight must not."""
    schema = {"name": "bools", "episode_end": [], "truncation": [],
              "fields": {"mask": {"dtype": "bool", "shape": [3]}, "x": {"dtype": "int64"}}}
    mask = np.array([[True, False, True], [False, True, True]])
    with ab.ExperienceStore(schema, capacity=8, seed=0) as store, ab.serve(store) as server:
        store.extend({"mask": mask, "x": np.arange(2)})
        client = ab.connect(server.location)
        got = client.sample(6).to_numpy()
        assert got["mask"].dtype == np.bool_ and np.array_equal(got["mask"], mask[got["x"]])
        client.close()
