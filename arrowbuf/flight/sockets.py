"""Cutting a Flight server's client connections, the last step of a bounded shutdown.

pyarrow's `FlightServerBase.shutdown()` (and the finalizer pyarrow runs at interpreter exit) waits for every call in
progress, with no deadline: gRPC's `Shutdown(deadline)` and a server-side call cancel are not exposed to Python.
A call whose client reads nothing never ends on its own: its handler (or pyarrow's C++ loop sending a DoGet stream)
is blocked in a gRPC write held back by flow control. Shutting the server's accepted TCP connections down in both
directions makes gRPC close their transports, which cancels their calls: the blocked write fails, the handler
returns, and the shutdown completes. `StoreServer.close()` does this only after `shutdown_timeout`, for calls that
did not end by themselves.

It finds the connections among this process's own file descriptors (`/proc/self/fd`, Linux): TCP sockets whose local
port is the server's and that have a peer (the listening socket has none; clients of the server in the same process
have the server's port as their peer's, not their own). The descriptors stay gRPC's: each is `dup`-ed, the copy is
shut down (which acts on the connection both share) and closed.
"""

from __future__ import annotations

import os
import socket
import stat

FD_DIR = "/proc/self/fd"


def cut_server_connections(port: int, peers: set[tuple[str, int]] | None = None) -> int:
    """Shut down every accepted TCP connection of this process on local port `port` (only those whose remote end is
    one of `peers`, `(host, port)` pairs, when given); returns how many.

    Returns 0 where the process's descriptors cannot be listed (no `/proc`): there, calls stalled by their clients
    end only when the clients go away.
    """
    try:
        names = os.listdir(FD_DIR)
    except OSError:
        return 0
    cut = 0
    for name in names:
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            copy = os.dup(fd)
        except (ValueError, OSError):  # the listing's own descriptor, or one closed since
            continue
        try:
            sock = socket.socket(fileno=copy)
        except OSError:
            os.close(copy)
            continue
        with sock:
            try:
                if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                    continue
                if sock.getsockname()[1] != port:
                    continue
                remote = sock.getpeername()  # OSError (not connected) for the listening socket
                if peers is not None and (_host(remote[0]), remote[1]) not in peers:
                    continue
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:
                continue
    return cut


def _host(host: str) -> str:
    """An IPv4 peer of a dual-stack socket as gRPC names it (`::ffff:127.0.0.1` -> `127.0.0.1`)."""
    return host[7:] if host.startswith("::ffff:") else host


__all__ = ["cut_server_connections"]
