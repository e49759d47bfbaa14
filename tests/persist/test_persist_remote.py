"""The Flight `checkpoint` action (and `RemoteStore.checkpoint`): writes only under the server's checkpoint root. Real server on port 0."""

from __future__ import annotations

import json
import os

import pyarrow.flight as flight
import pytest

import arrowbuf as ab
from arrowbuf.persist.remote import resolve_under_root

from conftest import SMALL, make_episodes


def _call(location: str, body: dict) -> dict:
    client = flight.FlightClient(location)
    try:
        (result,) = list(client.do_action(flight.Action("checkpoint", json.dumps({"v": 1, **body}).encode())))
        return json.loads(result.body.to_pybytes())
    finally:
        client.close()


def test_checkpoint_action_writes_under_the_root(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    with ab.ExperienceStore(SMALL, capacity=500, seed=0) as store:
        store.extend(make_episodes([100, 50], seed=0)[0])
        with ab.serve(store, "grpc://127.0.0.1:0", checkpoint_root=root) as server:
            out = _call(server.location, {"path": "run-1/latest", "keep": 2})
            assert out["path"] == "run-1/latest" and out["rows"] == 150
            assert "checkpoint" in dict(server_actions(server.location))
        with ab.ExperienceStore.restore(root / "run-1" / "latest") as again:
            assert again.to_table().equals(store.to_table())


def server_actions(location: str):
    client = flight.FlightClient(location)
    try:
        return [(a.type, a.description) for a in client.list_actions()]
    finally:
        client.close()


@pytest.mark.parametrize("bad", ["../escape", "/tmp/abs", "a/../../b", "a//b", ".hidden", "a/./b", "", "x" * 200,
                                 "link/inside", "run\\..\\x"])
def test_checkpoint_action_refuses_paths_outside_the_root(tmp_path, bad):
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "link")
    with ab.ExperienceStore(SMALL, capacity=100, seed=0) as store:
        store.extend(make_episodes([20])[0])
        with ab.serve(store, "grpc://127.0.0.1:0", checkpoint_root=root) as server:
            with pytest.raises(flight.FlightError):
                _call(server.location, {"path": bad})
    assert list(outside.iterdir()) == []
    assert sorted(p.name for p in root.iterdir()) == ["link"]
    with pytest.raises(ab.InvalidArgument):
        resolve_under_root(str(root), bad)


def test_server_without_a_root_takes_no_checkpoints(tmp_path):
    with ab.ExperienceStore(SMALL, capacity=100, seed=0) as store:
        with ab.serve(store, "grpc://127.0.0.1:0") as server:
            with pytest.raises(flight.FlightError, match="checkpoint_root"):
                _call(server.location, {"path": "x"})


def test_a_remote_store_checkpoints_under_the_servers_root(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    with ab.ExperienceStore(SMALL, capacity=500, seed=0) as store:
        store.extend(make_episodes([60, 40], seed=1)[0])
        with ab.serve(store, "grpc://127.0.0.1:0", checkpoint_root=root) as server, \
                ab.connect(server.location) as client:
            out = client.checkpoint("run-2/latest", keep=1)
            assert out["path"] == "run-2/latest" and out["rows"] == 100
            with pytest.raises(ab.InvalidArgument, match="'..' is not allowed"):
                client.checkpoint("../escape")
        with ab.ExperienceStore.restore(root / "run-2" / "latest") as again:
            assert again.to_table().equals(store.to_table())


def test_a_remote_store_of_a_server_without_a_root_cannot_checkpoint(tmp_path):
    with ab.ExperienceStore(SMALL, capacity=100, seed=0) as store:
        with ab.serve(store, "grpc://127.0.0.1:0") as server, ab.connect(server.location) as client:
            with pytest.raises(ab.ArrowbufError, match="checkpoint_root"):
                client.checkpoint("run")


class _NoCheckpoints:
    """A store surface without `checkpoint` (a proxy over a store): the action refuses it by name."""

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        if name in ("checkpoint", "_store"):
            raise AttributeError(name)
        return getattr(self._store, name)

    def __len__(self):
        return len(self._store)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def test_checkpoint_action_refuses_a_store_that_takes_no_checkpoints(tmp_path):
    with ab.ExperienceStore(SMALL, capacity=100, seed=0) as store:
        store.extend(make_episodes([20])[0])
        with ab.serve({"proxy": _NoCheckpoints(store)}, "grpc://127.0.0.1:0", checkpoint_root=tmp_path) as server:
            with pytest.raises(flight.FlightError) as info:
                _call(server.location, {"path": "run-1"})
    assert "takes no checkpoints" in str(info.value)
    assert list(tmp_path.iterdir()) == []
