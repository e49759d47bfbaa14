"""The tq.v2 server (`arrowbuf.compat.transfer_queue.server.TQServer`) under hostile clients: every request is
bounded before bulk data is read, allocation follows the bytes a client sent (docs/security.md, "What a request may
make a server allocate"), and errors carry a code, never a traceback or a server path. Real servers on 127.0.0.1:0.

Each test here failed on the server before issue 42 (the finding it checks is in its docstring; the protocol was
tq.v1 then, the same rules hold for tq.v2)."""

from __future__ import annotations

import gc
import json
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from arrowbuf.compat.transfer_queue.columns import FieldKind, FieldValues, field_values
from arrowbuf.compat.transfer_queue.limits import TQLimits
from arrowbuf.compat.transfer_queue.remote import RemoteBackend
from arrowbuf.compat.transfer_queue.server import TQServer
from arrowbuf.compat.transfer_queue.state import StorageKeyNotFoundError, TQState
from arrowbuf.compat.transfer_queue.wire import arrow_type
from arrowbuf.errors import InvalidArgument
from arrowbuf.serving.limits import SERVERS, InsecureServerWarning

ROOT = Path(__file__).resolve().parents[1]
CALL = flight.FlightCallOptions(timeout=60)
F32 = FieldKind("tensor", "float32")


def _insert(backend: Any, pid: str, dense: np.ndarray, field: str = "x") -> list[int]:
    """New samples of `pid` with `dense` as `field` (TransferQueue's put without metadata: insert, then put)."""
    gidx = backend.get_meta(pid, [field], len(dense), "insert")["global_indexes"]
    backend.put(pid, gidx, {field: FieldValues(FieldKind("tensor", dense.dtype.name), len(dense), dense=dense)}, [])
    return gidx


@pytest.fixture
def served():
    state = TQState(capacity=4096)
    server = TQServer(state)
    client = flight.FlightClient(server.location)
    try:
        yield state, server, client
    finally:
        client.close()
        server.close()
        state.close()


def _put_command(pid: str, kinds: dict[str, FieldKind], rows: int = 0, **extra: Any) -> bytes:
    return json.dumps({"op": "put", "partition_id": pid, "gidx": list(range(rows)), "nested": [],
                       "kinds": {f: k.to_json() for f, k in kinds.items()}, **extra}).encode()


def _refusal(exc: BaseException) -> dict[str, Any]:
    """The status detail of a tq.v2 error (and: no traceback, no server path in anything the client sees)."""
    text = str(exc)
    assert "Traceback" not in text and str(ROOT) not in text and "File \"" not in text, text[:600]
    assert isinstance(exc, flight.FlightError), text[:300]
    detail = json.loads(exc.extra_info)
    assert set(detail) >= {"error", "code", "message"}, detail
    return detail


def _wire_bytes(descriptor: bytes, table: pa.Table) -> int:
    """Bytes a put sends: its descriptor, its schema message and its record batch messages."""
    return len(descriptor) + table.schema.serialize().size + sum(b.serialize().size for b in table.to_batches())


def test_a_read_naming_one_sample_many_times_is_refused_not_amplified(served):
    """Finding: a 945-byte read ticket repeating one id 300 times got a 300x reply."""
    state, server, client = served
    backend = RemoteBackend(server.location)
    _insert(backend, "p", np.ones((1, 256), np.float32))
    ticket = json.dumps({"op": "read", "partition_id": "p", "gidx": [0] * 300, "fields": ["x"]}).encode()
    with pytest.raises(flight.FlightError) as err:
        client.do_get(flight.Ticket(ticket), CALL).read_all()
    detail = _refusal(err.value)
    assert detail["code"] == "INVALID_ARGUMENT" and "more than once" in detail["message"]
    ok = client.do_get(flight.Ticket(json.dumps({"op": "read", "partition_id": "p", "gidx": [0],
                                                 "fields": ["x"]}).encode()), CALL).read_all()
    assert ok.num_rows == 1  # each sample once is served
    backend.close_client()


