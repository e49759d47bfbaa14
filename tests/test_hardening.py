"""Issue 30's service hardening, each against a real Flight server on 127.0.0.1 port 0."""

import contextlib
import time
from typing import Any

import numpy as np
import pytest

import arrowbuf as ab

GRPO = "grpo"


def _served(**kw):
    store = ab.ExperienceStore(GRPO, capacity=64, tasks=["train"])
    return store, ab.serve(store, "grpc://127.0.0.1:0", **kw)


def test_policy_version_is_monotonic_by_default_on_a_served_store():
    store, server = _served()
    try:
        with server, ab.connect(server.location) as client:
            client.policy_version = 5
            with pytest.raises(ab.InvalidArgument, match="monotonic"):
                client.policy_version = 3          # backwards: every consumer's staleness window would move
            with pytest.raises(ab.InvalidArgument, match="max_policy_version_step"):
                client.policy_version = 2**63 - 1  # a jump that could never be undone
            assert client.policy_version == 5 and store.policy_version == 5
            client.policy_version = 6
            assert store.policy_version == 6
    finally:
        store.close()


def test_policy_version_any_order_when_the_server_allows_it():
    store = ab.ExperienceStore(GRPO, capacity=64, tasks=["train"])
    limits = ab.ServerLimits(monotonic_policy_version=False)
    try:
        with ab.serve(store, "grpc://127.0.0.1:0", limits=limits) as server, ab.connect(server.location) as client:
            client.policy_version = 5
            client.policy_version = 3
            assert store.policy_version == 3
    finally:
        store.close()


def test_staleness_consumers_are_not_starved_by_a_backwards_version():
    store, server = _served()
    try:
        with server, ab.connect(server.location) as client:
            store.policy_version = 4
            store.extend({"prompt_id": [1], "prompt_tokens": [[1]], "response_tokens": [[2]], "logprobs": [[-0.1]],
                          "policy_version": [4], "done": [True]})
            with pytest.raises(ab.InvalidArgument):
                client.policy_version = 0
            assert len(client.consume("train", 1, max_staleness=0)) == 1
    finally:
        store.close()


@pytest.mark.parametrize("lo,hi", [(10**15, 10**15 + 5), (0, 10**15), (7, 3), (-4, 1)])
def test_attach_refuses_a_garbage_live_range(names, lo, hi):
    """A shared store whose index header holds an impossible live range is StoreCorrupt naming the file (it
    attached, and `len` said 5 while `to_table` returned nothing and `sample` timed out)."""
    import os

    from conftest import SMALL, make_episodes

    from arrowbuf.tiers import shm

    name = names()
    store = ab.ExperienceStore(ab.load_schema(SMALL), capacity=64, tier="shm", name=name)
    try:
        store.extend(make_episodes([5, 7])[0])
        header = os.path.join(shm.store_path(name), "arena.index.header")
        mm = np.memmap(header, dtype=np.int64, mode="r+", shape=(2,))
        mm[0], mm[1] = lo, hi
        mm.flush()
        del mm
        with pytest.raises(ab.StoreCorrupt, match="arena.index.header"):
            ab.ExperienceStore.attach(name)
    finally:
        store.close()


class _BrokenAfterServerEnd:
    """A session's writer whose writes fail with a bare transport error, as gRPC reports a write to a stream the
    server already ended (the race seen under a burst of sessions): the status has not been read yet."""

    def __init__(self, writer):
        self.writer = writer
        self.broken = False

    def write_metadata(self, buf):
        if self.broken:
            import pyarrow as pa

            raise pa.ArrowIOError("Could not write metadata to stream (client disconnect?)")
        return self.writer.write_metadata(buf)

    def __getattr__(self, name):
        return getattr(self.writer, name)


def test_a_session_the_server_ended_gives_the_servers_reason_to_a_writing_client():
    import pyarrow as pa
    from conftest import SMALL, make_episodes

    from arrowbuf.flight import protocol as P

    store = ab.ExperienceStore(ab.load_schema(SMALL), capacity=256, sampler=ab.samplers.Prioritized())
    store.extend(make_episodes([50, 50])[0])
    try:
        with ab.serve(store, "grpc://127.0.0.1:0") as server, ab.connect(server.location) as client:
            session = client.session(8, prefetch=2)
            next(session)
            # a NaN priority (a client that skips validation): the server refuses it and ends the session
            session._writer.write_metadata(pa.py_buffer(P.encode_priorities(np.array([0]), np.array([np.nan]))))
            session._writer = _BrokenAfterServerEnd(session._writer)
            session._writer.broken = True
            with pytest.raises(ab.ArrowbufError, match="priorities"):
                session.update_priorities(np.array([0]), np.array([1.0]))
            session.close()
    finally:
        store.close()


