"""An extend in parts into a store with ragged fields, straight into its ring (`ServerLimits.parts_into_ring`): the
same store as one extend wherever the ring wraps, nothing of an aborted or cut batch stored, the write lock held
for the batch and given back on every end, and the client's pipelined parts (`parts.pipelined`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.flight import parts as P
from arrowbuf.flight.parts import split_rows

#: GRPO-like: ragged tokens and logprobs, a ragged field and a scalar filled later, episode ends.
RAGGED = {"name": "rag", "fields": {
    "prompt_id": {"dtype": "int64"},
    "tokens": {"dtype": "int32", "ragged": True},
    "logprobs": {"dtype": "float32", "ragged": True},
    "ref": {"dtype": "float32", "ragged": True, "later": True},
    "reward": {"dtype": "float32", "later": True},
    "done": {"dtype": "bool"}},
    "episode_end": ["done"]}
MIB = 1 << 20


def _ragged(rng: np.random.Generator, lens: np.ndarray, dtype: type) -> pa.Array:
    offs = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
    total = int(offs[-1])
    values = rng.integers(0, 1000, total).astype(dtype) if dtype is np.int32 else rng.random(total, np.float32)
    return pa.ListArray.from_arrays(pa.array(offs), pa.array(values))


def _batch(n: int, seed: int = 0, hi: int = 300, ref: bool = True) -> dict:
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, hi + 1, n)
    out = {"prompt_id": np.arange(seed * 100_000, seed * 100_000 + n), "tokens": _ragged(rng, lens, np.int32),
           "logprobs": _ragged(rng, lens, np.float32), "done": (np.arange(n) % 8) == 7}
    if ref:
        out["ref"] = _ragged(rng, lens, np.float32)
    return out


def _values(store) -> list:
    return store.to_table().select(["prompt_id", "tokens", "logprobs", "ref", "reward", "done"]).to_pylist()


@pytest.fixture
def servers(servers):
    def start(stores, **kw):
        kw.setdefault("parts_into_ring", True)
        return servers(stores, **kw)

    return start


def test_a_parted_ragged_put_gives_the_same_store_as_one_extend(servers):
    parted = ab.ExperienceStore(RAGGED, capacity=3000, chunk_rows=256)
    whole = ab.ExperienceStore(RAGGED, capacity=3000, chunk_rows=256)
    server = servers(parted, max_batch_bytes=MIB)
    remote = ab.connect(server.location)
    try:
        assert remote.parts_into_ring
        for k in range(4):  # 1200 rows a batch: the ring (3000 rows + a spare chunk) wraps inside the third
            batch = _batch(1200, k)
            assert remote.to_batch(batch).nbytes > 2 * MIB  # several parts
            ids = remote.extend(batch)
            np.testing.assert_array_equal(ids, whole.extend(batch))
            assert parted.to_table().equals(whole.to_table())
        assert len(parted) == 3000
        # later fields fill as on one extend's rows
        assert parted.update(ids[:5], {"reward": np.ones(5, np.float32)}) == 5
        whole.update(ids[:5], {"reward": np.ones(5, np.float32)})
        assert _values(parted) == _values(whole)
        a, b = parted.sample(64), whole.sample(64)  # sampleable, packed as one extend's
        assert a.to_torch(pack=True)["tokens"].shape[0] > 0 and len(b) == 64
    finally:
        remote.close()
        parted.close()
        whole.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 30), min_size=1, max_size=4), st.integers(0, 200), st.integers(0, 4),
       st.integers(0, 40))
def test_ragged_pieces_equal_one_extend_wherever_the_ring_wraps(cuts, before, fail_at, hi):
    """Pieces of a ragged batch at any sizes, after any number of rows (the rows wrap the ring anywhere, chunk slots
    fill across pieces): the store equals one extend's; an abort after `fail_at` pieces stores nothing of the batch,
    gives the write lock back, and the ring stays usable."""
    n = sum(cuts)
    a = ab.ExperienceStore(RAGGED, capacity=128, chunk_rows=16)
    b = ab.ExperienceStore(RAGGED, capacity=128, chunk_rows=16)
    try:
        if before:
            a.extend(_batch(before, 7, hi))
            b.extend(_batch(before, 7, hi))
        batch = _batch(n, 1, hi)
        rb = pa.RecordBatch.from_pydict({k: pa.array(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()})
        if fail_at < len(cuts):
            sink = a.begin_extend(n, rb.schema.names)
            off = 0
            for c in cuts[:fail_at]:
                sink.write(rb.slice(off, c))
                off += c
            sink.abort()
            got, full = _values(a), _values(b)  # nothing of it stored; at most rows it evicted for room are gone
            assert len(got) == len(a) and got == full[len(full) - len(got):] and len(got) >= min(len(full), 128 - n)
        sink = a.begin_extend(n, rb.schema.names)
        off = 0
        for c in cuts:
            sink.write(rb.slice(off, c))
            off += c
        ids = sink.commit()
        want = b.extend(batch)
        assert np.array_equal(ids, np.arange(ids[0], ids[0] + n)) and len(ids) == len(want)
        got, full = _values(a), _values(b)
        if fail_at >= len(cuts):
            assert a.to_table().equals(b.to_table())
        else:  # the aborted batch's hole took ring room (as a dead writer's): at most older rows are gone
            assert len(got) >= min(len(full), 128 - n) and got == full[len(full) - len(got):]
        a.extend(_batch(5, 9, hi))  # the write lock was given back
    finally:
        a.close()
        b.close()


def test_a_bad_piece_of_a_ragged_batch_stores_nothing_and_gives_the_lock_back():
    store = ab.ExperienceStore(RAGGED, capacity=256, chunk_rows=16)
    try:
        store.extend(_batch(20, 3))
        before = store.to_table()
        rb = pa.RecordBatch.from_pydict({k: pa.array(v) if isinstance(v, np.ndarray) else v
                                         for k, v in _batch(40, 1).items()})
        bad = rb.set_column(1, "tokens", pa.array([["x"]] * 40, pa.list_(pa.string()))).slice(20, 20)
        sink = store.begin_extend(40, rb.schema.names)
        try:
            sink.write(rb.slice(0, 20))
            with pytest.raises(ab.SchemaError):
                sink.write(bad)
        finally:
            sink.abort()
        assert store.to_table().equals(before)
        assert len(store.extend(_batch(10, 4))) == 10  # not blocked: the lock was given back
    finally:
        store.close()


def test_shared_memory_ragged_stores_assemble_parts():
    name = f"ragparts-{os.getpid()}"
    schema = {**RAGGED, "fields": {k: {**v, "mean_length": 64} if v.get("ragged") else v
                                    for k, v in RAGGED["fields"].items()}}
    store = ab.ExperienceStore(schema, capacity=64, tier="shm", name=name)
    try:  # a shared store's ragged values are written under the cross-process lock: never held across a stream
        assert store.begin_extend(10, ["prompt_id", "tokens", "logprobs", "done"]) is None
    finally:
        store.close()


_CLIENT = textwrap.dedent("""
    import json, sys, time
    import numpy as np, pyarrow as pa, pyarrow.flight as flight
    import arrowbuf as ab
    from arrowbuf.flight.parts import split_rows
    remote = ab.connect(sys.argv[1])
    n = 600
    lens = np.full(n, 50)
    offs = pa.array(np.concatenate(([0], np.cumsum(lens))).astype(np.int32))
    rag = pa.ListArray.from_arrays(offs, pa.array(np.ones(int(lens.sum()), np.float32)))
    tok = pa.ListArray.from_arrays(offs, pa.array(np.ones(int(lens.sum()), np.int32)))
    rb = remote.to_batch({"prompt_id": np.arange(n), "tokens": tok, "logprobs": rag, "done": np.ones(n, bool)})
    parts = [rb.slice(o, k) for o, k in split_rows(rb, 1 << 15)]
    client = flight.FlightClient(sys.argv[1])
    cmd = {"v": 3, "kind": "extend", "parts": len(parts), "rows": rb.num_rows}
    writer, reader = client.do_put(flight.FlightDescriptor.for_command(json.dumps(cmd).encode()), rb.schema)
    for p in parts[:2]:
        writer.write_batch(p)
    print("sent", flush=True)
    time.sleep(60)
