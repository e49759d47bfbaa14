"""The relay-to-relay data plane of a broadcast: buckets stream over one TCP connection per (receiver, upstream).

Why not Ray actor calls: a block returned by an actor call becomes a Ray object (one copy into the sender's object
store, one into the receiver's, then a third into the receiver's file), and Ray's object-store arena keeps every page
it touched resident, so a relay's RSS grew with the bytes it moved, not with the blocks in flight; each block also
cost an RPC round trip through the raylets. Here the sender writes from its mapped file straight into the socket and
the receiver reads from the socket straight into its mapped file: no user-space buffer on either side, and only the
kernel's socket buffers in between.

The protocol (little-endian, all sizes fixed or bounded before anything is read)::

    receiver -> upstream   hello:   "ABBCREL2"  secret (16 bytes)  u64 version  u16 n  requester (n <= 256 bytes)
                           then any number of requests: u64 bucket index  u64 offset (the receiver keeps k = window
                           ahead; the offset is 0 but for a bucket resumed after its upstream died mid-bucket)
    upstream -> receiver   per request, in order: u8 status  u64 index  u64 n  then n bytes:
                           status OK: bytes offset.. of bucket `index`, n exactly the bucket's size minus the offset;
                           else an error (n <= 4096 bytes of UTF-8), after which the upstream closes the connection

The secret is the broadcast's (random, 16 bytes, given to its relays by the directory through Ray): a local process
that is not part of the broadcast cannot read the weights through a relay's port. The upstream checks the hello
within `HELLO_TIMEOUT_S`, refuses a wrong magic, secret or length and closes; it serves only indices of the version it
holds, and an offset only inside the bucket. The receiver accepts a frame only if its status is known, its index is
the one it asked for next and its size is what it asked for; every bucket is then checked whole against the
producer's digest (relay.py) before it counts, so the bytes kept from a dead upstream and the rest from the new one
are verified together (a resume is as safe as a whole re-fetch).
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import struct
import time
from typing import TYPE_CHECKING

from ...errors import ArrowbufError

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Buffer

MAGIC = b"ABBCREL2"
SECRET_BYTES = 16
HELLO = struct.Struct("<8s16sQH")
REQUEST = struct.Struct("<QQ")
FRAME = struct.Struct("<BQQ")
MAX_REQUESTER = 256
MAX_MESSAGE = 4096
HELLO_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0

OK, SUPERSEDED, REFUSED, GONE, BAD = 0, 1, 2, 3, 4
STATUSES = (OK, SUPERSEDED, REFUSED, GONE, BAD)


class WireError(ArrowbufError, ConnectionError):
    """The peer broke the protocol (bad hello, unexpected frame); the connection is closed."""


class PeerError(ArrowbufError, RuntimeError):
    """The upstream answered a request with an error frame (`status`: SUPERSEDED, REFUSED, GONE or BAD)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Cut(ConnectionError):
    """The peer closed (or reset) the connection after `got` bytes of the buffer had landed."""

    def __init__(self, message: str, got: int) -> None:
        super().__init__(message)
        self.got = got


async def recv_into(sock: socket.socket, view: memoryview, stamp: list[float] | None = None) -> None:
    """Fill `view` from `sock` (non-blocking, on the running loop): straight into the caller's buffer, no copy.
    Raises `Cut` (a ConnectionError saying how many bytes landed) when the peer closes or resets first.
    `stamp[0]`: set to `time.monotonic()` whenever bytes land (failover records: when the last bytes came)."""
    loop = asyncio.get_running_loop()
    got, n = 0, len(view)
    while got < n:
        try:
            k = await loop.sock_recv_into(sock, view[got:])
        except OSError as exc:  # reset by the peer (a killed process), or shut down by the stall watch
            raise Cut(f"the connection failed after {got} of {n} bytes: {exc}", got) from exc
        if k == 0:
            raise Cut(f"the peer closed the connection after {got} of {n} bytes", got)
        got += k
        if stamp is not None:
            stamp[0] = time.monotonic()


async def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """`n` bytes from `sock` (a small, bounded read: headers and messages)."""
    buf = bytearray(n)
    await recv_into(sock, memoryview(buf))
    return bytes(buf)


async def send(sock: socket.socket, data: Buffer) -> None:
    """Send all of `data` (a bytes-like object; a view of a mapping is sent from the mapping, not copied)."""
    await asyncio.get_running_loop().sock_sendall(sock, data)


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def listen(host: str) -> socket.socket:
    """A non-blocking listening socket on `host` (the node's IP), port chosen by the kernel."""
    sock = socket.create_server((host, 0), backlog=128)
    sock.setblocking(False)
    return sock