def test_a_put_without_columns_creates_no_samples_from_its_length_field(served):
    """Finding: the sample count came from the IPC length field (no columns: 5,000,000 samples from zero data)."""
    state, server, client = served
    table = pa.table({"x": pa.nulls(5_000_000)}).select([])  # no columns, a length of 5,000,000
    command = _put_command("empty", {})
    with pytest.raises(flight.FlightError) as err:
        writer, reader = client.do_put(flight.FlightDescriptor.for_command(command), table.schema, CALL)
        with writer:
            writer.write_table(table)
            writer.done_writing()
            reader.read()
    assert _refusal(err.value)["code"] == "INVALID_ARGUMENT"
    assert "empty" not in state.partitions  # nothing was created


def test_a_sample_of_zero_bytes_is_refused(served):
    """Same finding, with a column: a field of shape [0] carries no bytes per sample, so its rows are free to
    send; the server refuses it rather than keep bookkeeping for millions of samples."""
    state, server, client = served
    kind = F32
    typ = arrow_type(kind, False, (0,))
    storage = pa.array([[]] * 50_000, pa.list_(pa.float32(), 0))
    table = pa.table({"x": pa.ExtensionArray.from_storage(typ, storage)})
    with pytest.raises(flight.FlightError) as err:
        writer, reader = client.do_put(flight.FlightDescriptor.for_command(_put_command("z", {"x": kind}, 50_000)),
                                       pa.schema([pa.field("x", typ)]), CALL)
        with writer:
            writer.write_table(table)
            writer.done_writing()
            reader.read()
    assert _refusal(err.value)["code"] == "INVALID_ARGUMENT"
    assert "z" not in state.partitions


def _traced(fn: Any) -> int:
    """Bytes `fn()` leaves allocated in this process (Python and numpy through tracemalloc, Arrow's pool)."""
    gc.collect()
    tracemalloc.start()
    try:
        before, arrow = tracemalloc.get_traced_memory()[0], pa.total_allocated_bytes()
        fn()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before + max(0, pa.total_allocated_bytes() - arrow)
    finally:
        tracemalloc.stop()


def test_a_one_float_put_into_a_new_partition_allocates_a_bounded_multiple_of_its_bytes(served):
    """Finding: each new partition was a new store of 65,536 rows (120 one-float puts: +256 MiB of RSS)."""
    state, server, client = served
    rule = SERVERS["tq.v2"].allocation
    backend = RemoteBackend(server.location)
    one = np.ones(1, np.float32)
    _insert(backend, "warm", one)  # the server's first calls: its own set-up
    table = pa.table({"x": pa.array(one)})
    for k in range(3):
        used = _traced(lambda k=k: _insert(backend, f"new-{k}", one))
        insert = json.dumps({"partition_id": f"new-{k}", "data_fields": ["x"], "batch_size": 1,
                             "mode": "insert", "task_name": None, "sampler": None, "sampling_config": {}})
        sent = len(insert) + _wire_bytes(_put_command(f"new-{k}", {"x": F32}, 1), table)
        assert used <= rule.bound(sent, rows=1), (used, sent, rule)
    backend.close_client()


def test_task_names_are_bounded_in_length_and_number(served):
    """Finding: any task name (up to 1,024 characters, as many as a client likes) allocated a per-task array."""
    state, server, client = served
    backend = RemoteBackend(server.location)
    _insert(backend, "p", np.ones(4, np.float32))

    def get_meta(task: str) -> None:
        body = {"partition_id": "p", "data_fields": ["x"], "batch_size": 1, "mode": "fetch", "task_name": task}
        list(client.do_action(flight.Action("tq.v2.get_meta", json.dumps(body).encode()), CALL))

    with pytest.raises(flight.FlightError) as err:
        get_meta("t" * (server.limits.max_task_chars + 1))
    assert _refusal(err.value)["code"] == "INVALID_ARGUMENT"
    for i in range(server.limits.max_tasks):
        get_meta(f"task-{i}")
    with pytest.raises(flight.FlightError) as err:
        get_meta("one-more")
    assert _refusal(err.value)["code"] == "RESOURCE_EXHAUSTED"
    # asking for the status of a task that does not exist creates nothing
    body = {"partition_id": "p", "task_name": "never-consumed"}
    list(client.do_action(flight.Action("tq.v2.consumption_status", json.dumps(body).encode()), CALL))
    get_meta("task-0")  # an existing task still consumes
    backend.close_client()


