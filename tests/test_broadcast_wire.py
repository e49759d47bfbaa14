"""The relay-to-relay wire format of the broadcast (`arrowbuf.ray.hoplite.wire`), fuzzed over real socket pairs: a
hostile peer's bytes are refused or read exactly as the format says, never anything else (no Ray needed)."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arrowbuf.ray.hoplite import wire

SECRET = bytes(range(16))
_FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _feed(data: bytes, coro_fn):
    """Run `coro_fn(sock)` on one end of a socket pair whose other end sent `data` and closed."""

    async def main():
        a, b = socket.socketpair()
        try:
            a.setblocking(False)
            b.sendall(data)
            b.shutdown(socket.SHUT_WR)
            return await asyncio.wait_for(coro_fn(a), 5)
        finally:
            a.close()
            b.close()

    return asyncio.run(main())


def test_a_good_hello_reads_back():
    assert _feed(wire.hello(SECRET, 7, "node#0"), lambda s: wire.read_hello(s, SECRET)) == (7, "node#0")


@pytest.mark.parametrize("data, why", [
    (wire.hello(bytes(16), 7, "x"), "wrong broadcast secret"),
    (b"NOTARELY" + wire.hello(SECRET, 7, "x")[8:], "not a broadcast relay"),
    (struct.pack("<8s16sQH", wire.MAGIC, SECRET, 7, wire.MAX_REQUESTER + 1) + b"x" * 300, "requester name of"),
    (struct.pack("<8s16sQH", wire.MAGIC, SECRET, 7, 2) + b"\xff\xfe", "not UTF-8"),
])
def test_a_bad_hello_is_refused(data, why):
    with pytest.raises(wire.WireError, match=why):
        _feed(data, lambda s: wire.read_hello(s, SECRET))


@_FUZZ
@given(st.binary(max_size=400) | st.builds(lambda tail: wire.MAGIC + SECRET + tail, st.binary(max_size=300)))
def test_a_mangled_hello_is_refused_or_read_exactly(data):
    try:
        version, who = _feed(data, lambda s: wire.read_hello(s, SECRET))
    except (wire.WireError, ConnectionError):
        return
    # accepted only with the magic, the secret and a name of the stated length
    magic, secret, v, n = struct.unpack_from("<8s16sQH", data)
    assert (magic, secret, v, n) == (wire.MAGIC, SECRET, version, len(who.encode()))
    assert data[wire.HELLO.size:wire.HELLO.size + n].decode() == who


def test_requests_read_back_in_order_and_end_cleanly():
    async def read_all(s):
        out = []
        while (i := await wire.read_request(s)) is not None:
            out.append(i)
        return out

    data = b"".join(wire.REQUEST.pack(i, off) for i, off in [(3, 0), (4, 17), (5, 0), (2**63, 2**64 - 1)])
    assert _feed(data, read_all) == [(3, 0), (4, 17), (5, 0), (2**63, 2**64 - 1)]
    with pytest.raises(ConnectionError):  # a request cut short is not a request
        _feed(data + b"\x01\x02", read_all)


@_FUZZ
@given(st.binary(max_size=300),
       st.builds(lambda status, index, n, body: wire.FRAME.pack(status, index, n) + body,
                 st.sampled_from([0, 1, 2, 3, 4, 5, 255]), st.sampled_from([0, 1, 9, 2**64 - 1]),
                 st.sampled_from([0, 5, 16, 17, 4096, 4097, 2**64 - 1]), st.binary(max_size=64)))
def test_a_mangled_frame_is_refused_or_read_exactly(junk, frame):
    for data in (junk, frame):
        into = bytearray(16)
        try:
            _feed(data, lambda s, into=into: wire.read_bucket(s, 1, memoryview(into)))
        except wire.PeerError as exc:  # an error frame: a known status, a bounded message
            status, _, n = wire.FRAME.unpack_from(data)
            assert status == exc.status and status in wire.STATUSES and status != wire.OK and n <= wire.MAX_MESSAGE
            continue
        except (wire.WireError, ConnectionError):
            assert into == bytearray(16) or data[:wire.FRAME.size] == wire.FRAME.pack(wire.OK, 1, 16)
            continue
        # accepted: exactly bucket 1 of exactly 16 bytes, and those bytes
        assert data[:wire.FRAME.size] == wire.FRAME.pack(wire.OK, 1, 16)
        assert bytes(into) == data[wire.FRAME.size:wire.FRAME.size + 16]


def test_a_bucket_lands_in_the_callers_buffer():
    payload = bytes(range(256)) * 64
    frame = wire.FRAME.pack(wire.OK, 3, len(payload)) + payload
    into = bytearray(len(payload))
    _feed(frame, lambda s: wire.read_bucket(s, 3, memoryview(into)))
    assert bytes(into) == payload
    with pytest.raises(wire.WireError, match="expected bucket 4"):
        _feed(frame, lambda s: wire.read_bucket(s, 4, memoryview(bytearray(len(payload)))))


def test_a_bucket_cut_mid_way_says_how_many_of_its_bytes_landed():
    """An upstream that dies inside a bucket's bytes: the receiver learns exactly how many landed (a resume keeps
    them); cut inside the header, none did."""
    payload = bytes(range(256)) * 64
    frame = wire.FRAME.pack(wire.OK, 3, len(payload)) + payload
    into = bytearray(len(payload))
    with pytest.raises(wire.Cut) as cut:
        _feed(frame[:wire.FRAME.size + 1000], lambda s: wire.read_bucket(s, 3, memoryview(into)))
    assert cut.value.got == 1000 and bytes(into[:1000]) == payload[:1000]
    with pytest.raises(wire.Cut) as cut:
        _feed(frame[:wire.FRAME.size - 1], lambda s: wire.read_bucket(s, 3, memoryview(bytearray(len(payload)))))
    assert cut.value.got == 0


def test_a_resumed_request_asks_for_the_rest_of_the_bucket_only():
    """`request(..., offset)` asks for the first bucket from the offset on, the others whole; the answer to a resume
    carries exactly the rest of the bucket, read into the rest of the caller's buffer."""

    async def requests(s):
        out = []
        while (r := await wire.read_request(s)) is not None:
            out.append(r)
        return out

    async def ask(sock):
        await wire.request(sock, 7, 3, 1000)

    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        asyncio.run(ask(a))
        a.shutdown(socket.SHUT_WR)
        data = b.recv(1 << 16)
    finally:
        a.close()
        b.close()
    assert _feed(data, requests) == [(7, 1000), (8, 0), (9, 0)]
    payload = bytes(range(256)) * 64
    into = bytearray(len(payload))
    into[:1000] = payload[:1000]
    _feed(wire.frame_header(7, len(payload) - 1000) + payload[1000:],
          lambda s: wire.read_bucket(s, 7, memoryview(into)[1000:]))
    assert bytes(into) == payload


