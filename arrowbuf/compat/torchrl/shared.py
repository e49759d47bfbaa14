"""A shared-memory `ArrowbufStorage` handed to other processes before its first write: the process that made the
storage (its home) creates, and so owns, the store, whichever process writes first.

A shared store lives as long as the process that created it (`arrowbuf.tiers.shm`: its owner). Its schema comes
from the first write, which may happen in a worker that exits soon after; if that worker created the store, the
store would go with it. So the home process listens on a Unix socket (in a private 0700 directory) from the time
the storage is made until it is closed; a process that writes first sends the layout it inferred, the home
creates the store (once: later requests are checked against its layout) and answers; the writer then attaches::

    home = StoreHome(create)              # in the process that made the storage; create(layout_json) -> None
    home.address                          # travels with the pickled storage (fork or spawn)
    request_store(address, layout_json)   # in a worker: returns once the store exists (raises on a mismatch)

Nothing polls: the home's thread blocks in `accept`, a worker in `recv` (bounded by `timeout`). A home that is
gone makes the worker's connect fail at once with a clear error.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable

from ...errors import ArrowbufError, InvalidArgument

_MAX_MESSAGE = 16 << 20


def _send(sock: socket.socket, text: str) -> None:
    data = text.encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv(sock: socket.socket) -> str:
    head = _recv_exact(sock, 4)
    (n,) = struct.unpack("!I", head)
    if n > _MAX_MESSAGE:
        raise InvalidArgument(f"a store request of {n} bytes is over the limit of {_MAX_MESSAGE}")
    return _recv_exact(sock, n).decode()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


class StoreHome:
    """The home process's side (see the module doc): a daemon thread that creates the store on request."""

    def __init__(self, create: Callable[[str], None]) -> None:
        self._create = create
        self._dir = tempfile.mkdtemp(prefix="arrowbuf-torchrl-")  # 0700: only this user connects
        self.address = os.path.join(self._dir, "home.sock")
        self.pid = os.getpid()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(64)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="arrowbuf-torchrl-home", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    layout = _recv(conn)
                    self._create(layout)
                    _send(conn, "ok")
                except Exception as exc:  # noqa: BLE001 (reported to the requesting process, which raises it)
                    try:
                        _send(conn, f"error: {type(exc).__name__}: {exc}")
                    except OSError:
                        pass

    def close(self) -> None:
        """Stop listening (idempotent; only in the home process)."""
        if self._closed or os.getpid() != self.pid:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(5)
        shutil.rmtree(self._dir, ignore_errors=True)


def request_store(address: str, layout: str, timeout: float) -> None:
    """Ask the home process to create the store of `layout` (a no-op when it exists with that layout).

    Raises:
        ArrowbufError: the home process is gone, did not answer within `timeout` seconds, or refused (its store
            holds another layout: the message says how they differ).
    """
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(address)
            _send(sock, layout)
            answer = _recv(sock)
    except (OSError, ConnectionError) as exc:
        raise ArrowbufError(
            f"the shared ArrowbufStorage's store does not exist yet and the process that made the storage (which "
            f"creates it) did not answer at {address} ({exc}); keep that process alive while others write, or write "
            "once in it before handing the storage to other processes") from None
    if answer != "ok":
        raise ArrowbufError(f"the shared ArrowbufStorage's home process refused to create its store: {answer[7:]}")
