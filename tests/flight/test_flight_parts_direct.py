"""An extend in parts written straight into the ring (issue 28): the server's parted DoPut copies each part into
rows it reserved (`arrowbuf.engine.pieces.ExtendInPieces`), with the guarantees of one extend: the same store as one
message, every row or none, consecutive ids, readers never see part of it, and a client that dies or a part that
fails leaves nothing stored and nothing reserved. Real servers on port 0, real client processes."""

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
from arrowbuf.flight.parts import split_rows
from arrowbuf.persist import journal as jr

#: Fixed-width fields only (the direct path): a tensor, a scalar, a field filled later.
FIXED = {"name": "fixed", "fields": {
    "obs": {"dtype": "float32", "shape": [64, 4], "allow_nan": False},
    "x": {"dtype": "int64"},
    "score": {"dtype": "float32", "later": True}}}
MIB = 1 << 20


def _batch(n: int, start: int = 0) -> dict:
    rng = np.random.default_rng(start)
    return {"obs": rng.standard_normal((n, 64, 4), dtype=np.float32), "x": np.arange(start, start + n)}


def _state(store) -> dict:
    t = store.to_table()
    return {"obs": t.column("obs").combine_chunks().storage.flatten().to_numpy().reshape(-1, 64, 4),
            "x": t.column("x").to_numpy(), "score": t.column("score").to_pylist(),
            "ids": np.asarray(store.ids() if hasattr(store, "ids") else t.column("x").to_numpy())}


@pytest.fixture
def servers(servers):
    """conftest's `servers`, with parts written into the ring (`ServerLimits.parts_into_ring`, off by default)."""

    def start(stores, **kw):
        kw.setdefault("parts_into_ring", True)
        return servers(stores, **kw)

    return start


def _raw_put(server, parts, declared, rows, schema) -> None:
    client = flight.FlightClient(server.location)
    cmd = {"v": 3, "kind": "extend", "parts": declared, "rows": rows}
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


def test_the_direct_path_is_taken_only_where_it_keeps_extends_guarantees(tmp_path):
    assert ab.ExperienceStore(FIXED, capacity=64).begin_extend(10, ["obs", "x"]) is not None
    assert ab.ExperienceStore(FIXED, capacity=64).begin_extend(65, ["obs", "x"]) is None  # over the capacity
    ragged = {"name": "r", "fields": {"t": {"dtype": "int32", "ragged": True}}}
    assert ab.ExperienceStore(ragged, capacity=64).begin_extend(10, ["t"]) is not None  # under the write lock
    done = {"name": "d", "fields": {"x": {"dtype": "int64"}, "done": {"dtype": "bool"}}}
    assert ab.ExperienceStore(done, capacity=64).begin_extend(10, ["x", "done"]) is not None  # planned at commit
    assert ab.ExperienceStore(done, capacity=64).begin_extend(10, ["x", "done", "actor"]) is None
    derived = {"name": "n", "fields": {"obs": {"dtype": "float32"}, "done": {"dtype": "bool"}},
               "derived": {"next_obs": {"next_of": "obs"}}}
    assert ab.ExperienceStore(derived, capacity=64).begin_extend(10, ["obs", "done"]) is None  # final observations
    durable = ab.ExperienceStore(FIXED, capacity=64, durable=tmp_path / "d", durability="os")
    try:
        assert durable.begin_extend(10, ["obs", "x"]) is None  # journaled whole (see the durable test)
    finally:
        durable.close()


def test_a_parted_put_gives_the_same_store_as_one_message(servers):
    parted = ab.ExperienceStore(FIXED, capacity=4096)
    whole = ab.ExperienceStore(FIXED, capacity=4096)
    server = servers(parted, max_batch_bytes=MIB)
    remote = ab.connect(server.location)
    try:
        batch = _batch(3000)
        assert remote.to_batch(batch).nbytes > 2 * MIB  # several parts
        np.testing.assert_array_equal(remote.extend(batch), np.arange(3000))
        np.testing.assert_array_equal(whole.extend(batch), np.arange(3000))
        a, b = _state(parted), _state(whole)
        np.testing.assert_array_equal(a["obs"], batch["obs"])
        np.testing.assert_array_equal(a["x"], b["x"])
        assert a["score"] == b["score"] == [None] * 3000  # the later field is empty
        assert parted.to_table().equals(whole.to_table())
        # a second parted batch wraps around the ring (capacity 4096): still whole, ids consecutive
        np.testing.assert_array_equal(remote.extend(_batch(3000, 3000)), np.arange(3000, 6000))
        whole.extend(_batch(3000, 3000))
        assert len(parted) == 4096 and parted.to_table().equals(whole.to_table())
        assert parted.update(np.arange(5000, 5004), {"score": np.ones(4, np.float32)}) == 4  # fills later fields
    finally:
        remote.close()


