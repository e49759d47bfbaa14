"""Arrow Flight service: serve stores to remote actors and learners, in any language.

`serve(store)` runs a server; `connect(location)` returns a `RemoteStore` with the local store's surface.
The wire format lives in `arrowbuf.flight.protocol` and is documented in docs/flight-protocol.md.
"""

from . import protocol
from .client import LearnerSession, RemoteStore, RemoteWriter, connect
from .limits import ServerLimits
from .server import StoreServer, serve

__all__ = ["LearnerSession", "RemoteStore", "RemoteWriter", "ServerLimits", "StoreServer", "connect", "protocol",
           "serve"]
