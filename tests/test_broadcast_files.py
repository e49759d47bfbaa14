"""The broadcast's payload format (no pickle) and its private files (`arrowbuf.tiers.shm.private`), without Ray: real
files in a temporary shared-memory root that each test plants and removes itself."""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import struct
import uuid

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arrowbuf.errors import BroadcastRefused, InvalidArgument, PickleWarning
from arrowbuf.ray.hoplite import payload
from arrowbuf.tiers.shm import private

torch = pytest.importorskip("torch")
FOREIGN_UID = 65534  # nobody


@pytest.fixture
def root():
    """A fresh shared-memory root under /dev/shm (so the files are on tmpfs, as in use); removed afterwards."""
    path = f"/dev/shm/pt-bcfiles-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.mkdir(path, 0o755)
    yield path
    for dirpath, dirnames, filenames in os.walk(path, topdown=False):
        for n in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            os.unlink(os.path.join(dirpath, n))
        for d in dirnames:
            if not os.path.islink(os.path.join(dirpath, d)):
                os.rmdir(os.path.join(dirpath, d))
    os.rmdir(path)
    assert not os.path.exists(path)


def _payload(obj, **kw) -> bytes:
    lay = payload.encode(obj, **kw)
    buf = bytearray(lay.size)
    lay.write(buf)
    return bytes(buf)


# ------------------------------------------------------------------------------------------------------ payload
def test_a_state_dict_round_trips_bit_exact_as_numpy_and_as_torch_views():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.BatchNorm1d(17), torch.nn.Linear(17, 5))
    sd = dict(model.state_dict())
    sd["half"] = torch.randn(7, 3).to(torch.bfloat16)
    sd["mask"] = torch.rand(9) > 0.5
    sd["empty"] = torch.zeros(0, 4)
    raw = _payload({"sd": sd, "step": 12, "table": pa.table({"x": [1, 2, 3]}), "tags": ("a", None, 2.5)})
    out = payload.decode(memoryview(raw))
    assert out["step"] == 12 and out["tags"] == ("a", None, 2.5) and out["table"].column("x").to_pylist() == [1, 2, 3]
    for k, t in sd.items():
        a = out["sd"][k]
        assert not a.flags.writeable  # a view of the payload, read-only
        assert a.tobytes() == t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    views = payload.decode(bytearray(raw), torch_views=True)
    for k, t in sd.items():
        assert views["sd"][k].dtype == t.dtype and torch.equal(views["sd"][k], t)
    assert set(payload.flat_tensors(views)) >= {f"sd.{k}" for k in sd}


def test_no_pickle_unless_both_ends_opt_in_loudly():
    class Thing:
        pass

    with pytest.raises(InvalidArgument, match="without pickle"):
        payload.encode({"w": np.zeros(3), "thing": Thing()})
    with pytest.raises(InvalidArgument):
        payload.encode({1: np.zeros(3)})  # non-string keys would need pickle too
    with pytest.warns(PickleWarning):
        raw = _payload({"thing": {1, 2}}, allow_pickle=True)
    with pytest.raises(BroadcastRefused, match="pickled"):
        payload.decode(memoryview(raw))
    with pytest.warns(PickleWarning):
        assert payload.decode(memoryview(raw), allow_pickle=True)["thing"] == {1, 2}