""")


def test_a_client_killed_mid_ragged_parts_leaves_no_rows_and_releases_the_store(servers):
    store = ab.ExperienceStore(RAGGED, capacity=2048, chunk_rows=256)
    server = servers(store, max_batch_bytes=MIB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _CLIENT, server.location], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"sent"
        assert len(store) == 0  # parts are in the ring's reserved rows, not visible
        time.sleep(1.0)  # the first part reaches the server (sent is not yet received)
        out: list = []
        t = threading.Thread(target=lambda: out.append(store.extend(_batch(100, 3))))
        t.start()
        t.join(0.5)
        assert t.is_alive()  # the ragged batch in parts holds the write lock (parts_into_ring is opt-in)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t.join(30)  # the server aborts the cut stream: the lock is given back, its rows are a hole
        assert not t.is_alive() and len(out[0]) == 100
        assert len(store) == 100
        assert [r["prompt_id"] for r in _values(store)] == list(range(300_000, 300_100))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        store.close()


@pytest.mark.parametrize("into_ring", [False, True])
def test_a_stalled_ragged_batch_holds_back_writers_and_updates_only_with_parts_into_the_ring(servers, into_ring):
    store = ab.ExperienceStore(RAGGED, capacity=4096, chunk_rows=256)
    ids = store.extend(_batch(10, 5))
    server = servers(store, max_batch_bytes=MIB, parts_into_ring=into_ring)
    remote = ab.connect(server.location)
    client = flight.FlightClient(server.location)
    try:
        assert remote.parts_into_ring is into_ring
        rb = remote.to_batch(_batch(1500, 1))
        parts = [rb.slice(o, n) for o, n in split_rows(rb, MIB // 4)]
        cmd = {"v": 3, "kind": "extend", "parts": len(parts), "rows": rb.num_rows}
        writer, reader = client.do_put(flight.FlightDescriptor.for_command(json.dumps(cmd).encode()), rb.schema,
                                       options=flight.FlightCallOptions(timeout=30))
        writer.write_batch(parts[0])  # ... and stalls
        time.sleep(0.5)
        done = threading.Event()
        threading.Thread(target=lambda: (store.update(ids[:2], {"reward": np.ones(2, np.float32)}),
                                         store.extend(_batch(10, 9)), done.set()), daemon=True).start()
        assert done.wait(3.0) is (not into_ring)
        with pytest.raises(flight.FlightError, match="ended after 1 of"):
            writer.close()
        assert done.wait(10.0)
        assert len(store) == 20
    finally:
        client.close()
        remote.close()
        store.close()


def test_a_large_batch_goes_in_parts_only_to_a_server_that_writes_them_into_the_ring(servers, monkeypatch):
    monkeypatch.setattr(P, "PIPELINE_PART_BYTES", 64 * 1024)
    sent: list = []
    import arrowbuf.flight.client as C

    real = C.split_rows
    monkeypatch.setattr(C, "split_rows", lambda rb, limit: sent.append(limit) or real(rb, limit))
    into = ab.ExperienceStore(RAGGED, capacity=4096)
    other = ab.ExperienceStore(RAGGED, capacity=4096)
    a = ab.connect(servers(into).location)
    b = ab.connect(servers(other, parts_into_ring=False).location)
    try:
        assert a.parts_into_ring and not b.parts_into_ring
        batch = _batch(600, 2)
        assert 2 * 64 * 1024 < a.to_batch(batch).nbytes < a.max_batch_bytes
        np.testing.assert_array_equal(a.extend(batch), b.extend(batch))
        assert sent == [64 * 1024]  # only to the server that writes parts into the ring
        assert into.to_table().equals(other.to_table())
        small = _batch(5, 3)  # under 2 x the part size: one message
        a.extend(small)
        assert sent == [64 * 1024]
    finally:
        a.close()
        b.close()
        into.close()
        other.close()


def test_a_durable_store_does_not_ask_for_pipelined_parts(servers, tmp_path):
    store = ab.ExperienceStore(RAGGED, capacity=64, durable=tmp_path / "d", durability="os")
    remote = ab.connect(servers(store).location)
    try:
        assert not remote.parts_into_ring  # it journals a batch whole: parts would only add an assembly
    finally:
        remote.close()
        store.close()


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1 << 40), st.one_of(st.none(), st.integers(1, 1 << 40)), st.booleans())
def test_pipelined_part_sizes_are_bounded(nbytes, max_batch_bytes, into_ring):
    limit = P.pipelined(nbytes, max_batch_bytes, into_ring)
    if max_batch_bytes is None:
        assert limit is None
    elif into_ring and nbytes > 2 * P.PIPELINE_PART_BYTES:
        assert limit is not None and 1 <= limit <= min(max_batch_bytes, P.PIPELINE_PART_BYTES)
    elif nbytes > max_batch_bytes:
        assert limit == P.part_bytes(max_batch_bytes)
    else:
        assert limit is None
    if limit is not None:  # a part never exceeds what the server takes in one message
        assert limit <= max_batch_bytes


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=2)))
def test_the_describe_flag_is_taken_only_when_it_is_true(value):
    from arrowbuf.flight.client import into_ring_of

    assert into_ring_of({"parts_into_ring": value}, (1, 2, 3)) is (value is True)
    assert into_ring_of({"parts_into_ring": value}, (1, 2)) is False  # a server before parts
    assert into_ring_of({}, (1, 2, 3)) is False


def test_closing_the_server_ends_a_stalled_ragged_batch_and_frees_the_store(servers):
    """A stalled ragged batch in parts holds the store's write lock; closing the server cuts its stream, which
    aborts the batch, so the store closes (its close takes the write lock) instead of waiting for the client."""
    store = ab.ExperienceStore(RAGGED, capacity=4096, chunk_rows=256)
    server = servers(store, max_batch_bytes=MIB)
    remote = ab.connect(server.location)
    client = flight.FlightClient(server.location)
    try:
        rb = remote.to_batch(_batch(1500, 1))
        parts = [rb.slice(o, n) for o, n in split_rows(rb, MIB // 4)]
        cmd = {"v": 3, "kind": "extend", "parts": len(parts), "rows": rb.num_rows}
        writer, _ = client.do_put(flight.FlightDescriptor.for_command(json.dumps(cmd).encode()), rb.schema,
                                  options=flight.FlightCallOptions(timeout=30))
        writer.write_batch(parts[0])  # ... and stalls
        time.sleep(0.5)
        t0 = time.monotonic()
        server.close()
        closed = threading.Event()
        threading.Thread(target=lambda: (store.close(), closed.set()), daemon=True).start()
        assert closed.wait(15.0), "the store's close waited for the stalled client"
        assert time.monotonic() - t0 < 15.0
        try:
            writer.close()
        except flight.FlightError:
            pass
    finally:
        client.close()
        remote.close()


def _hostile_offsets_batch() -> pa.RecordBatch:
    """Offsets [0, 3, 1]: first and last within the values (Arrow's cheap validation, which the IPC reader runs,
    passes) but decreasing, so row 0 spans 3 values of which 1 exists and row 1 has length -2."""
    offsets = pa.py_buffer(np.array([0, 3, 1], np.int32).tobytes())
    values = pa.array(np.arange(5, dtype=np.int32))
    tokens = pa.Array.from_buffers(pa.list_(pa.int32()), 2, [None, offsets], children=[values])
    return pa.RecordBatch.from_arrays([tokens, pa.array([True, True])], names=["tokens", "done"])


RAGGED_ONE = {"name": "r1", "fields": {"tokens": {"dtype": "int32", "ragged": True}, "done": {"dtype": "bool"}},
              "episode_end": ["done"]}


def test_a_ragged_column_with_decreasing_offsets_is_refused_locally():
    store = ab.ExperienceStore(RAGGED_ONE, capacity=64, chunk_rows=16)
    try:
        with pytest.raises(ab.SchemaError, match="offsets"):
            store.extend(_hostile_offsets_batch())
        assert len(store) == 0
    finally:
        store.close()
    later = ab.ExperienceStore(RAGGED, capacity=64, chunk_rows=16)  # the same check on update (a later field)
    try:
        ids = later.extend(_batch(2, 1, ref=False))
        with pytest.raises(ab.SchemaError, match="offsets"):
            later.update(ids, {"ref": _hostile_offsets_batch().column(0).cast(pa.list_(pa.float32()))})
        assert later.to_table().column("ref").to_pylist() == [None, None]
    finally:
        later.close()


@pytest.mark.parametrize("parts", [None, 1])
def test_a_ragged_column_with_decreasing_offsets_is_refused_over_flight(servers, parts):
    """A hostile client's offsets would make the store read values it never wrote (another row's, or stale arena
    memory) and store a negative length: refused, nothing stored, in one message and in parts."""
    store = ab.ExperienceStore(RAGGED_ONE, capacity=64, chunk_rows=16)
    server = servers(store)
    client = flight.FlightClient(server.location)
    try:
        store.extend({"tokens": pa.array([[7, 8]], pa.list_(pa.int32())), "done": np.array([True])})
        before = store.to_table()
        rb = _hostile_offsets_batch()
        cmd = {"v": 3, "kind": "extend"} if parts is None else {"v": 3, "kind": "extend", "parts": 1, "rows": 2}
        writer, reader = client.do_put(flight.FlightDescriptor.for_command(json.dumps(cmd).encode()), rb.schema)
        with pytest.raises(flight.FlightError, match="offsets"):
            writer.write_batch(rb)
            writer.done_writing()
            reader.read()
            writer.close()
        assert store.to_table().equals(before)
        assert len(store.extend({"tokens": pa.array([[1]], pa.list_(pa.int32())), "done": np.array([True])})) == 1
    finally:
        client.close()
        store.close()


def test_a_parted_ragged_batch_over_the_capacity_keeps_the_newest_rows_as_one_extend(servers):
    """A batch longer than the ring is not written in pieces (`pieces_ok`): the server assembles it and extends once,
    which keeps its newest rows, as a local extend does."""
    parted = ab.ExperienceStore(RAGGED, capacity=500, chunk_rows=64)
    whole = ab.ExperienceStore(RAGGED, capacity=500, chunk_rows=64)
    remote = ab.connect(servers(parted, max_batch_bytes=MIB).location)
    try:
        assert parted.begin_extend(1200, list(RAGGED["fields"])) is None
        batch = _batch(1200, 4)
        assert remote.to_batch(batch).nbytes > 2 * MIB
        np.testing.assert_array_equal(remote.extend(batch), whole.extend(batch))
        assert len(parted) == 500 and parted.to_table().equals(whole.to_table())
    finally:
        remote.close()
        parted.close()
        whole.close()
