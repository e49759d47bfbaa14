"""What a request may make a server allocate (docs/security.md, "What a request may make a server allocate"), measured
for tiny and malformed requests to each server in this process: at most `multiple` x its bytes, plus the reply it
asked for (bounded on every server), plus `per_row` bytes of bookkeeping per row it stores
(`arrowbuf.serving.limits.SERVERS[...].allocation`). The tq.v1 findings of issue 42 (a 300x read, 5,000,000 samples
from a length field, a 65,536-row store for one float) have their own tests in tests/test_compat_tq_server.py.

Allocation is Python's and numpy's (tracemalloc, peak) plus Arrow's default pool (bytes still held)."""

from __future__ import annotations

import gc
import http.client
import json
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

import arrowbuf as ab
from arrowbuf.serving.limits import SERVERS

CALL = flight.FlightCallOptions(timeout=30)
SCHEMA = {"name": "alloc", "fields": {"x": {"dtype": "float32"}, "done": {"dtype": "bool"}}}


def allocated(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(bytes `fn()` allocated at its peak, its result)."""
    fn()  # warm: first-call caches (decoders, sandbox connections) are no request's doing
    gc.collect()
    tracemalloc.start()
    try:
        arrow = pa.total_allocated_bytes()
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        out = fn()
        peak = tracemalloc.get_traced_memory()[1] - before
        return peak + max(0, pa.total_allocated_bytes() - arrow), out
    finally:
        tracemalloc.stop()


def _refused(fn: Callable[[], Any]) -> Callable[[], int]:
    def call() -> int:
        try:
            fn()
        except (pa.ArrowException, ab.ArrowbufError):
            return 0
        return 0

    return call


@pytest.fixture
def flight_server():
    store = ab.ExperienceStore(SCHEMA, capacity=4096)
    store.extend({"x": np.ones(100, np.float32), "done": np.ones(100, bool)})
    with ab.serve(store) as server:
        client = flight.FlightClient(server.location)
        yield store, server, client
        client.close()
    store.close()


@pytest.mark.parametrize("size", [1 << 10, 1 << 20])
def test_a_malformed_flight_request_allocates_a_bounded_multiple_of_its_bytes(flight_server, size):
    _, _, client = flight_server
    rule = SERVERS["flight"].allocation
    junk = b'{"v": 1, "kind": "sample", "store": "alloc", "n": ' + b"1" * size + b"}"
    deep = b"[" * (size // 2) + b"]" * (size // 2)
    for raw in (junk, deep, b"\xff" * size):
        used, _ = allocated(_refused(lambda raw=raw: client.do_get(flight.Ticket(raw), CALL).read_all()))
        assert used <= rule.bound(len(raw)) + (64 << 10), (used, len(raw))
        used, _ = allocated(_refused(lambda raw=raw: list(client.do_action(flight.Action("stats", raw), CALL))))
        assert used <= rule.bound(len(raw)) + (64 << 10), (used, len(raw))


def test_a_one_row_flight_put_allocates_a_bounded_multiple_of_its_bytes(flight_server):
    store, server, client = flight_server
    rule = SERVERS["flight"].allocation
    batch = pa.record_batch({"x": pa.array([1.0], pa.float32()), "done": pa.array([True])})
    descriptor = flight.FlightDescriptor.for_path("alloc")
    sent = batch.schema.serialize().size + batch.serialize().size + 16

    def put() -> None:
        writer, _ = client.do_put(descriptor, batch.schema, CALL)
        writer.write_batch(batch)
        writer.close()

    used, _ = allocated(put)
    assert used <= rule.bound(sent, rows=1) + (64 << 10), (used, sent)


def _http(port: int, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body or None, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_an_inspector_request_allocates_a_bounded_multiple_of_its_bytes_plus_its_reply():
    from arrowbuf.observe.ui import Inspector

    rule = SERVERS["inspector"].allocation
    store = ab.ExperienceStore(SCHEMA, capacity=4096)
    store.extend({"x": np.ones(100, np.float32), "done": np.ones(100, bool)})
    with Inspector(store, "127.0.0.1:0", token="t") as ins:
        headers = {"Host": f"127.0.0.1:{ins.port}", "Authorization": "Bearer t", "Content-Type": "application/json"}
        for body in (b"x" * 100_000, b"[" * 60_000 + b"]" * 60_000,
                     json.dumps({"query": "SELECT count(*) FROM experience"}).encode()):
            used, (status, reply) = allocated(lambda body=body: _http(ins.port, "POST", "/api/sql", headers, body))
            assert status in (200, 400), status
            assert used <= rule.bound(len(body) + 200, named_bytes=4 * len(reply)) + (256 << 10), (used, len(body))
        used, (status, reply) = allocated(lambda: _http(ins.port, "GET", "/api/overview", headers))
        assert status == 200 and used <= rule.bound(200, named_bytes=4 * len(reply)) + (256 << 10), used
    store.close()


def test_a_tq_request_of_junk_allocates_a_bounded_multiple_of_its_bytes():
    from arrowbuf.compat.transfer_queue.server import TQServer
    from arrowbuf.compat.transfer_queue.state import TQState

    rule = SERVERS["tq.v2"].allocation
    state = TQState(capacity=64, polling_mode=True)
    with TQServer(state) as server:
        client = flight.FlightClient(server.location)
        for raw in (b'{"partition_id": "p", "gidx": [' + b"0, " * 100_000 + b"0]}", b"[" * 500_000,
                    b'{"partition_id": "' + b"p" * 500_000 + b'"}'):
            for call in (lambda raw=raw: list(client.do_action(flight.Action("tq.v2.kv_retrieve_keys", raw), CALL)),
                         lambda raw=raw: client.do_get(flight.Ticket(raw), CALL).read_all()):
                used, _ = allocated(_refused(call))
                assert used <= rule.bound(len(raw)), (used, len(raw))
        client.close()
    state.close()