def test_idle_uploads_and_sessions_cannot_take_every_call_slot():
    """Clients that open DoPut uploads or DoExchange sessions and then send nothing hold their slots; past the
    stream slots they are refused, and short calls of a legitimate client are still served."""
    import pyarrow.flight as flight
    from conftest import SMALL, make_episodes

    from arrowbuf.flight import protocol as P

    store = ab.ExperienceStore(ab.load_schema(SMALL), capacity=256, seed=0)
    store.extend(make_episodes([50, 50])[0])
    limits = ab.ServerLimits(max_concurrent_calls=8)
    idle, opened = [], []
    try:
        with ab.serve(store, "grpc://127.0.0.1:0", limits=limits) as server:
            for i in range(limits.max_concurrent_calls):  # as many idle streams as there are call slots
                c = flight.FlightClient(server.location)
                idle.append(c)
                try:
                    if i % 2:
                        w, r = c.do_put(P.put_descriptor(store.name, None), store.schema.input_schema())
                    else:
                        w, r = c.do_exchange(P.session_descriptor(P.SessionRequest(2, prefetch=0)))
                    opened.append(w)
                except flight.FlightError:
                    pass
            held = 6  # the stream slots of 8 calls (a quarter stays free for short calls)
            assert server.calls.wait_for(lambda running: running["call"] >= held, timeout=60)
            with ab.connect(server.location) as client:  # a legitimate client's short calls are served
                assert len(client) == 100
                assert client.sample(4).to_numpy()["obs"].shape[0] == 4
                assert client.stats()["size"] == 100
            for w in opened:
                with contextlib.suppress(flight.FlightError):  # the refused ones say so again on close
                    w.close()
    finally:
        for c in idle:
            c.close()
        store.close()


def test_idle_streams_give_their_slots_to_a_new_upload_and_session():
    """When idle clients hold every stream slot, a legitimate client's upload and learner session are still served:
    the streams idle for `stream_idle_timeout` are cut (their clients' connections), streams that move are not."""
    import pyarrow.flight as flight
    from conftest import SMALL, make_episodes

    from arrowbuf.flight import protocol as P

    store = ab.ExperienceStore(ab.load_schema(SMALL), capacity=512, seed=0)
    batch, _ = make_episodes([50, 50])
    store.extend(batch)
    limits = ab.ServerLimits(max_concurrent_calls=8, stream_idle_timeout=1.0)
    idle: list[Any] = []
    streams: list[Any] = []
    try:
        with ab.serve(store, "grpc://127.0.0.1:0", limits=limits) as server:
            slots = limits.stream_slots
            for i in range(slots):  # every stream slot held by a client that then sends nothing
                c = flight.FlightClient(server.location)
                idle.append(c)
                if i % 2:  # (the writer and reader are kept: dropping them would end the stream)
                    streams.append(c.do_put(P.put_descriptor(store.name, None), store.schema.input_schema()))
                else:
                    streams.append(c.do_exchange(P.session_descriptor(P.SessionRequest(2, prefetch=0))))
            assert server.calls.wait_for(lambda running: running["stream"] >= slots, timeout=60)
            with ab.connect(server.location) as client:
                # fresh streams are not idle yet: a new upload is refused, and says why
                with pytest.raises(ab.ArrowbufError, match="busy|at most"):
                    client.extend(batch)
                time.sleep(1.2)  # now they are idle: the next upload cuts them and is served
                start = time.monotonic()
                ids = client.extend(batch)
                assert len(ids) == 100 and len(client) == 200
                session = client.session(4, prefetch=0)
                assert next(session).to_numpy()["obs"].shape[0] == 4
                session.close()
                assert time.monotonic() - start < 30
            assert server.calls.wait_for(lambda running: running["stream"] == 0, timeout=30)
    finally:
        for w, _ in streams:  # cut by the server: closing says so (explicitly, not in a destructor's log line)
            with contextlib.suppress(Exception):
                w.close()
        for c in idle:
            c.close()
        store.close()


def test_get_schema_errors_carry_no_traceback_text():
    """GetSchema is the one verb whose errors pyarrow formats with a Python traceback; none may reach a client."""
    import pyarrow as pa
    import pyarrow.flight as flight

    store = ab.ExperienceStore("cartpole", capacity=16)
    try:
        with ab.serve(store, "grpc://127.0.0.1:0") as server:
            client = flight.FlightClient(server.location)
            try:
                for descriptor in (flight.FlightDescriptor.for_path("nope"),
                                   flight.FlightDescriptor.for_command(b"x"),
                                   flight.FlightDescriptor.for_path("cartpole", "bad")):
                    with pytest.raises(pa.ArrowException) as info:
                        client.get_schema(descriptor)
                    text = str(info.value)
                    assert "Traceback" not in text and "File " not in text and ".pyx" not in text, text
                    assert "cartpole" in text or "descriptor" in text  # the reason itself is kept
                assert client.get_schema(flight.FlightDescriptor.for_path("cartpole")).schema.names
            finally:
                client.close()
    finally:
        store.close()