async def accept(lsock: socket.socket) -> socket.socket:
    conn, _ = await asyncio.get_running_loop().sock_accept(lsock)
    _tune(conn)
    return conn


async def connect(address: tuple[str, int], secret: bytes, version: int, requester: str) -> socket.socket:
    """Connect to an upstream relay and send the hello; the caller closes the socket."""
    loop = asyncio.get_running_loop()
    host, port = address
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, stype, proto, _, addr = infos[0]
    sock = socket.socket(family, stype, proto)
    try:
        _tune(sock)
        await asyncio.wait_for(loop.sock_connect(sock, addr), CONNECT_TIMEOUT_S)
        await send(sock, hello(secret, version, requester))
    except BaseException:
        sock.close()
        raise
    return sock


def hello(secret: bytes, version: int, requester: str) -> bytes:
    name = requester.encode()[:MAX_REQUESTER]
    return HELLO.pack(MAGIC, secret, int(version), len(name)) + name


async def read_hello(sock: socket.socket, secret: bytes) -> tuple[int, str]:
    """(version, requester) of a connection's hello, read within `HELLO_TIMEOUT_S`; `WireError` for a wrong magic
    or secret (compared in constant time) or a bad requester name."""

    async def read() -> tuple[int, str]:
        magic, got, version, n = HELLO.unpack(await recv_exactly(sock, HELLO.size))
        if magic != MAGIC:
            raise WireError("not a broadcast relay connection")
        if not hmac.compare_digest(got, secret):
            raise WireError("wrong broadcast secret")
        if n > MAX_REQUESTER:
            raise WireError(f"requester name of {n} bytes (at most {MAX_REQUESTER})")
        try:
            return version, (await recv_exactly(sock, n)).decode()
        except UnicodeDecodeError as exc:
            raise WireError("requester name is not UTF-8") from exc

    return await asyncio.wait_for(read(), HELLO_TIMEOUT_S)


async def read_request(sock: socket.socket) -> tuple[int, int] | None:
    """The next (bucket index, byte offset) asked for, or None when the receiver closed the connection between
    requests (the caller checks both against the bucket before serving)."""
    loop = asyncio.get_running_loop()
    buf = bytearray(REQUEST.size)
    view = memoryview(buf)
    k = await loop.sock_recv_into(sock, view)
    if k == 0:
        return None
    if k < len(buf):
        await recv_into(sock, view[k:])
    index, offset = REQUEST.unpack(buf)
    return int(index), int(offset)


async def request(sock: socket.socket, first: int, count: int, offset: int = 0) -> None:
    """Ask for buckets first .. first + count - 1 (one send); the first from byte `offset` on (a resume)."""
    await send(sock, b"".join(REQUEST.pack(i, offset if i == first else 0) for i in range(first, first + count)))


def frame_header(index: int, n: int) -> bytes:
    """The header of an OK frame carrying `n` bytes of bucket `index` (the sender then sends those bytes)."""
    return FRAME.pack(OK, index, n)


async def send_bucket(sock: socket.socket, index: int, data: memoryview) -> None:
    await send(sock, frame_header(index, len(data)))
    await send(sock, data)


async def send_error(sock: socket.socket, status: int, index: int, message: str) -> None:
    body = message.encode()[:MAX_MESSAGE]
    await send(sock, FRAME.pack(status, index, len(body)) + body)


async def read_bucket(sock: socket.socket, index: int, into: memoryview, stamp: list[float] | None = None) -> None:
    """Read the answer to the request for bucket `index` straight into `into` (the bytes asked for: the bucket from
    the requested offset on).

    Raises `PeerError` for an error frame, `WireError` for a frame that is not the answer asked for (an unknown
    status, another index, another size, an oversized message), ConnectionError when the upstream closed: `Cut`
    with `got` the bytes of `into` that landed when it closed inside the bucket's bytes (a resume keeps them).
    `stamp`: see `recv_into`.
    """
    try:
        status, got, n = FRAME.unpack(await recv_exactly(sock, FRAME.size))
    except Cut as exc:  # none of the bucket's bytes landed
        raise Cut(str(exc), 0) from exc
    if status not in STATUSES:
        raise WireError(f"unknown frame status {status}")
    if status != OK:
        if n > MAX_MESSAGE:
            raise WireError(f"error message of {n} bytes (at most {MAX_MESSAGE})")
        try:
            message = await recv_exactly(sock, n)
        except Cut as exc:
            raise Cut(str(exc), 0) from exc
        raise PeerError(status, message.decode(errors="replace"))
    if got != index or n != len(into):
        raise WireError(f"frame for bucket {got} of {n} bytes, expected bucket {index} of {len(into)} bytes")
    await recv_into(sock, into, stamp)