def test_partitions_are_capped():
    """Finding: partitions (each a store) were unbounded in number."""
    state = TQState(capacity=64)
    with TQServer(state, max_partitions=3) as server:
        backend = RemoteBackend(server.location)
        for k in range(3):
            _insert(backend, f"p{k}", np.ones(1, np.float32))
        with pytest.raises(Exception, match="max_partitions"):
            _insert(backend, "p3", np.ones(1, np.float32))
        with pytest.raises(Exception, match="max_partitions"):
            backend.kv_put("p4", ["k"], {}, [], [{"a": 1}])
        assert sorted(state.partitions) == ["p0", "p1", "p2"]
        backend.close_client()
    state.close()


def test_a_put_over_the_upload_cap_is_refused_before_the_next_message_and_writes_nothing():
    """Finding: puts were buffered up to 16 GiB per stream. (The values of a put are written as they arrive: the
    rows written before the refusal are dead, never registered.)"""
    state = TQState(capacity=64)
    state.get_meta("big", ["x"], 800, "insert")
    with TQServer(state, max_upload_bytes=1 << 20) as server:
        client = flight.FlightClient(server.location)
        kind = F32
        batch = pa.record_batch({"x": pa.FixedShapeTensorArray.from_numpy_ndarray(np.ones((200, 1024), np.float32))})
        with pytest.raises(flight.FlightError) as err:
            writer, reader = client.do_put(flight.FlightDescriptor.for_command(_put_command("big", {"x": kind}, 800)),
                                           batch.schema, CALL)
            with writer:
                for _ in range(4):  # 800 KiB each
                    writer.write_batch(batch)
                writer.done_writing()
                reader.read()
        assert _refusal(err.value)["code"] == "RESOURCE_EXHAUSTED"
        assert not state.partitions["big"].fields and not state.partitions["big"].info
        assert state.production_status("big", ["x"]) is None  # the field was never registered
        client.close()
    state.close()


def _open_put(client: flight.FlightClient, pid: str) -> Any:
    kind = {"x": F32}
    writer, reader = client.do_put(flight.FlightDescriptor.for_command(_put_command(pid, kind, 1)),
                                   pa.schema([pa.field("x", pa.float32())]), CALL)
    return writer, reader


def test_open_put_streams_are_capped_and_an_idle_one_gives_its_slot_to_a_new_put():
    """Finding: no cap on put streams (each may buffer data) and no idle timeout."""
    state = TQState(capacity=64)
    with TQServer(state, max_concurrent_streams=2, idle_timeout=0.5) as server:
        a, b, c = (flight.FlightClient(server.location) for _ in range(3))
        state.get_meta("p", ["x"], 1, "insert")
        held = [_open_put(a, "p"), _open_put(b, "p")]
        assert server.calls.wait_for(lambda r: r["stream"] == 2, timeout=30)
        threading.Event().wait(1.0)  # both now idle for longer than idle_timeout
        writer, reader = _open_put(c, "p")
        with writer:
            writer.write_batch(pa.record_batch({"x": pa.array([1.0], pa.float32())}))
            writer.done_writing()
            assert json.loads(reader.read().to_pybytes()) == {"result": None}
        assert state.read("p", [0], ["x"])["x"].dense.tolist() == [1.0]
        for w, _ in held:
            try:
                w.close()
            except flight.FlightError:
                pass  # cut by the server
        for cl in (a, b, c):
            cl.close()
    state.close()


def test_deeply_nested_json_is_an_invalid_argument_with_a_code_and_no_traceback(served):
    """Finding: tq.v1 mapped only KeyError/ValueError: a RecursionError from deeply nested JSON reached the client
    with a traceback and server paths."""
    state, server, client = served
    deep = b"[" * 200_000 + b"]" * 200_000
    for call in (lambda: list(client.do_action(flight.Action("tq.v2.get_meta", deep), CALL)),
                 lambda: client.do_get(flight.Ticket(deep), CALL).read_all(),
                 lambda: list(client.do_action(flight.Action("tq.v2.set_custom_meta", b'{"custom_meta": '
                                                             + b"[" * 5000 + b"]" * 5000 + b"}"), CALL))):
        with pytest.raises(flight.FlightError) as err:
            call()
        detail = _refusal(err.value)
        assert detail["code"] in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"), detail


