"""Issue 30, clients and errors: what a new user's first mistakes look like (a wrong location, nothing listening, a
shared store whose creator died, a tiered store refused for its budget)."""

import multiprocessing as mp
import os
import socket

import pytest
from conftest import SMALL, make_episodes

import arrowbuf as ab


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def test_connect_to_a_port_with_nothing_listening_says_so():
    port = _free_port()
    with pytest.raises(ab.Unavailable, match=f"nothing is listening at 127.0.0.1:{port}"):
        ab.connect(f"grpc://127.0.0.1:{port}", reconnect_timeout=60.0)  # refused: no 60 s of silent retries


@pytest.mark.parametrize("location,hint", [("127.0.0.1:8815", "grpc://127.0.0.1:8815"),
                                           ("http://127.0.0.1:8815", "grpc://127.0.0.1:8815"),
                                           ("grpc://127.0.0.1:notaport", "port")])
def test_connect_to_a_location_that_is_not_flight_names_the_form(location, hint):
    with pytest.raises(ab.InvalidArgument) as info:
        ab.connect(location)
    assert hint in str(info.value)


def _create_and_die(name, root):
    os.environ["ARROWBUF_SHM_DIR"] = root
    store = ab.ExperienceStore(ab.load_schema(SMALL), capacity=16, tier="shm", name=name)
    store.extend(make_episodes([3])[0])
    os._exit(0)  # dies without closing: the store is stale


def test_attach_to_a_store_whose_creator_died_says_it_was_reclaimed(tmp_path, monkeypatch):
    root = str(tmp_path / "shm")
    os.makedirs(root)
    monkeypatch.setenv("ARROWBUF_SHM_DIR", root)
    name = "died"
    p = mp.get_context("spawn").Process(target=_create_and_die, args=(name, root))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    with pytest.raises(ab.StoreNotFound, match="the process that created it died"):
        ab.ExperienceStore.attach(name)
    assert os.listdir(root) == []


def test_a_tiered_store_refused_for_its_budget_leaves_no_spill_directory(tmp_path):
    spill = tmp_path / "spill" / "run1"
    with pytest.raises(ab.OutOfSpace):
        ab.ExperienceStore(ab.load_schema("atari"), capacity=100_000,
                           tiers={"host": "1KiB", "disk": (str(spill), "1MiB")})
    assert not (tmp_path / "spill").exists()


def test_connect_to_the_inspector_port_says_an_http_server_answered():
    """Issue 44: `ab.connect` to the inspector's (an HTTP/1 server) port says at once what answered there, instead
    of gRPC's 10 s of retries and `Failed parsing HTTP/2`."""
    from arrowbuf.observe.ui import Inspector

    store = ab.ExperienceStore(ab.load_schema(SMALL), capacity=16)
    try:
        with Inspector(store, "127.0.0.1:0") as inspector:
            with pytest.raises(ab.Unavailable) as info:
                ab.connect(f"grpc://127.0.0.1:{inspector.port}", reconnect_timeout=60.0)
        msg = str(info.value)
        assert "HTTP" in msg and "not an Arrow Flight server" in msg and "server.location" in msg, msg
        assert "inspector" in msg and "metrics" in msg  # the likely mix-up
    finally:
        store.close()


def test_connect_to_the_metrics_port_says_an_http_server_answered():
    pytest.importorskip("prometheus_client")
    store = ab.ExperienceStore(ab.load_schema(SMALL), capacity=16)
    try:
        with store.serve_metrics("127.0.0.1:0") as endpoint:
            port = int(endpoint.url.rstrip("/").rsplit(":", 1)[1].split("/")[0])
            with pytest.raises(ab.Unavailable, match="not an Arrow Flight server"):
                ab.connect(f"grpc://127.0.0.1:{port}", reconnect_timeout=60.0)
    finally:
        store.close()


def test_connect_still_reaches_a_flight_server():
    store = ab.ExperienceStore(ab.load_schema(SMALL), capacity=16)
    try:
        with ab.serve(store, "grpc://127.0.0.1:0") as server:
            client = ab.connect(server.location)
            try:
                assert len(client) == 0
            finally:
                client.close()
    finally:
        store.close()
