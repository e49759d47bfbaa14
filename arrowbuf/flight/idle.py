"""Open uploads and sessions of a Flight server, and freeing the slots that idle ones hold.

A DoPut upload or a DoExchange learner session keeps its call open for as long as its client wants, and holds one
of the server's stream slots (`ServerLimits.stream_slots`) all that time. A client that opens streams and then sends
nothing would hold them for good, and every later upload or session would be refused as busy. So each open stream
records when it last moved (a message read or written), and when a new stream finds every slot taken, the server
cuts the connections of the streams that have not moved for `ServerLimits.stream_idle_timeout` seconds
(`sockets.cut_server_connections`; that cancels their calls, their handlers return and give their slots back) and
the new stream waits briefly for a slot.

Streams are only cut under that pressure: a learner that pauses its session for an hour on a server with free slots
keeps it. Cutting acts on a client's whole connection (gRPC multiplexes all of one client's calls on one), so an
idle client loses its other calls on that connection too; it reconnects on its next call.

Each handler runs in its own gRPC thread for the whole call, so a stream is keyed by its thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import unquote

from ..errors import ResourceExhausted
from ..serving.limits import CallGate
from .sockets import cut_server_connections

log = logging.getLogger(__name__)

#: seconds a new stream waits for a slot freed by cutting idle streams' connections
SLOT_WAIT_S = 5.0


@dataclass
class _Stream:
    peer: tuple[str, int] | None
    last: float


def parse_peer(peer: str | bytes | None) -> tuple[str, int] | None:
    """`("127.0.0.1", 54321)` from gRPC's peer string (`ipv4:127.0.0.1:54321`, `ipv6:%5B::1%5D:54321`); None for
    anything else (a Unix socket, an in-process transport, garbage)."""
    if isinstance(peer, bytes):
        peer = peer.decode("utf-8", "replace")
    if not isinstance(peer, str):
        return None
    family, _, rest = unquote(peer).partition(":")
    if family not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        return None
    return host, int(port)


class OpenStreams:
    """The streams a server has open, each with the time it last moved (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[int, _Stream] = {}

    @contextmanager
    def open(self, peer: str | bytes | None) -> Iterator[None]:
        """Record a stream of the calling thread for the duration of the block."""
        key = threading.get_ident()
        with self._lock:
            self._streams[key] = _Stream(parse_peer(peer), time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._streams.pop(key, None)

    def touch(self) -> None:
        """The calling thread's stream moved (read or wrote a message); a no-op outside a stream."""
        stream = self._streams.get(threading.get_ident())
        if stream is not None:
            stream.last = time.monotonic()

    def idle_peers(self, idle_for: float) -> set[tuple[str, int]]:
        """Peers (host, port) of the streams that have not moved for `idle_for` seconds."""
        now = time.monotonic()
        with self._lock:
            return {s.peer for s in self._streams.values() if s.peer is not None and now - s.last >= idle_for}

    def __len__(self) -> int:
        with self._lock:
            return len(self._streams)


__all__ = ["OpenStreams", "parse_peer"]


def acquire_stream_slot(calls: CallGate, streams: OpenStreams, port: int, idle_timeout: float, where: str) -> None:
    """Take one of `calls`' "stream" slots. When every one is taken, first cut the connections of the streams idle for
    `idle_timeout` seconds or more, then wait up to `SLOT_WAIT_S` for a slot (`ResourceExhausted` when none is idle
    or none frees). `where` names the server in the warning. The Flight server and the TransferQueue-compatible one
    share it."""
    try:
        calls.acquire("stream")
        return
    except ResourceExhausted:
        idle = streams.idle_peers(idle_timeout)
        if not idle:
            raise
    cut = cut_server_connections(port, idle)
    log.warning("%s: every stream slot taken; cut %d connection(s) whose streams were idle for %gs or more", where,
                cut, idle_timeout)
    calls.acquire("stream", wait=SLOT_WAIT_S)
