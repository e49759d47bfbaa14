"""A Flight location a user typed, checked before any call: the scheme (`grpc://`, `grpc+tls://`, ...) and, for a
TCP location, whether anything listens there (a refused connection is known at once; gRPC would retry it in
silence until the reconnect timeout)."""

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


def raise_if_refused(location: str, timeout: float = 2.0) -> None:
    """`Unavailable` at once when a TCP location refuses connections (nothing listens on that port); any other
    outcome (connected, slow, unreachable, a unix socket) is left to the Flight client and its retries."""
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
        with socket.create_connection((host, port), timeout=timeout):
            return
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            raise Unavailable(f"nothing is listening at {host}:{port} (connection refused); is the server running? "
                              "`arrowbuf serve` and `server.location` print the location to use") from None


__all__ = ["SCHEMES", "check_location", "raise_if_refused"]