WITH_DONE = {"name": "episodes", "fields": {
    "obs": {"dtype": "float32", "shape": [64, 4]},
    "x": {"dtype": "int64"},
    "done": {"dtype": "bool"}}}


def test_a_parted_put_with_episode_ends_plans_its_episodes_as_one_extend(servers):
    """Episode ends come with the parts: ids, episode ids, steps and what is sampleable equal one extend's, also when
    a local writer of the server's process writes between parted puts."""
    parted = ab.ExperienceStore(WITH_DONE, capacity=8192)
    whole = ab.ExperienceStore(WITH_DONE, capacity=8192)
    server = servers(parted, max_batch_bytes=MIB)
    remote = ab.connect(server.location)
    try:
        for k in range(3):
            batch = {**_batch(1500, 1500 * k)}
            batch["done"] = (np.arange(1500) % 7) == 6
            batch["done"][-1] = k == 1  # an episode left open across batches
            np.testing.assert_array_equal(remote.extend(batch), whole.extend(batch))
            step = {"obs": np.zeros((64, 4), np.float32), "x": -k, "done": False}
            assert parted.append(step) == whole.append(step)
        assert parted.to_table().equals(whole.to_table())
        assert len(parted) == len(whole) == 4503
    finally:
        remote.close()


@pytest.mark.parametrize("case", ["short", "extra part", "too many rows", "too few rows", "empty part",
                                  "over max_extend_bytes", "part over max_batch_bytes", "bad values"])
