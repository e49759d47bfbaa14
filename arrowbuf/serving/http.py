"""The HTTP side of arrowbuf's servers (the inspector and the metrics endpoint): a bounded HTTP server and the checks
every browser-reachable endpoint makes.

`BoundedHTTPServer` is `http.server.ThreadingHTTPServer` with the limits of `arrowbuf.serving.limits.NetLimits`:
- at most `max_connections` connections at once: one more is answered 503 and closed at once, without a thread;
- `idle_timeout` per read and write (a client that sends half a request and stops is dropped when it passes), and
  `request_timeout` per connection in all (a reaper shuts down sockets older than that: a client trickling one byte
  per `idle_timeout` cannot hold a thread longer);
- at most `max_header_bytes` + `max_request_bytes` read from one connection (`GuardedHandler.setup`).

`RequestGuard` is what a page in a browser must not get around:
- **Host** (DNS rebinding: a page on attacker.example whose name then resolves to 127.0.0.1 reaches the server as
  "same origin" for the browser): the Host header must name this machine by a loopback name, an IP address
  (rebinding needs a name), the bound name, or a name the server was told to allow.
- **Origin** (cross-site requests, CSRF): a request that carries an Origin must come from the server's own origin
  (`http://<Host>`); `Origin: null` and `Sec-Fetch-Site: cross-site` are refused.
- POSTs need `Content-Type: application/json` (a cross-site form or `text/plain` fetch cannot send it without a
  CORS preflight, which this server never grants), and are authenticated before their body is read.
- Every answer carries `X-Frame-Options: DENY` and `Content-Security-Policy: frame-ancestors 'none'` (no framing,
  no clickjacking), `X-Content-Type-Options: nosniff` and `Cache-Control: no-store`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import socket
import threading
import time
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from .limits import HTTP_STATUS, LOOPBACK_NAMES, CallGate, NetLimits, PublicError, public_error

log = logging.getLogger("arrowbuf.serving")

#: Bytes of request line and headers read from one connection (a browser sends a few KiB).
MAX_HEADER_BYTES = 64 << 10
#: Security headers on every answer.
SECURITY_HEADERS = (
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
)
#: The CSP of an answer that is not the page itself (the page adds what its inline script and styles need).
DEFAULT_CSP = "default-src 'none'; frame-ancestors 'none'"


def _host_name(header: str) -> str | None:
    """The host part of a Host header ("name:port", "[v6]:port", "name"), lowercased; None when malformed."""
    header = header.strip().lower()
    if not header or len(header) > 300:
        return None
    if header.startswith("["):
        end = header.find("]")
        if end < 0:
            return None
        name, rest = header[1:end], header[end + 1:]
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return None
        return name
    name, _, port = header.partition(":")
    if port and not port.isdigit():
        return None
    if not name or any(not (c.isalnum() or c in "-._") for c in name):
        return None
    return name.rstrip(".")


class RequestGuard:
    """Host and Origin checks of a browser-reachable server (module docstring).

    Args:
        host: the address the server binds (a name there is allowed in Host headers).
        allowed_hosts: more names clients may use in the Host header (e.g. a DNS name of this machine).
    """

    def __init__(self, host: str, allowed_hosts: Iterable[str] = ()) -> None:
        self.allowed = {h.lower().rstrip(".") for h in allowed_hosts} | set(LOOPBACK_NAMES)
        bound = host.strip("[]").lower()
        if bound not in ("0.0.0.0", "::", ""):
            self.allowed.add(bound)
        else:  # every interface: this machine's own name too
            self.allowed.add(socket.gethostname().lower())

    def host_ok(self, header: str | None) -> bool:
        """Whether a Host header names this server (no header: a client that is no browser, allowed)."""
        if header is None:
            return True
        name = _host_name(header)
        if name is None:
            return False
        if name in self.allowed:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    def origin_ok(self, origin: str | None, host_header: str | None, fetch_site: str | None) -> bool:
        """Whether a request comes from this server's own origin, or from no browser page at all."""
        if fetch_site is not None and fetch_site.strip().lower() == "cross-site":
            return False
        if origin is None:
            return True
        parts = urlsplit(origin.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc or host_header is None:
            return False  # "null" (a sandboxed frame, a file), or garbage
        return parts.netloc.lower() == host_header.strip().lower()

    def refusal(self, headers: Any, *, needs_origin: bool) -> str | None:
        """Why a request is refused (None: it is not). `needs_origin`: a request that acts (POST) or reads data."""
        host = headers.get("Host")
        if not self.host_ok(host):
            return (f"Host {str(host)[:100]!r} does not name this server (DNS rebinding?): use "
                    "http://127.0.0.1:<port>/ or an IP address, or start the server with that name allowed")
        if needs_origin and not self.origin_ok(headers.get("Origin"), host, headers.get("Sec-Fetch-Site")):
            return "a cross-origin request: this server answers its own page only"
        return None


class _CappedReader:
    """A connection's read side that hands out at most `cap` bytes in all (then reads as end of stream)."""

    def __init__(self, raw: Any, cap: int) -> None:
        self._raw, self.left = raw, cap

    def readline(self, limit: int = -1) -> bytes:
        n = self.left if limit is None or limit < 0 else min(limit, self.left)
        if n <= 0:
            return b""
        line = self._raw.readline(n)
        self.left -= len(line)
        return bytes(line)

    def read(self, n: int = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        if n <= 0:
            return b""
        data = self._raw.read(n)
        self.left -= len(data)
        return bytes(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class GuardedHandler(BaseHTTPRequestHandler):
    """A request handler with the answers and checks every arrowbuf HTTP endpoint shares (module docstring).

    A subclass sets `guard` and `limits` (class attributes) and calls `check_request` first in each `do_*`.
    """

    guard: RequestGuard
    limits: NetLimits
    server_version = "arrowbuf"
    protocol_version = "HTTP/1.0"  # one request per connection: `request_timeout` bounds the request
    default_request_version = "HTTP/1.0"  # an unparsable request is answered with a status line (not as HTTP/0.9)

    def setup(self) -> None:
        super().setup()
        self.rfile = _CappedReader(self.rfile, MAX_HEADER_BYTES + self.limits.max_request_bytes)  # type: ignore

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s: " + format, type(self).__name__, *args)

    def send(self, status: int, body: bytes, ctype: str, csp: str = DEFAULT_CSP) -> None:
        """One answer with the security headers; a client that went away is not an error."""
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for name, value in SECURITY_HEADERS:
                self.send_header(name, value)
            self.send_header("Content-Security-Policy", csp)
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client went away (reset, timed out) while it was answered
            self.close_connection = True

    def send_json(self, status: int, obj: Any) -> None:
        self.send(status, json.dumps(obj).encode(), "application/json")

    def send_error_json(self, err: PublicError) -> None:
        self.send_json(HTTP_STATUS.get(err.code, 400), err.json())

    def send_exception(self, exc: BaseException, what: str) -> None:
        """An error as JSON: its code and message, or INTERNAL with no details (logged here)."""
        err = public_error(exc)
        if not err.expected:
            log.error("%s failed", what, exc_info=exc)
        self.send_error_json(err)

    def check_request(self, *, needs_origin: bool) -> bool:
        """Host and Origin checks; False (after a 403) when refused."""
        why = self.guard.refusal(self.headers, needs_origin=needs_origin)
        if why is None:
            return True
        self.close_connection = True
        self.send_json(403, {"error": "Forbidden", "code": "PERMISSION_DENIED", "message": why})
        return False

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (a malformed request line, an unknown method) as JSON too."""
        self.close_connection = True
        self.send_json(code, {"error": "BadRequest", "code": "INVALID_ARGUMENT",
                              "message": (message or "a malformed request")[:200]})


_BUSY = json.dumps({"error": "ResourceExhausted", "code": "RESOURCE_EXHAUSTED",
                    "message": "this server has all its connections open; retry later"}).encode()
_BUSY_ANSWER = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(_BUSY)).encode() + b"\r\nConnection: close\r\n\r\n" + _BUSY)


class BoundedHTTPServer(ThreadingHTTPServer):
    """`ThreadingHTTPServer` with a connection cap and idle and total timeouts (module docstring).

    Attributes:
        connections: the `CallGate` counting open connections (`running()["connection"]`).
        refused: connections answered 503 because every slot was taken.
        peak: the most connections handled at once so far.
    """

    daemon_threads = True
    # the listen backlog: connections past the cap are accepted and answered 503 at once, so the backlog only needs
    # to cover a burst between two accepts (socketserver's default of 5 drops SYNs: clients then stall a second)
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[GuardedHandler], limits: NetLimits) -> None:
        self.limits = limits
        self.connections = CallGate({"connection": limits.max_connections})
        self.refused = 0
        self.peak = 0
        self._open: dict[int, tuple[socket.socket, float]] = {}
        self._open_lock = threading.Lock()
        self._stop = threading.Event()
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)
        self._reaper = threading.Thread(target=self._reap, name="arrowbuf-http-reaper", daemon=True)
        self._reaper.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.connections.try_acquire("connection"):
            self.refused += 1
            with contextlib.suppress(OSError):
                request.settimeout(1.0)
                request.sendall(_BUSY_ANSWER)
            self.shutdown_request(request)
            return
        request.settimeout(self.limits.idle_timeout)
        with self._open_lock:
            self._open[id(request)] = (request, time.monotonic())
            self.peak = max(self.peak, len(self._open))
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def _done(self, request: Any) -> None:
        with self._open_lock:
            if self._open.pop(id(request), None) is None:
                return
        self.connections.release("connection")

    def _reap(self) -> None:
        period = min(1.0, self.limits.request_timeout / 4)
        while not self._stop.wait(period):
            self.cut(older_than=self.limits.request_timeout)

    def cut(self, older_than: float = 0.0) -> int:
        """Shut down the connections open for more than `older_than` seconds (their handlers then end)."""
        now = time.monotonic()
        with self._open_lock:
            late = [s for s, t0 in self._open.values() if now - t0 >= older_than]
        for s in late:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        return len(late)

    def open_connections(self) -> int:
        """Connections being handled now."""
        return self.connections.running()["connection"]

    def wait_connections(self, at_most: int, timeout: float) -> bool:
        """Block until at most `at_most` connections are open; False if `timeout` seconds passed first."""
        return self.connections.wait_for(lambda r: r["connection"] <= at_most, timeout)

    def close(self) -> None:
        """Stop serving and end every connection (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.shutdown()
        self.server_close()
        self.cut()
        self._reaper.join(5.0)


__all__ = ["DEFAULT_CSP", "MAX_HEADER_BYTES", "SECURITY_HEADERS", "BoundedHTTPServer", "GuardedHandler",
           "RequestGuard"]