def test_a_relay_serves_the_rest_of_a_bucket_from_the_offset_asked_and_refuses_an_offset_outside_it(tmp_path):
    """The serving side of a resume, on a real relay object and a real socket pair (no Ray): a request with an offset
    is answered with exactly the rest of that bucket, from the node's file; an offset at or past the bucket's end is
    refused (BAD) before anything is sent, and the connection ends."""
    from arrowbuf.ray.hoplite.payload import bucket_digests, combine
    from arrowbuf.ray.hoplite.relay import Relay, _Copy, file_name

    size, bs = 3000, 1024
    data = bytes((i * 7) % 251 for i in range(size))
    digests = bucket_digests(memoryview(data), bs)
    meta = {"version": 1, "size": size, "block_size": bs, "nblocks": len(digests), "digests": digests,
            "digest": combine(digests)}

    async def main():
        r = Relay("t1", "k", root=str(tmp_path), secret=SECRET.hex())
        copy = _Copy(meta, file_name("t1", "k", 1), create=True, root=str(tmp_path))
        copy.mm[:] = data
        copy.have = copy.meta["nblocks"]
        r.cur = copy
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        try:
            served = asyncio.create_task(r._serve(a))
            await wire.send(b, wire.hello(SECRET, 1, "me") + wire.REQUEST.pack(1, 100) + wire.REQUEST.pack(2, 0)
                            + wire.REQUEST.pack(0, bs))
            into = bytearray(bs)
            await wire.read_bucket(b, 1, memoryview(into)[100:])
            assert bytes(into[100:]) == data[bs + 100:2 * bs]
            last = bytearray(size - 2 * bs)
            await wire.read_bucket(b, 2, memoryview(last))
            assert bytes(last) == data[2 * bs:]
            with pytest.raises(wire.PeerError, match="has no byte 1024") as refused:
                await wire.read_bucket(b, 0, memoryview(bytearray(bs)))
            assert refused.value.status == wire.BAD
            await asyncio.wait_for(served, 5)
        finally:
            b.close()
            await r.close()

    asyncio.run(main())


@_FUZZ
@given(st.binary(max_size=200))
def test_mangled_requests_read_as_whole_index_offset_pairs_or_not_at_all(data):
    """Any bytes a receiver sends read as whole (index, offset) requests, 16 bytes each, in order; a trailing part of
    a request is a broken connection, never a request (the relay bounds both numbers before serving)."""

    async def read_all(s):
        out = []
        while (r := await wire.read_request(s)) is not None:
            out.append(r)
        return out

    whole = len(data) - len(data) % wire.REQUEST.size
    expected = [wire.REQUEST.unpack_from(data, o) for o in range(0, whole, wire.REQUEST.size)]
    if whole == len(data):
        assert _feed(data, read_all) == expected
    else:
        with pytest.raises(ConnectionError):
            _feed(data, read_all)