def test_a_broken_or_bad_part_refuses_the_whole_batch_and_reserves_nothing(servers, case):
    store = ab.ExperienceStore(FIXED, capacity=2048)
    server = servers(store, max_batch_bytes=MIB, max_extend_bytes=2 * MIB)
    remote = ab.connect(server.location)
    try:
        rb = remote.to_batch(_batch(1500))
        parts = [rb.slice(o, n) for o, n in split_rows(rb, MIB // 4)]
        assert len(parts) >= 3
        declared, rows = len(parts), rb.num_rows
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
        elif case == "over max_extend_bytes":
            big = remote.to_batch(_batch(2100))
            parts = [big.slice(o, n) for o, n in split_rows(big, MIB // 2)]
            declared, rows = len(parts), big.num_rows
        elif case == "part over max_batch_bytes":
            parts = parts[:1] + [rb.slice(parts[0].num_rows)]
            assert parts[1].nbytes > MIB
        elif case == "bad values":  # the last part has a NaN where the schema forbids it
            obs = _batch(rows)["obs"]
            obs[-1, 0, 0] = np.nan
            good = remote.to_batch({"obs": _batch(rows)["obs"], "x": np.arange(rows)})  # the client checks NaN
            t = good.schema.field("obs").type
            storage = pa.FixedSizeListArray.from_arrays(pa.array(obs.reshape(-1)), t.storage_type.list_size)
            bad = pa.RecordBatch.from_arrays([pa.ExtensionArray.from_storage(t, storage), *good.columns[1:]],
                                             schema=good.schema)
            parts[-1] = bad.slice(rows - parts[-1].num_rows)
        with pytest.raises(flight.FlightError) as info:
            _raw_put(server, parts, declared, rows, rb.schema)
        assert json.loads(info.value.extra_info)["code"] == "INVALID_ARGUMENT"
        assert len(store) == 0 and store.to_table().num_rows == 0  # nothing stored
        ids = remote.extend(_batch(1500, 7))  # the ring is usable: a parted batch lands whole after it
        assert len(ids) == 1500 and np.array_equal(ids, np.arange(ids[0], ids[0] + 1500))
        assert len(store) == 1500
        np.testing.assert_array_equal(_state(store)["x"], np.arange(7, 1507))
    finally:
        remote.close()


_CLIENT = textwrap.dedent("""
    import json, sys, time
    import numpy as np, pyarrow as pa, pyarrow.flight as flight
    import arrowbuf as ab
    from arrowbuf.flight.parts import split_rows
    remote = ab.connect(sys.argv[1])
    rb = remote.to_batch({"obs": np.ones((1000, 64, 4), np.float32), "x": np.arange(1000)})
    parts = [rb.slice(o, n) for o, n in split_rows(rb, 1 << 18)]
    client = flight.FlightClient(sys.argv[1])
    cmd = {"v": 3, "kind": "extend", "parts": len(parts), "rows": rb.num_rows}
    writer, reader = client.do_put(flight.FlightDescriptor.for_command(json.dumps(cmd).encode()), rb.schema)
    for p in parts[:2]:
        writer.write_batch(p)
    print("sent", flush=True)
    time.sleep(60)
""")


def test_a_client_killed_mid_parts_leaves_no_rows_and_the_ring_usable(servers):
    store = ab.ExperienceStore(FIXED, capacity=2048)
    server = servers(store, max_batch_bytes=MIB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _CLIENT, server.location], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"sent"
        assert len(store) == 0  # parts are in the ring's reserved rows, not visible
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        out: list = []
        t = threading.Thread(target=lambda: out.append(store.extend(_batch(500, 3))))
        t.start()
        t.join(30)  # the server aborts the cut stream: its reserved rows become a hole, this write commits
        assert not t.is_alive() and len(out[0]) == 500
        assert len(store) == 500
        np.testing.assert_array_equal(_state(store)["x"], np.arange(3, 503))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_readers_never_see_part_of_a_parted_put(servers):
    store = ab.ExperienceStore(FIXED, capacity=8192)
    server = servers(store, max_batch_bytes=256 * 1024)  # many parts
    remote = ab.connect(server.location)
    seen: set = set()
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.add(len(store))
            seen.add(store.to_table(columns=["x"]).num_rows)

    t = threading.Thread(target=watch)
    t.start()
    try:
        for k in range(3):
            remote.extend(_batch(2000, 2000 * k))
    finally:
        stop.set()
        t.join()
        remote.close()
    assert seen <= {0, 2000, 4000, 6000}, seen
    np.testing.assert_array_equal(_state(store)["x"], np.arange(6000))


def test_a_durable_store_journals_a_parted_put_as_one_batch(servers, tmp_path):
    d = tmp_path / "run"
    store = ab.ExperienceStore(FIXED, capacity=4096, durable=d, durability="os")
    server = servers(store, max_batch_bytes=MIB)
    remote = ab.connect(server.location)
    try:
        batch = _batch(3000)
        np.testing.assert_array_equal(remote.extend(batch), np.arange(3000))
        want = store.to_table()
    finally:
        remote.close()
        server.close()
        store.close()
    recs, torn, _ = jr.read_segments(str(d), 0)
    batches = [r for r in recs if r.kind == "batch"]
    assert torn is None and len(batches) == 1 and batches[0].meta["n"] == 3000
    back = ab.ExperienceStore.restore(d)
    try:
        assert back.to_table().equals(want)
    finally:
        back.close()


def test_a_parted_put_into_a_shared_memory_store_is_whole_for_an_attached_reader(servers):
    name = f"parts-{os.getpid()}"
    store = ab.ExperienceStore(FIXED, capacity=4096, tier="shm", name=name)
    reader = ab.ExperienceStore.attach(name, timeout=10.0)
    ends = ab.ExperienceStore(WITH_DONE, capacity=64, tier="shm", name=name + "-ends")
    server = servers(store, max_batch_bytes=MIB)
    remote = ab.connect(server.location)
    try:
        assert store.begin_extend(10, ["obs", "x"]) is not None
        # episode ends in a shared store: assembled (their plan at commit would need the cross-process write lock,
        # which another process's writer may hold while it waits for the reserved rows)
        assert ends.begin_extend(10, ["obs", "x", "done"]) is None
        whole = ab.ExperienceStore(FIXED, capacity=4096)
        batch = _batch(3000)
        np.testing.assert_array_equal(remote.extend(batch), whole.extend(batch))
        assert len(reader) == 3000 and reader.to_table().equals(whole.to_table())
    finally:
        remote.close()
        reader.close()
        store.close()
        ends.close()


def _data(store) -> list:
    """The stored rows' values (an aborted batch's seqs are a hole and its steps were counted, as a dead writer's:
    ids, seq and step may differ after one)."""
    return store.to_table().select(["obs", "x", "score"]).to_pylist()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 30), min_size=1, max_size=4), st.integers(0, 200), st.integers(0, 4))
def test_pieces_equal_one_extend_wherever_the_ring_wraps(cuts, before, fail_at):
    """Cut a batch into pieces at any sizes, after any number of rows (so the rows wrap around the arena anywhere):
    the store equals one extend's; an abort after `fail_at` pieces leaves the stored values as they were and the
    ring usable."""
    n = sum(cuts)
    a = ab.ExperienceStore(FIXED, capacity=128, chunk_rows=16)
    b = ab.ExperienceStore(FIXED, capacity=128, chunk_rows=16)
    if before:
        a.extend(_batch(before, 10_000))
        b.extend(_batch(before, 10_000))
    batch = _batch(n)
    rb = pa.RecordBatch.from_pydict({"obs": pa.FixedShapeTensorArray.from_numpy_ndarray(batch["obs"]),
                                     "x": pa.array(batch["x"])})
    if fail_at < len(cuts):  # an aborted batch first: nothing of it is stored
        sink = a.begin_extend(n, rb.schema.names)
        off = 0
        for c in cuts[:fail_at]:
            sink.write(rb.slice(off, c))
            off += c
        sink.abort()
        got, full = _data(a), _data(b)  # nothing of it stored; at most the rows it evicted for room are gone
        assert len(a) == len(got) and got == full[len(full) - len(got):] and len(got) >= min(len(full), 128 - n)
    sink = a.begin_extend(n, rb.schema.names)
    off = 0
    for c in cuts:
        sink.write(rb.slice(off, c))
        off += c
    ids = sink.commit()
    want = b.extend(batch)
    assert np.array_equal(ids, np.arange(ids[0], ids[0] + n)) and len(ids) == len(want)
    if fail_at >= len(cuts):  # no abort: the same store, ids and index too
        assert a.to_table().equals(b.to_table())
    else:  # the aborted batch's hole took ring room (as a dead writer's): at most older rows are gone
        got, full = _data(a), _data(b)
        assert len(got) >= min(len(full), 128 - n) and got == full[len(full) - len(got):]
    a.close()
    b.close()


@pytest.mark.parametrize("into_ring", [False, True])
def test_a_client_stalled_mid_batch_holds_back_other_writers_only_with_parts_into_the_ring(servers, into_ring):
    # the default (parts_into_ring=False) assembles a parted batch before it reserves anything, so a client that
    # sends its first part and stalls holds back nobody; with the option on, its reservation holds back the commit of
    # a later writer until its stream ends (the reason the option is off by default: docs/security.md)
    store = ab.ExperienceStore(FIXED, capacity=4096)
    server = servers(store, max_batch_bytes=MIB, parts_into_ring=into_ring)
    remote = ab.connect(server.location)
    client = flight.FlightClient(server.location)
    try:
        rb = remote.to_batch(_batch(1500))
        parts = [rb.slice(o, n) for o, n in split_rows(rb, MIB // 4)]
        cmd = {"v": 3, "kind": "extend", "parts": len(parts), "rows": rb.num_rows}
        writer, reader = client.do_put(flight.FlightDescriptor.for_command(json.dumps(cmd).encode()), rb.schema,
                                       options=flight.FlightCallOptions(timeout=30))
        writer.write_batch(parts[0])  # ... and stalls
        time.sleep(0.5)  # the first part reaches the server
        done = threading.Event()
        threading.Thread(target=lambda: (store.extend(_batch(10, 9)), done.set()), daemon=True).start()
        finished = done.wait(3.0)
        assert finished is (not into_ring)
        with pytest.raises(flight.FlightError, match="ended after 1 of"):
            writer.close()  # the stalled stream ends: its rows are refused, nothing waits any more
        assert done.wait(10.0)
        assert len(store) == 10
    finally:
        client.close()
        remote.close()