def test_a_planted_pickle_payload_runs_nothing(tmp_path):
    """What the old format did: `pickle.loads` of the mapped bytes. A payload of the old format, or a new one whose
    leaf says pickle, is refused without unpickling (the marker file would be written by the pickle)."""
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    body = pickle.dumps(Evil(), protocol=5)
    old = b"ABBCAST1" + struct.pack("<QI", len(body), 0) + body
    with pytest.raises(BroadcastRefused):
        payload.decode(memoryview(old))
    head = json.dumps({"format": payload.FORMAT, "data": {"k": "pickle", "offset": 0, "nbytes": len(body)}}).encode()
    start = -(-(payload.PREFIX + len(head)) // 64) * 64
    new = (payload.MAGIC + struct.pack("<Q", len(head)) + head).ljust(start, b"\0") + body
    with pytest.raises(BroadcastRefused):
        payload.decode(memoryview(new))
    assert not marker.exists()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_mangled_payload_is_refused_or_decoded_never_anything_else(data):
    base = bytearray(_payload({"a": np.arange(10, dtype=np.float32), "b": {"c": [1, "x"]},
                               "t": pa.table({"y": [1.0]})}))
    hlen = struct.unpack_from("<Q", base, 8)[0]
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, 16 + hlen - 1))
        base[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(base)))
    try:
        payload.decode(memoryview(bytes(base[:cut] if data.draw(st.booleans()) else base)))
    except BroadcastRefused:
        pass


@given(st.dictionaries(st.text(max_size=8), st.one_of(
    st.integers(-2**62, 2**62), st.text(max_size=20), st.none(), st.booleans(),
    st.lists(st.integers(0, 255), max_size=50).map(lambda v: np.asarray(v, dtype=np.uint8)),
    st.lists(st.floats(allow_nan=False, width=32), max_size=20).map(lambda v: np.asarray(v, dtype=np.float32))),
    max_size=6))
@settings(max_examples=100, deadline=None)
def test_any_supported_tree_round_trips(tree):
    out = payload.decode(memoryview(_payload(tree)))
    assert set(out) == set(tree)
    for k, v in tree.items():
        if isinstance(v, np.ndarray):
            assert out[k].dtype == v.dtype and out[k].tobytes() == v.tobytes()
        else:
            assert out[k] == v


