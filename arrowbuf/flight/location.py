"""A Flight location a user typed, checked before any call: the scheme (`grpc://`, `grpc+tls://`, ...) and, for a
TCP location, whether anything listens there (a refused connection is known at once; gRPC would retry it in
silence until the reconnect timeout) and, without TLS, whether what answers speaks HTTP/2 at all (an HTTP/1 server,
such as the inspector's page or the /metrics endpoint, answers the HTTP/2 preface with an `HTTP/1.x` status line:
said at once, where gRPC would retry for the reconnect timeout and then report `Failed parsing HTTP/2`)."""

from __future__ import annotations

import errno
import socket
from urllib.parse import urlsplit

from ..errors import InvalidArgument, Unavailable

#: The schemes a Flight client speaks.
SCHEMES = ("grpc", "grpc+tcp", "grpc+tls", "grpc+unix")


def check_location(location: object) -> str:
    """`location` as a string, or `InvalidArgument` saying what a Flight location looks like."""
    if not isinstance(location, str) or not location:
        raise InvalidArgument(f"a Flight location is a string such as 'grpc://127.0.0.1:8815', got {location!r}")
    scheme, sep, rest = location.partition("://")
    if not sep:
        raise InvalidArgument(f"location {location!r} has no scheme; a Flight location looks like "
                              f"'grpc://{location}' (or grpc+tls://... with TLS): pass server.location or the line "
                              "`arrowbuf serve` printed")
    if scheme.lower() not in SCHEMES:
        raise InvalidArgument(f"location {location!r}: Flight speaks {', '.join(s + '://' for s in SCHEMES)}, not "
                              f"{scheme}://; try 'grpc://{rest}'")
    return location


#: What an HTTP/2 client sends first (RFC 9113, 3.4): the preface and an empty SETTINGS frame. A gRPC server answers
#: with its own SETTINGS frame; an HTTP/1 server with a status line (`HTTP/1.0 505 ...`, `HTTP/1.1 400 ...`).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
#: How long the probe waits for the first bytes of an answer; a server that says nothing in this time is left to the
#: Flight client (it may be busy: a slow answer is no evidence of a wrong port).
_ANSWER_TIMEOUT = 1.0


def raise_if_refused(location: str, timeout: float = 2.0) -> None:
    """`Unavailable` at once when a TCP location refuses connections (nothing listens on that port) or, for a
    plain-text location (`grpc://`, `grpc+tcp://`), when an HTTP/1 server answers there instead of an HTTP/2 (gRPC)
    one; any other outcome (a Flight server, slow, unreachable, TLS, a unix socket) is left to the Flight client and
    its retries."""
    parts = urlsplit(location)
    if parts.scheme.lower() == "grpc+unix":
        return
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        raise InvalidArgument(f"location {location!r}: the port is not a number in 0..65535") from None
    if not host or port is None:
        raise InvalidArgument(f"location {location!r} names no host and port; e.g. 'grpc://127.0.0.1:8815'")
    try:
        conn = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            raise Unavailable(f"nothing is listening at {host}:{port} (connection refused); is the server running? "
                              "`arrowbuf serve` and `server.location` print the location to use") from None
        return
    with conn:
        if parts.scheme.lower() not in ("grpc", "grpc+tcp"):
            return
        first = _first_answer(conn)
    if (first[:1].isascii() and first[:1].isalpha()) or first[:1] == b"<":
        # an HTTP/2 frame starts with its 24-bit length (0 for a SETTINGS frame); text is an HTTP/1 status line or,
        # from Python's http.server, an HTML error page (it answers an HTTP/2.0 request line as HTTP/0.9)
        line = first.split(b"\n", 1)[0].strip().decode("latin-1")[:60]
        raise Unavailable(f"an HTTP/1 server answered at {host}:{port} ({line!r}), not an Arrow Flight server: is "
                          "this the port of the inspector page (arrowbuf ui, --ui) or of the Prometheus metrics "
                          "(--metrics, server.metrics_url)? Those are for a browser or Prometheus (http://); "
                          "ab.connect needs the Flight location: server.location, or the grpc://... address that "
                          "`arrowbuf serve` printed")


def _first_answer(conn: socket.socket) -> bytes:
    """The first bytes a server sends after an HTTP/2 preface (b"" when it says nothing in time or closes)."""
    try:
        conn.settimeout(_ANSWER_TIMEOUT)
        conn.sendall(_H2_PREFACE)
        return conn.recv(64)
    except OSError:
        return b""


__all__ = ["SCHEMES", "check_location", "raise_if_refused"]