def test_an_unexpected_error_is_internal_without_details(served, monkeypatch):
    state, server, client = served

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"secret detail at {ROOT}/arrowbuf/compat/transfer_queue/state.py")

    monkeypatch.setattr(state, "kv_list", boom)
    with pytest.raises(flight.FlightError) as err:
        list(client.do_action(flight.Action("tq.v2.kv_list", b"{}"), CALL))
    detail = _refusal(err.value)
    assert detail["code"] == "INTERNAL" and "secret" not in str(err.value)


def test_a_non_loopback_bind_needs_a_token_unless_explicitly_allowed():
    """Finding: TQServer bound any host without a token and without the warning `ab.serve` gives."""
    state = TQState(capacity=16)
    with pytest.raises(InvalidArgument, match="token"):
        TQServer(state, "grpc://192.0.2.1:0")  # TEST-NET-1: never bound, refused before
    with pytest.warns(InsecureServerWarning, match="without a token"), pytest.raises(Exception) as err:
        TQServer(state, "grpc://192.0.2.1:0", allow_unauthenticated=True)  # warned, then the bind itself fails
    assert not isinstance(err.value, InvalidArgument)
    state.close()


def test_a_token_guards_every_call_when_set():
    state = TQState(capacity=16)
    with TQServer(state, token="s3cret") as server:
        client = flight.FlightClient(server.location)
        with pytest.raises(flight.FlightUnauthenticatedError):
            list(client.do_action(flight.Action("tq.v2.kv_list", b"{}"), CALL))
        ok = RemoteBackend(server.location, token="s3cret")
        assert ok.kv_list(None) == {}
        ok.close_client()
        client.close()
    state.close()


def test_the_limits_are_validated_and_stated():
    with pytest.raises(InvalidArgument, match="max_upload_bytes"):
        TQLimits(max_upload_bytes=0)
    with pytest.raises(InvalidArgument, match="unknown"):
        TQLimits().with_overrides(bogus=1)
    state = TQState(capacity=16)
    with TQServer(state, max_tasks=5) as server:
        client = flight.FlightClient(server.location)
        described = json.loads(list(client.do_action(flight.Action("tq.v2.limits", b"{}"), CALL))[0].body.to_pybytes())
        assert described["result"]["max_tasks"] == 5 and set(SERVERS["tq.v2"].limits) <= set(described["result"])
        client.close()
    state.close()


def test_a_field_group_grows_from_a_few_rows_and_reads_back_across_growth_and_eviction():
    """The small first store (issue 42) grows by copying its rows; ids stay valid across each growth, and past the
    partition's capacity the oldest values are evicted as before."""
    from arrowbuf.compat.transfer_queue import partition

    state = TQState(capacity=100)
    written: list[tuple[int, float]] = []
    n = 0
    for size in [1, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37]:
        vals = np.arange(n, n + size, dtype=np.float32)
        gidx = state.get_meta("p", ["x"], size, "insert")["global_indexes"]
        state.put("p", gidx, {"x": FieldValues(F32, size, dense=vals)})
        written += list(zip(gidx, vals.tolist(), strict=True))
        n += size
        group = state.partitions["p"].stores[0]
        assert group.store.capacity <= max(partition.INITIAL_ROWS, 2 * n)  # grows with what it holds
        live = written[-100:]
        got = state.read("p", [g for g, _ in live], ["x"])
        assert got["x"].dense.tolist() == [v for _, v in live]
    assert state.partitions["p"].stores[0].store.capacity == 100
    with pytest.raises(StorageKeyNotFoundError, match="evicted"):
        state.read("p", [written[0][0]], ["x"])
    state.close()