def test_a_header_that_points_outside_the_payload_is_refused_before_reading():
    raw = bytearray(_payload({"a": np.zeros(4, np.float64)}))
    hlen = struct.unpack_from("<Q", raw, 8)[0]
    head = json.loads(bytes(raw[16:16 + hlen]))
    for bad in ({"nbytes": 1 << 40}, {"offset": -8}, {"shape": [5]}, {"dtype": "object"}, {"shape": [-1, -4]}):
        h = json.loads(json.dumps(head))
        h["data"]["items"]["a"].update(bad)
        enc = json.dumps(h).encode()
        start = -(-(16 + len(enc)) // 64) * 64
        body = (payload.MAGIC + struct.pack("<Q", len(enc)) + enc).ljust(start, b"\0") + bytes(64)
        with pytest.raises(BroadcastRefused):
            payload.decode(memoryview(body))


def test_bucket_digests_combine_into_the_payload_digest():
    raw = os.urandom(1000)
    d = payload.bucket_digests(raw, 300)
    assert len(d) == 4 and d[3] == payload.digest_of(raw[900:])
    assert payload.combine(d) == payload.digest_of(b"".join(bytes.fromhex(x) for x in d))


# ------------------------------------------------------------------------------------------------ private files
def test_the_private_directory_is_0700_and_files_0600(root):
    fd = private.create_file("bc-x-a", 4096, root)
    try:
        st_dir = os.lstat(private.user_dir(root))
        assert st_dir.st_mode & 0o777 == 0o700 and st_dir.st_uid == os.geteuid()
        st_file = os.stat(os.path.join(private.user_dir(root), "bc-x-a"))
        assert st_file.st_mode & 0o777 == 0o600 and st_file.st_size == 4096
        rd = private.open_verified("bc-x-a", 4096, private.identity(fd), root)
        os.close(rd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("plant", ["symlink", "foreign", "open"])
def test_a_planted_private_directory_is_refused(root, tmp_path, plant):
    path = private.user_dir(root)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if plant == "symlink":
        os.symlink(elsewhere, path)
    else:
        os.mkdir(path, 0o700)
        if plant == "foreign":
            os.chown(path, FOREIGN_UID, FOREIGN_UID)
        else:
            os.chmod(path, 0o755)
    with pytest.raises(BroadcastRefused):
        private.create_file("bc-x-a", 10, root)
    with pytest.raises(BroadcastRefused):
        private.open_dir(root)
    assert not os.listdir(elsewhere)
    assert private.sweep(root) == [] and private.names(root=root) == []  # a refused directory is left untouched


@pytest.mark.parametrize("plant", ["symlink", "foreign", "stale"])
def test_create_refuses_any_existing_name_and_never_writes_through_it(root, tmp_path, plant):
    os.close(private.open_dir(root))
    name = "bc-x-v1"
    path = os.path.join(private.user_dir(root), name)
    target = tmp_path / "victim"
    target.write_bytes(b"keep me")
    if plant == "symlink":
        os.symlink(target, path)
    else:
        with open(path, "wb") as f:
            f.write(b"planted")
        if plant == "foreign":
            os.chown(path, FOREIGN_UID, FOREIGN_UID)
    with pytest.raises(BroadcastRefused, match="exists"):
        private.create_file(name, 1 << 20, root)
    assert target.read_bytes() == b"keep me"
    assert os.path.lexists(path)  # refused, not removed and not replaced


@pytest.mark.parametrize("plant", ["symlink", "foreign", "mode", "hardlink", "other_inode", "size"])
def test_open_verified_accepts_only_the_creators_very_file(root, tmp_path, plant):
    name = "bc-x-v1"
    fd = private.create_file(name, 4096, root)
    ident = private.identity(fd)
    path = os.path.join(private.user_dir(root), name)
    size = 4096
    try:
        if plant == "symlink":
            os.rename(path, path + ".moved")
            os.symlink(path + ".moved", path)
        elif plant == "foreign":
            os.chown(path, FOREIGN_UID, FOREIGN_UID)
        elif plant == "mode":
            os.chmod(path, 0o644)
        elif plant == "hardlink":
            os.link(path, path + ".second")
        elif plant == "other_inode":
            os.unlink(path)
            os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
            os.truncate(path, 4096)
        else:
            size = 8192
        with pytest.raises(BroadcastRefused):
            os.close(private.open_verified(name, size, ident, root))
    finally:
        os.close(fd)


def test_sweep_removes_files_nobody_holds_and_keeps_held_ones(root):
    held = private.create_file("bc-x-held", 100, root)
    dead = private.create_file("bc-x-dead", 100, root)
    os.close(dead)  # its holder is gone (a killed relay's descriptor closes the same way)
    os.symlink("/etc/passwd", os.path.join(private.user_dir(root), "bc-x-link"))
    try:
        assert sorted(private.sweep(root, grace_s=0)) == ["bc-x-dead", "bc-x-link"]
        assert private.names(root=root) == ["bc-x-held"]
        with pytest.raises(BlockingIOError):  # still share-locked by its holder
            probe = os.open(os.path.join(private.user_dir(root), "bc-x-held"), os.O_RDONLY)
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(probe)
    finally:
        os.close(held)
    assert private.sweep(root, grace_s=0) == ["bc-x-held"]
    assert not os.path.exists(private.user_dir(root))  # the empty directory goes too


# ------------------------------------------------------------------------------------------ the emulated link
def test_the_emulated_link_sends_in_order_and_skips_receivers_that_died():
    """A relay's token bucket: sends leave in the order asked, and the blocks queued for a receiver that died before
    its turn cost the link nothing (so the survivors' failover does not wait behind them)."""
    import asyncio

    from arrowbuf.ray.hoplite.relay import TokenBucket

    async def run():
        tb = TokenBucket(1 << 30)  # fast: the order and the skipping are what is checked, not the time
        dead: set[int] = set()
        order: list[int] = []

        async def send(i: int) -> bool:
            ok = await tb.take(1 << 20, lambda: i not in dead)
            if ok:
                order.append(i)
            return ok

        tasks = [asyncio.create_task(send(i)) for i in range(8)]
        await asyncio.sleep(0)
        dead.update({2, 3, 5})
        got = await asyncio.gather(*tasks)
        return got, order

    got, order = asyncio.run(run())
    assert order == [0, 1, 4, 6, 7] and got == [i not in {2, 3, 5} for i in range(8)]


def test_the_emulated_link_overlaps_the_copy_of_a_bucket_with_the_next_slot(monkeypatch):
    """A slot starts when its send became possible (`since`), not after the previous bucket was copied into the
    socket: the copy time is not added to every bucket. Slots never overlap: a send asked when the link is idle
    waits one full slot. (A fake clock: the schedule is checked, not the machine's timing.)"""
    import asyncio
    import types

    from arrowbuf.ray.hoplite import relay

    clock = [100.0]
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def fake_sleep(d: float) -> None:
        slept.append(round(d, 6))
        clock[0] += d
        await real_sleep(0)

    monkeypatch.setattr(relay, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(relay.asyncio, "sleep", fake_sleep)

    async def run() -> None:
        tb = relay.TokenBucket(1.0)  # 1 byte/s: a 1-byte bucket is a 1 s slot
        assert await tb.take(1, since=100.0)  # the link is idle: one full slot (100 -> 101)
        clock[0] += 3.0  # copying that bucket into the socket took 3 s (a loaded machine)
        assert await tb.take(1, since=100.5)  # asked at 100.5 with the bucket there: its slot was 101 -> 102, past
        assert await tb.take(1, since=clock[0])  # asked now (104), the link idle since 102: a full slot again

    asyncio.run(run())
    assert slept == [1.0, 0.0, 1.0]


def test_the_emulated_link_streams_pieces_and_is_free_when_its_receiver_dies_mid_bucket(monkeypatch):
    """`transmit` sends a bucket piece by piece, each when the link has carried it (a receiver whose upstream dies
    keeps the pieces that arrived); when the receiver dies mid-bucket the link stops and is free at once, so the
    next send does not wait for the rest of the dead receiver's slot. (A fake clock.)"""
    import asyncio
    import types

    from arrowbuf.ray.hoplite import relay

    clock = [100.0]
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def fake_sleep(d: float) -> None:
        slept.append(round(d, 6))
        clock[0] += d
        await real_sleep(0)

    monkeypatch.setattr(relay, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(relay.asyncio, "sleep", fake_sleep)
    monkeypatch.setattr(relay, "LINK_PIECE", 1)
    sent: list[tuple[int, int, float]] = []

    async def send(off: int, n: int) -> None:
        sent.append((off, n, clock[0]))

    async def run() -> tuple[int, int]:
        tb = relay.TokenBucket(1.0)  # 1 byte/s, pieces of 1 byte: a piece a second
        first = await tb.transmit(8, send, alive=lambda: len(sent) < 3, since=100.0)  # dies after 3 pieces
        second = await tb.transmit(2, send, since=clock[0])  # the link was freed at 104, not at 108
        return first, second

    assert asyncio.run(run()) == (3, 2)
    assert sent == [(0, 1, 101.0), (1, 1, 102.0), (2, 1, 103.0), (0, 1, 105.0), (1, 1, 106.0)]
    assert slept == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]


# ------------------------------------------------------------------------------------------ the directory
def test_a_loss_reported_for_a_superseded_version_does_not_mark_the_holder_dead():
    """A receiver still pulling version 1 from a holder that moved on to version 2 gets "superseded" and reports the
    loss; that must not make the holder dead for version 2 (it was: its upstream then refused it forever as `gone`,
    and its version-2 copy never completed)."""
    import asyncio

    from arrowbuf.ray.hoplite.directory import BlockDirectory

    def meta(v: int) -> dict:
        return {"version": v, "nblocks": 8, "upload_slots": 1, "root_slots": 1, "pipelined": True}

    async def run() -> dict:
        d = BlockDirectory("t", {})
        await d.publish(meta(1), "root")
        await d.publish(meta(2), "root")
        await d.progress(2, "a", 3)
        await d.lost(1, "b", "a")  # late: b's version-1 pull from a, which holds version 2 now
        return await d.state()

    state = asyncio.run(run())
    assert state["dead"] == [] and state["count"].get("a") == 3
