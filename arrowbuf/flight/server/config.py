"""What a Flight server is built from: the named stores it serves, its location and TLS material, and the bearer-token
check every call passes before a handler runs. `arrowbuf.flight.server.StoreServer` calls these once, when it starts.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import pyarrow.flight as flight

from ...errors import InvalidArgument, Unauthenticated
from ...serving.limits import is_loopback as _is_loopback
from ...surface import check_surface
from .. import protocol as P


class TokenMiddlewareFactory(flight.ServerMiddlewareFactory):
    """Rejects every call whose `authorization` header is not `Bearer <token>` (before any handler runs)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info: Any, headers: Mapping[str, list[Any]]) -> None:
        for value in headers.get(P.AUTH_HEADER, []):
            raw = value if isinstance(value, bytes) else str(value).encode()
            if hmac.compare_digest(raw, self._expected):
                return None
        got = "a wrong token" if headers.get(P.AUTH_HEADER) else "no token"
        exc = Unauthenticated(f"this server needs a bearer token (header 'authorization: Bearer <token>'); "
                              f"the call came with {got}")
        raise P.to_flight_error(exc)


def named_stores(value: Any) -> dict[str, Any]:
    """name -> store of what `serve` was given (a store, a list named by `store.name`, or a dict); each checked to
    implement `ab.StoreSurface` (`InvalidArgument` otherwise, or for none, or for two of one name)."""
    if isinstance(value, Mapping):
        stores = {str(k): v for k, v in value.items()}
    elif isinstance(value, (list, tuple)):
        stores = {}
        for s in value:
            name = getattr(s, "name", None) or s.schema.name
            if name in stores:
                raise InvalidArgument(f"two stores are named {name!r}; pass a dict name -> store")
            stores[name] = s
    else:
        stores = {getattr(value, "name", None) or value.schema.name: value}
    if not stores:
        raise InvalidArgument("serve() needs at least one store")
    for name, s in stores.items():  # --- contracts: a store is anything that implements ab.StoreSurface
        check_surface(s, f"serve(): store {name!r}")
    return stores


def parse_location(location: str, tls: bool) -> tuple[str, str, int]:
    """(scheme, host, port) of a `grpc://host:port` location ("grpc+tls" with `tls`); `InvalidArgument` for any
    other scheme, TLS asked for without a certificate, or a bad port."""
    if isinstance(location, tuple):
        host, port = location
        location = f"grpc://{host}:{port}"
    parts = urlsplit(str(location))
    scheme = parts.scheme or "grpc"
    if scheme not in ("grpc", "grpc+tcp", "grpc+tls"):
        raise InvalidArgument(f"location {location!r}: expected grpc://host:port or grpc+tls://host:port")
    if scheme == "grpc+tls" and not tls:
        raise InvalidArgument(f"location {location!r} asks for TLS: pass tls=(certificate, private_key)")
    if tls:
        scheme = "grpc+tls"
    elif scheme == "grpc+tcp":
        scheme = "grpc"
    host = parts.hostname or "127.0.0.1"
    try:
        port = parts.port or 0
    except ValueError:
        raise InvalidArgument(f"location {location!r}: bad port") from None
    return scheme, host, port


def is_loopback(host: str) -> bool:
    """Whether `host` is localhost or a loopback address (`arrowbuf.serving.limits.is_loopback`)."""
    return _is_loopback(host)


def read_tls(tls: Any) -> tuple[bytes, bytes]:
    """(certificate, private key) PEM bytes of `tls=`: a pair (or a dict with "cert" and "key") of PEM bytes/str or
    file paths."""
    if isinstance(tls, Mapping):
        tls = (tls["cert"], tls["key"])
    if not isinstance(tls, (tuple, list)) or len(tls) != 2:
        raise InvalidArgument("tls must be (certificate, private_key): PEM bytes/str or file paths")
    return _pem(tls[0]), _pem(tls[1])


def _pem(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    text = str(value)
    if "-----BEGIN" in text:
        return text.encode()
    with open(text, "rb") as fh:
        return fh.read()