def test_key_lookups_name_each_sample_once(served):
    """The read's rule for the lookups whose replies repeat stored values (a 1,024-character key named 500,000 times
    by a 1 MiB request would be a 500 MB reply)."""
    state, server, client = served
    backend = RemoteBackend(server.location)
    backend.kv_put("p", ["k" * 1024], {"x": FieldValues(F32, 1, dense=np.ones(1, np.float32))}, [], [{"a": 1}])
    for op, body in (("kv_retrieve_keys", {"partition_id": "p", "gidx": [0] * 1000}),
                     ("kv_retrieve_meta", {"partition_id": "p", "keys": ["k" * 1024] * 1000})):
        with pytest.raises(flight.FlightError) as err:
            list(client.do_action(flight.Action(f"tq.v2.{op}", json.dumps(body).encode()), CALL))
        assert "more than once" in _refusal(err.value)["message"]
    assert backend.kv_retrieve_keys("p", [0]) == ["k" * 1024]
    assert backend.kv_retrieve_meta("p", ["k" * 1024])["custom_meta"] == [{"a": 1}]
    backend.close_client()


def test_a_put_in_flight_keeps_its_rows_when_another_put_needs_its_group_to_grow():
    """A Flight put's rows are written after its plan, with the state lock released (the streamed put): a second
    put that needs the field group to grow meanwhile goes into a new group instead of copying the store under the
    first one's writer; both read back whole."""
    from arrowbuf.compat.transfer_queue import partition

    state = TQState(capacity=1024)
    n0 = partition.INITIAL_ROWS
    first = state.get_meta("p", ["x"], n0, "insert")["global_indexes"]
    state.put("p", first, {"x": FieldValues(F32, n0, dense=np.arange(n0, dtype=np.float32))})
    a_idx = state.get_meta("p", ["x"], 8, "insert")["global_indexes"]
    b_idx = state.get_meta("p", ["x"], 16, "insert")["global_indexes"]
    a_vals = FieldValues(F32, 8, dense=np.full(8, 100.0, dtype=np.float32))
    b_vals = FieldValues(F32, 16, dense=np.full(16, 200.0, dtype=np.float32))
    a = state.plan_put("p", {"x": a_vals.spec()}, [], 8, gidx=a_idx)  # the group grows for it now (16 -> 32 rows)
    b = state.plan_put("p", {"x": b_vals.spec()}, [], 16, gidx=b_idx)  # 40 rows > 32, a's in flight: a new group
    assert b.group != a.group and b.created_group
    state.commit_put(b, state.write_plan(b, {"x": b_vals}))
    state.commit_put(a, state.write_plan(a, {"x": a_vals}))
    got = state.read("p", first + a_idx + b_idx, ["x"])["x"].dense
    assert got.tolist() == list(range(n0)) + [100.0] * 8 + [200.0] * 16
    state.close()


def test_a_put_and_a_read_of_many_messages_round_trip(served):
    """Puts and read replies over `wire.CHUNK_BYTES` travel as several record batches (written, and copied on the
    client, one at a time): the values come back whole and in order."""
    from arrowbuf.compat.transfer_queue.wire import CHUNK_BYTES

    state, server, _ = served
    backend = RemoteBackend(server.location)
    rows = 40
    dense = np.random.default_rng(0).random((rows, CHUNK_BYTES // 4 // 8), dtype=np.float32)  # 2.5 chunks
    gidx = _insert(backend, "big", dense)
    got = backend.read("big", gidx, ["x"])["x"].dense
    np.testing.assert_array_equal(got, dense)
    assert len(state.partitions["big"].stores) == 1
    # the group takes the messages after the first as they arrive; a put of another shape makes the field ragged:
    # its messages (dense on the wire) are converted into the ragged group's form, never written as they are
    wider = np.random.default_rng(1).random((rows, CHUNK_BYTES // 4 // 8 + 3), dtype=np.float32)
    more = _insert(backend, "big", wider)
    assert len(state.partitions["big"].stores) == 2
    old, new = backend.read("big", gidx, ["x"])["x"], backend.read("big", more, ["x"])["x"]
    np.testing.assert_array_equal(np.stack(old.components()), dense)
    np.testing.assert_array_equal(np.stack(new.components()), wider)
    # ragged on the wire (nested values: a column of lists, the shapes in the command) over several messages: the
    # group's rows carry a column of shapes beside the values, so no message is written as it is
    rng = np.random.default_rng(2)
    parts = [rng.random(CHUNK_BYTES // 4 // 8 + int(n), dtype=np.float32) for n in rng.integers(0, 99, rows)]
    gidx = backend.get_meta("nested", ["y"], rows, "insert")["global_indexes"]
    backend.put("nested", gidx, {"y": field_values("y", parts)}, ["y"])
    got = backend.read("nested", gidx, ["y"])["y"].components()
    assert len(got) == rows and all(np.array_equal(a, b) for a, b in zip(got, parts, strict=True))


def test_ragged_and_dense_reads_kept_by_the_caller_are_never_overwritten_by_later_reads(served):
    """A reply's fields are copied into arrays of the client's pool (their pages already mapped, reused from read to
    read): a read that the caller still holds, or a tensor over it, is never the memory of the next read. The values
    come back writable and aligned whether the reply was one message or several."""
    import torch

    from arrowbuf.compat.transfer_queue.columns import to_torch_field
    from arrowbuf.compat.transfer_queue.wire import CHUNK_BYTES

    _, server, _ = served
    backend = RemoteBackend(server.location)
    rng = np.random.default_rng(3)
    rows = 24
    for width, name in ((CHUNK_BYTES // 4 // 8, "many"), (64, "one")):  # several messages, then one
        first = [rng.random(width + int(n), dtype=np.float32) for n in rng.integers(0, 99, rows)]
        second = [rng.random(len(a), dtype=np.float32) for a in first]  # the same sizes: the pool's array fits
        dense = rng.random((rows, width), dtype=np.float32)
        ids = []
        for parts in (first, second):
            gidx = backend.get_meta(name, ["y", "d"], rows, "insert")["global_indexes"]
            backend.put(name, gidx, {"y": field_values("y", parts),
                                     "d": FieldValues(FieldKind("tensor", "float32"), rows, dense=dense + len(ids))},
                        ["y"])
            ids.append(gidx)
        kept = backend.read(name, ids[0], ["y", "d"])
        nested = to_torch_field(kept["y"])
        del kept["d"]  # dropped: its array may serve the next read
        for _ in range(3):
            later = backend.read(name, ids[1], ["y", "d"])
            assert all(np.array_equal(a, b) for a, b in zip(later["y"].components(), second, strict=True))
            np.testing.assert_array_equal(later["d"].dense, dense + 1)
            del later
        assert all(np.array_equal(a, b) for a, b in zip(kept["y"].components(), first, strict=True)), name
        assert all(torch.equal(t, torch.from_numpy(a)) for t, a in zip(nested.unbind(), first, strict=True)), name
        flat = kept["y"].flat
        assert flat.flags.writeable and flat.flags.aligned, name
        flat[0] += 1  # the caller's own memory


def test_a_put_whose_later_message_fails_while_it_is_written_registers_nothing(served):
    """From a put's second message on, each message is written on the put's own thread while the next arrives: an
    error in such a write (here a message whose values disagree with the shapes the command gave) refuses the whole
    put, nothing of it is registered, and the same samples can be put again."""
    state, server, client = served
    backend = RemoteBackend(server.location)
    rows, per = 12, 4
    rng = np.random.default_rng(3)
    parts = [rng.random(int(n), dtype=np.float32) for n in rng.integers(1, 9, rows)]
    gidx = backend.get_meta("p", ["y"], rows, "insert")["global_indexes"]
    shapes = [[len(p)] for p in parts]
    shapes[-1] = [len(parts[-1]) + 1]  # the third message's last sample: one value short of its shape
    column = pa.array([p.tolist() for p in parts], type=pa.list_(pa.float32()))
    table = pa.table({"y": column})
    command = json.dumps({"op": "put", "partition_id": "p", "gidx": gidx, "nested": ["y"],
                          "kinds": {"y": F32.to_json()}, "shapes": {"y": shapes}}).encode()
    with pytest.raises(flight.FlightError) as err:
        writer, reader = client.do_put(flight.FlightDescriptor.for_command(command), table.schema, CALL)
        with writer:
            writer.write_table(table, max_chunksize=per)
            writer.done_writing()
            reader.read()
    assert _refusal(err.value)["code"] == "INVALID_ARGUMENT"
    assert state.production_status("p", ["y"]) is None  # the field was never registered
    backend.put("p", gidx, {"y": field_values("y", parts)}, ["y"])
    got = backend.read("p", gidx, ["y"])["y"].components()
    assert all(np.array_equal(a, b) for a, b in zip(got, parts, strict=True))
